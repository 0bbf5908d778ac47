"""The edge's model-based value scorer: a published land-cover model's predictive uncertainty.

value = normalised predictive entropy H(p) / log(n_classes) in [0, 1]: samples the model is unsure
about are the most valuable to send to the centre. The edge scorer registry imports this lazily
(torch is only needed where the 'model' scorer is configured).

    scorer = ModelScorer("latest", store)        # the model in models/landcover/latest.json
    scorer = ModelScorer("s3://.../model.pt", store)
    values = scorer.score(table)                 # table with the contract's `pixels` column
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from edgehaul.blocks import ObjectStore
from edgehaul.contracts import contract_by_id
from edgehaul.edge.scorer_registry import ScorerContext
from edgehaul.training.model import build_model, pixels_to_tensor
from edgehaul.training.registry import load_model_file, parse_model_file, resolve_model_uri


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
        self.n_classes = int(f["arch"]["n_classes"])
        self.batch_size = batch_size

    def probabilities(self, table: pa.Table) -> np.ndarray:
        """Class probabilities (n, n_classes); rows without pixels (summaries) get NaN."""
        if "pixels" not in table.column_names:
            raise ValueError(f"table has no 'pixels' column (columns: {table.column_names})")
        pixels = table.column("pixels").combine_chunks()
        out = np.full((len(pixels), self.n_classes), np.nan, dtype=np.float32)
        present = np.asarray(pc.is_valid(pixels).to_numpy(zero_copy_only=False), dtype=bool)
        idx = np.flatnonzero(present)
        with torch.no_grad():
            for s in range(0, len(idx), self.batch_size):
                part = idx[s : s + self.batch_size]
                x = pixels_to_tensor(pixels.take(pa.array(part)), self.contract)
                out[part] = torch.softmax(self.model(x), dim=1).numpy()
        return out

    def score(self, table: pa.Table) -> np.ndarray:
        """Normalised predictive entropy per row in [0, 1]; 0 for rows without pixels."""
        p = self.probabilities(table)
        with np.errstate(divide="ignore", invalid="ignore"):
            h = -np.nansum(np.where(p > 0, p * np.log(p), 0.0), axis=1) / math.log(self.n_classes)
        h = np.where(np.isnan(p).any(axis=1), 0.0, h)
        return np.clip(h, 0.0, 1.0).astype(np.float64)


DOWNLINK = "downlink:"  # model_uri "downlink:<name>": the node's downlinked copy, no store access
_loaded: dict[tuple[str, str], ModelScorer] = {}
_loaded_lock = threading.Lock()


def from_context(ctx: ScorerContext) -> ModelScorer:
    """The `model` entry point. A model is loaded once per process and model id: a task per batch must not
    download it again; 'latest' is re-resolved on every call, so a newly published model re-scores."""
    if not ctx.policy.model_uri:
        raise ValueError(f"tiering policy {ctx.policy.version}: scorer 'model' needs model_uri")
    if ctx.policy.model_uri.startswith(DOWNLINK):  # the model the core downlinked to this node
        return _downlinked(ctx, ctx.policy.model_uri.removeprefix(DOWNLINK))
    store = ctx.store or ObjectStore.from_env()
    uri = resolve_model_uri(store, ctx.policy.model_uri)
    key = (uri, store.model_dump_json())
    with _loaded_lock:
        scorer = _loaded.get(key)
        if scorer is None:
            scorer = _loaded[key] = ModelScorer(uri, store)
    if scorer.contract.id != ctx.contract.id:
        raise ValueError(f"model {scorer.version} was trained on {scorer.contract.id}, cannot score {ctx.contract.id}")
    return scorer


def _downlinked(ctx: ScorerContext, name: str) -> ModelScorer:
    from edgehaul.downlink import current_file

    path = current_file(ctx.node_dir, "model", name) if ctx.node_dir else None
    if path is None:
        raise ValueError(f"no model {name!r} downlinked to this node yet ({ctx.node_dir}); it arrives with the "
                         f"next contact (edgehaul downlink sync)")
    key = (str(path), "downlink")  # a new generation is a new folder: a new model re-scores
    with _loaded_lock:
        scorer = _loaded.get(key)
        if scorer is None:
            scorer = _loaded[key] = ModelScorer(f"downlink:{name}", model_file=parse_model_file(path.read_bytes()))
    return scorer
