"""The webhook gateway as an attacker sees it: malformed headers, keys that climb out
of the node's prefix, a sender speaking for another node, and a flood of valid hooks.

On main at 8a307c0 each of these failed: a non-ASCII signature header gave a 500 with a traceback, a
`nan` timestamp passed the staleness check, `../` and `//` keys and any self-declared node were
accepted, and 300 hooks made 300 core_ingest runs (and "database is locked" errors on the server).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import posixpath
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from starlette.testclient import TestClient

from edgehaul.services.gateway import (
    BundleUploaded,
    GatewayConfig,
    SenderRegistry,
    create_app,
    new_secret,
    sign,
    signed_headers,
    write_senders,
)
from edgehaul_dev import deploy, localstack
from tests.prefect_cleanup import delete_deployments
from tests.services.test_gateway import Recorder, _bundle
from tests.waiting import wait_for

KEY = new_secret()
SENDERS = {"node-a": {"keys": [KEY], "nodes": ["node-a"], "hooks": ["bundle-uploaded", "contact-window-opened"]}}
HOOK = "/hooks/node-a/bundle-uploaded"


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("gw")
    write_senders(root / "senders.json", SENDERS)
    rec = Recorder()
    with TestClient(create_app(GatewayConfig(SenderRegistry(root / "senders.json"), root / "state",
                                             batch_window_s=3600, batch_max=500), rec)) as client:
        client.recorder = rec  # type: ignore[attr-defined]
        yield client


def _body() -> bytes:
    return json.dumps(_bundle("node-a", uuid.uuid4().hex[:12])).encode()


def _short_json_4xx(r: httpx.Response) -> str:
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    assert len(r.content) < 600 and "Traceback" not in r.text, r.text[:300]
    return str(r.json()["error"])


def _no_tracebacks(caplog: pytest.LogCaptureFixture) -> None:
    for rec in caplog.records:
        assert rec.exc_info is None and len(rec.getMessage()) < 400, rec.getMessage()[:400]


@pytest.mark.parametrize(
    ("header", "value", "status", "says"),
    [
        ("webhook-signature", "v1,\xe9t\xe9".encode(), 400, "printable ASCII"),
        ("webhook-signature", "v1,✓".encode(), 400, "printable ASCII"),
        ("webhook-id", "msg-ü".encode(), 400, "printable ASCII"),
        ("webhook-timestamp", "١٧٠٠٠٠٠٠٠٠".encode(), 400, "printable ASCII"),  # Arabic-Indic digits
        ("webhook-timestamp", b"nan", 400, "integer unix seconds"),
        ("webhook-timestamp", b"inf", 400, "integer unix seconds"),
        ("webhook-timestamp", b"-inf", 400, "integer unix seconds"),
        ("webhook-timestamp", b"1e9", 400, "integer unix seconds"),
        ("webhook-timestamp", b"-5", 400, "integer unix seconds"),
        ("webhook-timestamp", b"1700000000.5", 400, "integer unix seconds"),
        ("webhook-timestamp", b"9" * 40, 400, "integer unix seconds"),
        ("webhook-timestamp", b"999999999999", 401, "stale"),
        ("webhook-timestamp", b"0", 401, "stale"),
        ("webhook-signature", b"v1,@@not-base64@@", 400, "base64"),
        ("webhook-signature", b"v1,YWJj", 400, "32 bytes"),
        ("webhook-signature", b"v1," + b"A" * 2000, 400, "at most 1024"),
        ("webhook-signature", b" ".join([b"v1,YWJj"] * 9), 400, "at most 8"),
        ("webhook-signature", b"v2,c29tZXRoaW5n", 401, "no 'v1,<base64>'"),
        ("webhook-signature", b"sha256=abcdef", 401, "no 'v1,<base64>'"),
        ("webhook-id", b"has space", 400, "visible ASCII"),
        ("webhook-id", b"", 401, "unsigned"),
        ("content-length", b"12abc", 400, "Content-Length"),
    ],
)
def test_every_malformed_header_is_a_short_4xx(gw: TestClient, caplog: pytest.LogCaptureFixture, header: str,
                                                value: bytes, status: int, says: str) -> None:
    body = _body()
    headers: dict[str, Any] = signed_headers(KEY, body)
    headers[header] = value
    if header == "webhook-timestamp":  # correctly signed, so only the timestamp itself can be refused
        headers["webhook-signature"] = sign(KEY, headers["webhook-id"], value.decode(), body)
    with caplog.at_level(logging.INFO, logger="edgehaul.services.gateway"):
        r = gw.post(HOOK, content=body, headers=headers)
    assert r.status_code == status and says in _short_json_4xx(r)
    _no_tracebacks(caplog)


@pytest.mark.parametrize("missing", ["webhook-id", "webhook-timestamp", "webhook-signature"])
def test_a_missing_header_is_401(gw: TestClient, missing: str) -> None:
    body = _body()
    headers = signed_headers(KEY, body)
    del headers[missing]
    assert "unsigned" in _short_json_4xx(gw.post(HOOK, content=body, headers=headers))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(["webhook-id", "webhook-timestamp", "webhook-signature"]),
       st.binary(min_size=1, max_size=300).filter(lambda b: not set(b) & {0, 10, 13}))
def test_any_header_bytes_give_a_4xx_never_a_500(gw: TestClient, header: str, value: bytes) -> None:
    body = _body()
    headers: dict[str, Any] = signed_headers(KEY, body)
    headers[header] = value
    r = gw.post(HOOK, content=body, headers=headers)
    if r.status_code != 202:  # only a value equal to the signed one (after stripping) can pass
        _short_json_4xx(r)


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"object_key": "node-a/../node-b/2026-12-03/b-x.parquet"}, "'..'"),
        ({"object_key": "node-a/2026-12-03/../../b-x.parquet"}, "'..'"),
        ({"object_key": "node-a//2026-12-03/b-x.parquet"}, "'//'"),
        ({"object_key": "/node-a/2026-12-03/b-x.parquet"}, "relative"),
        ({"object_key": "node-b/2026-12-03/b-x.parquet"}, "not under the node's prefix 'node-a/'"),
        ({"object_key": "node-a/2026-12-03/b-other.parquet"}, "must end with"),
        ({"object_key": "node-a\\..\\node-b\\b-x.parquet"}, "relative"),
        ({"manifest_key": "node-b/2026-12-03/b-x.manifest.json"}, "not under the node's prefix"),
        ({"manifest_key": "node-a/2026-12-03/b-y.manifest.json"}, "manifest_key must be object_key"),
        ({"node_id": "node-a/../node-b"}, "node_id"),
    ],
)
def test_keys_outside_the_nodes_prefix_are_422(gw: TestClient, over: dict[str, Any], field: str) -> None:
    doc = _bundle("node-a", "x") | over
    if "object_key" in over and "manifest_key" not in over:
        doc["manifest_key"] = over["object_key"].removesuffix(".parquet") + ".manifest.json"
    body = json.dumps(doc).encode()
    r = gw.post(HOOK, content=body, headers=signed_headers(KEY, body))
    assert r.status_code == 422, r.text
    assert field in json.dumps(r.json()["detail"]), r.json()


def test_a_sender_cannot_speak_for_another_node(gw: TestClient) -> None:
    uid = uuid.uuid4().hex[:8]
    before = len(gw.recorder.batch_keys()) + gw.get("/healthz").json()["pending"]  # type: ignore[attr-defined]
    body = json.dumps(_bundle("node-b", uid)).encode()  # node-b's keys, node-b's id, node-a's signature
    r = gw.post(HOOK, content=body, headers=signed_headers(KEY, body))
    assert r.status_code == 403 and "may not speak for node 'node-b'" in r.json()["error"]
    contact = json.dumps({"station_id": "gs-1", "node_id": "node-b", "window_start": "2026-12-03T10:00:00Z",
                          "window_end": "2026-12-03T10:12:00Z"}).encode()
    r = gw.post("/hooks/node-a/contact-window-opened", content=contact, headers=signed_headers(KEY, contact))
    assert r.status_code == 403
    assert len(gw.recorder.batch_keys()) + gw.get("/healthz").json()["pending"] == before  # type: ignore[attr-defined]


@pytest.mark.integration
def test_non_ascii_header_on_the_real_server_is_400_without_traceback(stack: localstack.StackState) -> None:
    url = localstack.start_gateway(stack)
    sender, key = localstack.gateway_sender(stack)
    log = Path(stack.root) / "logs" / "gateway.log"
    size = log.stat().st_size
    body = json.dumps(_bundle("node-a", uuid.uuid4().hex[:8])).encode()
    for name, value in [("webhook-signature", "v1,é".encode()), ("webhook-timestamp", b"nan")]:
        h: dict[str, Any] = signed_headers(key, body) | {name: value}
        r = httpx.post(f"{url}/hooks/{sender}/bundle-uploaded", content=body, headers=h, timeout=30)
        assert r.status_code == 400 and len(r.content) < 300, r.text
    time.sleep(0.5)
    added = log.read_bytes()[size:].decode(errors="replace")
    assert "Traceback" not in added and len(added) < 1000, added


def _server_log_size(root: Path) -> int:
    return (root / "logs" / "prefect.log").stat().st_size


def _server_errors(root: Path, since: int) -> list[str]:
    """The server's error lines (and what they say, a line after each) logged past byte `since` of its log."""
    with open(root / "logs" / "prefect.log", "rb") as f:
        f.seek(since)
        lines = f.read().decode(errors="replace").splitlines()
    return [f"{line} / {lines[i + 1] if i + 1 < len(lines) else ''}".strip() for i, line in enumerate(lines)
            if "| ERROR" in line or "database is locked" in line or line.startswith("Traceback")]


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_a_flood_of_300_hooks_from_20_senders_is_a_few_core_ingest_runs(stack: localstack.StackState,
                                                                         tmp_path: Path) -> None:
    """Each key in exactly one run's bundle_keys, through the real `bundle_landed` trigger of
    deployments/prefect.yaml and the real core_ingest parameter schema (runs are created, not executed)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
    from prefect.events import DeploymentEventTrigger

    from edgehaul.flows.core_ingest import core_ingest

    root = Path(stack.root)
    url = localstack.start_gateway(stack)
    uid = uuid.uuid4().hex[:8]
    # 20 senders, each bound to its own node: the running gateway picks the new registry up
    senders_file = root / "gateway" / "senders.json"
    registry = json.loads(senders_file.read_text())["senders"]
    keys = {f"fl{uid}-{i:02d}": new_secret() for i in range(20)}
    registry |= {s: {"keys": [k], "nodes": [s], "hooks": ["bundle-uploaded"]} for s, k in keys.items()}
    write_senders(senders_file, registry)

    spec = deploy.load_spec()
    (ingest,) = [d for d in spec["deployments"] if d["entrypoint"].endswith(":core_ingest") and d.get("triggers")]
    trigger = DeploymentEventTrigger(**ingest["triggers"][0])
    dep_id = core_ingest.to_deployment(name=f"flood-{uid}", triggers=[trigger],
                                       parameters=ingest["parameters"]).apply()
    with get_client(sync_client=True) as client:
        assert client.read_resource_related_automations(f"prefect.deployment.{dep_id}")
    time.sleep(2)  # the triggers service loads the new automation
    errors_before = _server_log_size(root)

    async def send_all() -> list[tuple[int, str]]:
        async with httpx.AsyncClient(timeout=60) as http:
            async def sender(s: str, k: str) -> list[tuple[int, str]]:
                out = []
                for j in range(15):
                    doc = _bundle(s, f"{uid}-{s[-2:]}-{j}")
                    body = json.dumps(doc).encode()
                    r = await http.post(f"{url}/hooks/{s}/bundle-uploaded", content=body, headers=signed_headers(k, body))
                    out.append((r.status_code, doc["object_key"]))
                return out

            return [x for part in await asyncio.gather(*(sender(s, k) for s, k in keys.items())) for x in part]

    t0 = time.monotonic()
    sent = asyncio.run(send_all())
    send_s = time.monotonic() - t0
    assert [c for c, _ in sent] == [202] * 300
    want = {k for _, k in sent}
    assert len(want) == 300

    def runs() -> list[Any]:
        with get_client(sync_client=True) as client:
            return client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[dep_id])))

    def cancel_unserved() -> None:  # nothing executes them: ended now, they never go Late (a server write each)
        from prefect.states import Cancelled

        with get_client(sync_client=True) as client:
            for fr in runs():
                if not (fr.state and fr.state.is_final()):
                    client.set_flow_run_state(fr.id, Cancelled(message="flood test: created, not executed"),
                                              force=True)

    try:
        wait_for(lambda: want <= {k for fr in runs() for k in fr.parameters["params"]["bundle_keys"]}, 120,
                 "every flooded key in a core_ingest run")
        settle_s = time.monotonic() - t0
        cancel_unserved()
        time.sleep(8)  # more than a window: a late duplicate run would show up now
        final = runs()
        cancel_unserved()
        new_errors = _server_errors(root, since=errors_before)
    finally:
        delete_deployments([dep_id])
    mine = [k for fr in final for k in fr.parameters["params"]["bundle_keys"] if k in want]
    print(f"flood: 300 hooks from 20 senders sent in {send_s:.1f} s, all keys in runs after {settle_s:.1f} s, "
          f"{len(final)} core_ingest runs of sizes {[len(fr.parameters['params']['bundle_keys']) for fr in final]}")
    assert sorted(mine) == sorted(want), f"{len(set(want) - set(mine))} keys in no run, {len(mine) - len(set(mine))} twice"
    # 300 keys, at most 200 a batch, one batch per 5 s window while they arrive (here: 2 runs for ~8 s of sending)
    assert 2 <= len(final) <= math.ceil(send_s / 5) + 2 <= 8
    assert all(fr.parameters["params"]["store_block"] == "ingest" for fr in final)
    health = httpx.get(f"{url}/healthz").json()
    assert health["batch_errors"] == 0 and health["pending"] == 0
    assert not new_errors, "\n".join(new_errors)[-4000:]


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ({"keys": ["c2hvcnQ="], "nodes": ["node-a"], "hooks": ["bundle-uploaded"]}, "must start with 'whsec_'"),
        ({"keys": ["whsec_c2hvcnQ="], "nodes": ["node-a"], "hooks": ["bundle-uploaded"]}, "at least 16 bytes"),
        ({"keys": ["whsec_!!!"], "nodes": ["node-a"], "hooks": ["bundle-uploaded"]}, "base64"),
        ({"keys": [KEY], "nodes": ["node-a"], "hooks": ["delete-everything"]}, "unknown hook kinds"),
        ({"keys": [KEY], "nodes": ["../*"], "hooks": ["bundle-uploaded"]}, "node patterns"),
        ({"keys": [], "nodes": ["node-a"], "hooks": ["bundle-uploaded"]}, "keys"),
    ],
)
def test_a_bad_senders_file_is_refused_with_what_is_wrong(tmp_path: Path, spec: dict[str, Any], says: str) -> None:
    path = tmp_path / "senders.json"
    path.write_text(json.dumps({"senders": {"gs-1": spec}}))
    path.chmod(0o600)
    with pytest.raises(ValueError, match="senders file") as e:
        SenderRegistry(path)
    assert says in str(e.value)


def test_a_world_readable_senders_file_stops_the_gateway(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    from edgehaul.services import gateway

    path = tmp_path / "senders.json"
    write_senders(path, SENDERS)
    path.chmod(0o644)
    monkeypatch.setenv("EDGEHAUL_GATEWAY_SENDERS", str(path))
    monkeypatch.setenv("EDGEHAUL_GATEWAY_SECRET", "x")
    assert gateway.main([]) == 2
    assert "readable by every user (mode 644)" in caplog.text


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="ab./\\-_%~ ", max_size=24), st.sampled_from(["node-a", "node-b"]))
def test_an_accepted_key_never_leaves_its_nodes_prefix(middle: str, prefix: str) -> None:
    key = f"{prefix}/{middle}/b-x.parquet"
    doc = _bundle("node-a", "x") | {"object_key": key, "manifest_key": key.removesuffix(".parquet") + ".manifest.json"}
    try:
        BundleUploaded.model_validate(doc)
    except ValidationError:
        return
    assert posixpath.normpath(key) == key and key.startswith("node-a/") and "\\" not in key
