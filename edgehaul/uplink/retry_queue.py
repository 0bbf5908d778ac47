"""The uplink's persistent retry queue: bundles that failed to land, with a cap and an expiry.

One SQLite file in the spool root. A retry queue without both a cap and an expiry fills the disk, so:
- at most `cap` entries; adding one more evicts the lowest-priority entry (normal before high,
  then lowest value, then the oldest failure) — possibly the new one;
- an entry whose first failure is older than `expiry_seconds` expires.
Every eviction and expiry is recorded in the ledger by sample id (stage "uplink", reasons
`retry-overflow` / `retry-expired`), a RETRY_EXPIRED event is emitted, and `discard(bundle_id)`
lets the spool delete the bundle's bytes, so each sample ends in exactly one place.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from edgehaul import events
from edgehaul.bundles import BundleManifest
from edgehaul.contracts import tier_rank

STAGE_UPLINK = "uplink"
RETRY_EXPIRED = "retry-expired"
RETRY_OVERFLOW = "retry-overflow"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS retry (
    bundle_id TEXT PRIMARY KEY,
    tier_rank INTEGER NOT NULL,
    max_value REAL NOT NULL,
    first_failed REAL NOT NULL,
    last_failed REAL NOT NULL,
    attempts INTEGER NOT NULL,
    next_attempt REAL NOT NULL,
    last_error TEXT NOT NULL,
    sample_ids TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS retry_next ON retry (next_attempt);
"""


class LedgerLike(Protocol):
    def record(self, sample_ids: list[str], *, stage: str, reason: str, bundle_id: str | None = None,
               detail: str = "") -> int: ...


@dataclass(frozen=True)
class RetryEntry:
    bundle_id: str
    tier_rank: int
    max_value: float
    first_failed: float
    attempts: int
    next_attempt: float
    last_error: str


class RetryQueue:
    """Bundles waiting for another uplink attempt; survives restarts (SQLite, WAL)."""

    def __init__(
        self,
        path: Path,
        *,
        cap: int,
        expiry_seconds: float,
        ledger: LedgerLike | None,
        discard: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.time,
        backoff_s: tuple[float, ...] = (30.0, 120.0, 600.0, 1800.0),
        resource_id: str = "edgehaul.uplink.retry",
        emit_events: bool = True,
    ) -> None:
        if cap <= 0 or expiry_seconds <= 0:
            raise ValueError(f"retry queue needs cap > 0 and expiry_seconds > 0, got {cap}, {expiry_seconds}")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.cap = cap
        self.expiry_seconds = expiry_seconds
        self.ledger = ledger
        self.discard = discard
        self.clock = clock
        self.backoff_s = backoff_s
        self.resource_id = resource_id
        self.emit_events = emit_events
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(self.path, timeout=30.0, check_same_thread=False, isolation_level=None)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.executescript(_SCHEMA)

    def __len__(self) -> int:
        with self._lock:
            return int(self._conn.execute("SELECT COUNT(*) FROM retry").fetchone()[0])

    def add(self, manifest: BundleManifest, *, error: str) -> list[str]:
        """Queue (or re-queue) a failed bundle; returns the bundle ids evicted to stay within the cap."""
        now = float(self.clock())
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                row = self._conn.execute(
                    "SELECT attempts, first_failed FROM retry WHERE bundle_id=?", (manifest.bundle_id,)
                ).fetchone()
                attempts = (row[0] if row else 0) + 1
                first = row[1] if row else now
                delay = self.backoff_s[min(attempts - 1, len(self.backoff_s) - 1)]
                self._conn.execute(
                    "INSERT OR REPLACE INTO retry VALUES (?,?,?,?,?,?,?,?,?)",
                    (manifest.bundle_id, tier_rank(manifest.tier), manifest.max_value, first, now, attempts,
                     now + delay, error[:2000], json.dumps(manifest.sample_ids)),
                )
                over = int(self._conn.execute("SELECT COUNT(*) FROM retry").fetchone()[0]) - self.cap
                victims = []
                if over > 0:
                    victims = self._conn.execute(
                        "SELECT bundle_id, sample_ids FROM retry ORDER BY tier_rank DESC, max_value ASC, first_failed ASC "
                        "LIMIT ?", (over,),
                    ).fetchall()
                    self._conn.executemany("DELETE FROM retry WHERE bundle_id=?", [(b,) for b, _ in victims])
                self._conn.execute("COMMIT")
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
        for bundle_id, ids in victims:
            self._drop(bundle_id, json.loads(ids), RETRY_OVERFLOW, f"retry queue full (cap {self.cap})")
        return [b for b, _ in victims]

    def remove(self, bundle_id: str) -> None:
        with self._lock:
            self._conn.execute("DELETE FROM retry WHERE bundle_id=?", (bundle_id,))

    def entries(self) -> list[RetryEntry]:
        with self._lock:
            rows = self._conn.execute(
                "SELECT bundle_id, tier_rank, max_value, first_failed, attempts, next_attempt, last_error FROM retry "
                "ORDER BY next_attempt"
            ).fetchall()
        return [RetryEntry(*r) for r in rows]

    def blocked_ids(self, now: float | None = None) -> set[str]:
        """Bundles whose next attempt is not due yet (the drain skips them)."""
        now = float(self.clock()) if now is None else now
        with self._lock:
            return {r[0] for r in self._conn.execute("SELECT bundle_id FROM retry WHERE next_attempt > ?", (now,))}

    def due(self, now: float | None = None) -> list[str]:
        now = float(self.clock()) if now is None else now
        with self._lock:
            return [r[0] for r in self._conn.execute(
                "SELECT bundle_id FROM retry WHERE next_attempt <= ? ORDER BY tier_rank, max_value DESC", (now,))]

    def expire(self, now: float | None = None) -> list[str]:
        """Drop entries whose first failure is older than the expiry; returns their bundle ids."""
        now = float(self.clock()) if now is None else now
        cutoff = now - self.expiry_seconds
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                rows = self._conn.execute(
                    "SELECT bundle_id, sample_ids, attempts FROM retry WHERE first_failed < ?", (cutoff,)
                ).fetchall()
                self._conn.executemany("DELETE FROM retry WHERE bundle_id=?", [(r[0],) for r in rows])
                self._conn.execute("COMMIT")
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
        for bundle_id, ids, attempts in rows:
            self._drop(bundle_id, json.loads(ids), RETRY_EXPIRED,
                       f"not landed after {attempts} attempts in {self.expiry_seconds:.0f}s")
        return [r[0] for r in rows]

    def _drop(self, bundle_id: str, sample_ids: list[str], reason: str, detail: str) -> None:
        # Ledger first: if the process dies between the two steps, the samples are double-accounted
        # (ledger + spool) rather than lost; the next expiry pass of the spool resolves it.
        if self.ledger is not None:
            self.ledger.record(sample_ids, stage=STAGE_UPLINK, reason=reason, bundle_id=bundle_id, detail=detail)
        if self.discard is not None:
            self.discard(bundle_id)
        if self.emit_events:
            events.emit(events.RETRY_EXPIRED, self.resource_id,
                        {"bundle_id": bundle_id, "samples": len(sample_ids), "reason": reason, "detail": detail})

    def close(self) -> None:
        with self._lock:
            self._conn.close()
