"""The edge ledger: every sample that leaves the normal path, with its stage and reason.

One SQLite file (WAL, so the ingest flow and the uplink drain can write from separate processes)
in the spool root. A row is (sample_id, stage, reason, bundle_id, detail, at); recording the same
(sample_id, stage, reason) twice is a no-op, so a retried step never double-counts.

Bounded like the rest of the spool: with `max_bytes`, a write that takes the ledger's pages over it drops the
oldest rows (down to `TRIM_TO` of the bound; rejected input rows before samples the spool dropped), and keeps
how many it dropped per (stage, reason) in `evicted`, so `counts()` stays exact while `lookup` knows only the
rows kept. A file whose every row is rejected grows it by at most one batch past its bound. The spool counts
its bytes against the spool cap.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

# Stages and reasons used by the edge side (others may add their own strings).
STAGE_PREPROCESS = "preprocess"  # reasons: edgehaul.edge.preprocess.REASONS
STAGE_SPOOL = "spool"
TTL_EXPIRED = "ttl-expired"  # a bundle not uplinked within its TTL
FULL_REJECTED = "spool-full-rejected"  # full spool, policy reject-new (or nothing cheaper to drop)
FULL_DROPPED = "spool-full-dropped"  # full spool, policy drop-lowest-value: an older, lower-value bundle went
TOO_LARGE = "larger-than-cap"  # a bundle bigger than the whole spool cap
RAW_EVICTED = "raw-evicted"  # a low-tier raw sample removed by clean-up (its summary row was kept)
RAW_RETENTION = "raw-retention-expired"  # a low-tier raw sample past retention (its summary row was kept)
CORRUPT = "corrupt-on-disk"  # a spooled bundle whose bytes no longer match its manifest

_SCHEMA = """
CREATE TABLE IF NOT EXISTS ledger (
    sample_id TEXT NOT NULL,
    stage TEXT NOT NULL,
    reason TEXT NOT NULL,
    bundle_id TEXT,
    detail TEXT NOT NULL DEFAULT '',
    at REAL NOT NULL,
    PRIMARY KEY (sample_id, stage, reason)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS ledger_stage_reason ON ledger (stage, reason);
CREATE INDEX IF NOT EXISTS ledger_at ON ledger (at);
CREATE TABLE IF NOT EXISTS evicted (
    stage TEXT NOT NULL,
    reason TEXT NOT NULL,
    n INTEGER NOT NULL,
    PRIMARY KEY (stage, reason)
) WITHOUT ROWID;
"""
TRIM_TO = 0.8  # an over-full ledger drops its oldest rows down to this share of its bound
WAL_LIMIT_BYTES = 4 << 20  # the write-ahead log is cut back to this after a checkpoint


class Ledger:
    """Append-mostly record of dropped/rejected/expired samples, keyed by sample id."""

    def __init__(self, path: Path, *, clock: Callable[[], float] | None = None, max_bytes: int | None = None) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._clock: Callable[[], float] = clock or time.time
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(self.path, timeout=30.0, check_same_thread=False, isolation_level=None)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=FULL")  # a recorded drop survives a power cut
        self._conn.execute(f"PRAGMA journal_size_limit={WAL_LIMIT_BYTES}")
        self._conn.executescript(_SCHEMA)

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
                if self.max_bytes is not None and self._used(self._conn) > self.max_bytes:
                    self._trim(self._conn, self.max_bytes)
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    @staticmethod
    def _used(conn: sqlite3.Connection) -> int:
        page = conn.execute("PRAGMA page_size").fetchone()[0]
        pages = conn.execute("PRAGMA page_count").fetchone()[0]
        free = conn.execute("PRAGMA freelist_count").fetchone()[0]
        return int((pages - free) * page)

    def _trim(self, conn: sqlite3.Connection, max_bytes: int) -> None:
        """Drop the oldest rows until the ledger's pages are back to TRIM_TO of `max_bytes`, counting them."""
        while (used := self._used(conn)) > TRIM_TO * max_bytes:
            rows = int(conn.execute("SELECT COUNT(*) FROM ledger").fetchone()[0])
            if not rows:
                return
            k = max(1, min(rows, int(rows * (1 - TRIM_TO * max_bytes / used)) + 1))
            # rejected input rows go first (their file is kept in rejected/ or the source log); a sample the
            # spool accepted and then dropped stays named as long as any other row can go instead
            oldest = ("SELECT sample_id, stage, reason FROM ledger ORDER BY stage = ?, at LIMIT ?")
            args = (STAGE_SPOOL, k)
            for stage, reason, n in conn.execute(
                    f"SELECT stage, reason, COUNT(*) FROM ({oldest}) GROUP BY stage, reason", args).fetchall():
                conn.execute("INSERT INTO evicted VALUES (?, ?, ?) ON CONFLICT (stage, reason) DO UPDATE "
                             "SET n = n + excluded.n", (stage, reason, n))
            conn.execute(f"DELETE FROM ledger WHERE (sample_id, stage, reason) IN ({oldest})", args)
            if k == rows:
                return

    def used_bytes(self) -> int:
        """Bytes of the ledger's pages in use (what counts against the spool cap)."""
        with self._lock:
            return self._used(self._conn)

    def evicted(self) -> dict[tuple[str, str], int]:
        """(stage, reason) -> rows dropped by the bound (counted in `counts`, no longer in `lookup`)."""
        with self._lock:
            return {(s, r): int(n) for s, r, n in self._conn.execute("SELECT stage, reason, n FROM evicted")}

    def record(
        self, sample_ids: Sequence[str], *, stage: str, reason: str, bundle_id: str | None = None, detail: str = ""
    ) -> int:
        """Record samples under (stage, reason); returns how many were new (repeats are ignored)."""
        if not sample_ids:
            return 0
        at = float(self._clock())
        rows = [(str(s), stage, reason, bundle_id, detail, at) for s in sample_ids]
        with self._tx() as conn:
            before = conn.total_changes
            conn.executemany(
                "INSERT OR IGNORE INTO ledger (sample_id, stage, reason, bundle_id, detail, at) VALUES (?,?,?,?,?,?)",
                rows,
            )
            return conn.total_changes - before

    def record_many(self, rows: Sequence[tuple[str, str, str]], *, stage: str, bundle_id: str | None = None) -> int:
        """Record (sample_id, reason, detail) rows in one transaction (e.g. preprocessing rejects)."""
        if not rows:
            return 0
        at = float(self._clock())
        with self._tx() as conn:
            before = conn.total_changes
            conn.executemany(
                "INSERT OR IGNORE INTO ledger (sample_id, stage, reason, bundle_id, detail, at) VALUES (?,?,?,?,?,?)",
                [(s, stage, r, bundle_id, d, at) for s, r, d in rows],
            )
            return conn.total_changes - before

    def forget(self, bundle_ids: Sequence[str], *, stage: str) -> int:
        """Delete the rows recorded at `stage` for these bundles: samples recorded as gone that did not go (a
        thinning that was undone put them back in the bundles they never left). Returns the rows deleted; rows the
        bound already dropped stay counted in `evicted`."""
        ids = list(dict.fromkeys(bundle_ids))
        if not ids:
            return 0
        with self._tx() as conn:
            before = conn.total_changes
            for i in range(0, len(ids), 500):
                part = ids[i : i + 500]
                conn.execute(f"DELETE FROM ledger WHERE stage = ? AND bundle_id IN ({','.join('?' * len(part))})",
                             [stage, *part])
            return conn.total_changes - before

    def counts(self) -> dict[tuple[str, str], int]:
        """(stage, reason) -> number of samples (rows kept plus rows the bound dropped)."""
        with self._lock:
            cur = self._conn.execute("SELECT stage, reason, COUNT(*) FROM ledger GROUP BY stage, reason")
            out = {(s, r): int(n) for s, r, n in cur.fetchall()}
            for s, r, n in self._conn.execute("SELECT stage, reason, n FROM evicted").fetchall():
                out[(s, r)] = out.get((s, r), 0) + int(n)
            return out

    def lookup(self, sample_ids: Sequence[str]) -> dict[str, list[tuple[str, str]]]:
        """sample_id -> [(stage, reason), ...] for the ids present in the ledger."""
        out: dict[str, list[tuple[str, str]]] = {}
        ids = list(dict.fromkeys(sample_ids))
        with self._lock:
            for i in range(0, len(ids), 500):
                part = ids[i : i + 500]
                marks = ",".join("?" * len(part))
                q = f"SELECT sample_id, stage, reason FROM ledger WHERE sample_id IN ({marks}) ORDER BY at"
                for sid, stage, reason in self._conn.execute(q, part):
                    out.setdefault(sid, []).append((stage, reason))
        return out

    def total(self) -> int:
        """Samples recorded, the rows the bound dropped included."""
        with self._lock:
            kept = int(self._conn.execute("SELECT COUNT(*) FROM ledger").fetchone()[0])
            return kept + int(self._conn.execute("SELECT COALESCE(SUM(n), 0) FROM evicted").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            self._conn.close()
