"""Scorers: give each preprocessed sample a value in [0, 1]; a TieringPolicy maps value to tier.

A scorer is anything with `version: str` and `score(table) -> np.ndarray` (float32 in [0, 1], one
per row); scorers are plugins chosen by name (`edgehaul.edge.scorer_registry`). Shipped here:
`NoveltyScorer` (no model, registered as `novelty`). The model scorer lives in
`edgehaul.edge.model_scorer.ModelScorer` (training side, registered as `model`).

NoveltyScorer = 1 - (1 - rarity) * (1 - novelty) (either signal alone can make a sample valuable),
with rarity = 1 - p(class) / p(commonest class) only where the policy lets scorers read labels (`use_labels`)
and the row has one (0 otherwise: value from the features alone, the default) and novelty from the
diagonal Mahalanobis distance of the sample's features (`contract.feature_columns`: channel statistics,
`norm_<column>`, a feature function's outputs; a NaN feature adds no distance), both against a running sketch:
per-batch sketches (label counts, feature sums and sums of squares) kept in fold order in a small
JSON state file, keyed by batch content hash. A batch is scored against itself plus the batches
folded BEFORE it: all of them for a new batch, the prefix up to its own position for a batch
already folded. So rescoring a batch (a rerun) sees exactly the context it saw the first time,
which keeps the score/tier cache valid while the sketch keeps learning from new batches.
`cache_version(batch_key)` names that context (it is part of the score/tier cache key).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from edgehaul.contracts import Contract

if TYPE_CHECKING:
    from edgehaul.edge.scorer_registry import ScorerContext

log = logging.getLogger(__name__)

NOVELTY_VERSION = "novelty-1"


class CannotScore(ValueError):
    """A scorer cannot value this batch (no features, no reference yet...): the message says why. The caller
    falls back explicitly (`values_or_fallback`), never to a quiet constant."""


@runtime_checkable
class Scorer(Protocol):
    @property
    def version(self) -> str: ...

    def score(self, table: pa.Table) -> np.ndarray: ...


@runtime_checkable
class ContextualScorer(Scorer, Protocol):
    """A scorer that learns from the batches it sees: it scores a batch against the batches folded before
    it (`batch_key` names the batch), then folds it; `save()` persists what it learnt."""

    def score(self, table: pa.Table, batch_key: str | None = None) -> np.ndarray: ...

    def cache_version(self, batch_key: str) -> str: ...

    def fold(self, table: pa.Table, batch_key: str) -> None: ...

    def save(self) -> None: ...


@dataclass
class BatchSketch:
    n: int
    label_counts: dict[int, int]
    fsum: list[float]
    fsumsq: list[float]

    @classmethod
    def of(cls, table: pa.Table, contract: Contract) -> BatchSketch:
        feats = feature_matrix(table, contract).astype(np.float64)
        counts: dict[int, int] = {}
        if contract.label_column is not None:  # a kind without a label sketches its features only
            labels = _labels(table, contract)
            vals, cnts = np.unique(labels[~np.isnan(labels)].astype(np.int64), return_counts=True)
            counts = {int(v): int(c) for v, c in zip(vals, cnts, strict=True)}
        # NaN (a null reading's norm_<column>) adds nothing to the sums
        return cls(n=int(table.num_rows), label_counts=counts, fsum=np.nansum(feats, axis=0).tolist(),
                   fsumsq=np.nansum(feats**2, axis=0).tolist())


@dataclass
class NoveltyState:
    """Per-batch sketches, oldest first, bounded to `max_batches` (the 'running' window)."""

    batches: OrderedDict[str, BatchSketch] = field(default_factory=OrderedDict)
    max_batches: int = 512

    def context(self, batch_key: str | None) -> list[str]:
        """Keys a batch is scored against (besides itself): those folded before it."""
        keys = list(self.batches)
        return keys[: keys.index(batch_key)] if batch_key is not None and batch_key in self.batches else keys

    def digest(self, keys: list[str] | None = None) -> str:
        h = hashlib.sha256(NOVELTY_VERSION.encode())
        for key in self.batches if keys is None else keys:
            h.update(key.encode())
        return h.hexdigest()[:16]

    def fold(self, key: str, sketch: BatchSketch) -> None:
        if key in self.batches:
            return
        self.batches[key] = sketch
        while len(self.batches) > self.max_batches:
            self.batches.popitem(last=False)

    def to_json(self) -> bytes:
        return json.dumps({"max_batches": self.max_batches,
                           "batches": [[k, s.__dict__] for k, s in self.batches.items()]}).encode()

    @classmethod
    def load(cls, path: Path | None) -> NoveltyState:
        if path is None or not path.exists():
            return cls()
        doc = json.loads(path.read_bytes())
        batches: OrderedDict[str, BatchSketch] = OrderedDict()
        for key, s in doc["batches"]:
            s["label_counts"] = {int(k): int(v) for k, v in s["label_counts"].items()}
            batches[key] = BatchSketch(**s)
        return cls(batches=batches, max_batches=int(doc.get("max_batches", 512)))

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(self.to_json())
        os.replace(tmp, path)


def _labels(table: pa.Table, contract: Contract) -> np.ndarray:
    """The label column as float64, NaN where null (unlabelled)."""
    assert contract.label_column is not None
    col = table.column(contract.label_column).cast(pa.float64())
    return np.asarray(pc.fill_null(col, np.nan).to_numpy(zero_copy_only=False), dtype=np.float64)


def feature_matrix(table: pa.Table, contract: Contract) -> np.ndarray:
    """The contract's feature columns as a rows x features float32 matrix (NaN where a reading is null): what the
    novelty scorer reads, and what a budgeted draw spreads its rows over (`tiering.spread_order`)."""
    if table.num_rows == 0 or not contract.feature_columns:
        return np.empty((0, len(contract.feature_columns)), np.float32)
    return np.column_stack([table.column(c).to_numpy(zero_copy_only=False) for c in contract.feature_columns]).astype(
        np.float32
    )


class NoveltyScorer:
    """Class rarity + feature novelty against the running sketch (no model), for any contract: its
    `feature_columns` and its label when it has one."""

    STATE_FILE = "novelty-state.json"

    def __init__(self, contract: Contract, state: NoveltyState | None = None, state_path: Path | None = None, *,
                 use_labels: bool = False) -> None:
        self.contract = contract
        self.state = state or NoveltyState()
        self.state_path = state_path
        self.use_labels = use_labels and contract.label_column is not None

    @classmethod
    def from_context(cls, ctx: ScorerContext) -> NoveltyScorer:
        """The `novelty` entry point: state in the node's folder for this kind."""
        path = ctx.state_dir / cls.STATE_FILE
        return cls(ctx.contract, NoveltyState.load(path), state_path=path, use_labels=ctx.policy.use_labels)

    def save(self) -> None:
        if self.state_path is not None:
            self.state.save(self.state_path)

    @property
    def version(self) -> str:
        return f"{NOVELTY_VERSION}{'+labels' if self.use_labels else ''}+{self.state.digest()}"

    def cache_version(self, batch_key: str) -> str:
        """What the scores of batch `batch_key` depend on besides the batch itself."""
        return f"{NOVELTY_VERSION}{'+labels' if self.use_labels else ''}/{self.state.digest(self.state.context(batch_key))}"

    def score(self, table: pa.Table, batch_key: str | None = None) -> np.ndarray:
        own = BatchSketch.of(table, self.contract)
        k = len(self.contract.feature_columns)
        # A sketch of another width is another kind's (a state folder shared by mistake): never mixed in.
        ctx = [s for s in (self.state.batches[b] for b in self.state.context(batch_key)) if len(s.fsum) == k]
        ctx.append(own)
        n = sum(s.n for s in ctx)
        if table.num_rows == 0:
            return np.zeros(0, np.float32)
        if k == 0 and not self.use_labels:
            raise CannotScore(f"novelty: contract {self.contract.id} has no feature columns and labels are not used")
        rarity = np.zeros(table.num_rows)  # features alone: novelty
        if self.use_labels:
            counts: dict[int, int] = {}
            for s in ctx:
                for lab, c in s.label_counts.items():
                    counts[lab] = counts.get(lab, 0) + c
            # Rarity relative to the commonest class (+1 smoothing): 0 for it, -> 1 for a first sighting.
            top = max(counts.values(), default=0) + 1
            lut = {lab: 1.0 - (counts.get(lab, 0) + 1) / top for lab in self.contract.label_values}
            label_arr = _labels(table, self.contract)
            rarity = np.zeros(table.num_rows)  # an unlabelled row: novelty alone decides
            for lab, r in lut.items():
                rarity[label_arr == lab] = r
        # Feature novelty: diagonal Mahalanobis distance of the feature vector from the sketch.
        novelty = np.zeros(table.num_rows)
        if k:
            fsum = np.sum([s.fsum for s in ctx], axis=0)
            fsq = np.sum([s.fsumsq for s in ctx], axis=0)
            mean = fsum / n
            var = np.maximum(fsq / n - mean**2, 1e-8)
            feats = feature_matrix(table, self.contract).astype(np.float64)
            dist = ((feats - mean) ** 2) / var
            d2 = np.nan_to_num(np.nanmean(np.where(np.isnan(dist), 0.0, dist), axis=1))  # NaN (null) = no distance
            novelty = 1.0 - np.exp(-np.maximum(d2 - 1.0, 0.0) / 2.0)
        value = 1.0 - (1.0 - rarity) * (1.0 - novelty)
        return np.clip(value, 0.0, 1.0).astype(np.float32)

    def fold(self, table: pa.Table, batch_key: str) -> None:
        """Add a batch to the running sketch (idempotent per batch key)."""
        self.state.fold(batch_key, BatchSketch.of(table, self.contract))


def scorer_cache_version(scorer: Scorer, batch_key: str) -> str:
    """Cache-key part for scoring one batch: a scorer's `cache_version` if it has one, else `version`."""
    fn = getattr(scorer, "cache_version", None)
    return str(fn(batch_key)) if callable(fn) else scorer.version


def values_or_fallback(scorer: Scorer, table: pa.Table, batch_key: str | None = None) -> np.ndarray:
    """The scorer's values, or, where it says it cannot score (`CannotScore`), the same value for every row
    with a warning: under a byte budget that is a uniform random sample, stated, not a quiet constant."""
    try:
        if isinstance(scorer, ContextualScorer):
            return scorer.score(table, batch_key=batch_key)
        return scorer.score(table)
    except CannotScore as e:
        log.warning("scorer %s cannot score %d rows (%s): every row the same value, a uniform sample",
                    scorer.version, table.num_rows, e)
        return np.zeros(table.num_rows, np.float32)
