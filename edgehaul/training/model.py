"""The models central training builds, one family per `contract.training.model`:

- `cnn2d` (`LandCoverNet`): images of any HxW and channel count, channels-last or first in the contract;
- `cnn1d` (`Cnn1d`): multichannel series CxT (or TxC), a Conv1d stack and a global pool;
- `mlp` (`Mlp`): the numeric columns of a columns kind, or a flattened tensor.

Kept deliberately small so they train on CPU in tests. The architecture (with its `family`) is recorded
in every checkpoint and model file, so a loader rebuilds exactly what was trained; an arch without a
family is a Landsat-era cnn2d. Inputs always come from `edgehaul.decode` (the one place payloads
become arrays), normalised as the contract says.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import torch
from torch import nn

from edgehaul.contracts import Contract, ContractError
from edgehaul.decode import column_matrix, decode_tensors, normalise


class LandCoverNet(nn.Module):
    """The cnn2d family: conv(3x3) x3 with stride-2 downsampling, global average pool, linear head.

    No batch norm: ranks may see empty local batches (uneven shards) and batch statistics would
    then differ between single-process and distributed runs (the same holds for every family).
    """

    def __init__(self, in_channels: int = 6, n_classes: int = 7, width: int = 32, dropout: float = 0.1) -> None:
        super().__init__()
        self.arch = {"in_channels": in_channels, "n_classes": n_classes, "width": width, "dropout": dropout}
        w = width
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, w, 3, padding=1), nn.ReLU(),
            nn.Conv2d(w, 2 * w, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(2 * w, 2 * w, 3, stride=2, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )
        self.head = nn.Sequential(nn.Dropout(dropout), nn.Linear(2 * w, n_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class Cnn1d(nn.Module):
    """The cnn1d family: conv(k=5) x3 over time with stride-2 downsampling, global average pool, linear head."""

    def __init__(self, in_channels: int, n_classes: int, width: int = 32, dropout: float = 0.1) -> None:
        super().__init__()
        w = width
        self.features = nn.Sequential(
            nn.Conv1d(in_channels, w, 5, padding=2), nn.ReLU(),
            nn.Conv1d(w, 2 * w, 5, stride=2, padding=2), nn.ReLU(),
            nn.Conv1d(2 * w, 2 * w, 5, stride=2, padding=2), nn.ReLU(),
            nn.AdaptiveAvgPool1d(1), nn.Flatten(),
        )
        self.head = nn.Sequential(nn.Dropout(dropout), nn.Linear(2 * w, n_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class Mlp(nn.Module):
    """The mlp family: two hidden layers of `width` units."""

    def __init__(self, in_features: int, n_classes: int, width: int = 32, dropout: float = 0.1) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(in_features, width), nn.ReLU(),
            nn.Linear(width, width), nn.ReLU(),
            nn.Dropout(dropout), nn.Linear(width, n_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


FAMILIES: dict[str, type[nn.Module]] = {"cnn2d": LandCoverNet, "cnn1d": Cnn1d, "mlp": Mlp}


def family_of(contract: Contract) -> str:
    """The contract's model family; a kind without a training section cannot be trained."""
    if contract.training is None:
        raise ContractError(f"contract {contract.id} has no training section ({contract.source}): "
                            "add `training:` (model, model_name) to train this kind")
    return contract.training.model


def arch_for(contract: Contract, width: int, family: str | None = None) -> dict[str, Any]:
    """The architecture a contract's data needs: input size from the contract, one output per label value
    (an anomaly flag is 2 classes)."""
    family = family or family_of(contract)
    n_classes = len(contract.label_values)
    if n_classes < 2:
        raise ContractError(f"contract {contract.id}: training needs a label with at least 2 values, "
                            f"has {list(contract.label_values)}")
    if family == "mlp":
        t = contract.tensor
        n_in = len(contract.numeric_columns) if contract.layout == "columns" else (
            int(np.prod(t.shape)) if t is not None else 0)
        if n_in == 0:
            raise ContractError(f"contract {contract.id}: mlp needs numeric columns or a tensor, it has neither")
        return {"family": family, "in_features": n_in, "n_classes": n_classes, "width": width}
    if family not in ("cnn2d", "cnn1d"):
        raise ContractError(f"contract {contract.id}: unknown model family {family!r} (known: {sorted(FAMILIES)})")
    rank = 3 if family == "cnn2d" else 2
    if contract.tensor is None or len(contract.shape) != rank:
        raise ContractError(f"contract {contract.id}: {family} needs a rank-{rank} tensor")
    return {"family": family, "in_channels": len(contract.channels), "n_classes": n_classes, "width": width}


def build_model(arch: dict[str, Any]) -> nn.Module:
    """The model an arch dict describes (no family: the Landsat-era cnn2d)."""
    a = {k: v for k, v in arch.items() if k not in ("input_shift", "input_scale")}  # inputs' business, not the net's
    family = a.pop("family", "cnn2d")
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r} in arch {arch} (known: {sorted(FAMILIES)})")
    return FAMILIES[family](**a)


def empty_inputs(contract: Contract, arch: dict[str, Any]) -> torch.Tensor:
    """A 0-row input batch of the family's shape (a rank whose shard ran dry still steps)."""
    family = arch.get("family", "cnn2d")
    if family == "mlp":
        return torch.zeros((0, int(arch["in_features"])))
    t = contract.tensor
    assert t is not None
    rest = [s for i, s in enumerate(t.shape) if i != t.channel_axis]
    return torch.zeros((0, len(t.channels), *rest))


def inputs(table: pa.Table | pa.RecordBatch, contract: Contract, arch: dict[str, Any]) -> torch.Tensor:
    """Trainable rows (no summaries, no null payload) -> the family's float input batch: (m, C, H, W) for
    cnn2d, (m, C, T) for cnn1d (the channel axis moved first), (m, features) for mlp (a columns kind's
    numeric columns scaled to their ranges, a null reading as 0; or the normalised tensor flattened)."""
    family = arch.get("family", "cnn2d")
    if table.num_rows == 0:
        return empty_inputs(contract, arch)
    if contract.layout == "columns":
        if family != "mlp":
            raise ContractError(f"contract {contract.id}: a columns kind trains an mlp, not {family}")
        x = np.nan_to_num(column_matrix(pa.Table.from_batches([table]) if isinstance(table, pa.RecordBatch)
                                        else table, contract), nan=0.0)
    else:
        spec = contract.tensor
        if spec is None:
            raise ContractError(f"contract {contract.id} ({contract.layout}) has no tensor to train on")
        x = normalise(decode_tensors(table.column(contract.payload_columns[0]), contract), spec)
        x = x.reshape(len(x), -1) if family == "mlp" else np.moveaxis(x, 1 + spec.channel_axis, 1)
    return torch.from_numpy(standardise(np.ascontiguousarray(x, dtype=np.float32), arch))


def standardise(x: np.ndarray, arch: dict[str, Any]) -> np.ndarray:
    """(x - input_shift) / input_scale per feature or channel (axis 1) where the arch carries them: the
    statistics the trainer measured on the data, kept in the model file so the edge scorer feeds the model
    exactly what it was trained on."""
    if "input_shift" not in arch:
        return x
    shape = (1, -1) + (1,) * (x.ndim - 2)
    shift = np.asarray(arch["input_shift"], dtype=np.float32).reshape(shape)
    scale = np.asarray(arch["input_scale"], dtype=np.float32).reshape(shape)
    return (x - shift) / scale


def input_statistics(x: np.ndarray) -> dict[str, list[float]]:
    """Per-feature (mlp) or per-channel (cnn) mean and std of an unstandardised input batch, for the arch.

    A declared range (a sensor's full scale) is far wider than what it reads in use: scaled to it, 1 g
    of gravity and a 0.2 g gait swing differ by 0.02, too little for a small model to learn from in a few
    epochs. A std of 0 (a constant input) is kept at 1 so the input passes unscaled."""
    axes = tuple(i for i in range(x.ndim) if i != 1)
    mean = x.astype(np.float64).mean(axis=axes)
    std = x.astype(np.float64).std(axis=axes)
    std = np.where(std > 1e-6, std, 1.0)
    return {"input_shift": [float(v) for v in mean], "input_scale": [float(v) for v in std]}


def pixels_to_tensor(payload: pa.Array | pa.ChunkedArray, contract: Contract) -> torch.Tensor:
    """An image kind's payload column (no nulls) -> float NCHW, normalised (the cnn2d input)."""
    t = contract.tensor
    if t is None:
        raise ContractError(f"contract {contract.id} has no tensor")
    col = payload.combine_chunks() if isinstance(payload, pa.ChunkedArray) else payload
    batch = pa.table({contract.payload_columns[0]: col})
    return inputs(batch, contract, {"family": "cnn2d"})


def labels_to_targets(labels: pa.Array | pa.ChunkedArray, contract: Contract) -> torch.Tensor:
    """Contract labels (e.g. 1..7; 0/1 for an anomaly flag) -> class indices 0..n-1; unknown labels are an error."""
    values = np.asarray(labels.to_numpy(zero_copy_only=False), dtype=np.int64)
    known = np.asarray(contract.label_values, dtype=np.int64)
    order = np.argsort(known)
    pos = np.clip(np.searchsorted(known[order], values), 0, len(known) - 1)
    bad = known[order][pos] != values
    if bad.any():
        v = int(values[np.flatnonzero(bad)[0]])
        raise ValueError(f"label {v} not in contract {contract.id} values {list(contract.label_values)}")
    return torch.from_numpy(order[pos].astype(np.int64))


def estimate_storage_bytes(arch: dict[str, Any], keep_checkpoints: int) -> int:
    """Bytes a run keeps: the model file plus `keep_checkpoints` checkpoints (weights + two AdamW
    moments each), with 10% for serialisation overhead and RNG/position state."""
    params = sum(p.numel() for p in build_model(arch).parameters()) * 4
    return int((params + keep_checkpoints * 3 * params) * 1.1) + 64 * 1024
