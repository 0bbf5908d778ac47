"""Webhook gateway: signed HTTP requests from outside systems become Prefect events.

Open-source Prefect has no inbound webhooks (its events endpoint takes only full Prefect event
objects from authenticated clients), so ground stations and edge nodes that do not run Prefect post
here instead. This is the one entry to the product that is not authenticated by Prefect itself:
every request must carry

    X-Edgehaul-Timestamp: <unix seconds>
    X-Edgehaul-Signature: sha256=<hex HMAC-SHA256 of  timestamp + "." + raw body>

with a secret shared through a Prefect `Secret` block (`EDGEHAUL_GATEWAY_SECRET_BLOCK`, default
`edgehaul-gateway-hmac`; `EDGEHAUL_GATEWAY_SECRET` overrides it for tests and one-off runs).

`POST /alerts` (bearer token derived from the same secret, `alert_token`) is the local receiver
of the alert automations' webhook notifications: it appends them to `alerts.jsonl`.

Answers: 202 accepted (event emitted, id in the body); 401 unsigned, badly signed or stale;
404 unknown kind; 409 replayed; 413 body over the cap (enforced while reading); 422 malformed or
schema-invalid (field errors listed); 429 replay store full; 503 Prefect unreachable (safe to retry:
the request is not remembered as seen). Nothing is emitted unless the answer is 202.

    python -m edgehaul.platform.gateway --port 8787
    curl -X POST localhost:8787/hooks/bundle-uploaded -H "X-Edgehaul-Timestamp: $ts" \\
         -H "X-Edgehaul-Signature: sha256=$sig" -d @body.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import os
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from edgehaul import events

log = logging.getLogger("edgehaul.platform.gateway")

TIMESTAMP_HEADER = "x-edgehaul-timestamp"
SIGNATURE_HEADER = "x-edgehaul-signature"
SECRET_ENV = "EDGEHAUL_GATEWAY_SECRET"
SECRET_BLOCK_ENV = "EDGEHAUL_GATEWAY_SECRET_BLOCK"
DEFAULT_SECRET_BLOCK = "edgehaul-gateway-hmac"
DEFAULT_PORT = 8787

_NAME = r"^[a-z0-9][a-z0-9._-]{0,62}$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", str_strip_whitespace=True)


class ContactWindowOpened(_Strict):
    """A ground station reports that a contact window with an edge node has opened."""

    station_id: str = Field(pattern=_NAME)
    node_id: str = Field(pattern=_NAME)
    window_start: AwareDatetime
    window_end: AwareDatetime
    bandwidth_bps: float | None = Field(default=None, gt=0, le=1e12)

    @model_validator(mode="after")
    def _window_order(self) -> ContactWindowOpened:
        if self.window_end <= self.window_start:
            raise ValueError("window_end must be after window_start")
        return self


class BundleUploaded(_Strict):
    """An edge node reports a bundle (Parquet + manifest) complete in the landing zone."""

    node_id: str = Field(pattern=_NAME)
    bundle_id: str = Field(pattern=_NAME)
    object_key: str = Field(min_length=1, max_length=1024, pattern=r"^[^/].*\.parquet$")
    manifest_key: str = Field(min_length=1, max_length=1024, pattern=r"^[^/].*\.manifest\.json$")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    row_count: int = Field(ge=0, le=10_000_000)
    contract: str = Field(pattern=r"^[a-z0-9_]+\.v[0-9]+$")
    tier: Literal["high", "normal"] = "normal"
    nbytes: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _key_matches_node(self) -> BundleUploaded:
        # A node may only announce bundles under its own landing prefix.
        if not self.object_key.startswith(f"{self.node_id}/"):
            raise ValueError(f"object_key must start with '{self.node_id}/'")
        return self


@dataclass(frozen=True)
class HookKind:
    schema: type[_Strict]
    event: str
    resource: Callable[[Any], dict[str, str]]


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
        events.BUNDLE_LANDED,
        lambda m: {
            "prefect.resource.id": f"edgehaul.bundle.{m.bundle_id}",
            "edgehaul.node.id": m.node_id,
        },
    ),
}


def sign(secret: str | bytes, timestamp: str, body: bytes) -> str:
    """The signature header value for `body` sent at `timestamp` (what a sender computes)."""
    key = secret.encode() if isinstance(secret, str) else secret
    mac = hmac.new(key, timestamp.encode() + b"." + body, hashlib.sha256)
    return "sha256=" + mac.hexdigest()


def signed_headers(secret: str | bytes, body: bytes, now: float | None = None) -> dict[str, str]:
    ts = str(int(time.time() if now is None else now))
    return {
        "content-type": "application/json",
        TIMESTAMP_HEADER: ts,
        SIGNATURE_HEADER: sign(secret, ts, body),
    }


class ReplayGuard:
    """Signatures accepted within the tolerance window, bounded in size.

    A stale timestamp is rejected anyway, so an entry only needs to live as long as the window;
    when the store is full of live entries we refuse (429) rather than forget one early, since
    forgetting would let that request be replayed.
    """

    def __init__(self, window_s: float, capacity: int) -> None:
        self.window_s = window_s
        self.capacity = capacity
        self._seen: OrderedDict[str, float] = OrderedDict()  # signature -> expiry (monotonic)

    def __len__(self) -> int:
        return len(self._seen)

    def _prune(self, now: float) -> None:
        while self._seen:
            sig, expiry = next(iter(self._seen.items()))
            if expiry > now:
                break
            del self._seen[sig]

    def reserve(self, signature: str) -> Literal["ok", "replayed", "full"]:
        """Record `signature`; no await between check and insert, so concurrent duplicates lose."""
        now = time.monotonic()
        self._prune(now)
        if signature in self._seen:
            return "replayed"
        if len(self._seen) >= self.capacity:
            return "full"
        # Entries keep insertion order = expiry order, since the window is constant.
        self._seen[signature] = now + 2 * self.window_s  # timestamps may be up to window_s in the future
        return "ok"

    def release(self, signature: str) -> None:
        self._seen.pop(signature, None)


Emitter = Callable[[str, dict[str, str], dict[str, Any], uuid.UUID], Awaitable[None]]


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

    async def __call__(self, name: str, resource: dict[str, str], payload: dict[str, Any], event_id: uuid.UUID) -> None:
        from prefect.events import Event

        ev = Event(event=name, resource=resource, payload=payload, id=event_id)  # type: ignore[arg-type]
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
    secret: str
    max_body_bytes: int = 64 * 1024
    tolerance_s: float = 300.0
    replay_capacity: int = 10_000
    alert_log: str | None = None


def alert_token(secret: str) -> str:
    """Bearer token the alert notification block sends to /alerts (derived, so one secret to manage)."""
    return hmac.new(secret.encode(), b"edgehaul-alerts", hashlib.sha256).hexdigest()


class _Reject(Exception):
    def __init__(self, status: int, error: str, detail: Any = None) -> None:
        super().__init__(error)
        self.status, self.error, self.detail = status, error, detail

    def response(self) -> JSONResponse:
        body: dict[str, Any] = {"error": self.error}
        if self.detail is not None:
            body["detail"] = self.detail
        return JSONResponse(body, status_code=self.status)


async def _read_capped(request: Request, cap: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            n = int(declared)
        except ValueError:
            raise _Reject(400, "invalid Content-Length header") from None
        if n > cap:
            raise _Reject(413, f"body of {n} bytes exceeds the {cap}-byte limit")
    buf = bytearray()
    async for chunk in request.stream():
        buf += chunk
        if len(buf) > cap:  # chunked or lying sender: stop reading at the cap
            raise _Reject(413, f"body exceeds the {cap}-byte limit")
    return bytes(buf)


def _field_errors(e: ValidationError) -> list[dict[str, str]]:
    return [
        {"field": ".".join(str(p) for p in err["loc"]) or "(body)", "message": err["msg"]}
        for err in e.errors(include_url=False)
    ]


def create_app(config: GatewayConfig, emitter: Emitter | None = None) -> Starlette:
    if not config.secret:
        raise ValueError("gateway secret is empty; set the Secret block or EDGEHAUL_GATEWAY_SECRET")
    emit = emitter or PrefectEmitter()
    guard = ReplayGuard(config.tolerance_s, config.replay_capacity)
    key = config.secret.encode()
    stats = {"accepted": 0, "rejected": 0}

    async def handle(request: Request) -> JSONResponse:
        kind_name = request.path_params["kind"]
        try:
            kind = HOOKS.get(kind_name)
            if kind is None:
                raise _Reject(404, f"unknown hook kind {kind_name!r}", {"kinds": sorted(HOOKS)})
            ts = request.headers.get(TIMESTAMP_HEADER)
            sig = request.headers.get(SIGNATURE_HEADER)
            if not ts or not sig:
                raise _Reject(401, f"unsigned request: {TIMESTAMP_HEADER} and {SIGNATURE_HEADER} headers are required")
            body = await _read_capped(request, config.max_body_bytes)
            expected = sign(key, ts, body)
            if not hmac.compare_digest(expected, sig.strip()):
                raise _Reject(401, "bad signature: expected sha256=HMAC-SHA256(secret, timestamp + '.' + body)")
            try:
                sent = float(ts)
            except ValueError:
                raise _Reject(401, f"{TIMESTAMP_HEADER} must be unix seconds, got {ts[:40]!r}") from None
            skew = time.time() - sent
            if abs(skew) > config.tolerance_s:
                raise _Reject(
                    401, f"stale request: timestamp is {skew:+.0f} s from now, tolerance {config.tolerance_s:.0f} s"
                )
            try:
                doc = json.loads(body)
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise _Reject(422, f"body is not JSON: {e}") from None
            if not isinstance(doc, dict):
                raise _Reject(422, "body must be a JSON object")
            try:
                model = kind.schema.model_validate(doc)
            except ValidationError as e:
                raise _Reject(422, f"invalid {kind_name} payload", _field_errors(e)) from None
            verdict = guard.reserve(sig.strip())
            if verdict == "replayed":
                raise _Reject(409, "replayed request: this signature was already accepted")
            if verdict == "full":
                raise _Reject(429, "replay store full; retry later")
        except _Reject as r:
            stats["rejected"] += 1
            log.info("rejected %s: %d %s", kind_name, r.status, r.error)
            return r.response()

        # Same signed request -> same event id, so even a replay that outlived the store dedups.
        event_id = uuid.uuid5(uuid.NAMESPACE_URL, f"edgehaul-gateway:{sig.strip()}")
        payload = {**model.model_dump(mode="json"), "source": "gateway", "hook": kind_name}
        try:
            await emit(kind.event, kind.resource(model), payload, event_id)
        except Exception as e:
            guard.release(sig.strip())  # not accepted: the sender may retry the same request
            stats["rejected"] += 1
            log.warning("event %s not emitted: %s", kind.event, e)
            return _Reject(503, "event could not be delivered to Prefect; retry").response()
        stats["accepted"] += 1
        log.info("accepted %s -> %s %s", kind_name, kind.event, event_id)
        return JSONResponse({"event": kind.event, "event_id": str(event_id)}, status_code=202)

    async def alerts(request: Request) -> JSONResponse:
        # Sink for the alert automations' webhook notifications (local stack): one JSON line per alert
        # in config.alert_log, so operators and `make verify` can see what fired without a pager.
        if not config.alert_log:
            return JSONResponse({"error": "no alert log configured"}, status_code=404)
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {alert_token(config.secret)}".encode()):
            return JSONResponse({"error": "bad or missing bearer token"}, status_code=401)
        try:
            doc = json.loads(await _read_capped(request, config.max_body_bytes))
        except _Reject as r:
            return r.response()
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            return JSONResponse({"error": f"body is not JSON: {e}"}, status_code=422)
        line = json.dumps({"received": time.time(), **(doc if isinstance(doc, dict) else {"body": doc})})
        with open(config.alert_log, "a") as f:
            f.write(line + "\n")
        log.warning("alert: %s", str(doc.get("subject", "")) if isinstance(doc, dict) else "")
        return JSONResponse({"ok": True}, status_code=202)

    async def health(_: Request) -> JSONResponse:
        return JSONResponse({"ok": True, "kinds": sorted(HOOKS), "replay_entries": len(guard), **stats})

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        yield
        if isinstance(emit, PrefectEmitter):
            await emit.close()

    return Starlette(
        routes=[
            Route("/hooks/{kind}", handle, methods=["POST"]),
            Route("/alerts", alerts, methods=["POST"]),
            Route("/healthz", health, methods=["GET"]),
        ],
        lifespan=lifespan,
    )


def load_secret() -> str:
    """The HMAC secret: EDGEHAUL_GATEWAY_SECRET, else the Prefect Secret block named by
    EDGEHAUL_GATEWAY_SECRET_BLOCK (default `edgehaul-gateway-hmac`)."""
    env = os.environ.get(SECRET_ENV)
    if env:
        return env
    from prefect.blocks.system import Secret

    name = os.environ.get(SECRET_BLOCK_ENV, DEFAULT_SECRET_BLOCK)
    try:
        value = Secret.load(name).get()  # type: ignore[union-attr]
    except ValueError as e:
        raise RuntimeError(f"gateway secret: Secret block {name!r} not found ({e}); create it or set {SECRET_ENV}") from e
    if not isinstance(value, str) or not value:
        raise RuntimeError(f"gateway secret: Secret block {name!r} must hold a non-empty string")
    return value


def ensure_secret_block(name: str = DEFAULT_SECRET_BLOCK) -> str:
    """Create the Secret block with a random value if it does not exist; return its value."""
    import secrets as _secrets

    from prefect.blocks.system import Secret

    try:
        value = Secret.load(name).get()  # type: ignore[union-attr]
        if isinstance(value, str) and value:
            return value
    except ValueError:
        pass
    value = _secrets.token_urlsafe(32)
    Secret(value=SecretStr(value)).save(name, overwrite=True)
    return value


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="edgehaul gateway", description=__doc__.split("\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=int(os.environ.get("EDGEHAUL_GATEWAY_PORT", DEFAULT_PORT)))
    ap.add_argument("--max-body", type=int, default=64 * 1024, help="largest accepted body in bytes")
    ap.add_argument("--tolerance", type=float, default=300.0, help="allowed clock skew / replay window, seconds")
    ap.add_argument("--replay-capacity", type=int, default=10_000)
    ap.add_argument("--alert-log", default=os.environ.get("EDGEHAUL_ALERT_LOG", "alerts.jsonl"),
                    help="where POST /alerts appends alert notifications (JSON lines)")
    ap.add_argument("--create-secret", action="store_true", help="create the Secret block (random value) if missing")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    import uvicorn

    if args.create_secret and not os.environ.get(SECRET_ENV):
        ensure_secret_block(os.environ.get(SECRET_BLOCK_ENV, DEFAULT_SECRET_BLOCK))
    app = create_app(GatewayConfig(load_secret(), args.max_body, args.tolerance, args.replay_capacity, args.alert_log))
    log.info("gateway on http://%s:%d/hooks/{%s}", args.host, args.port, ",".join(sorted(HOOKS)))
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
