"""Anomaly-aware scorer for labelled telemetry (registered as `anomaly` under `edgehaul.scorers`).

value = a robust distance of the row's features (the contract's feature columns, e.g. `norm_<column>`) from
the running statistics of the reference rows (every row by default: the median and MAD shrug off the few
anomalies among them; with the policy's `use_labels` and an anomaly label, the rows labelled normal, and a row
labelled an anomaly is 1): per feature z = (x - median) / (1.4826 * MAD), d = sqrt(mean(z^2)) and
value = 1 - exp(-(d / 3)^2), so a typical normal row (d ~ 1) is ~0.1 (low tier) and one about four robust
sigmas out (d ~ 4) ~0.83 (high): an unlabelled anomaly still travels first. The normal class is label 0 of
an anomaly label; for a class label (or none) every row counts, which makes this a robust novelty score.

Median and MAD are not mergeable, so the state keeps a bounded reference sample instead: per folded batch
up to `per_batch` normal rows (evenly spaced over the batch, so the same batch always gives the same rows),
at most `max_batches` batches, oldest dropped. As with the novelty scorer, a batch is scored against its
own reference rows plus those of the batches folded before it (a rescored batch sees exactly the context
it saw the first time; `cache_version` names it), and the state lives in the node's folder for the kind
(`ScorerContext.state_dir`), so two kinds on one node never mix their statistics.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from edgehaul.contracts import Contract
from edgehaul.edge.scoring import CannotScore

if TYPE_CHECKING:
    from edgehaul.edge.scorer_registry import ScorerContext

ANOMALY_VERSION = "anomaly-1"
MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution x this = its standard deviation
SCALE_FLOOR = 1e-3  # a constant feature (MAD 0) still gives a finite z
DISTANCE_SCALE = 3.0  # d at which value = 1 - 1/e


def _features(table: pa.Table, contract: Contract) -> np.ndarray:
    cols = contract.feature_columns
    if table.num_rows == 0 or not cols:
        return np.empty((table.num_rows, len(cols)), np.float64)
    return np.column_stack([table.column(c).to_numpy(zero_copy_only=False) for c in cols]).astype(np.float64)


def _labels(table: pa.Table, contract: Contract) -> np.ndarray:
    """Label per row as float (NaN where unlabelled, or all NaN when the kind has no label)."""
    col = contract.label_column
    if col is None or col not in table.column_names:
        return np.full(table.num_rows, np.nan)
    return np.asarray(table.column(col).to_numpy(zero_copy_only=False), dtype=np.float64)


def _normal_mask(labels: np.ndarray, contract: Contract, use_labels: bool) -> np.ndarray:
    if use_labels and contract.label.kind == "anomaly":
        return labels == 0
    return np.ones(len(labels), dtype=bool)


class AnomalyState:
    """Reference rows of the normal class per folded batch, oldest first, bounded."""

    def __init__(self, batches: OrderedDict[str, np.ndarray] | None = None, *, per_batch: int = 128,
                 max_batches: int = 64, use_labels: bool = False) -> None:
        self.use_labels = use_labels
        self.batches: OrderedDict[str, np.ndarray] = batches or OrderedDict()
        self.per_batch = per_batch
        self.max_batches = max_batches

    def reference(self, table: pa.Table, contract: Contract) -> np.ndarray:
        """Up to per_batch normal rows of a batch, evenly spaced (deterministic per batch)."""
        feats = _features(table, contract)[_normal_mask(_labels(table, contract), contract, self.use_labels)]
        finite = feats[np.isfinite(feats).all(axis=1)]
        if len(finite) <= self.per_batch:
            return finite
        return finite[np.linspace(0, len(finite) - 1, self.per_batch).round().astype(np.int64)]

    def context(self, batch_key: str | None) -> list[str]:
        keys = list(self.batches)
        return keys[: keys.index(batch_key)] if batch_key is not None and batch_key in self.batches else keys

    def digest(self, keys: list[str] | None = None) -> str:
        h = hashlib.sha256((ANOMALY_VERSION + ("+labels" if self.use_labels else "")).encode())
        for key in self.batches if keys is None else keys:
            h.update(key.encode())
        return h.hexdigest()[:16]

    def fold(self, key: str, rows: np.ndarray) -> None:
        if key in self.batches:
            return
        self.batches[key] = rows
        while len(self.batches) > self.max_batches:
            self.batches.popitem(last=False)

    def to_json(self) -> bytes:
        # Full float64 (repr round-trips): a reloaded state rescores a batch to exactly the same values.
        return json.dumps({"version": ANOMALY_VERSION, "use_labels": self.use_labels, "per_batch": self.per_batch,
                           "max_batches": self.max_batches,
                           "batches": [[k, v.tolist()] for k, v in self.batches.items()]}).encode()

    @classmethod
    def load(cls, path: Path | None, width: int, *, use_labels: bool = False) -> AnomalyState:
        if path is None or not path.exists():
            return cls(use_labels=use_labels)
        doc = json.loads(path.read_bytes())
        batches: OrderedDict[str, np.ndarray] = OrderedDict()
        for key, rows in doc["batches"]:
            arr = np.asarray(rows, dtype=np.float64).reshape(-1, width)
            batches[key] = arr
        if bool(doc.get("use_labels", True)) != use_labels:  # another reference set: start afresh
            return cls(use_labels=use_labels)
        return cls(batches, per_batch=int(doc["per_batch"]), max_batches=int(doc["max_batches"]),
                   use_labels=use_labels)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(self.to_json())
        os.replace(tmp, path)


class AnomalyScorer:
    """Labelled anomalies first, then rows far from the normal class (robust z-score)."""

    STATE_FILE = "anomaly-state.json"

    def __init__(self, contract: Contract, state: AnomalyState | None = None, state_path: Path | None = None) -> None:
        self.contract = contract
        self.state = state or AnomalyState()
        self.state_path = state_path

    @classmethod
    def from_context(cls, ctx: ScorerContext) -> AnomalyScorer:
        """The `anomaly` entry point: state in the node's folder for this kind."""
        path = ctx.state_dir / cls.STATE_FILE
        state = AnomalyState.load(path, len(ctx.contract.feature_columns), use_labels=ctx.policy.use_labels)
        return cls(ctx.contract, state, state_path=path)

    @property
    def version(self) -> str:
        return f"{ANOMALY_VERSION}{'+labels' if self.state.use_labels else ''}+{self.state.digest()}"

    def cache_version(self, batch_key: str) -> str:
        labels = "+labels" if self.state.use_labels else ""
        return f"{ANOMALY_VERSION}{labels}/{self.state.digest(self.state.context(batch_key))}"

    def score(self, table: pa.Table, batch_key: str | None = None) -> np.ndarray:
        n = table.num_rows
        if n == 0:
            return np.zeros(0, np.float32)
        labels = _labels(table, self.contract)
        own = self.state.reference(table, self.contract)
        ref = np.concatenate([*(self.state.batches[k] for k in self.state.context(batch_key)), own]) \
            if self.contract.feature_columns else own
        if not self.contract.feature_columns:
            raise CannotScore(f"anomaly: contract {self.contract.id} has no feature columns")
        if len(ref) == 0:
            raise CannotScore(f"anomaly: no reference rows yet for {self.contract.id} (no finite features"
                              f"{', no row labelled normal' if self.state.use_labels else ''})")
        else:
            median = np.median(ref, axis=0)
            scale = np.maximum(MAD_TO_SIGMA * np.median(np.abs(ref - median), axis=0), SCALE_FLOOR)
            z = (_features(table, self.contract) - median) / scale
            d = np.sqrt(np.mean(np.nan_to_num(z, nan=0.0, posinf=1e6, neginf=-1e6) ** 2, axis=1))
            value = 1.0 - np.exp(-((d / DISTANCE_SCALE) ** 2))
        if self.state.use_labels and self.contract.label.kind == "anomaly":
            value = np.where(labels == 1, 1.0, value)
        return np.clip(value, 0.0, 1.0).astype(np.float32)

    def fold(self, table: pa.Table, batch_key: str) -> None:
        """Add a batch's normal reference rows (idempotent per batch key)."""
        self.state.fold(batch_key, self.state.reference(table, self.contract))

    def save(self) -> None:
        if self.state_path is not None:
            self.state.save(self.state_path)
