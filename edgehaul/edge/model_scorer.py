"""The edge's model-based value scorer, for every kind: a published model's view of each row.

value = what the centre's model does not yet know: its normalised predictive entropy H(p) / log(n_classes)
in [0, 1] (samples the model is unsure about teach it the most); for an anomaly kind, the larger of that and
the model's probability of the anomaly class (an anomaly it recognises still goes first, for the operator).
No label is read: labels at the edge are not needed. Rows are decoded by
`edgehaul.decode` (through `training.model.inputs`), as training decoded them. The edge scorer
registry imports this lazily (torch is only needed where the 'model' scorer is configured).

    scorer = ModelScorer("latest", store)        # the model in models/landcover/latest.json
    scorer = ModelScorer("latest:motions", store)
    scorer = ModelScorer("s3://.../model.pt", store)
    values = scorer.score(table)                 # rows of the model's contract (bundle schema)

A policy's `model_uri: latest` means the published model of the scored kind (its contract's
`training.model_name`), so one node scores each kind with that kind's own model.

Before a kind has a model (none published, or none downlinked to the node yet: the closed loop's cold start),
the policy's `fallback_scorer` values its rows (`ColdStart`, default `novelty`), said in every log line and in
the scorer version that keys the edge cache, so the first batches after a model arrives are scored by it. With
`fallback_scorer: null` the missing model fails the batch, as any other missing input.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import replace
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from edgehaul.blocks import ObjectStore
from edgehaul.bundles import full_rows
from edgehaul.contracts import Contract, contract_by_id
from edgehaul.edge.scorer_registry import ScorerContext, build_scorer
from edgehaul.edge.scoring import CannotScore, ContextualScorer, Scorer, scorer_cache_version
from edgehaul.training.model import build_model, inputs
from edgehaul.training.registry import NoPublishedModel, load_model_file, parse_model_file, resolve_model_uri

log = logging.getLogger(__name__)


class NoModelYet(ValueError):
    """The kind has no model for this scorer yet: none published, or none downlinked to the node."""


class ModelScorer:
    """Scores rows by the uncertainty of a registered model. `version` is the model id (it keys the
    scoring cache, so a newly published model re-scores)."""

    def __init__(self, model_uri: str | None, store: ObjectStore | None = None, *, batch_size: int = 1024,
                 model_file: dict[str, Any] | None = None) -> None:
        if model_file is not None:  # already on the node (downlinked): no store involved
            self.model_uri, f = model_uri or "local", model_file
        else:
            self.store = store or ObjectStore.from_env()
            self.model_uri = model_uri = resolve_model_uri(self.store, model_uri)
            f = load_model_file(self.store, model_uri)
        self.version: str = str(f["model_id"])
        self.contract = contract_by_id(str(f["contract"]))
        self.model = build_model(dict(f["arch"]))
        self.model.load_state_dict(f["state_dict"])
        self.model.eval()
        self.arch = dict(f["arch"])
        self.n_classes = int(self.arch["n_classes"])
        # The anomaly class of an anomaly kind (label value 1); None for class kinds (scored by entropy).
        self.anomaly_index: int | None = (list(self.contract.label_values).index(1)
                                          if self.contract.label.kind == "anomaly" else None)
        self.batch_size = batch_size

    def _present(self, table: pa.Table) -> np.ndarray:
        """Rows the model can see: not a summary and with their payload (every payload column, for a columns
        kind the non-nullable ones)."""
        missing = [c for c in self.contract.payload_columns if c not in table.column_names]
        if missing:
            raise ValueError(f"table lacks the payload columns {missing} of {self.contract.id} "
                             f"(columns: {table.column_names})")
        mask = np.ones(table.num_rows, dtype=bool)
        needed = [c.name for c in self.contract.columns if not c.nullable] if self.contract.layout == "columns" \
            else list(self.contract.payload_columns)
        for name in needed:
            mask &= np.asarray(pc.is_valid(table.column(name)).to_numpy(zero_copy_only=False), dtype=bool)
        if "is_summary" in table.column_names:
            mask &= full_rows(table)
        return mask

    def probabilities(self, table: pa.Table) -> np.ndarray:
        """Class probabilities (n, n_classes); rows without their payload (summaries) get NaN."""
        out = np.full((table.num_rows, self.n_classes), np.nan, dtype=np.float32)
        idx = np.flatnonzero(self._present(table))
        with torch.no_grad():
            for s in range(0, len(idx), self.batch_size):
                part = idx[s : s + self.batch_size]
                x = inputs(table.take(pa.array(part)), self.contract, self.arch)
                out[part] = torch.softmax(self.model(x), dim=1).numpy()
        return out

    def score(self, table: pa.Table) -> np.ndarray:
        """Per row in [0, 1]: the normalised predictive entropy (for anomaly kinds, at least the anomaly
        probability); 0 for rows without their payload (summaries), CannotScore when no row has one."""
        p = self.probabilities(table)
        missing = np.isnan(p).any(axis=1)
        if table.num_rows and missing.all():
            raise CannotScore(f"model {self.version}: none of the {table.num_rows} rows has its payload")
        with np.errstate(divide="ignore", invalid="ignore"):
            v = -np.nansum(np.where(p > 0, p * np.log(p), 0.0), axis=1) / math.log(max(self.n_classes, 2))
        if self.anomaly_index is not None:
            v = np.maximum(v, p[:, self.anomaly_index].astype(np.float64))
        v = np.where(missing, 0.0, v)
        return np.clip(v, 0.0, 1.0).astype(np.float64)


def kind_model_uri(model_uri: str, contract: Contract) -> str:
    """`latest` (no name) means the published model of the scored kind: `latest:<training.model_name>`
    (a kind without a training section keeps the registry's default name)."""
    if model_uri == "latest" and contract.training is not None:
        return f"latest:{contract.training.model_name}"
    return model_uri


DOWNLINK = "downlink:"  # model_uri "downlink:<name>": the node's downlinked copy, no store access
_loaded: dict[tuple[str, str], ModelScorer] = {}
_loaded_lock = threading.Lock()


class ColdStart:
    """The `model` scorer of a kind that has no model yet: the policy's fallback scorer values the rows.
    Its version names both, so batches scored now are scored again once a model arrives."""

    def __init__(self, fallback: Scorer, reason: str) -> None:
        self.fallback, self.reason = fallback, reason

    @property
    def version(self) -> str:
        return f"model-pending+{self.fallback.version}"

    def cache_version(self, batch_key: str) -> str:
        return f"model-pending+{scorer_cache_version(self.fallback, batch_key)}"

    def score(self, table: pa.Table, batch_key: str | None = None) -> np.ndarray:
        if isinstance(self.fallback, ContextualScorer):
            return self.fallback.score(table, batch_key=batch_key)
        return self.fallback.score(table)

    def fold(self, table: pa.Table, batch_key: str) -> None:
        if isinstance(self.fallback, ContextualScorer):
            self.fallback.fold(table, batch_key)

    def save(self) -> None:
        if isinstance(self.fallback, ContextualScorer):
            self.fallback.save()


def from_context(ctx: ScorerContext) -> ModelScorer | ColdStart:
    """The `model` entry point: the kind's model, or before it has one the policy's fallback scorer (its state
    in a folder of its own under this scorer's)."""
    try:
        return _model_for(ctx)
    except NoModelYet as e:
        name = ctx.policy.fallback_scorer
        if name is None:
            raise
        log.warning("scorer model for %s: %s; scoring with %s until a model arrives", ctx.contract.id, e, name)
        return ColdStart(build_scorer(name, replace(ctx, state_dir=ctx.state_dir / f"fallback-{name}")), str(e))


def _model_for(ctx: ScorerContext) -> ModelScorer:
    """A model is loaded once per process and model id: a task per batch must not download it again; 'latest'
    is re-resolved on every call, so a newly published model re-scores."""
    if not ctx.policy.model_uri:
        raise ValueError(f"tiering policy {ctx.policy.version}: scorer 'model' needs model_uri")
    if ctx.policy.model_uri.startswith(DOWNLINK):  # the model the core downlinked to this node
        return _downlinked(ctx, ctx.policy.model_uri.removeprefix(DOWNLINK))
    store = ctx.store or ObjectStore.from_env()
    try:
        uri = resolve_model_uri(store, kind_model_uri(ctx.policy.model_uri, ctx.contract))
    except NoPublishedModel as e:
        raise NoModelYet(str(e)) from e
    key = (uri, store.model_dump_json())
    with _loaded_lock:
        scorer = _loaded.get(key)
        if scorer is None:
            scorer = _loaded[key] = ModelScorer(uri, store)
    return _same_kind(scorer, ctx)


def _same_kind(scorer: ModelScorer, ctx: ScorerContext) -> ModelScorer:
    if scorer.contract.id != ctx.contract.id:
        raise ValueError(f"model {scorer.version} was trained on {scorer.contract.id}, cannot score {ctx.contract.id}")
    return scorer


def _downlinked(ctx: ScorerContext, name: str) -> ModelScorer:
    if not name and ctx.contract.training is not None:  # `downlink:` alone: the scored kind's own model
        name = ctx.contract.training.model_name
    path = ctx.downlinked("model", name) if ctx.downlinked else None
    if path is None:
        raise NoModelYet(f"no model {name!r} downlinked to this node yet ({ctx.state_dir}); it arrives with the "
                         f"next contact (edgehaul downlink sync)")
    key = (str(path), "downlink")  # a new generation is a new folder: a new model re-scores
    with _loaded_lock:
        scorer = _loaded.get(key)
        if scorer is None:
            scorer = _loaded[key] = ModelScorer(f"downlink:{name}", model_file=parse_model_file(path.read_bytes()))
    return _same_kind(scorer, ctx)
