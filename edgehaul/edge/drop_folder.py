"""A drop folder: where an instrument writes its output files, read by the node once each (issue #20 item 2).

Formats, by suffix: Parquet (`.parquet`), Arrow IPC (`.arrow`, `.feather`, `.ipc`) and CSV (`.csv`; a binary
column is read as base64 text). A file is read only when it is complete:

- names that writers use while a file is being written are never read: a leading `.` or `~`, or a suffix
  `.tmp`, `.part`, `.partial`, `.inprogress`, `.crdownload` (the usual write-then-rename);
- a file modified less than `settle_s` ago is left for the next run (writers that append in place);
- its size and mtime are taken again after reading: a file that changed while it was read is not recorded.

Each file is recorded by content (sha256) in the node's source log (`<spool>/sources.sqlite`, WAL, fsync)
*before* it moves to `done/`, so a run that dies between the two moves it next time without reading it again,
and the same content dropped twice (a re-sent file under another name) is recorded as a duplicate, not read.
Files of an unknown format are moved to `rejected/` with the reason in the log: they are named, not lost.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from edgehaul.contracts import Contract

FORMATS = {".parquet": "parquet", ".arrow": "ipc", ".feather": "ipc", ".ipc": "ipc", ".csv": "csv"}
PARTIAL_SUFFIXES = (".tmp", ".part", ".partial", ".inprogress", ".crdownload")
SOURCES_FILE = "sources.sqlite"

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
    format: str
    size: int
    mtime_ns: int
    sha256: str


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
                 clock: Callable[[], float] = time.time) -> None:
        self.folder, self.done = Path(folder), Path(done)
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
        for p in entries:
            st = p.stat()
            if is_partial_name(p.name) or now - st.st_mtime < self.settle_s:
                out.waiting.append(p.name)
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

    def read(self, f: DropFile, contract: Contract, batch_size: int) -> Iterator[pa.Table]:
        """The file's rows in batches of at most `batch_size`, columns as the file has them (preprocessing
        casts to the contract and rejects bad values row by row)."""
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
