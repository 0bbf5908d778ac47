"""A drop folder: where an instrument writes its output files, read by the node once each.

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

A table file is read through once (`check`, streamed, nothing kept) before any of it is spooled: a file that is
empty, not UTF-8, cut short mid-write, a broken Parquet/IPC file, of an unknown format, lacking a required raw
column the contract does not derive (`Contract.required_raw_columns`, `raw.derive`), or whose every row was
rejected at preprocessing, moves to `rejected/` with `<name>.reason.txt` and the reason in the log: named, not
lost, and never blocking the files behind it (`DropRun`). Reading streams: CSV in CSV_BLOCK_BYTES blocks, every
column as text (a `NaN` cell is a value, not a null: CSV_NULLS), Parquet and IPC batch by batch; identity
columns the contract derives are filled in per batch (`derive_columns`); columns it does not read are left out
and reported. docs/CONTRACTS.md ("Raw files at the edge") states the rules.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import json
import os
import sqlite3
import stat
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
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
REASON_SUFFIX = ".reason.txt"  # beside a file in rejected/: why it is there
# CSV cells read as null: an empty cell and the usual spellings of "no value". Not NaN: a NaN is a value
# (preprocessing rejects it as `nan` unless the column allows it), never a missing field.
CSV_NULLS = ["", "NA", "N/A", "NULL", "null", "None"]
CSV_BLOCK_BYTES = 4 << 20  # CSV is parsed in blocks this size: memory follows the block, not the file

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


@dataclass(frozen=True)
class FileCheck:
    rows: int
    extra: tuple[str, ...]  # columns the contract does not read: reported, not kept
    derived: tuple[str, ...]  # identity columns the file lacks, derived as the contract declares


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
        self._twins: dict[str, list[Path]] = {}  # sha -> later files of the same content in this claim
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

    def _rejected_before(self, sha: str) -> str | None:
        row = self._db.execute("SELECT detail FROM source_files WHERE sha256 = ? AND outcome = 'rejected'",
                               (sha,)).fetchone()
        return None if row is None else str(row[0])

    def _move(self, path: Path, to: Path, reason: str | None = None) -> None:
        """Move `path` into `to`; with a reason, `<name>.reason.txt` beside it says why (for whoever looks)."""
        to.mkdir(parents=True, exist_ok=True)
        dest = to / path.name
        if dest.exists():  # same name dropped again later: keep both
            dest = to / f"{path.stem}.{time.time_ns()}{path.suffix}"
        os.replace(path, dest)
        if reason is not None:
            dest.with_name(dest.name + REASON_SUFFIX).write_text(reason + "\n")

    def claim(self) -> Claimed:
        """The complete files not read before, oldest first. Moves away duplicates and unknown formats."""
        out = Claimed([], [], [], {})
        if not self.folder.is_dir():
            raise DropFolderError(f"drop folder {self.folder} does not exist")
        now = self._clock()
        claimed: set[str] = set()
        listed: list[tuple[Path, os.stat_result]] = []
        for p in self.folder.iterdir():
            try:  # a file renamed or removed since the listing is seen under its new name next time
                st = p.stat()
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode):
                listed.append((p, st))
        listed.sort(key=lambda e: (e[1].st_mtime_ns, e[0].name))
        obs = self.observation_suffixes
        stems = {p.stem for p, _ in listed if p.suffix.lower() in obs}
        for p, st in listed:
            if is_partial_name(p.name) or now - st.st_mtime < self.settle_s:
                out.waiting.append(p.name)
                continue
            if obs and p.suffix.lower() == SIDECAR_SUFFIX:  # a sidecar travels with its observation file
                if p.stem not in stems:
                    out.waiting.append(p.name)
                continue
            try:
                self._claim_one(p, st, now, claimed, out)
            except FileNotFoundError:  # renamed or removed while claimed: seen under its new name next time
                continue
        return out

    def _claim_one(self, p: Path, st: os.stat_result, now: float, claimed: set[str], out: Claimed) -> None:
        if p.suffix.lower() in self.observation_suffixes:
            self._claim_observation(p, st, now, claimed, out)
            return
        fmt = FORMATS.get(p.suffix.lower())
        sha = _sha256(p)
        if fmt is None:
            why = f"unknown format {p.suffix or '(no suffix)'}; known: {', '.join(sorted(FORMATS))}"
            self._record(p.name, sha, st.st_size, 0, "rejected", why)
            self._move(p, self.rejected_dir, why)
            out.rejected[p.name] = why
        elif st.st_size == 0:
            why = "empty file (0 bytes)"
            self._record(p.name, sha, 0, 0, "rejected", why)
            self._move(p, self.rejected_dir, why)
            out.rejected[p.name] = why
        elif (before := self._rejected_before(sha)) is not None:  # the same bad content again: the same answer
            why = f"same content as a file rejected before: {before}"
            self._move(p, self.rejected_dir, why)
            out.rejected[p.name] = why
        elif sha in claimed:  # twice in this very folder: it follows its twin, read or rejected (`_settle_twins`)
            self._twins.setdefault(sha, []).append(p)
            out.duplicates.append(p.name)
        elif self._known(sha):  # read before
            with self._lock:
                self._db.execute("INSERT INTO duplicate_files VALUES (?, ?, ?)", (p.name, sha, now))
            self._move(p, self.done)
            out.duplicates.append(p.name)
        else:
            claimed.add(sha)
            out.files.append(DropFile(p, fmt, st.st_size, st.st_mtime_ns, sha))

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
        self._move(p, self.rejected_dir, why)
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

    def check(self, f: DropFile, contract: Contract, batch_size: int) -> FileCheck:
        """Read the whole file once, keeping nothing (memory: one batch), before any of it is spooled: a file
        that does not parse (not UTF-8, a line cut short, a broken Parquet footer or page) or lacks a required
        column the contract does not derive raises DropFolderError with the reason; its rows are never half
        spooled. Returns its row count, and the columns it has beyond the contract's."""
        if f.format == "file":
            return FileCheck(rows=1, extra=(), derived=())
        names = _columns(f, contract)
        raw = contract.raw_schema.names
        derived = contract.raw.derived
        if missing := [c for c in contract.required_raw_columns if c not in names]:
            how = ", ".join(f"{k}: {v}" for k, v in derived.items()) or "nothing"
            raise DropFolderError(f"missing required columns {missing} (contract {contract.id} derives {how}); "
                                  f"the file has {names[:20]}{' ...' if len(names) > 20 else ''}")
        rows = sum(b.num_rows for b in self._batches(f, contract, batch_size))
        return FileCheck(rows=rows, extra=tuple(n for n in names if n not in raw),
                         derived=tuple(k for k in derived if k not in names))

    def read(self, f: DropFile, contract: Contract, batch_size: int) -> Iterator[pa.Table]:
        """The file's rows in batches of at most `batch_size`, streamed (memory follows the batch, not the
        file): the contract's raw columns as the file has them (preprocessing casts to the contract and rejects
        bad values row by row), the columns `raw.derive` derives filled in where the file lacks them, columns
        the contract does not read left out (`check` reports them)."""
        if f.format == "file":
            yield observation_table([f], contract)
            return
        raw = contract.raw_schema.names
        derived = contract.raw.derived
        row = 0
        for t in self._batches(f, contract, batch_size):
            t = t.select([n for n in t.column_names if n in raw])
            if derived:
                t = derive_columns(t, contract, file_time_ns=f.mtime_ns, first_row=row)
            row += t.num_rows
            yield t

    def _batches(self, f: DropFile, contract: Contract, batch_size: int) -> Iterator[pa.Table]:
        try:
            if f.format == "parquet":
                it: Iterator[pa.RecordBatch] = pq.ParquetFile(f.path).iter_batches(batch_size=batch_size)
            elif f.format == "ipc":
                it = _ipc_batches(f.path)
            else:
                it = _csv_batches(f.path, contract)
            yield from _rebatch(it, batch_size)
        except FileNotFoundError:
            raise
        except (pa.ArrowException, OSError, ValueError) as e:
            raise DropFolderError(f"not readable as {f.format}: {_short(e)}") from e

    def reject(self, f: DropFile, why: str, rows: int = 0) -> None:
        """A claimed file that cannot be read (or whose every row was rejected): recorded with the reason, then
        moved to rejected/ with `<name>.reason.txt`."""
        self._record(f.path.name, f.sha256, f.size, rows, "rejected", why)
        self._move(f.path, self.rejected_dir, why)
        if f.sidecar is not None and f.sidecar.exists():
            self._move(f.sidecar, self.rejected_dir)
        self._settle_twins(f, rejected=f"same content as {f.path.name}, rejected: {why}")

    def _settle_twins(self, f: DropFile, rejected: str | None = None) -> None:
        """Files of the same content claimed with `f` follow it: to rejected/ with the reason, or to done/ unread.
        After a crash before this, they are still in the folder and the next claim decides from the record."""
        for twin in self._twins.pop(f.sha256, []):
            try:
                if rejected is not None:
                    self._move(twin, self.rejected_dir, rejected)
                    continue
                with self._lock:
                    self._db.execute("INSERT INTO duplicate_files VALUES (?, ?, ?)", (twin.name, f.sha256,
                                                                                      self._clock()))
                self._move(twin, self.done)
            except FileNotFoundError:  # renamed or removed meanwhile: seen under its new name next time
                continue

    def unchanged(self, f: DropFile) -> bool:
        try:
            st = f.path.stat()
        except FileNotFoundError:  # renamed or removed while read: seen under its new name next time
            return False
        return (st.st_size, st.st_mtime_ns) == (f.size, f.mtime_ns)

    def mark_read(self, f: DropFile, rows: int) -> None:
        """Record the file (durably) and then move it to done/: after a crash in between, `claim` finds it
        recorded and moves it without reading it again."""
        self._record(f.path.name, f.sha256, f.size, rows, "read", "")
        self._move(f.path, self.done)
        if f.sidecar is not None and f.sidecar.exists():
            self._move(f.sidecar, self.done)
        self._settle_twins(f)

    def _record(self, name: str, sha: str, size: int, rows: int, outcome: str, detail: str) -> None:
        with self._lock:
            self._db.execute("INSERT OR IGNORE INTO source_files VALUES (?, ?, ?, ?, ?, ?, ?)",
                             (sha, name, size, rows, outcome, detail, self._clock()))

    def counts(self) -> dict[str, int]:
        rows = dict(self._db.execute("SELECT outcome, COUNT(*) FROM source_files GROUP BY outcome").fetchall())
        (dups,) = self._db.execute("SELECT COUNT(*) FROM duplicate_files").fetchone()
        return {"read": rows.get("read", 0), "rejected": rows.get("rejected", 0), "duplicates": dups}


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    first = (text[0] if text else type(e).__name__)[:300]
    return f"not UTF-8 text ({first})" if "invalid UTF8" in first else first


def _columns(f: DropFile, contract: Contract) -> list[str]:
    """The file's column names, from its header or schema (cheap: no rows read)."""
    try:
        if f.format == "parquet":
            return list(pq.ParquetFile(f.path).schema_arrow.names)
        if f.format == "ipc":
            with open(f.path, "rb") as fh:
                try:
                    return list(ipc.open_file(fh).schema.names)
                except pa.ArrowInvalid:
                    fh.seek(0)
                    return list(ipc.open_stream(fh).schema.names)
        return _csv_header(f.path)
    except FileNotFoundError:
        raise
    except (pa.ArrowException, OSError, ValueError) as e:
        raise DropFolderError(f"not readable as {f.format}: {_short(e)}") from e


def _csv_header(path: Path) -> list[str]:
    with open(path, "rb") as fh:
        first = fh.readline(1 << 20)
    if not first.strip():
        raise DropFolderError("empty CSV: no header line")
    try:
        text = first.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise DropFolderError(f"not UTF-8: header line, byte {e.start}") from e
    return next(csv.reader([text]), [])


def _ipc_batches(path: Path) -> Iterator[pa.RecordBatch]:
    with open(path, "rb") as fh:
        try:
            reader = ipc.open_file(fh)
        except pa.ArrowInvalid:  # the streaming format has no footer
            fh.seek(0)
            yield from ipc.open_stream(fh)
            return
        for i in range(reader.num_record_batches):
            yield reader.get_batch(i)


def _csv_batches(path: Path, contract: Contract) -> Iterator[pa.RecordBatch]:
    # every column as text: the contract's cast in preprocessing then rejects a bad value's row, not the file
    names = _csv_header(path)
    reader = pacsv.open_csv(path, read_options=pacsv.ReadOptions(block_size=CSV_BLOCK_BYTES),
                            convert_options=pacsv.ConvertOptions(column_types={n: pa.string() for n in names},
                                                                 strings_can_be_null=True, null_values=CSV_NULLS))
    raw = contract.raw_schema
    binary = [n for n in reader.schema.names if n in raw.names and pa.types.is_binary(raw.field(n).type)]
    for b in reader:
        for name in binary:  # a bad value nulls its row only
            i = b.schema.get_field_index(name)
            b = b.set_column(i, name, pa.array([_b64(v) for v in b.column(i).to_pylist()], pa.binary()))
        yield b


def _rebatch(batches: Iterator[pa.RecordBatch], size: int) -> Iterator[pa.Table]:
    """Record batches of any size -> tables of exactly `size` rows (the last one fewer)."""
    held: list[pa.RecordBatch] = []
    n = 0
    for b in batches:
        if not b.num_rows:
            continue
        held.append(b)
        n += b.num_rows
        while n >= size:
            t = pa.Table.from_batches(held)
            yield t.slice(0, size)
            rest = t.slice(size)
            held, n = rest.to_batches(), rest.num_rows
    if n:
        yield pa.Table.from_batches(held)


def derive_columns(t: pa.Table, contract: Contract, *, file_time_ns: int, first_row: int) -> pa.Table:
    """Fill in the identity columns a file lacks, as `raw.derive` declares: `seq` from the row's position in
    its file (`row-order`), `capture_time` from the file's mtime (`file-time`), `sample_id` from the row's
    content (`content-hash`: `row-` + 32 hex of SHA-256 over the row's raw values in contract order, so the
    same reading in two files is one observation, and rows identical in every column are too)."""
    derive = contract.raw.derived
    n = t.num_rows
    # the id first: from the values the file holds, never from the columns derived here
    ids = row_ids(t, contract) if derive.get("sample_id") == "content-hash" and "sample_id" not in t.column_names \
        else None
    if derive.get("seq") == "row-order" and "seq" not in t.column_names:
        t = t.append_column("seq", pa.array(range(first_row, first_row + n), pa.int64()))
    if derive.get("capture_time") == "file-time" and "capture_time" not in t.column_names:
        at = pa.scalar(file_time_ns // 1_000_000, pa.int64()).cast(pa.timestamp("ms", tz="UTC"))
        t = t.append_column("capture_time", pa.repeat(at, n))
    if ids is not None:
        t = t.append_column("sample_id", ids)
    return t


def row_ids(t: pa.Table, contract: Contract) -> pa.Array:
    """`row-` + 32 hex of SHA-256 over each row's raw values (contract order; a binary value as its SHA-256)."""
    from edgehaul.edge.preprocess import content_hashes

    if not t.num_rows:
        return pa.array([], pa.string())
    parts = []
    for name in contract.raw_schema.names:
        if name not in t.column_names or name == "sample_id":
            continue
        col = t.column(name).combine_chunks()
        typ = col.type
        text = (content_hashes(col) if pa.types.is_binary(typ) or pa.types.is_large_binary(typ)
                else col.cast(pa.string()))
        parts.append(pc.fill_null(pc.binary_join_element_wise(pa.scalar(name), text, "="), f"{name}\x00"))
    joined = pc.binary_join_element_wise(*parts, "\x1f")
    return pc.binary_join_element_wise("row-", pc.utf8_slice_codeunits(content_hashes(joined), 0, 32), "")


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


DROP_ALERT_LEVEL = 2  # edgehaul.services.automations: level 2, like a failed run
MOSTLY = 0.5  # a file whose rows are more than this share rejected is named in the run's state and alert
NAMED_FILES = 10  # files named in a state message (the rest counted)
SUMMARY_FILES = 100  # files listed per kind in a run's summary


@dataclass
class FileOutcome:
    """What one run did with one file: `read` (moved to done/), `rejected` (in rejected/ with `reason`), or
    `changed` (written to or renamed while read: read again next run)."""

    name: str
    outcome: str
    rows: int = 0
    accepted: int = 0
    rejects: dict[str, int] = field(default_factory=dict)  # preprocessing reason -> rows
    reason: str = ""
    extra: tuple[str, ...] = ()
    derived: tuple[str, ...] = ()

    @property
    def rejected_rows(self) -> int:
        return sum(self.rejects.values())


@dataclass(frozen=True)
class DropPart:
    """Which files a raw batch came from: one tabular file (`last`: its final batch), or observation files
    (one row each)."""

    file: DropFile | None
    files: tuple[DropFile, ...] = ()
    last: bool = True


class DropRun:
    """One ingest run over a drop folder: claims once, then yields each file's raw batches; a file that cannot
    be read is moved to rejected/ with its reason and the run goes on with the others. The caller reports each
    batch's outcome (`done`); a file is recorded once all of it is through: read, or rejected when every row
    was rejected (nothing is reported read that was not)."""

    def __init__(self, folder: DropFolder, contract: Contract, batch_size: int,
                 log: Callable[[str], None] | None = None) -> None:
        self.folder, self.contract, self.batch_size = folder, contract, batch_size
        self._log = log or (lambda _msg: None)
        self.claimed = folder.claim()  # listed once: a file dropped during the run waits for the next
        self.outcomes: dict[str, FileOutcome] = {
            name: FileOutcome(name, "rejected", reason=why) for name, why in self.claimed.rejected.items()}
        self._checks: dict[str, FileCheck] = {}

    def batches(self) -> Iterator[tuple[pa.Table, DropPart]]:
        c = self.claimed
        for t, observed in self.folder.read_observations(c.files, self.contract, self.batch_size):
            yield t, DropPart(None, tuple(observed))
        for f in c.files:
            if f.format != "file":
                yield from self._file_batches(f)

    def _file_batches(self, f: DropFile) -> Iterator[tuple[pa.Table, DropPart]]:
        name = f.path.name
        try:
            chk = self.folder.check(f, self.contract, self.batch_size)
        except FileNotFoundError:
            self.outcomes[name] = FileOutcome(name, "changed", reason="gone before it was read")
            return
        except DropFolderError as e:
            self.folder.reject(f, str(e))
            self.outcomes[name] = FileOutcome(name, "rejected", reason=str(e))
            self._log(f"drop file {name} rejected: {e}")
            return
        self._checks[name] = chk
        self.outcomes[name] = FileOutcome(name, "reading", extra=chk.extra, derived=chk.derived)
        if chk.extra:
            self._log(f"drop file {name}: {len(chk.extra)} columns the contract does not read, not kept: "
                      f"{list(chk.extra)[:20]}")
        if chk.rows == 0:  # a header or schema and no rows: read, nothing to spool
            self._finish(f)
            return
        seen = 0
        try:
            for t in self.folder.read(f, self.contract, self.batch_size):
                seen += t.num_rows
                yield t, DropPart(f, last=seen == chk.rows)
        except (DropFolderError, FileNotFoundError) as e:  # it changed after the check: read again next run
            self._changed(f, f"changed while read ({e})")
            return
        if seen != chk.rows:
            self._changed(f, f"changed while read ({seen} rows, {chk.rows} when checked)")

    def _changed(self, f: DropFile, why: str) -> None:
        o = self.outcomes[f.path.name]
        o.outcome, o.reason = "changed", why
        self._log(f"drop file {f.path.name}: {why}; it is read again next run")

    def done(self, part: DropPart, n_input: int, accepted: int, reject_counts: dict[str, int]) -> None:
        """One batch of `part` is spooled (or cached): count it; a file whose last batch this was is recorded."""
        if part.file is None:
            for f in part.files:  # an observation file: one row, read once it is spooled
                if self.folder.unchanged(f):
                    self.folder.mark_read(f, 1)
                    self.outcomes[f.path.name] = FileOutcome(f.path.name, "read", rows=1)
                else:
                    self.outcomes[f.path.name] = FileOutcome(f.path.name, "changed", reason="changed while read")
            return
        o = self.outcomes[part.file.path.name]
        o.rows += n_input
        o.accepted += accepted
        for k, v in reject_counts.items():
            o.rejects[k] = o.rejects.get(k, 0) + v
        if part.last:
            self._finish(part.file)

    def _finish(self, f: DropFile) -> None:
        o = self.outcomes[f.path.name]
        if not self.folder.unchanged(f):  # written to while read: read again next run (the core drops repeats)
            self._changed(f, "changed while read")
            return
        if o.rows and not o.accepted:
            why = f"all {o.rows} rows rejected at preprocessing: " + ", ".join(
                f"{k} {v}" for k, v in sorted(o.rejects.items(), key=lambda kv: -kv[1]))
            self.folder.reject(f, why, o.rows)
            o.outcome, o.reason = "rejected", why
            self._log(f"drop file {f.path.name} rejected: {why}")
        else:
            self.folder.mark_read(f, o.rows)
            o.outcome = "read"

    def problems(self) -> dict[str, str]:
        """File -> what went wrong, for every file rejected and every file read with most rows rejected."""
        out = {}
        for o in self.outcomes.values():
            if o.outcome == "rejected":
                out[o.name] = o.reason
            elif o.outcome == "read" and o.rows and o.rejected_rows > MOSTLY * o.rows:
                out[o.name] = (f"read, {o.rejected_rows} of {o.rows} rows rejected: " + ", ".join(
                    f"{k} {v}" for k, v in sorted(o.rejects.items(), key=lambda kv: -kv[1])))
        return out

    def summary(self) -> dict[str, Any]:
        by = [o.outcome for o in self.outcomes.values()]
        return {
            "files_read": by.count("read"), "files_rejected": by.count("rejected"),
            "files_changed": by.count("changed"), "files_waiting": len(self.claimed.waiting),
            "files_duplicate": len(self.claimed.duplicates),
            # per file, the first SUMMARY_FILES of each (the counts above are whole): a run result stays small
            "rejected_files": dict(list({o.name: o.reason for o in self.outcomes.values()
                                         if o.outcome == "rejected"}.items())[:SUMMARY_FILES]),
            "extra_columns": dict(list({o.name: list(o.extra) for o in self.outcomes.values()
                                        if o.extra}.items())[:SUMMARY_FILES]),
            "derived_columns": dict(list({o.name: list(o.derived) for o in self.outcomes.values()
                                          if o.derived}.items())[:SUMMARY_FILES]),
        }

    def message(self) -> str | None:
        """The run's state message when files were rejected or read with most rows rejected, naming each."""
        bad = self.problems()
        if not bad:
            return None
        seen = sum(1 for o in self.outcomes.values() if o.outcome in ("read", "rejected"))
        rejected = sum(1 for o in self.outcomes.values() if o.outcome == "rejected")
        head = f"{rejected} of {seen} drop files rejected" + (
            f", {len(bad) - rejected} read with most rows rejected" if len(bad) > rejected else "")
        named = [f"{k}: {v}" for k, v in list(bad.items())[:NAMED_FILES]]
        more = f"; and {len(bad) - NAMED_FILES} more" if len(bad) > NAMED_FILES else ""
        return f"{head}: " + "; ".join(named) + more


def emit_drop_rejected(node_id: str, message: str, problems: dict[str, str], counts: dict[str, Any]) -> bool:
    """The level-2 alert of a run whose drop files were rejected: one event naming each file (at most 50) and why.
    Routed to the node's outbox when the run is node-local (`events.routed`)."""
    from edgehaul import events

    files = dict(list(problems.items())[:50])
    payload: dict[str, Any] = {
        "level": DROP_ALERT_LEVEL, "node_id": node_id, "message": message[:2000], "files": files,
        "files_named": len(files), "files_with_problems": len(problems),
        **{k: counts[k] for k in ("files_read", "files_rejected") if k in counts}}
    return events.emit(events.DROP_REJECTED, f"edgehaul.node.{node_id}", payload)
