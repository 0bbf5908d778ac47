"""Webhook gateway: Standard Webhooks senders, each bound to its nodes; replays refused across restarts;
landed bundles leave as batches; signed requests reach Prefect and trigger flows, bad ones emit nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from standardwebhooks import Webhook
from starlette.testclient import TestClient

from edgehaul import events
from edgehaul.services.gateway import (
    HOOKS,
    GatewayConfig,
    SenderRegistry,
    alert_token,
    create_app,
    new_secret,
    sign,
    signed_headers,
    write_senders,
)
from edgehaul_dev import localstack
from tests.waiting import wait_for


class Recorder:
    """Stands in for the Prefect events client: records what the gateway emits, or fails like an
    unreachable server."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, str], dict[str, Any], uuid.UUID]] = []
        self.tried: list[uuid.UUID] = []
        self.fail = False

    async def __call__(self, name: str, resource: dict[str, str], payload: dict[str, Any], event_id: uuid.UUID,
                       occurred: datetime | None = None) -> None:
        self.tried.append(event_id)
        if self.fail:
            raise ConnectionError("Prefect unreachable")
        self.events.append((name, resource, payload, event_id))

    def batch_keys(self) -> list[str]:
        return [k for name, _, p, _ in self.events if name == events.LANDING_BATCH for k in p["bundle_keys"]]


def _gateway(tmp_path: Path, senders: dict[str, dict[str, Any]], emitter: Recorder, **kw: Any) -> TestClient:
    path = tmp_path / "senders.json"
    if not path.exists():
        write_senders(path, senders)
    return TestClient(create_app(GatewayConfig(SenderRegistry(path), tmp_path / "state", **kw), emitter))


def _contact(node: str, station: str = "gs-1") -> bytes:
    return json.dumps({"station_id": station, "node_id": node, "window_start": "2026-12-03T10:00:00Z",
                       "window_end": "2026-12-03T10:12:00Z", "bandwidth_bps": 2e6}).encode()


def _bundle(node: str, uid: str, **over: Any) -> dict[str, Any]:
    doc = {
        "node_id": node,
        "bundle_id": f"b-{uid}",
        "object_key": f"{node}/2026-12-03/b-{uid}.parquet",
        "manifest_key": f"{node}/2026-12-03/b-{uid}.manifest.json",
        "sha256": "ab" * 32,
        "row_count": 120,
        "contract": "landsat_patch.v1",
        "tier": "high",
    }
    return doc | over


@settings(max_examples=50, deadline=None)
@given(st.binary(max_size=300), st.integers(1, 2**33), st.text("abcdefghijklmnopqrstuvwxyz0123456789_", min_size=1,
                                                                 max_size=40))
def test_our_signature_is_the_standard_webhooks_one(body: bytes, ts: int, msg_id: str) -> None:
    key = new_secret()
    lib = Webhook(key).sign(msg_id, datetime.fromtimestamp(ts, UTC), body)
    assert sign(key, msg_id, str(ts), body) == lib and lib.startswith("v1,")
    assert sign(new_secret(), msg_id, str(ts), body) != lib
    Webhook(key).verify(body, signed_headers(key, body), json_parse=False)  # raises if it disagrees


def test_a_standard_webhooks_sender_is_accepted_for_its_nodes_and_hooks_only(tmp_path: Path) -> None:
    key, other = new_secret(), new_secret()
    rec = Recorder()
    senders = {"gs-1": {"keys": [key], "nodes": ["node-a", "edge-*"], "hooks": ["contact-window-opened"]},
               "gs-2": {"keys": [other], "nodes": ["*"], "hooks": sorted(HOOKS)}}
    wh = Webhook(key)

    def lib_headers(body: bytes, msg_id: str) -> dict[str, str]:
        now = datetime.now(UTC)
        return {"webhook-id": msg_id, "webhook-timestamp": str(int(now.timestamp())),
                "webhook-signature": wh.sign(msg_id, now, body), "content-type": "application/json"}

    url = "/hooks/gs-1/contact-window-opened"
    with _gateway(tmp_path, senders, rec) as gw:
        for i, node in enumerate(("node-a", "edge-17")):
            r = gw.post(url, content=_contact(node), headers=lib_headers(_contact(node), f"m{i}"))
            assert r.status_code == 202, r.text
        assert [(e[1]["edgehaul.node.id"], e[1]["edgehaul.sender.id"], e[2]["sender"]) for e in rec.events] == [
            ("node-a", "gs-1", "gs-1"), ("edge-17", "gs-1", "gs-1")]

        r = gw.post(url, content=_contact("node-b"), headers=lib_headers(_contact("node-b"), "m3"))
        assert r.status_code == 403 and r.json()["error"] == (
            "sender 'gs-1' may not speak for node 'node-b' (allowed: node-a, edge-*)")
        b = json.dumps(_bundle("node-a", "x1")).encode()
        r = gw.post("/hooks/gs-1/bundle-uploaded", content=b, headers=lib_headers(b, "m4"))
        assert r.status_code == 403 and "may not send 'bundle-uploaded'" in r.json()["error"]
        # gs-2's valid signature does not make a request gs-1's, nor does a sender that does not exist
        r = gw.post(url, content=_contact("node-a"), headers=signed_headers(other, _contact("node-a")))
        assert r.status_code == 401 and "bad signature for sender 'gs-1'" in r.json()["error"]
        r = gw.post(url.replace("gs-1", "gs-9"), content=_contact("node-a"), headers=signed_headers(key, _contact("node-a")))
        assert r.status_code == 401 and r.json()["error"] == "unknown sender 'gs-9'"
        assert len(rec.events) == 2  # nothing emitted for any refused request


def test_several_keys_at_once_and_rotation_without_restart(tmp_path: Path) -> None:
    old, new, stranger = new_secret(), new_secret(), new_secret()
    rec = Recorder()
    with _gateway(tmp_path, {"gs-1": {"keys": [old, new], "nodes": ["*"], "hooks": sorted(HOOKS)}}, rec) as gw:
        url = "/hooks/gs-1/contact-window-opened"
        body = _contact("node-a")
        for k in (old, new):
            assert gw.post(url, content=body, headers=signed_headers(k, body)).status_code == 202
        # a sender in the middle of rotation sends several signatures; unknown versions are ignored
        h = signed_headers(new, body)
        h["webhook-signature"] = " ".join([sign(stranger, h["webhook-id"], h["webhook-timestamp"], body),
                                           "v1a,c29tZXRoaW5nIGVsc2U=", h["webhook-signature"]])
        assert gw.post(url, content=body, headers=h).status_code == 202

        time.sleep(0.01)  # a distinct mtime for the rewrite
        write_senders(tmp_path / "senders.json", {"gs-1": {"keys": [new], "nodes": ["*"], "hooks": sorted(HOOKS)}})
        assert gw.post(url, content=body, headers=signed_headers(old, body)).status_code == 401
        assert gw.post(url, content=body, headers=signed_headers(new, body)).status_code == 202
        # a broken rewrite keeps the last good registry instead of locking every sender out
        (tmp_path / "senders.json").write_text("{not json")
        assert gw.post(url, content=body, headers=signed_headers(new, body)).status_code == 202
    assert len(rec.events) == 5


def test_replays_are_refused_across_a_restart_and_forgotten_after_the_window(tmp_path: Path) -> None:
    key = new_secret()
    senders = {"gs-1": {"keys": [key], "nodes": ["*"], "hooks": sorted(HOOKS)}}
    body = _contact("node-a")
    now = [1_800_000_000.0]  # the gateway's injected clock: the window passes without sleeping
    h = signed_headers(key, body, now=now[0])
    with _gateway(tmp_path, senders, Recorder(), tolerance_s=2, clock=lambda: now[0]) as gw:
        assert gw.post("/hooks/gs-1/contact-window-opened", content=body, headers=h).status_code == 202
        r = gw.post("/hooks/gs-1/contact-window-opened", content=body, headers=h)
        assert r.status_code == 409 and "already accepted" in r.json()["error"]
    rec = Recorder()
    with _gateway(tmp_path, senders, rec, tolerance_s=2, clock=lambda: now[0]) as gw:  # a new process, same state
        r = gw.post("/hooks/gs-1/contact-window-opened", content=body, headers=h)
        assert r.status_code == 409, r.text
        # the same id with a new signature (a new timestamp) is still the same message
        h2 = signed_headers(key, body, msg_id=h["webhook-id"], now=now[0] + 1)
        assert gw.post("/hooks/gs-1/contact-window-opened", content=body, headers=h2).status_code == 409
        now[0] += 3.5  # past timestamp + tolerance: the request is stale, its id no longer needed
        r = gw.post("/hooks/gs-1/contact-window-opened", content=body, headers=h)
        assert r.status_code == 401 and "stale" in r.json()["error"]
        r = gw.post("/hooks/gs-1/contact-window-opened", content=body, headers=signed_headers(key, body, now=now[0]))
        assert r.status_code == 202
        assert gw.get("/healthz").json()["replay_entries"] == 1  # the expired ones were pruned
    assert rec.events and all(e[0] == events.CONTACT_OPENED for e in rec.events)


@given(st.lists(st.tuples(st.sampled_from(["n1/d/a.parquet", "n1/d/b.parquet", "n2/d/c.parquet"]),
                          st.sampled_from(["n1", "n2"]), st.sampled_from(["a", "b", "c"])), min_size=1, max_size=30))
def test_a_batch_names_each_key_once_and_every_key_given(bundles: list[tuple[str, str, str]]) -> None:
    resource, payload = events.landing_batch("id-1", "gateway", bundles)
    assert sorted(payload["bundle_keys"]) == sorted({k for k, _, _ in bundles}) == sorted(set(payload["bundle_keys"]))
    assert payload["count"] == len(payload["bundle_keys"]) == len(payload["bundle_ids"])
    assert resource["prefect.resource.id"] == "edgehaul.landing.batch.id-1"
    assert ("edgehaul.node.id" in resource) == (len({n for _, n, _ in bundles}) == 1)


def test_landed_bundles_leave_as_bounded_batches_each_key_once(tmp_path: Path) -> None:
    key = new_secret()
    rec = Recorder()
    uid = uuid.uuid4().hex[:8]
    senders = {"node-a": {"keys": [key], "nodes": ["node-a"], "hooks": ["bundle-uploaded"]}}
    sent = []
    with _gateway(tmp_path, senders, rec, batch_window_s=60, batch_max=20) as gw:
        for i in range(50):
            doc = _bundle("node-a", f"{uid}-{i}")
            body = json.dumps(doc).encode()
            r = gw.post("/hooks/node-a/bundle-uploaded", content=body, headers=signed_headers(key, body))
            assert r.status_code == 202 and r.json()["queued"] is True
            sent.append(doc["object_key"])
        dup = json.dumps(_bundle("node-a", f"{uid}-49")).encode()  # re-announced under a new webhook-id
        assert gw.post("/hooks/node-a/bundle-uploaded", content=dup, headers=signed_headers(key, dup)).status_code == 202
        wait_for(lambda: len(rec.batch_keys()) >= 40, 10, "two full batches sent", interval=0.05)
        assert gw.get("/healthz").json()["pending"] == 11  # under batch_max, within the window: waiting
    # shutdown sends what is left
    assert [len(p["bundle_keys"]) for _, _, p, _ in rec.events] == [20, 20, 10]
    assert rec.batch_keys() == sent
    name, resource, payload, event_id = rec.events[0]
    assert name == events.LANDING_BATCH and resource["prefect.resource.id"] == f"edgehaul.landing.batch.{event_id}"
    assert resource["edgehaul.node.id"] == "node-a" and payload["senders"] == ["node-a"] and payload["count"] == 20


def test_queued_bundles_survive_an_unreachable_prefect_and_a_restart(tmp_path: Path) -> None:
    key = new_secret()
    senders = {"node-a": {"keys": [key], "nodes": ["node-a"], "hooks": ["bundle-uploaded"]}}
    down = Recorder()
    down.fail = True
    uid = uuid.uuid4().hex[:8]
    sent = []
    with _gateway(tmp_path, senders, down, batch_window_s=0.1, batch_max=10) as gw:
        for i in range(25):
            doc = _bundle("node-a", f"{uid}-{i}")
            body = json.dumps(doc).encode()
            r = gw.post("/hooks/node-a/bundle-uploaded", content=body, headers=signed_headers(key, body))
            assert r.status_code == 202
            sent.append(doc["object_key"])
        wait_for(lambda: gw.get("/healthz").json()["batch_errors"] >= 1, 10, "a failed batch send", interval=0.05)
        assert gw.get("/healthz").json()["pending"] == 25
    assert down.tried and not down.events
    up = Recorder()
    with _gateway(tmp_path, senders, up, batch_window_s=0.1, batch_max=10) as gw:
        wait_for(lambda: len(up.batch_keys()) >= 25, 10, "the queued bundles sent after the restart", interval=0.05)
        assert gw.get("/healthz").json()["pending"] == 0
    assert sorted(up.batch_keys()) == sorted(sent) and len(up.batch_keys()) == 25
    assert up.events[0][3] == down.tried[0]  # the claimed batch is re-sent under its id: Prefect can dedup it


def test_alert_sink_needs_its_token_and_appends_json_lines(tmp_path: Path) -> None:
    log = tmp_path / "alerts.jsonl"
    with _gateway(tmp_path, {}, Recorder(), alerts_secret="s3cret", alert_log=str(log)) as client:
        body = {"subject": "[edgehaul L2] spool-watermark", "body": '{"level": 2}'}
        assert client.post("/alerts", json=body).status_code == 401
        assert client.post("/alerts", json=body, headers={"authorization": "Bearer nope"}).status_code == 401
        assert client.post("/alerts", json=body, headers={"authorization": "Bearer é".encode()}).status_code == 401
        ok = client.post("/alerts", json=body, headers={"authorization": f"Bearer {alert_token('s3cret')}"})
        assert ok.status_code == 202
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(lines) == 1 and lines[0]["subject"] == body["subject"]


# ---- against the stack's gateway (real uvicorn process, real Prefect) ----------------------------


def _api_auth() -> tuple[str, str] | None:
    a = os.environ.get("PREFECT_API_AUTH_STRING")
    return tuple(a.split(":", 1)) if a else None  # type: ignore[return-value]


def _events_with_prefix(api_url: str, prefix: str, auth: tuple[str, str] | None = None) -> list[dict[str, Any]]:
    r = httpx.post(
        f"{api_url}/events/filter",
        json={"filter": {"resource": {"id_prefix": [prefix]}}, "limit": 50},
        auth=auth or _api_auth(),  # the session stack is closed: its string by default
        timeout=10,
    )
    r.raise_for_status()
    return r.json()["events"]


def _wait_events(api_url: str, prefix: str, n: int = 1, auth: tuple[str, str] | None = None) -> list[dict[str, Any]]:
    def found() -> list[dict[str, Any]]:
        got = _events_with_prefix(api_url, prefix, auth)
        return got if len(got) >= n else []

    return wait_for(found, 30, f"{n} events with resource prefix {prefix}", interval=0.5)


@pytest.fixture(scope="module")
def gateway(stack: localstack.StackState) -> Iterator[tuple[str, str, str]]:
    """The stack's gateway (real uvicorn process): its URL, the local sender and its key."""
    url = localstack.start_gateway(stack)
    sender, key = localstack.gateway_sender(stack)
    yield url, sender, key


@pytest.mark.integration
def test_each_bad_request_class_is_rejected_and_emits_nothing(stack: localstack.StackState,
                                                             gateway: tuple[str, str, str]) -> None:
    url, sender, key = gateway
    uid = uuid.uuid4().hex[:10]
    node = f"n{uid}"
    hook = f"{url}/hooks/{sender}/contact-window-opened"
    b = _contact(node)

    unsigned = httpx.post(hook, content=b, headers={"content-type": "application/json"}, timeout=60)
    assert unsigned.status_code == 401 and "unsigned" in unsigned.json()["error"]
    h = signed_headers(key, b)
    wrong = sign(new_secret(), h["webhook-id"], h["webhook-timestamp"], b)
    bad = httpx.post(hook, content=b, headers=h | {"webhook-signature": wrong}, timeout=60)
    assert bad.status_code == 401 and "bad signature" in bad.json()["error"]
    tampered = httpx.post(hook, content=b.replace(b"2000000", b"2000001"), headers=h, timeout=60)
    assert tampered.status_code == 401
    stale = httpx.post(hook, content=b, headers=signed_headers(key, b, now=time.time() - 3600), timeout=60)
    assert stale.status_code == 401 and "stale" in stale.json()["error"]

    big = json.dumps({"station_id": "gs-1", "padding": "x" * 70_000}).encode()
    assert httpx.post(hook, content=big, headers=signed_headers(key, big), timeout=60).status_code == 413

    def chunks() -> Iterator[bytes]:  # no Content-Length: the cap must hold while streaming
        for _ in range(100):
            yield b"x" * 4096

    streamed = httpx.post(hook, content=chunks(), headers=signed_headers(key, b"ignored"), timeout=60)
    assert streamed.status_code == 413

    notjson = b"{not json"
    r = httpx.post(hook, content=notjson, headers=signed_headers(key, notjson), timeout=60)
    assert r.status_code == 422 and "not JSON" in r.json()["error"]
    invalid = json.dumps({**json.loads(b), "bandwidth_bps": -1, "unexpected": 1}).encode()
    r = httpx.post(hook, content=invalid, headers=signed_headers(key, invalid), timeout=60)
    assert r.status_code == 422 and {e["field"] for e in r.json()["detail"]} == {"bandwidth_bps", "unexpected"}
    r = httpx.post(f"{url}/hooks/{sender}/no-such-kind", content=b, headers=signed_headers(key, b), timeout=60)
    assert r.status_code == 404 and set(r.json()["detail"]["kinds"]) == set(HOOKS)

    # One good request, then its replay; the good one's event proves the pipeline has caught up.
    ok = httpx.post(hook, content=b, headers=h, timeout=60)
    assert ok.status_code == 202, ok.text
    replay = httpx.post(hook, content=b, headers=h, timeout=60)
    assert replay.status_code == 409 and "replayed" in replay.json()["error"]

    _wait_events(stack.prefect_api_url, f"edgehaul.node.{node}")
    time.sleep(2)  # anything emitted before the good event would be persisted by now
    seen = _events_with_prefix(stack.prefect_api_url, f"edgehaul.node.{node}")
    assert len(seen) == 1 and seen[0]["id"] == ok.json()["event_id"]
    ev = seen[0]
    assert ev["event"] == events.CONTACT_OPENED and ev["resource"]["edgehaul.sender.id"] == sender
    assert ev["payload"]["bandwidth_bps"] == 2e6 and ev["resource"]["edgehaul.node.id"] == node
    assert httpx.get(f"{url}/healthz").json()["rejected"] >= 10


_TARGET = textwrap.dedent(
    """
    import json, os, sys
    from prefect import flow
    from prefect.events import DeploymentEventTrigger

    @flow(name="gateway-target-{uid}")
    def target(node: str, station: str, sender: str) -> None:
        with open(sys.argv[1], "w") as f:
            json.dump({{"node": node, "station": station, "sender": sender}}, f)

    if __name__ == "__main__":  # the runner re-imports this file in the flow-run process
        target.serve(
            name="on-contact",
            triggers=[DeploymentEventTrigger(
                expect={{"edgehaul.contact.opened"}},
                match={{"prefect.resource.id": "edgehaul.node.n{uid}"}},
                parameters={{"node": "{{{{ event.payload.node_id }}}}", "station": "{{{{ event.payload.station_id }}}}",
                            "sender": "{{{{ event.resource['edgehaul.sender.id'] }}}}"}},
            )],
        )
    """
)


@pytest.mark.integration
def test_signed_webhook_triggers_a_flow_run(stack: localstack.StackState, gateway: tuple[str, str, str],
                                           tmp_path: Path) -> None:
    from prefect.client.orchestration import get_client

    url, sender, key = gateway
    uid = uuid.uuid4().hex[:10]
    script = tmp_path / "target.py"
    script.write_text(_TARGET.format(uid=uid))
    marker = tmp_path / "ran.json"
    env = {**os.environ, "PREFECT_RUNNER_POLL_FREQUENCY": "1", "PREFECT_LOGGING_LEVEL": "WARNING"}
    log = open(tmp_path / "serve.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, str(script), str(marker)], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        def served() -> Any:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            with get_client(sync_client=True) as client:
                try:
                    dep = client.read_deployment_by_name(f"gateway-target-{uid}/on-contact")
                except Exception:
                    return None
                return client.read_resource_related_automations(f"prefect.deployment.{dep.id}") and dep

        dep = wait_for(served, 90, "the served deployment and its trigger", interval=0.5)

        body = _contact(f"n{uid}", station="gs-svalbard")
        r = httpx.post(f"{url}/hooks/{sender}/contact-window-opened", content=body, headers=signed_headers(key, body),
                       timeout=60)
        assert r.status_code == 202, r.text
        wait_for(marker.exists, 60, lambda: f"the triggered run's marker; {(tmp_path / 'serve.log').read_text()}",
                 interval=0.5)
        time.sleep(0.2)
        assert json.loads(marker.read_text()) == {"node": f"n{uid}", "station": "gs-svalbard", "sender": sender}
        with get_client(sync_client=True) as client:
            runs = client.read_flow_runs()
            mine = [fr for fr in runs if fr.deployment_id == dep.id]
            assert len(mine) == 1 and mine[0].parameters["node"] == f"n{uid}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


@pytest.mark.integration
def test_gateway_emits_with_prefect_api_auth_on(tmp_path: Path) -> None:
    """With PREFECT_SERVER_API_AUTH_STRING on, the gateway still emits (it uses PREFECT_API_AUTH_STRING)
    while the API itself refuses unauthenticated callers."""
    state = localstack.new_state(tmp_path, fixed_ports=False, api_auth=True)
    state.save()
    try:
        localstack.start_prefect(state)
        assert state.api_auth_string
        api = state.prefect_api_url
        assert httpx.post(f"{api}/events/filter", json={}).status_code == 401
        os.environ["EDGEHAUL_GATEWAY_SECRET"] = "auth-test-secret"
        try:
            url = localstack.start_gateway(state)
        finally:
            del os.environ["EDGEHAUL_GATEWAY_SECRET"]
        sender, key = localstack.gateway_sender(state)
        uid = uuid.uuid4().hex[:10]
        body = _contact(f"n{uid}")
        r = httpx.post(f"{url}/hooks/{sender}/contact-window-opened", content=body, headers=signed_headers(key, body),
                       timeout=60)
        assert r.status_code == 202, r.text
        auth = tuple(state.api_auth_string.split(":", 1))
        ev = _wait_events(api, f"edgehaul.node.n{uid}", auth=auth)[0]  # type: ignore[arg-type]
        assert ev["event"] == "edgehaul.contact.opened" and ev["payload"]["bandwidth_bps"] == 2e6
        bad = {**json.loads(body), "window_end": "2026-12-03T09:00:00Z"}
        body = json.dumps(bad).encode()
        r = httpx.post(f"{url}/hooks/{sender}/contact-window-opened", content=body, headers=signed_headers(key, body),
                       timeout=60)
        assert r.status_code == 422 and "window_end" in r.text
    finally:
        localstack.down(tmp_path)
