"""Webhook gateway: signed HTTP requests from outside systems become Prefect events.

Open-source Prefect has no inbound webhooks (its events endpoint takes only full Prefect event
objects from authenticated clients), so ground stations and edge nodes that do not run Prefect post
here instead. This is the one entry to the product that Prefect itself does not authenticate.

Requests follow the Standard Webhooks format (https://www.standardwebhooks.com), so a sender can use
an existing library (e.g. the `standardwebhooks` package):

    POST /hooks/<sender>/<kind>
    webhook-id: <unique message id>              (replays of an id are refused)
    webhook-timestamp: <integer unix seconds>    (within the tolerance, default 300 s)
    webhook-signature: v1,<base64 HMAC-SHA256(key, id + "." + timestamp + "." + body)> [v1,<...> ...]

Senders registry (`EDGEHAUL_GATEWAY_SENDERS`: a JSON file the operator manages, e.g. a mounted
Kubernetes Secret; it must not be readable by other users, and a change is picked up without restart):

    {"senders": {
        "gs-svalbard": {"keys": ["whsec_<base64>", "whsec_<base64 of the next key>"],
                        "nodes": ["node-*"], "hooks": ["contact-window-opened"]},
        "node-a":      {"keys": ["whsec_<base64>"], "nodes": ["node-a"], "hooks": ["bundle-uploaded", "node-events"],
                        "events": ["edgehaul.link.stats", "edgehaul.spool.watermark"]}}}

Each sender has one or more keys (all accepted: add the new key, move the sender over, remove the old
one), the node ids (fnmatch patterns) it may speak for and the hook kinds it may send. The sender id
is in the path rather than the signed content; that is enough since only that sender's keys verify.
Only one format is accepted: the former `X-Edgehaul-*` headers are gone (one shared secret, no id).

Landed bundles are coalesced: an accepted `bundle-uploaded` hook is queued in the gateway's SQLite
file (`<EDGEHAUL_GATEWAY_STATE_DIR>/gateway.sqlite`, with the replay store) and answered 202; every
`EDGEHAUL_GATEWAY_BATCH_WINDOW_S`, or as soon as `EDGEHAUL_GATEWAY_BATCH_MAX` keys wait, ONE
`edgehaul.landing.batch` event carries the queued keys, and the `bundle_landed` trigger of
deployments/prefect.yaml makes it one core_ingest run. An event (not a run created here) keeps the
trigger the one place that says what runs on landed bundles, for the uplink's batches as for ours.
A batch leaves the queue only once Prefect has the event; one that failed is re-sent with the same
event id (Prefect's triggers skip an event id they have seen, and core_ingest commits a bundle once).
`contact-window-opened` is emitted at once (one per node contact, nothing to coalesce).

`node-events` is an edge node's outbox, forwarded (edgehaul.uplink.forwarder): a batch of the node's
own events, each with its outbox `seq`. Node events are data, never commands: each type has a typed,
bounded payload schema (`NODE_EVENT_SCHEMAS`: numbers finite and bounded, strings and containers
bounded), a sender may forward only the types on its `events` allow-list (default: all node types; the
core's own `edgehaul.checkpoint.failed` never), and `seq` is at most 2**53 and at most `MAX_SEQ_JUMP`
past the highest seq the gateway has of that node. Each is re-emitted as itself,
attributed to `edgehaul.node.<id>` (the resource id the alert automations group by), with `occurred`
= when it happened on the node, its payload (alerts keep `level`), `age_s` and, past
`stale_after_s`, the label `edgehaul.stale: true`. Exactly once per (node, seq): the highest seq
Prefect has is kept per node in the gateway's SQLite file and advanced after each event, and the
event id is derived from (node, seq); a replayed webhook-id is answered 202 after re-sending only
what Prefect does not have yet (nothing, unless an earlier attempt died midway).

`POST /alerts` (bearer token derived from the gateway's own secret, `alert_token`; the secret is the 0600 file
`gateway-secret` in the state dir or EDGEHAUL_GATEWAY_SECRET, never a Prefect block) is the local
receiver of the alert automations' webhook notifications: it appends them to `alerts.jsonl`.

Answers, all with a short JSON body `{"error": ...}`: 202 accepted (queued or emitted); 400 malformed
header (non-ASCII, not integer seconds, bad base64); 401 unsigned, unknown sender, bad signature or
stale; 403 hook kind or node outside the sender's binding; 404 unknown kind; 409 replayed webhook-id;
413 body over the cap (enforced while reading); 422 malformed or schema-invalid body (field errors
listed; object keys with `..`, `//`, a leading `/` or outside the node's prefix; a node event off the
sender's allow-list, outside its type's schema or with a seq past the bound); 429 the sender is over its
own rate (`rate_per_s`, `rate_burst`) or its own share of the replay store (`replay_capacity` live ids per
sender), with `retry-after`: one sender's flood never refuses another; 503 Prefect unreachable (safe to
retry: the id is not remembered as seen). Nothing a signed sender can put in a body gives a 500.

    python -m edgehaul.services.gateway --port 8787
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import contextlib
import hashlib
import hmac
import itertools
import json
import logging
import math
import os
import re
import sqlite3
import stat
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import datetime
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Annotated, Any, Literal, Protocol

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, ValidationError, model_validator
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from edgehaul import events
from edgehaul.platform.fields import Strict
from edgehaul.platform.private_files import write_private
from edgehaul.platform.settings import get_settings
from edgehaul.platform.webhooks import (
    ID_HEADER,
    SECRET_PREFIX,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    digest,
    secret_bytes,
)
from edgehaul.platform.webhooks import new_secret as new_secret  # the gateway's CLI and set-up make keys
from edgehaul.platform.webhooks import sign as sign
from edgehaul.platform.webhooks import signed_headers as signed_headers

log = logging.getLogger("edgehaul.services.gateway")

SECRET_ENV = "EDGEHAUL_GATEWAY_SECRET"  # names for messages; the values come from get_settings()
SENDERS_ENV = "EDGEHAUL_GATEWAY_SENDERS"

_NAME = r"^[a-z0-9][a-z0-9._-]{0,62}$"
_MSG_ID = re.compile(r"^[\x21-\x7e]{1,256}$")  # visible ASCII, as Standard Webhooks ids are
_SECONDS = re.compile(r"^[0-9]{1,12}$")  # integer seconds only: no nan, inf, exponent, sign or fraction
_KEY_SEGMENT = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*$")
_MAX_SIGNATURES = 8


class _Strict(Strict):
    model_config = ConfigDict(str_strip_whitespace=True)  # and Strict's extra="forbid"


def _check_key(key: str, node_id: str, what: str) -> None:
    # Built into store keys by core_ingest: every segment a plain name, the first the node itself.
    if key.startswith("/") or "//" in key or "\\" in key:
        raise ValueError(f"{what} {key!r} must be relative, without '//' or '\\'")
    parts = key.split("/")
    if any(p in (".", "..") or not _KEY_SEGMENT.match(p) for p in parts):
        raise ValueError(f"{what} {key!r} has a '.', '..' or non-name segment")
    if parts[0] != node_id or len(parts) < 2:
        raise ValueError(f"{what} {key!r} is not under the node's prefix '{node_id}/'")


class _NodeHook(_Strict):
    """A hook that speaks for one node: the sender must be bound to it."""

    node_id: str = Field(pattern=_NAME)


class ContactWindowOpened(_NodeHook):
    """A ground station reports that a contact window with an edge node has opened."""

    station_id: str = Field(pattern=_NAME)
    window_start: AwareDatetime
    window_end: AwareDatetime
    bandwidth_bps: float | None = Field(default=None, gt=0, le=1e12)

    @model_validator(mode="after")
    def _window_order(self) -> ContactWindowOpened:
        if self.window_end <= self.window_start:
            raise ValueError("window_end must be after window_start")
        return self


class BundleUploaded(_NodeHook):
    """An edge node reports a bundle (Parquet + manifest) complete in the landing zone."""

    bundle_id: str = Field(pattern=_NAME)
    object_key: str = Field(min_length=1, max_length=1024, pattern=r"\.parquet$")
    manifest_key: str = Field(min_length=1, max_length=1024, pattern=r"\.manifest\.json$")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    row_count: int = Field(ge=0, le=10_000_000)
    contract: str = Field(pattern=r"^[a-z0-9_]+\.v[0-9]+$")
    tier: Literal["high", "normal"] = "normal"
    nbytes: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _keys_are_the_nodes(self) -> BundleUploaded:
        # A node may only announce its own bundles, at the shared landing layout <node>/<day>/<bundle>.parquet.
        _check_key(self.object_key, self.node_id, "object_key")
        _check_key(self.manifest_key, self.node_id, "manifest_key")
        if not self.object_key.endswith(f"/{self.bundle_id}.parquet"):
            raise ValueError(f"object_key must end with '/{self.bundle_id}.parquet'")
        if self.manifest_key != self.object_key.removesuffix(".parquet") + ".manifest.json":
            raise ValueError("manifest_key must be object_key with '.manifest.json' for '.parquet'")
        return self


MAX_SEQ = 2**53  # a node's outbox seq: exact in every JSON reader, far below SQLite's 2**63
MAX_SEQ_JUMP = 10_000_000  # how far past the highest seq the gateway has a batch may start
_MAX_DEPTH = 4
_MAX_ITEMS = 256
_MAX_STR = 2048

Finite = Annotated[float, Field(allow_inf_nan=False, ge=-1e15, le=1e15)]
Fraction = Annotated[float, Field(allow_inf_nan=False, ge=0, le=100)]
Count = Annotated[int, Field(ge=0, le=MAX_SEQ)]
Seconds = Annotated[float, Field(allow_inf_nan=False, ge=0, le=1e9)]
Lag = Annotated[float, Field(allow_inf_nan=False, ge=-1e9, le=1e9)]
Label = Annotated[str, Field(max_length=128)]
Text = Annotated[str, Field(max_length=_MAX_STR)]


def _bounded(v: Any, depth: int = 0) -> None:
    """A payload value that is plain data: finite bounded numbers, bounded strings, small shallow containers."""
    if v is None or isinstance(v, bool):
        return
    if isinstance(v, int):
        if abs(v) > MAX_SEQ:
            raise ValueError(f"integer {str(v)[:20]}... is beyond +-2**53")
        return
    if isinstance(v, float):
        if not math.isfinite(v) or abs(v) > 1e15:
            raise ValueError(f"number {v!r} is not finite or beyond +-1e15")
        return
    if isinstance(v, str):
        if len(v) > _MAX_STR:
            raise ValueError(f"string of {len(v)} characters, at most {_MAX_STR}")
        return
    if depth >= _MAX_DEPTH:
        raise ValueError(f"nested deeper than {_MAX_DEPTH}")
    if isinstance(v, list):
        if len(v) > _MAX_ITEMS:
            raise ValueError(f"list of {len(v)} items, at most {_MAX_ITEMS}")
        for x in v:
            _bounded(x, depth + 1)
        return
    if isinstance(v, dict):
        if len(v) > _MAX_ITEMS:
            raise ValueError(f"object of {len(v)} keys, at most {_MAX_ITEMS}")
        for k, x in v.items():
            if not isinstance(k, str) or len(k) > 128:
                raise ValueError("object keys must be strings of at most 128 characters")
            _bounded(x, depth + 1)
        return
    raise ValueError(f"unsupported value type {type(v).__name__}")


class _Payload(BaseModel):
    """A forwarded event's payload: the fields the centre reads are typed and bounded; anything else a
    node adds is kept only if it is plain bounded data (see `_bounded`). Data, never a command."""

    model_config = ConfigDict(extra="allow", strict=False)

    level: int | None = Field(default=None, ge=0, le=3)
    node_id: str | None = Field(default=None, pattern=_NAME)
    origin_resource: Label | None = None  # the emitter's resource id (the outbox sink adds it)

    @model_validator(mode="after")
    def _extras_bounded(self) -> _Payload:
        extra = self.model_extra or {}
        if len(extra) > 64:
            raise ValueError(f"{len(extra)} extra fields, at most 64")
        for k, v in extra.items():
            if len(k) > 128:
                raise ValueError("field names are at most 128 characters")
            try:
                _bounded(v)
            except ValueError as e:
                raise ValueError(f"field {k[:64]!r}: {e}") from None
        return self


class LinkStatsPayload(_Payload):
    retransmission_rate: Fraction | None = None
    goodput_bps: Annotated[float, Field(allow_inf_nan=False, ge=0, le=1e12)] | None = None
    rate_cap_use: Fraction | None = None
    queue_lengths: dict[Label, Count] = Field(default_factory=dict, max_length=32)
    retry_queue: Count | None = None
    bundles_landed: Count | None = None
    # a tier without samples reports None; a node's clock may put capture after landing (negative)
    capture_to_landed_p50_s: dict[Label, Lag | None] = Field(default_factory=dict, max_length=32)
    capture_to_landed_p99_s: dict[Label, Lag | None] = Field(default_factory=dict, max_length=32)
    spool_used_fraction: Fraction | None = None
    accelerator_utilisation: Fraction | None = None


class SpoolWatermarkPayload(_Payload):
    used_fraction: Fraction | None = None
    used_bytes: Count | None = None
    cap_bytes: Count | None = None


class ContactOpenedPayload(_Payload):
    waited_s: Seconds | None = None


class RetryExpiredPayload(_Payload):
    bundle_id: str | None = Field(default=None, pattern=_NAME)
    samples: Count | None = None
    reason: Label | None = None
    detail: Text | None = None


class RunSummaryPayload(_Payload):
    flow: Label | None = None


class LedgerCountsPayload(_Payload):
    totals: dict[Annotated[str, Field(max_length=256)], Count] = Field(default_factory=dict, max_length=1024)


class DownlinkAppliedPayload(_Payload):
    generation: Count | None = None
    previous: Count | None = None
    items: list[Text] = Field(default_factory=list, max_length=_MAX_ITEMS)


class DownlinkRefusedPayload(_Payload):
    generation: Count | None = None
    in_force: Count | None = None
    why: Text | None = None


class DropRejectedPayload(_Payload):
    message: Text | None = None
    files: dict[Annotated[str, Field(max_length=1024)], Text] = Field(default_factory=dict, max_length=50)
    files_named: Count | None = None
    files_with_problems: Count | None = None
    files_read: Count | None = None
    files_rejected: Count | None = None


# What an edge node may forward, each with its payload's schema. Never an event that starts work
# centrally, and never one only the core emits: CHECKPOINT_FAILED (training runs centrally) pages
# level 3 and feeds the checkpoint success figure, so a node's copy would be a forged page.
NODE_EVENT_SCHEMAS: dict[str, type[_Payload]] = {
    events.LINK_STATS: LinkStatsPayload,
    events.SPOOL_WATERMARK: SpoolWatermarkPayload,
    events.CONTACT_OPENED: ContactOpenedPayload,
    events.RETRY_EXPIRED: RetryExpiredPayload,
    events.NODE_RUN_SUMMARY: RunSummaryPayload,
    events.LEDGER_COUNTS: LedgerCountsPayload,
    events.DOWNLINK_APPLIED: DownlinkAppliedPayload,
    events.DOWNLINK_REFUSED: DownlinkRefusedPayload,
    events.DROP_REJECTED: DropRejectedPayload,
}
CORE_ONLY_EVENTS = frozenset({events.CHECKPOINT_FAILED})


class NodeEvent(_Strict):
    """One event of a node's outbox; its payload is checked against its event type's schema."""

    seq: int = Field(ge=1, le=MAX_SEQ)
    event: str = Field(pattern=r"^edgehaul\.[a-z0-9._-]{1,100}$")
    occurred: AwareDatetime
    priority: int = Field(ge=0, le=99)
    payload: dict[str, Any]

    @model_validator(mode="after")
    def _forwardable(self) -> NodeEvent:
        schema = NODE_EVENT_SCHEMAS.get(self.event)
        if schema is None:
            why = "is the core's own" if self.event in CORE_ONLY_EVENTS else "is not a node event"
            raise ValueError(f"event {self.event!r} {why} and may not be forwarded by a node "
                             f"(allowed: {', '.join(sorted(NODE_EVENT_SCHEMAS))})")
        try:
            self.payload = schema.model_validate(self.payload).model_dump(exclude_none=True)
        except ValidationError as e:
            raise ValueError(f"payload of {self.event}: " + "; ".join(
                f"{'.'.join(map(str, err['loc'])) or '(payload)'}: {err['msg']}"
                for err in e.errors(include_url=False))[:1000]) from None
        return self


class NodeEvents(_NodeHook):
    """A batch of an edge node's outbox, in seq order."""

    events: list[NodeEvent] = Field(min_length=1, max_length=500)

    @model_validator(mode="after")
    def _in_order(self) -> NodeEvents:
        seqs = [e.seq for e in self.events]
        if any(b <= a for a, b in itertools.pairwise(seqs)):
            raise ValueError("events must be in strictly increasing seq order")
        for e in self.events:
            claimed = e.payload.get("node_id")
            if claimed is not None and claimed != self.node_id:
                raise ValueError(f"event seq {e.seq}: payload node_id {claimed!r} is not the batch's node")
        return self


@dataclass(frozen=True)
class HookKind:
    schema: type[_NodeHook]
    event: str
    resource: Callable[[Any], dict[str, str]]
    coalesced: bool = False  # queued and sent as part of an edgehaul.landing.batch event
    fan_out: bool = False  # a batch of the node's own events, each re-emitted once per (node, seq)


HOOKS: dict[str, HookKind] = {
    "contact-window-opened": HookKind(
        ContactWindowOpened,
        events.CONTACT_OPENED,
        lambda m: {
            "prefect.resource.id": f"edgehaul.node.{m.node_id}",
            "edgehaul.node.id": m.node_id,
            "edgehaul.station.id": m.station_id,
        },
    ),
    "bundle-uploaded": HookKind(
        BundleUploaded,
        events.LANDING_BATCH,
        lambda m: {"prefect.resource.id": f"edgehaul.bundle.{m.bundle_id}", "edgehaul.node.id": m.node_id},
        coalesced=True,
    ),
    "node-events": HookKind(
        NodeEvents,
        "(each event's own name)",
        lambda m: {"prefect.resource.id": f"edgehaul.node.{m.node_id}", "edgehaul.node.id": m.node_id},
        fan_out=True,
    ),
}


# ---- senders -------------------------------------------------------------------------------------


class SenderSpec(_Strict):
    keys: list[str] = Field(min_length=1, max_length=8, description="Keys, `whsec_<base64>`; all are accepted.")
    nodes: list[str] = Field(min_length=1, description="Node ids (fnmatch patterns) the sender may speak for.")
    hooks: list[str] = Field(min_length=1, description="Hook kinds the sender may send.")
    events: list[str] | None = Field(default=None, description="Event types the sender may forward with "
                                     "`node-events` (default: every node event type).")

    @model_validator(mode="after")
    def _check(self) -> SenderSpec:
        if self.events is not None:
            core = sorted(set(self.events) & CORE_ONLY_EVENTS)
            if core:
                raise ValueError(f"events {core} are the core's own; no node may forward them")
            unknown = sorted(set(self.events) - set(NODE_EVENT_SCHEMAS))
            if unknown:
                raise ValueError(f"unknown node events {unknown}; known: {sorted(NODE_EVENT_SCHEMAS)}")
        for k in self.keys:
            if not k.startswith(SECRET_PREFIX):
                raise ValueError("keys must start with 'whsec_'")
            if len(secret_bytes(k)) < 16:
                raise ValueError("a key must decode to at least 16 bytes")
        unknown = sorted(set(self.hooks) - set(HOOKS))
        if unknown:
            raise ValueError(f"unknown hook kinds {unknown}; known: {sorted(HOOKS)}")
        bad = [p for p in self.nodes if not re.match(r"^[a-z0-9*?\[\]._-]{1,63}$", p)]
        if bad:
            raise ValueError(f"node patterns {bad} may hold only a-z 0-9 . _ - and * ? [ ]")
        return self


class SendersDoc(_Strict):
    senders: dict[str, SenderSpec]

    @model_validator(mode="after")
    def _ids(self) -> SendersDoc:
        bad = [s for s in self.senders if not re.match(_NAME, s)]
        if bad:
            raise ValueError(f"sender ids {bad} must match {_NAME}")
        return self


@dataclass(frozen=True)
class Sender:
    id: str
    keys: tuple[bytes, ...]
    nodes: tuple[str, ...]
    hooks: frozenset[str]
    events: frozenset[str] = frozenset(NODE_EVENT_SCHEMAS)

    def may_speak_for(self, node_id: str) -> bool:
        return any(fnmatchcase(node_id, p) for p in self.nodes)


def parse_senders(doc: Any) -> dict[str, Sender]:
    """The registry from its JSON document; ValueError naming what is wrong."""
    try:
        parsed = SendersDoc.model_validate(doc)
    except ValidationError as e:
        raise ValueError("; ".join(f"{'.'.join(map(str, err['loc'])) or '(document)'}: {err['msg']}"
                                   for err in e.errors(include_url=False))) from None
    return {sid: Sender(sid, tuple(secret_bytes(k) for k in s.keys), tuple(s.nodes), frozenset(s.hooks),
                        frozenset(NODE_EVENT_SCHEMAS if s.events is None else s.events))
            for sid, s in parsed.senders.items()}


class SenderRegistry:
    """The senders file, re-read when it changes (key rotation without a restart); a broken new
    version is logged and the last good one kept, so a typo does not lock every sender out."""

    def __init__(self, path: Path | None = None, senders: dict[str, Sender] | None = None) -> None:
        self.path = path
        self._senders = senders or {}
        self._stamp: tuple[int, int] | None = None
        if path is not None:
            self._senders = self._read(path)

    @staticmethod
    def _read(path: Path) -> dict[str, Sender]:
        st = path.stat()
        if st.st_mode & 0o007:
            raise ValueError(f"senders file {path} is readable by every user (mode {st.st_mode & 0o777:o}); "
                             f"chmod o-rwx it")
        try:
            doc = json.loads(path.read_bytes())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"senders file {path} is not JSON: {e}") from None
        try:
            return parse_senders(doc)
        except ValueError as e:
            raise ValueError(f"senders file {path}: {e}") from None

    def _refresh(self) -> None:
        if self.path is None:
            return
        try:
            st = self.path.stat()
            stamp = (st.st_mtime_ns, st.st_size)
            if stamp != self._stamp:
                self._senders, self._stamp = self._read(self.path), stamp
                log.info("senders: %d loaded from %s", len(self._senders), self.path)
        except (OSError, ValueError) as e:
            log.error("senders file not reloaded, keeping %d senders: %s", len(self._senders), e)

    def get(self, sender_id: str) -> Sender | None:
        self._refresh()
        return self._senders.get(sender_id)

    def __len__(self) -> int:
        return len(self._senders)


# ---- durable state: replay store and the queue of landed bundles -------------------------------


@dataclass
class Pending:
    object_key: str
    node_id: str
    bundle_id: str
    sender: str


class GatewayState:
    """One SQLite file: webhook ids seen within the tolerance, and accepted bundle hooks not yet sent
    as a batch. Used from the event loop's thread only, so check-then-insert needs no lock.
    `capacity` is per sender: one sender filling its share is refused (429), the others are not."""

    def __init__(self, path: Path, capacity: int = 10_000, clock: Callable[[], float] = time.time) -> None:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.path, self.capacity, self.clock = path, capacity, clock
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")  # a 202 promises the hook is on disk
        self._db.executescript(
            """
            CREATE TABLE IF NOT EXISTS seen (sender TEXT NOT NULL, msg_id TEXT NOT NULL, expires REAL NOT NULL,
                                             PRIMARY KEY (sender, msg_id)) WITHOUT ROWID;
            CREATE INDEX IF NOT EXISTS seen_expires ON seen (expires);
            CREATE TABLE IF NOT EXISTS landed (seq INTEGER PRIMARY KEY AUTOINCREMENT, sender TEXT NOT NULL,
                                               msg_id TEXT NOT NULL, object_key TEXT NOT NULL, node_id TEXT NOT NULL,
                                               bundle_id TEXT NOT NULL, accepted REAL NOT NULL, batch TEXT);
            CREATE INDEX IF NOT EXISTS landed_batch ON landed (batch, seq);
            CREATE TABLE IF NOT EXISTS node_seq (node_id TEXT PRIMARY KEY, seq INTEGER NOT NULL) WITHOUT ROWID;
            """
        )

    def close(self) -> None:
        self._db.close()

    def replay_entries(self) -> int:
        return int(self._db.execute("SELECT count(*) FROM seen").fetchone()[0])

    def sender_entries(self, sender: str) -> int:
        return int(self._db.execute("SELECT count(*) FROM seen WHERE sender = ?", (sender,)).fetchone()[0])

    def _reserve(self, sender: str, msg_id: str, expires: float) -> Literal["ok", "replayed", "full"]:
        now = self.clock()
        self._db.execute("DELETE FROM seen WHERE expires < ?", (now,))
        if self._db.execute("SELECT 1 FROM seen WHERE sender = ? AND msg_id = ?", (sender, msg_id)).fetchone():
            return "replayed"
        if self.sender_entries(sender) >= self.capacity:
            return "full"  # refuse rather than forget a live id early, which would let it be replayed
        self._db.execute("INSERT INTO seen VALUES (?, ?, ?)", (sender, msg_id, expires))
        return "ok"

    def reserve(self, sender: str, msg_id: str, expires: float,
                landed: Pending | None = None) -> Literal["ok", "replayed", "full"]:
        """Remember (sender, msg_id) until `expires` (wall clock) and, in the same transaction,
        queue `landed`; nothing is written unless the answer is "ok"."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            verdict = self._reserve(sender, msg_id, expires)
            if verdict == "ok" and landed is not None:
                self._db.execute(
                    "INSERT INTO landed (sender, msg_id, object_key, node_id, bundle_id, accepted) VALUES (?,?,?,?,?,?)",
                    (sender, msg_id, landed.object_key, landed.node_id, landed.bundle_id, self.clock()))
            self._db.execute("COMMIT")
            return verdict
        except BaseException:
            self._db.execute("ROLLBACK")
            raise

    def node_seq(self, node_id: str) -> int:
        """The highest outbox seq of `node_id` that Prefect has (0: none yet)."""
        row = self._db.execute("SELECT seq FROM node_seq WHERE node_id = ?", (node_id,)).fetchone()
        return int(row[0]) if row else 0

    def advance_node_seq(self, node_id: str, seq: int) -> None:
        self._db.execute("INSERT INTO node_seq VALUES (?, ?) ON CONFLICT(node_id) DO UPDATE SET seq = "
                         "max(seq, excluded.seq)", (node_id, seq))

    def release(self, sender: str, msg_id: str) -> None:
        self._db.execute("DELETE FROM seen WHERE sender = ? AND msg_id = ?", (sender, msg_id))

    def pending(self) -> tuple[int, float | None, bool]:
        """(queued hooks, accept time of the oldest, whether a claimed batch is still unsent)."""
        n, oldest = self._db.execute("SELECT count(*), min(accepted) FROM landed").fetchone()
        claimed = self._db.execute("SELECT 1 FROM landed WHERE batch IS NOT NULL LIMIT 1").fetchone() is not None
        return int(n), oldest, claimed

    def claim_batch(self, max_keys: int) -> tuple[str, list[Pending]] | None:
        """The batch to send: an unsent claimed one first (same id: a re-send is the same event), else
        up to `max_keys` of the oldest queued hooks under a new id."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            row = self._db.execute("SELECT batch FROM landed WHERE batch IS NOT NULL ORDER BY seq LIMIT 1").fetchone()
            batch = row[0] if row else str(uuid.uuid4())
            if not row:
                self._db.execute(
                    "UPDATE landed SET batch = ? WHERE seq IN "
                    "(SELECT seq FROM landed WHERE batch IS NULL ORDER BY seq LIMIT ?)", (batch, max_keys))
            rows = self._db.execute(
                "SELECT object_key, node_id, bundle_id, sender FROM landed WHERE batch = ? ORDER BY seq",
                (batch,)).fetchall()
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        return (batch, [Pending(*r) for r in rows]) if rows else None

    def finish_batch(self, batch: str) -> None:
        self._db.execute("DELETE FROM landed WHERE batch = ?", (batch,))


# ---- emitting ------------------------------------------------------------------------------------


class Emitter(Protocol):
    """Hands one event to Prefect; `occurred` defaults to now."""

    async def __call__(self, name: str, resource: dict[str, str], payload: dict[str, Any], event_id: uuid.UUID,
                       occurred: datetime | None = None) -> None: ...


class PrefectEmitter:
    """One events websocket, reused; each emit waits for the server's pong (checkpoint_every=1),
    so a 202 means the Prefect server has the event. Works with API auth (PREFECT_API_AUTH_STRING)."""

    def __init__(self) -> None:
        self._client: Any = None
        self._lock = asyncio.Lock()

    async def _open(self) -> Any:
        from prefect.events.clients import get_events_client

        client = get_events_client(checkpoint_every=1, reconnection_attempts=2)
        await client.__aenter__()
        return client

    async def __call__(self, name: str, resource: dict[str, str], payload: dict[str, Any], event_id: uuid.UUID,
                       occurred: datetime | None = None) -> None:
        from prefect.events import Event

        when = {"occurred": occurred} if occurred is not None else {}
        ev = Event(event=name, resource=resource, payload=payload, id=event_id, **when)  # type: ignore[arg-type]
        async with self._lock:
            for attempt in range(2):
                try:
                    if self._client is None:
                        self._client = await self._open()
                    await self._client.emit(ev)
                    return
                except Exception:
                    await self.close()
                    if attempt:
                        raise

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                await client.__aexit__(None, None, None)
            except Exception as e:  # a dead socket cannot be closed cleanly; nothing to keep
                log.debug("closing events client: %s", e)


@dataclass
class GatewayConfig:
    senders: SenderRegistry
    state_dir: Path
    alerts_secret: str | None = None
    max_body_bytes: int = 64 * 1024
    tolerance_s: float = 300.0
    replay_capacity: int = 10_000  # replay-store entries per sender (about 33 requests/s each over 300 s)
    batch_window_s: float = 5.0
    batch_max: int = 200
    alert_log: str | None = None
    stats: dict[str, int] = field(default_factory=dict)
    stale_after_s: float = 600.0  # a forwarded node event older than this is labelled stale
    rate_per_s: float = 20.0  # signed requests per second per sender, sustained
    rate_burst: float = 200.0  # ... and at once
    clock: Callable[[], float] = time.time  # wall clock (tests inject one instead of sleeping)


class RateQuota:
    """A token bucket per sender: a sender past its rate is refused (429) without touching the others."""

    def __init__(self, rate_per_s: float, burst: float, clock: Callable[[], float]) -> None:
        self.rate, self.burst, self.clock = rate_per_s, burst, clock
        self._buckets: dict[str, tuple[float, float]] = {}  # sender -> (tokens, at)

    def take(self, sender: str) -> float:
        """0 when the request may go ahead, else the seconds until it could."""
        now = self.clock()
        tokens, at = self._buckets.get(sender, (self.burst, now))
        tokens = min(self.burst, tokens + max(0.0, now - at) * self.rate)
        if tokens < 1:
            self._buckets[sender] = (tokens, now)
            return (1 - tokens) / self.rate if self.rate > 0 else 3600.0
        self._buckets[sender] = (tokens - 1, now)
        return 0.0


def alert_token(secret: str) -> str:
    """Bearer token the alert notification block sends to /alerts (derived, so one secret to manage)."""
    return hmac.new(secret.encode(), b"edgehaul-alerts", hashlib.sha256).hexdigest()


class _Reject(Exception):
    def __init__(self, status: int, error: str, detail: Any = None, retry_after_s: float | None = None) -> None:
        super().__init__(error)
        self.status, self.error, self.detail, self.retry_after_s = status, error, detail, retry_after_s

    def response(self) -> JSONResponse:
        body: dict[str, Any] = {"error": self.error}
        if self.detail is not None:
            body["detail"] = self.detail
        headers = {"retry-after": str(max(1, math.ceil(self.retry_after_s)))} if self.retry_after_s else None
        return JSONResponse(body, status_code=self.status, headers=headers)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _parse_json(body: bytes) -> Any:
    """Strict JSON: no NaN/Infinity, no number of over 4300 digits, nesting Python can recurse through;
    whatever fails is the sender's body (422), never the gateway's error (500)."""
    try:
        return json.loads(body, parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError and the int-digits limit are ValueErrors
        raise _Reject(422, f"body is not JSON: {str(e)[:200]}") from None
    except RecursionError:
        raise _Reject(422, "body is not JSON: nested too deeply") from None


async def _read_capped(request: Request, cap: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None:
        if not _SECONDS.match(declared):
            raise _Reject(400, "invalid Content-Length header")
        n = int(declared)
        if n > cap:
            raise _Reject(413, f"body of {n} bytes exceeds the {cap}-byte limit")
    buf = bytearray()
    async for chunk in request.stream():
        buf += chunk
        if len(buf) > cap:  # chunked or lying sender: stop reading at the cap
            raise _Reject(413, f"body exceeds the {cap}-byte limit")
    return bytes(buf)


def _field_errors(e: ValidationError, limit: int = 20) -> list[dict[str, str]]:
    # bounded: a body of 500 bad events must not make a 500-entry answer
    return [
        {"field": ".".join(str(p) for p in err["loc"])[:200] or "(body)", "message": err["msg"][:300]}
        for err in e.errors(include_url=False)[:limit]
    ]


def _header(request: Request, name: str) -> str:
    # Starlette decodes header bytes as latin-1: a non-ASCII byte shows up as a char above 0x7f.
    raw = request.headers.get(name)
    if not raw:
        raise _Reject(401, f"unsigned request: {ID_HEADER}, {TIMESTAMP_HEADER} and {SIGNATURE_HEADER} are required")
    if len(raw) > 1024 or not raw.isascii() or not raw.isprintable():
        raise _Reject(400, f"{name} header must be printable ASCII of at most 1024 characters")
    return raw.strip()


def _signatures(value: str) -> list[bytes]:
    """The v1 digests of a webhook-signature header; other versions are ignored, as the spec says."""
    entries = value.split()
    if len(entries) > _MAX_SIGNATURES:
        raise _Reject(400, f"{SIGNATURE_HEADER} has {len(entries)} entries, at most {_MAX_SIGNATURES}")
    out = []
    for entry in entries:
        version, _, b64 = entry.partition(",")
        if version != "v1":
            continue
        try:
            digest = base64.b64decode(b64, validate=True)
        except (binascii.Error, ValueError):
            raise _Reject(400, f"{SIGNATURE_HEADER}: 'v1,' must be followed by base64") from None
        if len(digest) != hashlib.sha256().digest_size:
            raise _Reject(400, f"{SIGNATURE_HEADER}: a v1 signature is 32 bytes, got {len(digest)}")
        out.append(digest)
    if not out:
        raise _Reject(401, f"{SIGNATURE_HEADER} has no 'v1,<base64>' signature")
    return out


def _check_node_events(sender: Sender, model: NodeEvents, have: int) -> None:
    """The sender's allow-list and the seq bound; a refusal is about the content (422: the forwarder
    sets the event aside on the node and goes on with the rest)."""
    for e in model.events:
        if e.event not in sender.events:
            raise _Reject(422, f"invalid node-events payload: seq {e.seq}: event {e.event!r} is not on sender "
                               f"{sender.id!r}'s allow-list ({', '.join(sorted(sender.events))})")
    prev = have
    for e in model.events:  # a counter pushed to the top would have every later event skipped
        if e.seq > prev + MAX_SEQ_JUMP:
            raise _Reject(422, f"invalid node-events payload: seq {e.seq} jumps more than {MAX_SEQ_JUMP} past "
                               f"{prev} (node {model.node_id!r}: the highest seq the gateway has is {have})")
        prev = max(prev, e.seq)


@dataclass(frozen=True)
class _Admitted:
    """A request that passed every check and holds its webhook-id in the replay store."""

    sender: Sender
    kind: HookKind
    kind_name: str
    msg_id: str
    model: _NodeHook
    verdict: str  # the replay store's answer: "ok", or "replayed" for a fan-out kind


class _Gateway:
    """The gateway's handlers over one state: replay store, quota, stats and the batch flusher's wake-up."""

    def __init__(self, config: GatewayConfig, emitter: Emitter | None) -> None:
        self.config = config
        self.emit = emitter or PrefectEmitter()
        self.clock = config.clock
        self.state = GatewayState(config.state_dir / "gateway.sqlite", config.replay_capacity, self.clock)
        self.quota = RateQuota(config.rate_per_s, config.rate_burst, self.clock)
        self.stats = config.stats
        self.stats.update({k: self.stats.get(k, 0) for k in ("accepted", "rejected", "queued", "batches",
                                                              "batch_errors", "node_events", "node_events_skipped")})
        self.wake = asyncio.Event()
        self.node_locks: dict[str, asyncio.Lock] = {}

    # ---- verification: route, signature, clock, binding, quota ----

    def _route(self, sender_id: str, kind_name: str) -> tuple[Sender, HookKind]:
        kind = HOOKS.get(kind_name)
        if kind is None:
            raise _Reject(404, f"unknown hook kind {kind_name!r}", {"kinds": sorted(HOOKS)})
        sender = self.config.senders.get(sender_id)
        if sender is None:
            raise _Reject(401, f"unknown sender {sender_id[:64]!r}")
        return sender, kind

    async def _signed_body(self, request: Request, sender: Sender) -> tuple[str, int, bytes]:
        """The webhook-id, timestamp and body of a request one of the sender's keys signed."""
        msg_id, ts, sig = (_header(request, h) for h in (ID_HEADER, TIMESTAMP_HEADER, SIGNATURE_HEADER))
        if not _MSG_ID.match(msg_id):
            raise _Reject(400, f"{ID_HEADER} must be 1-256 visible ASCII characters")
        if not _SECONDS.match(ts):
            raise _Reject(400, f"{TIMESTAMP_HEADER} must be integer unix seconds, got {ts[:40]!r}")
        given = _signatures(sig)
        body = await _read_capped(request, self.config.max_body_bytes)
        expected = [digest(k, msg_id, ts, body) for k in sender.keys]
        if not any(hmac.compare_digest(e, g) for e in expected for g in given):
            raise _Reject(401, f"bad signature for sender {sender.id!r}: expected v1 HMAC-SHA256 of "
                               "webhook-id + '.' + webhook-timestamp + '.' + body with one of its keys")
        return msg_id, int(ts), body

    def _check_fresh(self, sent: int) -> None:
        tolerance = self.config.tolerance_s
        skew = self.clock() - sent
        if abs(skew) > tolerance:
            raise _Reject(401, f"stale request: timestamp is {skew:+.0f} s from now, tolerance {tolerance:.0f} s")

    def _spend_quota(self, sender: Sender) -> None:
        # Only a signed request spends the sender's quota: nobody else can exhaust it.
        wait = self.quota.take(sender.id)
        if wait:
            raise _Reject(429, f"sender {sender.id!r} is over its rate of {self.config.rate_per_s:g} requests/s; "
                               f"retry in {wait:.1f} s", retry_after_s=wait)

    async def verify(self, request: Request, sender_id: str, kind_name: str) -> tuple[Sender, HookKind, str, int, bytes]:
        sender, kind = self._route(sender_id, kind_name)
        msg_id, sent, body = await self._signed_body(request, sender)
        self._check_fresh(sent)
        if kind_name not in sender.hooks:
            raise _Reject(403, f"sender {sender.id!r} may not send {kind_name!r} (allowed: {sorted(sender.hooks)})")
        self._spend_quota(sender)
        return sender, kind, msg_id, sent, body

    # ---- admission: payload, node binding, replay store ----

    @staticmethod
    def _payload(kind: HookKind, kind_name: str, body: bytes) -> _NodeHook:
        doc = _parse_json(body)
        if not isinstance(doc, dict):
            raise _Reject(422, "body must be a JSON object")
        try:
            return kind.schema.model_validate(doc)
        except ValidationError as e:
            errs = _field_errors(e)  # the first in the error line too: the node keeps it with what it set aside
            raise _Reject(422, f"invalid {kind_name} payload: {errs[0]['field']}: {errs[0]['message']}"[:400],
                          errs) from None

    def _reserve(self, sender: Sender, kind: HookKind, msg_id: str, sent: int, model: _NodeHook) -> str:
        # An id stays refused while its timestamp would still be accepted.
        config = self.config
        expires = max(sent, self.clock()) + config.tolerance_s + 1
        landed = None
        if kind.coalesced and isinstance(model, BundleUploaded):
            landed = Pending(model.object_key, model.node_id, model.bundle_id, sender.id)
        verdict = self.state.reserve(sender.id, msg_id, expires, landed)
        if verdict == "replayed" and not kind.fan_out:  # node events: deduplicated by (node, seq) below
            raise _Reject(409, f"replayed request: webhook-id {msg_id[:64]!r} was already accepted")
        if verdict == "full":
            raise _Reject(429, f"sender {sender.id!r} has {config.replay_capacity} live webhook-ids, its share "
                               "of the replay store; retry later", retry_after_s=config.tolerance_s / 10)
        return verdict

    async def admit(self, request: Request, sender_id: str, kind_name: str) -> _Admitted:
        sender, kind, msg_id, sent, body = await self.verify(request, sender_id, kind_name)
        model = self._payload(kind, kind_name, body)
        node_id = model.node_id
        if not sender.may_speak_for(node_id):
            raise _Reject(403, f"sender {sender.id!r} may not speak for node {node_id!r} "
                               f"(allowed: {', '.join(sender.nodes)})")
        if isinstance(model, NodeEvents):
            _check_node_events(sender, model, self.state.node_seq(node_id))
        verdict = self._reserve(sender, kind, msg_id, sent, model)
        return _Admitted(sender, kind, kind_name, msg_id, model, verdict)

    # ---- POST /hooks/{sender}/{kind} ----

    async def handle(self, request: Request) -> JSONResponse:
        kind_name, sender_id = request.path_params["kind"], request.path_params["sender"]
        try:
            a = await self.admit(request, sender_id, kind_name)
        except _Reject as r:
            self.stats["rejected"] += 1
            log.info("rejected %s/%s: %d %s", sender_id[:64], kind_name[:64], r.status, r.error)
            return r.response()
        except Exception as e:  # one line, never a traceback per request to an unauthenticated caller
            self.stats["rejected"] += 1
            log.error("request %s/%s failed: %s: %s", sender_id[:64], kind_name[:64], type(e).__name__, str(e)[:200])
            return JSONResponse({"error": "internal error"}, status_code=500)

        if a.kind.coalesced:
            self.stats["accepted"] += 1
            self.stats["queued"] += 1
            self.wake.set()
            return JSONResponse({"event": a.kind.event, "queued": True, "webhook_id": a.msg_id}, status_code=202)
        if a.kind.fan_out and isinstance(a.model, NodeEvents):
            try:
                return await self.forward_node_events(a.sender, a.msg_id, a.model, replayed=a.verdict == "replayed")
            except Exception as e:  # as above: one line and a 500, which the fuzz tests say never happens
                self.stats["rejected"] += 1
                log.error("node events %s failed: %s: %s", a.sender.id, type(e).__name__, str(e)[:200])
                return JSONResponse({"error": "internal error"}, status_code=500)
        return await self._emit_one(a)

    async def _emit_one(self, a: _Admitted) -> JSONResponse:
        sender, kind = a.sender, a.kind
        # Same sender and id -> same event id, so even a replay that outlived the store dedups.
        event_id = uuid.uuid5(uuid.NAMESPACE_URL, f"edgehaul-gateway:{sender.id}:{a.msg_id}")
        payload = {**a.model.model_dump(mode="json"), "source": "gateway", "hook": a.kind_name, "sender": sender.id}
        try:
            await self.emit(kind.event, {**kind.resource(a.model), "edgehaul.sender.id": sender.id}, payload, event_id)
        except Exception as e:
            self.state.release(sender.id, a.msg_id)  # not accepted: the sender may retry the same request
            self.stats["rejected"] += 1
            log.warning("event %s not emitted: %s", kind.event, e)
            return _Reject(503, "event could not be delivered to Prefect; retry").response()
        self.stats["accepted"] += 1
        log.info("accepted %s/%s -> %s %s", sender.id, a.kind_name, kind.event, event_id)
        return JSONResponse({"event": kind.event, "event_id": str(event_id)}, status_code=202)

    # ---- node events: fan-out, once per (node, seq) ----

    async def forward_node_events(self, sender: Sender, msg_id: str, model: NodeEvents, *,
                                  replayed: bool) -> JSONResponse:
        """Re-emit a node's outbox batch in seq order, each seq once; the high-water mark advances
        after each event Prefect acknowledged, so a batch cut off midway resumes where it stopped."""
        node = model.node_id
        async with self.node_locks.setdefault(node, asyncio.Lock()):  # two batches of one node: one at a time
            return await self._forward_locked(sender, msg_id, model, replayed=replayed)

    def _node_event(self, sender: Sender, node: str, ev: NodeEvent, now: float) -> tuple[dict[str, str], dict[str, Any]]:
        """The resource and payload of one forwarded node event."""
        age = max(0.0, now - ev.occurred.timestamp())
        stale = age > self.config.stale_after_s
        resource = {"prefect.resource.id": f"edgehaul.node.{node}", "edgehaul.node.id": node,
                    "edgehaul.node": node, "edgehaul.sender.id": sender.id, "edgehaul.forwarded": "true",
                    "edgehaul.stale": "true" if stale else "false", **events.alert_labels(ev.payload)}
        payload = {**ev.payload, "seq": ev.seq, "age_s": round(age, 3), "stale": stale, "sender": sender.id}
        return resource, payload

    async def _forward_locked(self, sender: Sender, msg_id: str, model: NodeEvents, *, replayed: bool) -> JSONResponse:
        node = model.node_id
        have = self.state.node_seq(node)
        emitted = skipped = 0
        now = self.clock()
        for ev in model.events:
            if ev.seq <= have:
                skipped += 1
                continue
            resource, payload = self._node_event(sender, node, ev, now)
            event_id = uuid.uuid5(uuid.NAMESPACE_URL, f"edgehaul-node-event:{node}:{ev.seq}")
            try:
                await self.emit(ev.event, resource, payload, event_id, ev.occurred)
            except Exception as e:
                if not replayed:
                    self.state.release(sender.id, msg_id)  # the node retries; done seqs are skipped then
                self.stats["node_events"] += emitted
                log.warning("node %s: %d events emitted, stopped at seq %d: %s", node, emitted, ev.seq, e)
                return _Reject(503, f"event seq {ev.seq} could not be delivered to Prefect; retry").response()
            self.state.advance_node_seq(node, ev.seq)
            emitted += 1
        self.stats["accepted"] += 1
        self.stats["node_events"] += emitted
        self.stats["node_events_skipped"] += skipped
        log.info("node %s: %d events emitted, %d already had (seq <= %d)", node, emitted, skipped, have)
        return JSONResponse({"node_id": node, "emitted": emitted, "skipped": skipped,
                             "seq": self.state.node_seq(node)}, status_code=202)

    # ---- landed bundles: coalesced batches ----

    def _batch_due(self, force: bool) -> bool:
        n, oldest, claimed = self.state.pending()
        return claimed or n >= self.config.batch_max or (
            n > 0 and oldest is not None and (force or self.clock() - oldest >= self.config.batch_window_s))

    async def flush(self, force: bool = False) -> int:
        """Send due batches; the number sent. A batch is due at batch_max keys or when its oldest
        hook has waited batch_window_s; an unsent claimed batch is always due."""
        sent = 0
        while self._batch_due(force):
            got = self.state.claim_batch(self.config.batch_max)
            if got is None:
                return sent
            batch, rows = got
            resource, payload = events.landing_batch(
                batch, "gateway", [(r.object_key, r.node_id, r.bundle_id) for r in rows],
                senders=sorted({r.sender for r in rows}))
            await self.emit(events.LANDING_BATCH, resource, payload, uuid.UUID(batch))
            self.state.finish_batch(batch)
            self.stats["batches"] += 1
            sent += 1
            log.info("batch %s: %d bundles from %d nodes", batch[:8], len(rows), len(payload["nodes"]))
        return sent

    async def flusher(self) -> None:
        backoff = 0.0
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), timeout=max(backoff, min(0.5, self.config.batch_window_s / 4)))
            self.wake.clear()
            try:
                await self.flush()
                backoff = 0.0
            except Exception as e:  # kept queued (and claimed): re-sent with the same id
                self.stats["batch_errors"] += 1
                backoff = min(max(2 * backoff, 1.0), 30.0)
                log.warning("batch not emitted, retry in %.0f s: %s", backoff, e)

    # ---- POST /alerts, GET /healthz, lifespan ----

    async def alerts(self, request: Request) -> JSONResponse:
        # Sink for the alert automations' webhook notifications (local stack): one JSON line per alert
        # in config.alert_log, so operators and `make verify` can see what fired without a pager.
        config = self.config
        if not config.alert_log or not config.alerts_secret:
            return JSONResponse({"error": "no alert log or gateway secret configured"}, status_code=404)
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode("latin-1"), f"Bearer {alert_token(config.alerts_secret)}".encode()):
            return JSONResponse({"error": "bad or missing bearer token"}, status_code=401)
        try:
            doc = _parse_json(await _read_capped(request, config.max_body_bytes))
        except _Reject as r:
            return r.response()
        line = json.dumps({"received": self.clock(), **(doc if isinstance(doc, dict) else {"body": doc})})
        with open(config.alert_log, "a") as f:
            f.write(line + "\n")
        log.warning("alert: %s", str(doc.get("subject", "")) if isinstance(doc, dict) else "")
        return JSONResponse({"ok": True}, status_code=202)

    async def health(self, _: Request) -> JSONResponse:
        n, _oldest, _claimed = self.state.pending()
        return JSONResponse({"ok": True, "kinds": sorted(HOOKS), "senders": len(self.config.senders),
                             "replay_entries": self.state.replay_entries(), "pending": n, **self.stats})

    @contextlib.asynccontextmanager
    async def lifespan(self, _: Starlette) -> AsyncIterator[None]:
        task = asyncio.create_task(self.flusher())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            with contextlib.suppress(Exception):  # best effort: what is left stays queued on disk
                await asyncio.wait_for(self.flush(force=True), timeout=10)
            if isinstance(self.emit, PrefectEmitter):
                await self.emit.close()
            self.state.close()


def create_app(config: GatewayConfig, emitter: Emitter | None = None) -> Starlette:
    gw = _Gateway(config, emitter)
    return Starlette(
        routes=[
            Route("/hooks/{sender}/{kind}", gw.handle, methods=["POST"]),
            Route("/alerts", gw.alerts, methods=["POST"]),
            Route("/healthz", gw.health, methods=["GET"]),
        ],
        lifespan=gw.lifespan,
    )


SECRET_FILE = "gateway-secret"  # in the gateway's state dir, 0600: never a Prefect block (any API client reads those)


def secret_path(state_dir: Path | None = None) -> Path:
    return (state_dir or get_settings().gateway_state_dir) / SECRET_FILE


def load_secret(state_dir: Path | None = None) -> str:
    """The gateway's own secret (the /alerts token is derived from it): EDGEHAUL_GATEWAY_SECRET, else the
    0600 file `gateway-secret` in the gateway's state dir (EDGEHAUL_GATEWAY_STATE_DIR, or `state_dir`)."""
    settings = get_settings()
    if settings.gateway_secret:
        return settings.gateway_secret.get_secret_value()
    path = secret_path(state_dir)
    try:
        st = path.stat()
        value = path.read_text().strip()
    except OSError as e:
        raise RuntimeError(f"gateway secret: {path}: cannot read ({e.strerror}); run the gateway with "
                           f"--create-secret or set {SECRET_ENV}") from None
    if st.st_mode & 0o077:
        raise RuntimeError(f"gateway secret: {path}: mode {stat.S_IMODE(st.st_mode):04o} lets group/other read "
                           f"or write it; make it 0600")
    if not value:
        raise RuntimeError(f"gateway secret: {path} is empty")
    return value


def ensure_secret_file(state_dir: Path | None = None) -> Path:
    """Create the secret file (random value, 0600 from its first byte) if it does not exist; return its path."""
    import secrets as _secrets

    path = secret_path(state_dir)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path
    with os.fdopen(fd, "w") as f:
        f.write(_secrets.token_urlsafe(32))
    return path


def write_senders(path: Path, senders: dict[str, dict[str, Any]]) -> None:
    """Write a senders file (mode 0600, atomically), validating it first."""
    doc = {"senders": senders}
    parse_senders(doc)
    write_private(path, json.dumps(doc, indent=2))


def main(argv: list[str] | None = None) -> int:
    settings = get_settings()
    ap = argparse.ArgumentParser(prog="edgehaul gateway", description=__doc__.split("\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=settings.gateway_port, help="default: EDGEHAUL_GATEWAY_PORT")
    ap.add_argument("--max-body", type=int, default=64 * 1024, help="largest accepted body in bytes")
    ap.add_argument("--tolerance", type=float, default=300.0, help="allowed clock skew / replay window, seconds")
    ap.add_argument("--replay-capacity", type=int, default=10_000, help="replay-store entries per sender")
    ap.add_argument("--rate", type=float, default=20.0, help="signed requests per second per sender")
    ap.add_argument("--burst", type=float, default=200.0, help="requests per sender at once")
    ap.add_argument("--alert-log", default=str(settings.alert_log),
                    help="where POST /alerts appends alert notifications (JSON lines; default: EDGEHAUL_ALERT_LOG)")
    ap.add_argument("--create-secret", action="store_true",
                    help="create the secret file in the state dir (random value, 0600) if missing")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    import uvicorn

    if args.create_secret and not settings.gateway_secret:
        ensure_secret_file(settings.gateway_state_dir)
    if settings.gateway_senders is None:
        log.warning("no senders registry (%s): every hook is refused", SENDERS_ENV)
    try:
        registry = SenderRegistry(settings.gateway_senders)
    except (OSError, ValueError) as e:
        log.error("gateway not started: %s: %s", SENDERS_ENV, e)
        return 2
    config = GatewayConfig(
        registry, settings.gateway_state_dir, load_secret(), args.max_body, args.tolerance, args.replay_capacity,
        settings.gateway_batch_window_s, settings.gateway_batch_max, args.alert_log,
        rate_per_s=args.rate, rate_burst=args.burst)
    app = create_app(config)
    log.info("gateway on http://%s:%d/hooks/<sender>/{%s}, %d senders, state in %s",
             args.host, args.port, ",".join(sorted(HOOKS)), len(registry), settings.gateway_state_dir)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
