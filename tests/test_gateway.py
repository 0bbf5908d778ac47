"""Webhook gateway: signed requests become Prefect events and trigger flows; bad ones emit nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from edgehaul.platform.gateway import HOOKS, ReplayGuard, sign, signed_headers
from edgehaul_dev import localstack


def test_signature_covers_timestamp_and_body() -> None:
    s = sign("k", "1700000000", b"{}")
    assert s.startswith("sha256=") and len(s) == 7 + 64
    assert s != sign("k", "1700000001", b"{}") and s != sign("k", "1700000000", b"{ }")
    assert s != sign("j", "1700000000", b"{}")


@given(st.binary(max_size=200), st.integers(0, 2**40))
def test_signature_is_deterministic_and_secret_bound(body: bytes, ts: int) -> None:
    assert sign("secret", str(ts), body) == sign(b"secret", str(ts), body) != sign("secret2", str(ts), body)


def test_replay_guard_bounded_and_expiring() -> None:
    g = ReplayGuard(window_s=0.05, capacity=2)
    assert g.reserve("a") == "ok" and g.reserve("a") == "replayed"
    assert g.reserve("b") == "ok" and g.reserve("c") == "full"  # never forgets a live entry early
    g.release("b")
    assert g.reserve("c") == "ok"
    time.sleep(0.12)  # entries live 2 x window
    assert g.reserve("a") == "ok" and len(g) == 1


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
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        found = _events_with_prefix(api_url, prefix, auth)
        if len(found) >= n:
            return found
        time.sleep(0.5)
    raise AssertionError(f"no event with resource prefix {prefix} after 30 s")


@pytest.fixture(scope="module")
def gateway(stack: localstack.StackState) -> Iterator[tuple[str, str]]:
    """The stack's gateway (real uvicorn process) and its secret, read from the Secret block."""
    from prefect.blocks.system import Secret

    url = localstack.start_gateway(stack)
    secret = Secret.load("edgehaul-gateway-hmac").get()  # type: ignore[union-attr]
    yield url, secret


@pytest.mark.integration
def test_each_bad_request_class_is_rejected_and_emits_nothing(stack: localstack.StackState,
                                                             gateway: tuple[str, str]) -> None:
    url, secret = gateway
    uid = uuid.uuid4().hex[:10]
    node = f"n{uid}"
    hook = f"{url}/hooks/bundle-uploaded"

    def body(**over: Any) -> bytes:
        return json.dumps(_bundle(node, f"{uid}-{len(over)}-{time.monotonic_ns()}", **over)).encode()

    b = body()
    unsigned = httpx.post(hook, content=b, headers={"content-type": "application/json"}, timeout=60)
    assert unsigned.status_code == 401 and "unsigned" in unsigned.json()["error"]

    h = signed_headers(secret, b)
    wrong = sign("wrong", h["x-edgehaul-timestamp"], b)
    bad = httpx.post(hook, content=b, headers=h | {"x-edgehaul-signature": wrong}, timeout=60)
    assert bad.status_code == 401 and "bad signature" in bad.json()["error"]
    tampered = httpx.post(hook, content=b.replace(b"120", b"121"), headers=h, timeout=60)
    assert tampered.status_code == 401

    stale = httpx.post(hook, content=b, headers=signed_headers(secret, b, now=time.time() - 3600), timeout=60)
    assert stale.status_code == 401 and "stale" in stale.json()["error"]

    big = json.dumps(_bundle(node, f"{uid}-big", padding="x" * 70_000)).encode()
    over = httpx.post(hook, content=big, headers=signed_headers(secret, big), timeout=60)
    assert over.status_code == 413

    def chunks() -> Iterator[bytes]:  # no Content-Length: the cap must hold while streaming
        for _ in range(100):
            yield b"x" * 4096

    streamed = httpx.post(hook, content=chunks(), headers=signed_headers(secret, b"ignored"), timeout=60)
    assert streamed.status_code == 413

    notjson = b"{not json"
    r = httpx.post(hook, content=notjson, headers=signed_headers(secret, notjson), timeout=60)
    assert r.status_code == 422 and "not JSON" in r.json()["error"]

    invalid = body(row_count=-1, sha256="xyz", object_key=f"other-node/x/b-{uid}.parquet")
    r = httpx.post(hook, content=invalid, headers=signed_headers(secret, invalid), timeout=60)
    assert r.status_code == 422
    fields = {e["field"] for e in r.json()["detail"]}
    assert {"row_count", "sha256"} <= fields

    extra = body(unexpected=1)
    r = httpx.post(hook, content=extra, headers=signed_headers(secret, extra), timeout=60)
    assert r.status_code == 422 and r.json()["detail"][0]["field"] == "unexpected"

    r = httpx.post(f"{url}/hooks/no-such-kind", content=b, headers=signed_headers(secret, b), timeout=60)
    assert r.status_code == 404 and set(r.json()["detail"]["kinds"]) == set(HOOKS)

    # One good request, then its replay; the good one's event proves the pipeline has caught up.
    good = json.dumps(_bundle(node, f"{uid}-good")).encode()
    hg = signed_headers(secret, good)
    ok = httpx.post(hook, content=good, headers=hg, timeout=60)
    assert ok.status_code == 202, ok.text
    replay = httpx.post(hook, content=good, headers=hg, timeout=60)
    assert replay.status_code == 409 and "replayed" in replay.json()["error"]

    seen = _wait_events(stack.prefect_api_url, f"edgehaul.bundle.b-{uid}")
    time.sleep(2)  # anything emitted before the good event would be persisted by now
    seen = _events_with_prefix(stack.prefect_api_url, f"edgehaul.bundle.b-{uid}")
    assert [e["resource"]["prefect.resource.id"] for e in seen] == [f"edgehaul.bundle.b-{uid}-good"]
    ev = seen[0]
    assert ev["event"] == "edgehaul.bundle.landed" and ev["id"] == ok.json()["event_id"]
    assert ev["payload"]["row_count"] == 120 and ev["resource"]["edgehaul.node.id"] == node
    assert httpx.get(f"{url}/healthz").json()["rejected"] >= 10


_TARGET = textwrap.dedent(
    """
    import json, os, sys
    from prefect import flow
    from prefect.events import DeploymentEventTrigger

    @flow(name="gateway-target-{uid}")
    def target(bundle_id: str, rows: int, node: str) -> None:
        with open(sys.argv[1], "w") as f:
            json.dump({{"bundle_id": bundle_id, "rows": rows, "node": node}}, f)

    if __name__ == "__main__":  # the runner re-imports this file in the flow-run process
        target.serve(
            name="on-bundle",
            triggers=[DeploymentEventTrigger(
                expect={{"edgehaul.bundle.landed"}},
                match={{"prefect.resource.id": "edgehaul.bundle.b-{uid}*"}},
                parameters={{"bundle_id": "{{{{ event.payload.bundle_id }}}}", "rows": "{{{{ event.payload.row_count }}}}",
                            "node": "{{{{ event.resource['edgehaul.node.id'] }}}}"}},
            )],
        )
    """
)


@pytest.mark.integration
def test_signed_webhook_triggers_a_flow_run(stack: localstack.StackState, gateway: tuple[str, str],
                                           tmp_path: Path) -> None:
    from prefect.client.orchestration import get_client

    url, secret = gateway
    uid = uuid.uuid4().hex[:10]
    script = tmp_path / "target.py"
    script.write_text(_TARGET.format(uid=uid))
    marker = tmp_path / "ran.json"
    env = {**os.environ, "PREFECT_RUNNER_POLL_FREQUENCY": "1", "PREFECT_LOGGING_LEVEL": "WARNING"}
    log = open(tmp_path / "serve.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, str(script), str(marker)], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        automations: list[Any] = []
        while not automations:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            assert time.monotonic() < deadline, "served deployment and its trigger never appeared"
            time.sleep(0.5)
            with get_client(sync_client=True) as client:
                try:
                    dep = client.read_deployment_by_name(f"gateway-target-{uid}/on-bundle")
                except Exception:
                    continue
                automations = client.read_resource_related_automations(f"prefect.deployment.{dep.id}")

        body = json.dumps(_bundle(f"n{uid}", uid)).encode()
        r = httpx.post(f"{url}/hooks/bundle-uploaded", content=body, headers=signed_headers(secret, body), timeout=60)
        assert r.status_code == 202, r.text
        while not marker.exists():
            assert time.monotonic() < deadline + 60, (tmp_path / "serve.log").read_text()
            time.sleep(0.5)
        time.sleep(0.2)
        assert json.loads(marker.read_text()) == {"bundle_id": f"b-{uid}", "rows": 120, "node": f"n{uid}"}
        with get_client(sync_client=True) as client:
            runs = client.read_flow_runs()
            mine = [fr for fr in runs if fr.deployment_id == dep.id]
            assert len(mine) == 1 and mine[0].parameters["bundle_id"] == f"b-{uid}"
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
        secret = "auth-test-secret"
        os.environ["EDGEHAUL_GATEWAY_SECRET"] = secret
        try:
            url = localstack.start_gateway(state)
        finally:
            del os.environ["EDGEHAUL_GATEWAY_SECRET"]
        uid = uuid.uuid4().hex[:10]
        doc = {"station_id": "gs-1", "node_id": f"n{uid}", "window_start": "2026-12-03T10:00:00Z",
               "window_end": "2026-12-03T10:12:00Z", "bandwidth_bps": 2e6}
        body = json.dumps(doc).encode()
        r = httpx.post(f"{url}/hooks/contact-window-opened", content=body, headers=signed_headers(secret, body), timeout=60)
        assert r.status_code == 202, r.text
        auth = tuple(state.api_auth_string.split(":", 1))
        ev = _wait_events(api, f"edgehaul.node.n{uid}", auth=auth)[0]  # type: ignore[arg-type]
        assert ev["event"] == "edgehaul.contact.opened" and ev["payload"]["bandwidth_bps"] == 2e6
        bad = {**doc, "window_end": "2026-12-03T09:00:00Z"}
        body = json.dumps(bad).encode()
        r = httpx.post(f"{url}/hooks/contact-window-opened", content=body, headers=signed_headers(secret, body), timeout=60)
        assert r.status_code == 422 and "window_end" in r.text
    finally:
        localstack.down(tmp_path)


def test_alert_sink_needs_its_token_and_appends_json_lines(tmp_path: Path) -> None:
    from starlette.testclient import TestClient

    from edgehaul.platform.gateway import GatewayConfig, alert_token, create_app

    log = tmp_path / "alerts.jsonl"
    with TestClient(create_app(GatewayConfig("s3cret", alert_log=str(log)))) as client:
        body = {"subject": "[edgehaul L2] spool-watermark", "body": '{"level": 2}'}
        assert client.post("/alerts", json=body).status_code == 401
        assert client.post("/alerts", json=body, headers={"authorization": "Bearer nope"}).status_code == 401
        ok = client.post("/alerts", json=body, headers={"authorization": f"Bearer {alert_token('s3cret')}"})
        assert ok.status_code == 202
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(lines) == 1 and lines[0]["subject"] == body["subject"]
