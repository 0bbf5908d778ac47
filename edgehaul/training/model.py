"""The land-cover classifier: a small CNN over contract patches (HWC uint8 -> 7 classes).

Kept deliberately small (about 60k parameters) so it trains on CPU in tests; the architecture is
recorded in every checkpoint and model file, so a loader rebuilds exactly what was trained.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import torch
from torch import nn

from edgehaul.contracts import Contract


class LandCoverNet(nn.Module):
    """conv(3x3) x3 with stride-2 downsampling, global average pool, linear head.

    No batch norm: ranks may see empty local batches (uneven shards) and batch statistics would
    then differ between single-process and distributed runs.
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


def build_model(arch: dict[str, Any]) -> LandCoverNet:
    return LandCoverNet(**arch)


def pixels_to_tensor(pixels: pa.Array | pa.ChunkedArray, contract: Contract) -> torch.Tensor:
    """Binary `pixels` column (no nulls) -> float NCHW tensor, normalised as the contract says."""
    arr = pixels.combine_chunks() if isinstance(pixels, pa.ChunkedArray) else pixels
    n = len(arr)
    if n == 0:
        return torch.zeros((0, contract.shape[2], contract.shape[0], contract.shape[1]), dtype=torch.float32)
    if arr.null_count:
        raise ValueError(f"pixels column has {arr.null_count} null rows; filter summary rows first")
    if pa.types.is_large_binary(arr.type):
        arr = arr.cast(pa.binary())
    offsets = np.frombuffer(arr.buffers()[1], dtype=np.int32)[arr.offset : arr.offset + n + 1]
    widths = np.diff(offsets)
    if not (widths == contract.sample_nbytes).all():
        bad = int(np.flatnonzero(widths != contract.sample_nbytes)[0])
        raise ValueError(
            f"pixels row {bad} has {int(widths[bad])} bytes, contract {contract.id} needs {contract.sample_nbytes}"
        )
    data = np.frombuffer(arr.buffers()[2], dtype=contract.np_dtype)
    start = int(offsets[0]) // contract.np_dtype.itemsize
    flat = data[start : start + n * contract.sample_nbytes // contract.np_dtype.itemsize]
    hwc = flat.reshape((n, *contract.shape)).astype(np.float32) * contract.scale + contract.offset
    return torch.from_numpy(np.ascontiguousarray(hwc.transpose(0, 3, 1, 2)))


def labels_to_targets(labels: pa.Array | pa.ChunkedArray, contract: Contract) -> torch.Tensor:
    """Contract labels (e.g. 1..7) -> class indices 0..n-1; unknown labels are an error."""
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
    params = sum(p.numel() for p in LandCoverNet(**arch).parameters()) * 4
    return int((params + keep_checkpoints * 3 * params) * 1.1) + 64 * 1024
