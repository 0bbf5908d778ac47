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
`anomaly` (labelled anomalies, then a robust z-score against the normal class: labelled telemetry) and
`model` (uncertainty of a published model; imported only when chosen, so a node without torch can run the
others).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import TYPE_CHECKING

from edgehaul.contracts import Contract
from edgehaul.edge.scoring import Scorer

if TYPE_CHECKING:
    from edgehaul.blocks.object_store import ObjectStore
    from edgehaul.blocks.policies import TieringPolicy

ENTRY_POINT_GROUP = "edgehaul.scorers"


class UnknownScorer(ValueError):
    """The policy names a scorer no installed package registers."""


@dataclass(frozen=True, slots=True)
class ScorerContext:
    contract: Contract  # the kind being scored: its label and feature columns
    policy: TieringPolicy
    store: ObjectStore | None  # where a model scorer finds its model (None: from the environment)
    state_dir: Path  # this node's and this kind's own folder for the scorer's state
    node_dir: Path | None = None  # the node's state root (its downlinked files are under it)


ScorerFactory = Callable[[ScorerContext], Scorer]


# The shipped scorers, also registered in pyproject.toml: known without the package's metadata (a checkout
# on PYTHONPATH, a stale editable install), so the default policy always works.
BUILTIN = {name: EntryPoint(name=name, value=value, group=ENTRY_POINT_GROUP) for name, value in (
    ("novelty", "edgehaul.edge.scoring:NoveltyScorer.from_context"),
    ("model", "edgehaul.edge.model_scorer:from_context"),
    ("anomaly", "edgehaul.edge.anomaly_scorer:AnomalyScorer.from_context"))}


@cache
def available_scorers() -> dict[str, EntryPoint]:
    """Scorers by name: the shipped ones, then those registered under the entry point group `edgehaul.scorers`
    by installed packages (read once per process)."""
    return {**BUILTIN, **{ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}}


def check_scorer_name(name: str) -> str:
    if name not in available_scorers():
        raise UnknownScorer(f"scorer {name!r} is not registered (entry point group {ENTRY_POINT_GROUP!r}); "
                            f"installed: {', '.join(sorted(available_scorers())) or 'none'}")
    return name


def load_factory(name: str) -> ScorerFactory:
    ep = available_scorers()[check_scorer_name(name)]
    try:
        factory = ep.load()
    except Exception as e:  # a broken plugin must say which one and why, not fail somewhere later
        raise UnknownScorer(f"scorer {name!r} ({ep.value}) failed to import: {type(e).__name__}: {e}") from e
    if not callable(factory):
        raise UnknownScorer(f"scorer {name!r} ({ep.value}) is not callable")
    return factory  # type: ignore[no-any-return]


def build_scorer(name: str, ctx: ScorerContext) -> Scorer:
    scorer = load_factory(name)(ctx)
    if not isinstance(scorer, Scorer):
        raise UnknownScorer(f"scorer {name!r} returned {type(scorer).__name__}, which lacks version/score()")
    return scorer


def scorer_state_dir(spool_dir: Path | str, scorer: str, contract: Contract) -> Path:
    """Where a node keeps `scorer`'s state for one kind (one folder per node spool, scorer and contract)."""
    return Path(spool_dir) / "scorer" / scorer / contract.id
