"""The edge ledger: every sample that leaves the normal path, with its stage and reason.

One SQLite file (WAL, so the ingest flow and the uplink drain can write from separate processes)
in the spool root. A row is (sample_id, stage, reason, bundle_id, detail, at); recording the same
(sample_id, stage, reason) twice is a no-op, so a retried step never double-counts.
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
"""


class Ledger:
    """Append-mostly record of dropped/rejected/expired samples, keyed by sample id."""

    def __init__(self, path: Path, *, clock: Callable[[], float] | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._clock: Callable[[], float] = clock or time.time
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(self.path, timeout=30.0, check_same_thread=False, isolation_level=None)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=FULL")  # a recorded drop survives a power cut
        self._conn.executescript(_SCHEMA)

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

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

    def counts(self) -> dict[tuple[str, str], int]:
        """(stage, reason) -> number of samples."""
        with self._lock:
            cur = self._conn.execute("SELECT stage, reason, COUNT(*) FROM ledger GROUP BY stage, reason")
            return {(s, r): int(n) for s, r, n in cur.fetchall()}

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
        with self._lock:
            return int(self._conn.execute("SELECT COUNT(*) FROM ledger").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            self._conn.close()
