"""Durable, ordered outbox of the events an edge node raises, kept while it is out of contact.

While the central Prefect API is out of reach, events are appended here instead of being lost;
the forwarder (`edgehaul.uplink.forwarder`) sends them in sequence order and deletes them only after
a 2xx. `Outbox.sink()` is the `edgehaul.events.routed` sink that turns `events.emit` into appends.

Storage: SQLite in the node's state dir, WAL + synchronous=FULL like the spool's ledger, so a
committed append survives kill -9. ``seq`` is an AUTOINCREMENT key, hence strictly increasing
and never reused, even after the newest rows were deleted.

Bundle announcements (`events.NODE_ANNOUNCED`: a bundle the node landed, for the gateway's
`bundle-uploaded` hook) are rows too, in the same order, with the highest priority (dropped last).

Cap: at most ``cap`` rows. When full, the oldest row of the lowest priority present is dropped
first (stats/summaries before alerts; among alerts level 3 before 2 before 1; announcements last),
and every drop is counted per event name in ``dropped`` so the loss is accounted for, never silent
(a dropped announcement's bundle is still in landing: core_ingest's sweep commits it).
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from edgehaul import events

# Lower number = more important = dropped last. Alerts carry their level (1 most severe).
PRIO_ANNOUNCE = 0  # a landed bundle: what the core waits for
PRIO_ALERT_L1 = 1
PRIO_ALERT_L2 = 2
PRIO_ALERT_L3 = 3
PRIO_STATS = 9
OUTBOX_FILE = "outbox.sqlite"  # in the node's spool folder: its persistent disk, beside the ledger
_LEVEL_PRIO = {1: PRIO_ALERT_L1, 2: PRIO_ALERT_L2, 3: PRIO_ALERT_L3}
# The fields of the gateway's `bundle-uploaded` hook (gateway.BundleUploaded), all an announcement keeps.
ANNOUNCEMENT_FIELDS = ("node_id", "bundle_id", "object_key", "manifest_key", "sha256", "row_count", "contract",
                       "tier", "nbytes")


def priority_of(payload: dict[str, Any]) -> int:
    """An alert's level (payload `level` 1-3) is its priority; anything else is statistics."""
    level = payload.get("level")
    return _LEVEL_PRIO.get(level, PRIO_STATS) if isinstance(level, int) and not isinstance(level, bool) else PRIO_STATS


@dataclass(frozen=True, slots=True)
class OutboxEvent:
    seq: int
    node_id: str
    event: str
    occurred: datetime
    priority: int
    payload: dict[str, Any]


class Outbox:
    def __init__(self, path: Path, node_id: str, *, cap: int = 10_000) -> None:
        if cap < 1:
            raise ValueError(f"outbox cap must be >= 1, got {cap} for {path}")
        self.path = Path(path)
        self.node_id = node_id
        self.cap = cap
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, timeout=30.0, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS outbox (seq INTEGER PRIMARY KEY AUTOINCREMENT, node_id TEXT NOT NULL,"
            " event TEXT NOT NULL, occurred TEXT NOT NULL, priority INTEGER NOT NULL, payload TEXT NOT NULL)"
        )
        self._db.execute("CREATE TABLE IF NOT EXISTS dropped (event TEXT PRIMARY KEY, n INTEGER NOT NULL)")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS set_aside (seq INTEGER PRIMARY KEY, event TEXT NOT NULL, occurred TEXT NOT NULL,"
            " payload TEXT NOT NULL, why TEXT NOT NULL)"
        )

    def append(
        self, event: str, payload: dict[str, Any], *, priority: int = PRIO_STATS, occurred: datetime | None = None
    ) -> int:
        """Append one event; returns its sequence number. Drops by priority if the cap is reached."""
        when = (occurred or datetime.now(UTC)).isoformat()
        body = json.dumps(payload, sort_keys=True, default=str)
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                (n,) = self._db.execute("SELECT COUNT(*) FROM outbox").fetchone()
                for _ in range(n - self.cap + 1):
                    # Oldest row among the least important priority present.
                    seq, name = self._db.execute(
                        "SELECT seq, event FROM outbox ORDER BY priority DESC, seq ASC LIMIT 1"
                    ).fetchone()
                    self._db.execute("DELETE FROM outbox WHERE seq = ?", (seq,))
                    self._db.execute(
                        "INSERT INTO dropped(event, n) VALUES (?, 1) ON CONFLICT(event) DO UPDATE SET n = n + 1",
                        (name,),
                    )
                cur = self._db.execute(
                    "INSERT INTO outbox(node_id, event, occurred, priority, payload) VALUES (?, ?, ?, ?, ?)",
                    (self.node_id, event, when, priority, body),
                )
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        assert cur.lastrowid is not None
        return cur.lastrowid

    def peek(self, limit: int) -> list[OutboxEvent]:
        """The oldest ``limit`` events in sequence order, left in place."""
        with self._lock:
            rows = self._db.execute(
                "SELECT seq, node_id, event, occurred, priority, payload FROM outbox ORDER BY seq LIMIT ?", (limit,)
            ).fetchall()
        return [OutboxEvent(s, nd, e, datetime.fromisoformat(o), p, json.loads(b)) for s, nd, e, o, p, b in rows]

    def ack(self, upto_seq: int) -> int:
        """Delete every event with seq <= upto_seq (after the gateway's 2xx); returns how many."""
        with self._lock:
            cur = self._db.execute("DELETE FROM outbox WHERE seq <= ?", (upto_seq,))
        return cur.rowcount

    def set_aside(self, seq: int, why: str) -> None:
        """Move one event the gateway refuses as content (not as a sender) out of the queue, kept with the
        reason: one bad row must not hold back the node's whole history."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute("INSERT OR REPLACE INTO set_aside SELECT seq, event, occurred, payload, ? FROM outbox"
                                 " WHERE seq = ?", (why, seq))
                self._db.execute("DELETE FROM outbox WHERE seq = ?", (seq,))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def set_aside_events(self) -> list[tuple[int, str, str]]:
        """(seq, event, why) of every event set aside."""
        with self._lock:
            return list(self._db.execute("SELECT seq, event, why FROM set_aside ORDER BY seq").fetchall())

    def __len__(self) -> int:
        with self._lock:
            (n,) = self._db.execute("SELECT COUNT(*) FROM outbox").fetchone()
        return int(n)

    def dropped(self) -> dict[str, int]:
        with self._lock:
            return dict(self._db.execute("SELECT event, n FROM dropped").fetchall())

    def sink(self, clock: Callable[[], float] = time.time) -> events.Sink:
        """An `events.routed` sink: each emitted event becomes one row, stamped with `clock` (when it
        happened), its priority from its level; the emitter's resource id travels as `origin_resource`.
        A bundle announcement keeps only the hook's fields, at PRIO_ANNOUNCE."""

        def keep(event: str, resource_id: str, payload: dict[str, Any], labels: dict[str, str]) -> bool:
            when = datetime.fromtimestamp(clock(), UTC)
            if event in events.NODE_ANNOUNCED:
                if payload.get("node_id") != self.node_id:
                    raise ValueError(f"bundle {payload.get('bundle_id')} of node {payload.get('node_id')!r} "
                                     f"announced through the outbox of {self.node_id}")
                body = {k: payload[k] for k in ANNOUNCEMENT_FIELDS if payload.get(k) is not None}
                self.append(event, body, priority=PRIO_ANNOUNCE, occurred=when)
                return True
            body = {**payload, "origin_resource": resource_id}
            self.append(event, body, priority=priority_of(payload), occurred=when)
            return True

        return keep

    def close(self) -> None:
        self._db.close()


def node_outbox(spool_dir: str | Path, node_id: str) -> Outbox:
    """The node's one outbox, `<spool_dir>/outbox.sqlite`: every writer on the node opens this one."""
    return Outbox(Path(spool_dir) / OUTBOX_FILE, node_id)


def record_run(box: Outbox, flow: str, counts: dict[str, Any], ledger: dict[str, int]) -> None:
    """A node-local run's summary and the node's ledger totals (stage/reason -> samples), for the centre:
    what the node did while nobody was watching, forwarded with its alerts."""
    box.append(events.NODE_RUN_SUMMARY, {"flow": flow, "node_id": box.node_id, **counts})
    box.append(events.LEDGER_COUNTS, {"node_id": box.node_id, "totals": ledger})
