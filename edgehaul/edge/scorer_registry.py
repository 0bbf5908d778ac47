"""Scorers as plugins: a scorer is one module that registers a factory under the `edgehaul.scorers`
entry point group; a TieringPolicy chooses it by name.

    # pyproject.toml of the package that ships the scorer
    [project.entry-points."edgehaul.scorers"]
    vibration = "acme_scorers.vibration:from_context"

    # acme_scorers/vibration.py
    def from_context(ctx: ScorerContext) -> Scorer: ...

A factory gets a `ScorerContext`: the contract of the kind being scored, the policy, the object store
(for a model), and a state folder of its own per node AND kind, so two kinds on one node never mix their
statistics. A scorer that keeps state across batches implements `ContextualScorer` (score a batch
against what was folded before it, then fold it; `save()` persists) and its `cache_version(batch_key)`
keys the edge cache; a stateless one only needs `version` and `score(table)`.

Shipped: `novelty` (rarity x feature novelty, generic over the contract's label and feature columns),
`anomaly` (labelled anomalies, then a robust z-score against the normal class: labelled telemetry), `density`
(a sparse neighbourhood in the batch is worth more: rare clusters, not far common ones) and `model` (uncertainty
of a published model; imported only when chosen, so a node without torch can run the others; before its kind has
a model, the policy's `fallback_scorer`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from edgehaul.contracts import Contract
from edgehaul.edge.scoring import Scorer
from edgehaul.scorer_names import ENTRY_POINT_GROUP as ENTRY_POINT_GROUP
from edgehaul.scorer_names import UnknownScorer as UnknownScorer
from edgehaul.scorer_names import available_scorers as available_scorers
from edgehaul.scorer_names import check_scorer_name

if TYPE_CHECKING:
    from edgehaul.blocks.object_store import ObjectStore
    from edgehaul.blocks.policies import TieringPolicy

@dataclass(frozen=True, slots=True)
class ScorerContext:
    contract: Contract  # the kind being scored: its label and feature columns
    policy: TieringPolicy
    store: ObjectStore | None  # where a model scorer finds its model (None: from the environment)
    state_dir: Path  # this node's and this kind's own folder for the scorer's state
    # the node's downlinked file in force for (item kind, name), e.g. ('model', 'landsat'); None: off a node
    downlinked: Callable[[str, str], Path | None] | None = None


ScorerFactory = Callable[[ScorerContext], Scorer]


def load_factory(name: str) -> ScorerFactory:
    ep = available_scorers()[check_scorer_name(name)]
    try:
        factory = ep.load()
    except Exception as e:  # a broken plugin must say which one and why, not fail somewhere later
        raise UnknownScorer(f"scorer {name!r} ({ep.value}) failed to import: {type(e).__name__}: {e}") from e
    if not callable(factory):
        raise UnknownScorer(f"scorer {name!r} ({ep.value}) is not callable")
    return factory


def build_scorer(name: str, ctx: ScorerContext) -> Scorer:
    scorer = load_factory(name)(ctx)
    if not isinstance(scorer, Scorer):
        raise UnknownScorer(f"scorer {name!r} returned {type(scorer).__name__}, which lacks version/score()")
    return scorer


def scorer_state_dir(spool_dir: Path | str, scorer: str, contract: Contract) -> Path:
    """Where a node keeps `scorer`'s state for one kind (one folder per node spool, scorer and contract)."""
    return Path(spool_dir) / "scorer" / scorer / contract.id
