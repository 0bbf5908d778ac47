"""Store and forward of what an edge node did: the outbox, drained to the gateway.

The node's events (run summaries, ledger counts, alerts of levels 1-3, link statistics) wait in its
durable outbox (`edgehaul.edge.outbox`) while the central API is out of reach. `Forwarder` sends them
in sequence order, in batches, to the gateway hook `POST /hooks/<sender>/node-events`, signed with
the node's own Standard Webhooks key, and deletes rows only once the gateway answered 2xx. The
gateway re-emits each event into Prefect as `edgehaul.node.<id>`, once per (node, seq), so a retried
batch (same webhook-id, or the same rows in a new batch) is harmless.

A bundle the node landed (`events.NODE_ANNOUNCED` rows) goes, in its place in the sequence, to the
hook `bundle-uploaded`, one request per bundle: the gateway coalesces every node's bundles into the
`edgehaul.landing.batch` event that starts core_ingest. Its webhook-id is derived from the bundle, so a
retry the gateway already accepted answers 409 (replayed), which acknowledges it; past the replay
window the retry is queued again, and core_ingest commits a bundle once.

Same link, same rules as data: a batch is paced through the link's shaper at the rate cap, with a
priority ahead of every bundle (control traffic first, never over the cap), and nothing is sent
while the link is down or outside a contact window.
"""

from __future__ import annotations

import json
import logging
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

import httpx

from edgehaul import events
from edgehaul.platform.webhooks import signed_headers
from edgehaul.uplink.link import Link, Priority

log = logging.getLogger(__name__)

HOOK = "node-events"
ANNOUNCE_HOOK = "bundle-uploaded"
# Data priorities start with a tier rank (>= 0): (-1,) sorts before every bundle's chunks.
CONTROL_PRIORITY: Priority = (-1,)


class QueuedEvent(Protocol):
    @property
    def seq(self) -> int: ...
    @property
    def event(self) -> str: ...
    @property
    def occurred(self) -> datetime: ...
    @property
    def priority(self) -> int: ...
    @property
    def payload(self) -> dict[str, Any]: ...


class EventQueue(Protocol):
    """What the forwarder needs of the outbox (`edgehaul.edge.outbox.Outbox`)."""

    node_id: str

    def peek(self, limit: int) -> list[Any]: ...
    def ack(self, upto_seq: int) -> int: ...
    def set_aside(self, seq: int, why: str) -> None: ...
    def __len__(self) -> int: ...


class ForwardError(RuntimeError):
    """The gateway refused the sender (401/403/404/409...): a retry will not fix it, an operator must.
    A refused event (400/422: its content) is set aside on the node instead, and the rest goes on."""


@dataclass
class ForwardReport:
    events: int = 0
    announced: int = 0  # bundles announced to the gateway (counted in `events` too)
    batches: int = 0
    bytes: int = 0
    left: int = 0
    error: str = ""
    statuses: list[int] = field(default_factory=list)
    set_aside: list[int] = field(default_factory=list)  # seqs the gateway refused as content (kept on the node)

    @property
    def ok(self) -> bool:
        return not self.error


def batch_body(node_id: str, rows: Sequence[QueuedEvent]) -> bytes:
    return json.dumps({"node_id": node_id, "events": [
        {"seq": r.seq, "event": r.event, "occurred": r.occurred.isoformat(), "priority": r.priority,
         "payload": r.payload} for r in rows]}, sort_keys=True, separators=(",", ":"), default=str).encode()


def read_node_key(path: Path) -> str:
    """The node's own gateway key (`whsec_...`) from its 0600 file, beside its S3 credentials; the
    error names the file and what is wrong with it."""
    try:
        st = path.stat()
        key = path.read_text().strip()
    except OSError as e:
        raise ValueError(f"node gateway key {path}: cannot read ({e.strerror})") from None
    if st.st_mode & 0o077:
        raise ValueError(f"node gateway key {path}: mode {stat.S_IMODE(st.st_mode):04o} lets group/other "
                         f"read or write it; make it 0600")
    if not key.startswith("whsec_"):
        raise ValueError(f"node gateway key {path}: expected one line 'whsec_<base64>'")
    return key


class Forwarder:
    """Drains an outbox to the gateway. `client` is an httpx.Client whose base_url is the gateway."""

    def __init__(self, outbox: EventQueue, client: httpx.Client, sender_id: str, key: str, *,
                 link: Link | None = None, batch_max: int = 100, max_body_bytes: int = 48 * 1024) -> None:
        if batch_max < 1:
            raise ValueError(f"forwarder batch_max must be >= 1, got {batch_max}")
        self.outbox, self.client, self.sender_id, self.key = outbox, client, sender_id, key
        self.link, self.batch_max, self.max_body_bytes = link, batch_max, max_body_bytes

    @classmethod
    def to_gateway(cls, outbox: EventQueue, gateway_url: str, key_file: Path, *, sender_id: str | None = None,
                   link: Link | None = None, timeout_s: float = 30.0) -> Forwarder:
        """A forwarder speaking as the node itself (sender id = node id unless given), its key read
        from `key_file`; close `.client` when done."""
        key = read_node_key(key_file)
        client = httpx.Client(base_url=gateway_url, timeout=timeout_s)
        return cls(outbox, client, sender_id or outbox.node_id, key, link=link)

    def _next_batch(self, limit: int | None = None) -> tuple[list[QueuedEvent], bytes, str]:
        """(rows, body, hook) of the next request: one announcement alone, or the node events up to it."""
        rows: list[QueuedEvent] = self.outbox.peek(limit or self.batch_max)
        if rows and rows[0].event in events.NODE_ANNOUNCED:
            one = rows[0]
            return [one], json.dumps({**one.payload, "node_id": self.outbox.node_id}, sort_keys=True,
                                     separators=(",", ":"), default=str).encode(), ANNOUNCE_HOOK
        cut = next((i for i, r in enumerate(rows) if r.event in events.NODE_ANNOUNCED), len(rows))
        rows = rows[:cut]
        body = batch_body(self.outbox.node_id, rows)
        while len(rows) > 1 and len(body) > self.max_body_bytes:  # under the gateway's body cap
            rows = rows[: max(1, len(rows) // 2)]
            body = batch_body(self.outbox.node_id, rows)
        return rows, body, HOOK

    def forward(self, max_batches: int = 1_000) -> ForwardReport:
        """Send batches until the outbox is empty, the link is down, the gateway is unreachable or
        refuses; what was not acknowledged stays in the outbox for the next call."""
        rep = ForwardReport()
        limit = self.batch_max  # halved on a content refusal until the refused event stands alone
        for _ in range(max_batches):
            if self.link is not None and not self.link.is_up():
                rep.error = f"link down: {self.link.down_reason()}"
                break
            rows, body, hook = self._next_batch(limit)
            if not rows:
                break
            first, last = rows[0].seq, rows[-1].seq
            # The same rows keep the same id; the gateway re-sends only seqs Prefect does not have yet.
            msg_id = f"ob-{self.outbox.node_id}-{first}-{last}"
            announce = hook == ANNOUNCE_HOOK
            if announce:  # one id per bundle: a replay of it means this bundle was accepted
                msg_id = f"an-{self.outbox.node_id}-{rows[0].payload.get('bundle_id', first)}"
            if self.link is not None:
                self.link.shaper.acquire(len(body), CONTROL_PRIORITY)
                self.link.control(len(body))
            try:
                r = self.client.post(f"/hooks/{self.sender_id}/{hook}", content=body,
                                     headers=signed_headers(self.key, body, msg_id=msg_id))
            except httpx.HTTPError as e:
                rep.error = f"gateway unreachable: {type(e).__name__}: {e}"
                break
            rep.statuses.append(r.status_code)
            rep.bytes += len(body)
            # 409 to an announcement: the gateway accepted this bundle before (its answer was lost)
            if r.is_success or (announce and r.status_code == 409):
                self.outbox.ack(last)
                rep.events += len(rows)
                rep.announced += announce
                rep.batches += 1
                limit = self.batch_max
                continue
            why = _error_of(r)
            if r.status_code in (400, 422):  # the content, not the sender: find the event and set it aside
                if len(rows) > 1:
                    limit = max(1, len(rows) // 2)
                    continue
                self.outbox.set_aside(first, f"{r.status_code} {why}")
                rep.set_aside.append(first)
                log.warning("node %s: outbox event seq %d (%s) refused by the gateway, set aside: %s",
                            self.outbox.node_id, first, rows[0].event, why)
                limit = self.batch_max
                continue
            if r.status_code in (429, 500, 502, 503, 504):
                rep.error = f"gateway busy or Prefect unreachable ({r.status_code}: {why}); seq {first}-{last} kept"
                break
            raise ForwardError(f"gateway refused {hook} seq {first}-{last} of {self.outbox.node_id} "
                               f"as sender {self.sender_id!r}: {r.status_code} {why}")
        rep.left = len(self.outbox)
        log.info("forwarded %d events (%d bundle announcements) in %d requests (%d bytes), %d left%s", rep.events,
                 rep.announced, rep.batches, rep.bytes, rep.left, f": {rep.error}" if rep.error else "")
        return rep


def _error_of(r: httpx.Response) -> str:
    try:
        doc = r.json()
    except ValueError:
        return r.text[:200]
    return str(doc.get("error", doc))[:200] if isinstance(doc, dict) else str(doc)[:200]
