"""A drop folder: where an instrument writes its output files, read by the node once each (issue #20 item 2).

Formats, by suffix: Parquet (`.parquet`), Arrow IPC (`.arrow`, `.feather`, `.ipc`) and CSV (`.csv`; a binary
column is read as base64 text). A file is read only when it is complete:

- names that writers use while a file is being written are never read: a leading `.` or `~`, or a suffix
  `.tmp`, `.part`, `.partial`, `.inprogress`, `.crdownload` (the usual write-then-rename);
- a file modified less than `settle_s` ago is left for the next run (writers that append in place);
- its size and mtime are taken again after reading: a file that changed while it was read is not recorded.

A file kind (`file:` in the contract, e.g. `image/png`) also takes one file per observation, by the media
type's suffix (`*.png`; see `MEDIA_SUFFIXES`): the sample id is the file name's stem, and an optional sidecar
`<stem>.json` gives `label` (or the contract's label column by name), `capture_time` (ISO 8601 with a time zone,
or epoch milliseconds), `seq` and `node_id`; without one, capture time is the file's mtime and seq its mtime in
ns. Write the sidecar first, then the file (a sidecar without its file waits; a file read without its sidecar is
not read again). Each such file is read once, at `claim`: a file over `file.max_bytes` (judged by its size, its
content only hashed), of another media type (its leading bytes), or with a sidecar that does not parse is moved
to `rejected/` with the reason; otherwise its bytes ride in the `DropFile` to `read_observations`, which packs
up to a batch of them into one raw table. Its record key is the sha256 of its stem and content, so the same
image under two names is two observations, and the same file dropped again is a duplicate.

Each file is recorded by content (sha256) in the node's source log (`<spool>/sources.sqlite`, WAL, fsync)
*before* it moves to `done/`, so a run that dies between the two moves it next time without reading it again,
and the same content dropped twice (a re-sent file under another name) is recorded as a duplicate, not read.
Files of an unknown format are moved to `rejected/` with the reason in the log: they are named, not lost.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import json
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from edgehaul.contracts import MEDIA_MAGIC, Contract

FORMATS = {".parquet": "parquet", ".arrow": "ipc", ".feather": "ipc", ".ipc": "ipc", ".csv": "csv"}
PARTIAL_SUFFIXES = (".tmp", ".part", ".partial", ".inprogress", ".crdownload")
SOURCES_FILE = "sources.sqlite"
# One file per observation, by a file kind's media type (the suffixes instruments write).
MEDIA_SUFFIXES: dict[str, tuple[str, ...]] = {
    "image/png": (".png",), "image/jpeg": (".jpg", ".jpeg"), "image/tiff": (".tif", ".tiff"),
    "application/x-parquet": (".parquet",), "application/octet-stream": (".bin", ".dat"),
}
SIDECAR_SUFFIX = ".json"
SIDECAR_KEYS = ("label", "capture_time", "seq", "node_id")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS source_files (
    sha256 TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    size INTEGER NOT NULL,
    rows INTEGER NOT NULL,
    outcome TEXT NOT NULL,  -- read | rejected
    detail TEXT NOT NULL DEFAULT '',
    at REAL NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS duplicate_files (name TEXT NOT NULL, sha256 TEXT NOT NULL, at REAL NOT NULL);
"""


class DropFolderError(ValueError):
    """A file that cannot be read as the contract's raw rows; names the file and why."""


@dataclass(frozen=True, slots=True)
class DropFile:
    path: Path
    format: str  # parquet | ipc | csv | file (one observation)
    size: int
    mtime_ns: int
    sha256: str
    data: bytes | None = field(default=None, repr=False)  # an observation's bytes, read once at claim
    sidecar: Path | None = None
    meta: dict[str, Any] = field(default_factory=dict)  # the parsed sidecar


@dataclass
class Claimed:
    files: list[DropFile]  # complete, new: to be read
    waiting: list[str]  # partial or still settling: next run
    duplicates: list[str]  # same content as a file read before: moved to done/ unread
    rejected: dict[str, str]  # name -> why (unknown format): moved to rejected/


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def is_partial_name(name: str) -> bool:
    return name.startswith((".", "~")) or name.lower().endswith(PARTIAL_SUFFIXES)


class DropFolder:
    def __init__(self, folder: Path | str, done: Path | str, log_dir: Path | str, *, settle_s: float = 5.0,
                 clock: Callable[[], float] = time.time, contract: Contract | None = None) -> None:
        self.folder, self.done = Path(folder), Path(done)
        self.contract = contract  # a file kind's contract: its files are observations (`claim`)
        f = contract.file if contract is not None else None
        self.observation_suffixes = MEDIA_SUFFIXES.get(f.media_type, ()) if f is not None else ()
        self.rejected_dir = self.done.parent / "rejected"
        self.settle_s, self._clock = settle_s, clock
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(Path(log_dir) / SOURCES_FILE, timeout=30.0, check_same_thread=False,
                                   isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")  # a file recorded as read survives a power cut
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        self._db.close()

    def _known(self, sha: str) -> bool:
        return self._db.execute("SELECT 1 FROM source_files WHERE sha256 = ?", (sha,)).fetchone() is not None

    def _move(self, path: Path, to: Path) -> None:
        to.mkdir(parents=True, exist_ok=True)
        dest = to / path.name
        if dest.exists():  # same name dropped again later: keep both
            dest = to / f"{path.stem}.{time.time_ns()}{path.suffix}"
        os.replace(path, dest)

    def claim(self) -> Claimed:
        """The complete files not read before, oldest first. Moves away duplicates and unknown formats."""
        out = Claimed([], [], [], {})
        if not self.folder.is_dir():
            raise DropFolderError(f"drop folder {self.folder} does not exist")
        now = self._clock()
        claimed: set[str] = set()
        entries = sorted((p for p in self.folder.iterdir() if p.is_file()), key=lambda p: (p.stat().st_mtime_ns, p.name))
        obs = self.observation_suffixes
        stems = {p.stem for p in entries if p.suffix.lower() in obs}
        for p in entries:
            st = p.stat()
            if is_partial_name(p.name) or now - st.st_mtime < self.settle_s:
                out.waiting.append(p.name)
                continue
            if obs and p.suffix.lower() == SIDECAR_SUFFIX:  # a sidecar travels with its observation file
                if p.stem not in stems:
                    out.waiting.append(p.name)
                continue
            if p.suffix.lower() in obs:
                self._claim_observation(p, st, now, claimed, out)
                continue
            fmt = FORMATS.get(p.suffix.lower())
            sha = _sha256(p)
            if fmt is None:
                why = f"unknown format {p.suffix or '(no suffix)'}; known: {', '.join(sorted(FORMATS))}"
                self._record(p.name, sha, st.st_size, 0, "rejected", why)
                self._move(p, self.rejected_dir)
                out.rejected[p.name] = why
            elif sha in claimed or self._known(sha):  # read before, or twice in this very folder
                with self._lock:
                    self._db.execute("INSERT INTO duplicate_files VALUES (?, ?, ?)", (p.name, sha, now))
                self._move(p, self.done)
                out.duplicates.append(p.name)
            else:
                claimed.add(sha)
                out.files.append(DropFile(p, fmt, st.st_size, st.st_mtime_ns, sha))
        return out

    def _claim_observation(self, p: Path, st: os.stat_result, now: float, claimed: set[str], out: Claimed) -> None:
        """One file of a file kind: read once here (size, media type, sidecar), or moved aside with the reason."""
        assert self.contract is not None and self.contract.file is not None
        f = self.contract.file
        beside = p.with_name(p.stem + SIDECAR_SUFFIX)
        sidecar = beside if beside.is_file() else None
        if st.st_size > f.max_bytes:  # never parsed: hashed for the record only
            sha = _observation_key(p.stem, _sha256(p))
            self._reject(p, sidecar, sha, st.st_size, f"too-large: {st.st_size} bytes, contract {self.contract.id} "
                                                      f"allows {f.max_bytes}", out)
            return
        data = p.read_bytes()
        sha = _observation_key(p.stem, hashlib.sha256(data).hexdigest())
        magics = MEDIA_MAGIC[f.media_type]
        if magics and not data.startswith(magics):
            self._reject(p, sidecar, sha, len(data), f"bad-file: does not start like {f.media_type} "
                                                     f"(first bytes {data[:8]!r})", out)
            return
        try:
            meta = _sidecar(sidecar, self.contract) if sidecar is not None else {}
        except DropFolderError as e:
            self._reject(p, sidecar, sha, len(data), f"bad-sidecar: {e}", out)
            return
        if sha in claimed or self._known(sha):
            with self._lock:
                self._db.execute("INSERT INTO duplicate_files VALUES (?, ?, ?)", (p.name, sha, now))
            self._move(p, self.done)
            if sidecar is not None:
                self._move(sidecar, self.done)
            out.duplicates.append(p.name)
            return
        claimed.add(sha)
        out.files.append(DropFile(p, "file", len(data), st.st_mtime_ns, sha, data=data, sidecar=sidecar, meta=meta))

    def _reject(self, p: Path, sidecar: Path | None, sha: str, size: int, why: str, out: Claimed) -> None:
        self._record(p.name, sha, size, 0, "rejected", why)
        self._move(p, self.rejected_dir)
        if sidecar is not None:
            self._move(sidecar, self.rejected_dir)
        out.rejected[p.name] = why

    def read_observations(self, files: list[DropFile], contract: Contract, batch_size: int
                          ) -> Iterator[tuple[pa.Table, list[DropFile]]]:
        """A file kind's claimed observation files, up to `batch_size` a raw table (the contract's raw
        columns; node_id null: preprocessing fills in the node's), each with the files it holds."""
        obs = [f for f in files if f.format == "file"]
        for off in range(0, len(obs), batch_size):
            part = obs[off : off + batch_size]
            yield observation_table(part, contract), part

    def read(self, f: DropFile, contract: Contract, batch_size: int) -> Iterator[pa.Table]:
        """The file's rows in batches of at most `batch_size`, columns as the file has them (preprocessing
        casts to the contract and rejects bad values row by row)."""
        if f.format == "file":
            yield observation_table([f], contract)
            return
        try:
            if f.format == "parquet":
                for rb in pq.ParquetFile(f.path).iter_batches(batch_size=batch_size):
                    yield pa.Table.from_batches([rb])
                return
            table = _read_ipc(f.path) if f.format == "ipc" else _read_csv(f.path, contract)
        except (pa.ArrowInvalid, OSError) as e:
            raise DropFolderError(f"drop file {f.path.name}: not readable as {f.format} ({e})") from e
        for off in range(0, table.num_rows, batch_size):
            yield table.slice(off, batch_size)

    def unchanged(self, f: DropFile) -> bool:
        st = f.path.stat()
        return (st.st_size, st.st_mtime_ns) == (f.size, f.mtime_ns)

    def mark_read(self, f: DropFile, rows: int) -> None:
        """Record the file (durably) and then move it to done/: after a crash in between, `claim` finds it
        recorded and moves it without reading it again."""
        self._record(f.path.name, f.sha256, f.size, rows, "read", "")
        self._move(f.path, self.done)
        if f.sidecar is not None and f.sidecar.exists():
            self._move(f.sidecar, self.done)

    def _record(self, name: str, sha: str, size: int, rows: int, outcome: str, detail: str) -> None:
        with self._lock:
            self._db.execute("INSERT OR IGNORE INTO source_files VALUES (?, ?, ?, ?, ?, ?, ?)",
                             (sha, name, size, rows, outcome, detail, self._clock()))

    def counts(self) -> dict[str, int]:
        rows = dict(self._db.execute("SELECT outcome, COUNT(*) FROM source_files GROUP BY outcome").fetchall())
        (dups,) = self._db.execute("SELECT COUNT(*) FROM duplicate_files").fetchone()
        return {"read": rows.get("read", 0), "rejected": rows.get("rejected", 0), "duplicates": dups}


def _read_ipc(path: Path) -> pa.Table:
    with open(path, "rb") as fh:
        try:
            return ipc.open_file(fh).read_all()
        except pa.ArrowInvalid:  # the streaming format has no footer
            fh.seek(0)
            return ipc.open_stream(fh).read_all()


def _read_csv(path: Path, contract: Contract) -> pa.Table:
    # every column as text: the contract's cast in preprocessing then rejects a bad value's row, not the file
    with open(path, newline="") as fh:
        names = next(csv.reader(fh), [])
    table = pacsv.read_csv(path, convert_options=pacsv.ConvertOptions(
        column_types={n: pa.string() for n in names}, strings_can_be_null=True))
    raw = contract.raw_schema
    for i, name in enumerate(table.column_names):
        if name in raw.names and pa.types.is_binary(raw.field(name).type):
            decoded = [_b64(v) for v in table.column(i).to_pylist()]  # a bad value nulls its row only
            table = table.set_column(i, name, pa.array(decoded, pa.binary()))
    return table


def _b64(v: str | None) -> bytes | None:
    if v is None:
        return None
    try:
        return base64.b64decode(v, validate=True)
    except ValueError:
        return None  # preprocessing rejects the row (missing field), naming its sample id


def _observation_key(stem: str, content_sha256: str) -> str:
    """The source log's key of an observation file: its name's stem and its content (the sample is both)."""
    return hashlib.sha256(f"edgehaul.drop.observation|{stem}|{content_sha256}".encode()).hexdigest()


def _sidecar(path: Path, contract: Contract) -> dict[str, Any]:
    """A sidecar's fields, checked: errors name the file and the field."""
    try:
        doc = json.loads(path.read_bytes())
    except (ValueError, OSError) as e:
        raise DropFolderError(f"{path.name}: not JSON ({e})") from e
    if not isinstance(doc, dict):
        raise DropFolderError(f"{path.name}: must be a JSON object, got {type(doc).__name__}")
    label_col = contract.label_column
    if label_col is not None and label_col != "label" and label_col in doc:
        doc = {**{k: v for k, v in doc.items() if k != label_col}, "label": doc[label_col]}
    known = {*SIDECAR_KEYS, *([label_col] if label_col else [])}
    if unknown := sorted(set(doc) - known):
        raise DropFolderError(f"{path.name}: unknown fields {unknown} (known: {sorted(known)})")
    if "label" in doc and label_col is None:
        raise DropFolderError(f"{path.name}: field label given, contract {contract.id} has no label")
    out: dict[str, Any] = dict(doc)
    if "capture_time" in doc:
        v = doc["capture_time"]
        if isinstance(v, int) and not isinstance(v, bool):
            out["capture_time"] = datetime.fromtimestamp(v / 1000, UTC)
        elif isinstance(v, str):
            try:
                t = datetime.fromisoformat(v)
            except ValueError as e:
                raise DropFolderError(f"{path.name}: field capture_time {v!r} is not ISO 8601 ({e})") from e
            if t.tzinfo is None:
                raise DropFolderError(f"{path.name}: field capture_time {v!r} has no time zone")
            out["capture_time"] = t
        else:
            raise DropFolderError(f"{path.name}: field capture_time must be ISO 8601 text or epoch ms, got {v!r}")
    if "seq" in doc and (not isinstance(doc["seq"], int) or isinstance(doc["seq"], bool)):
        raise DropFolderError(f"{path.name}: field seq must be an integer, got {doc['seq']!r}")
    if "node_id" in doc and not isinstance(doc["node_id"], str):
        raise DropFolderError(f"{path.name}: field node_id must be text, got {doc['node_id']!r}")
    return out


def observation_table(files: list[DropFile], contract: Contract) -> pa.Table:
    """Observation files -> raw rows: sample id = stem, the file's bytes in the payload column, the rest from
    the sidecar (capture time: else the mtime; seq: else the mtime in ns). A label that is not an integer
    travels as text, so preprocessing rejects its row (`bad-type`), never the batch."""
    assert contract.file is not None
    labels = [f.meta.get("label") for f in files]
    label_arr = (pa.array(labels, pa.int16()) if all(v is None or (isinstance(v, int) and not isinstance(v, bool)
                                                                   and -2**15 <= v < 2**15) for v in labels)
                 else pa.array([None if v is None else str(v) for v in labels], pa.string()))
    cols: dict[str, pa.Array] = {
        "sample_id": pa.array([f.path.stem for f in files], pa.string()),
        "node_id": pa.array([f.meta.get("node_id") for f in files], pa.string()),
        "capture_time": pa.array([f.meta.get("capture_time") or datetime.fromtimestamp(f.mtime_ns / 1e9, UTC)
                                  for f in files], pa.timestamp("ms", tz="UTC")),
        "seq": pa.array([f.meta.get("seq", f.mtime_ns) for f in files], pa.int64()),
    }
    if contract.label_column is not None:
        cols[contract.label_column] = label_arr
    cols[contract.file.column] = pa.array([f.data if f.data is not None else f.path.read_bytes() for f in files],
                                          pa.binary())
    return pa.table(cols)
