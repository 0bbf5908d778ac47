"""Store and forward of what a node did: the node's outbox, drained by the forwarder
to the gateway's `node-events` hook, reaches the session's real Prefect as `edgehaul.node.<id>` events,
in seq order, each exactly once (a retried batch, a batch cut off midway, a gateway restart), late
ones labelled stale with their age; same link and cap as data, control first."""

from __future__ import annotations

import json
import threading
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from edgehaul import events
from edgehaul.blocks import LinkProfile
from edgehaul.edge.outbox import PRIO_ALERT_L1, PRIO_ALERT_L3, PRIO_ANNOUNCE, PRIO_STATS, Outbox
from edgehaul.services.gateway import (
    GatewayConfig,
    PrefectEmitter,
    SenderRegistry,
    create_app,
    new_secret,
    signed_headers,
    write_senders,
)
from edgehaul.uplink.forwarder import ANNOUNCE_HOOK, CONTROL_PRIORITY, HOOK, Forwarder, ForwardError, batch_body
from edgehaul.uplink.link import Link, priority_key
from edgehaul_dev import localstack
from tests.conftest import api_auth
from tests.waiting import wait_for

HOURS = 3600.0


class FlakyPrefect:
    """The real events client, cut off once after `ok` events (Prefect going away mid batch)."""

    def __init__(self, fail_after: int | None = None) -> None:
        self.real = PrefectEmitter()
        self.fail_after = fail_after
        self.calls = 0

    async def __call__(self, name: str, resource: dict[str, str], payload: dict[str, Any], event_id: uuid.UUID,
                       occurred: datetime | None = None) -> None:
        self.calls += 1
        if self.fail_after is not None and self.calls > self.fail_after:
            self.fail_after = None
            raise ConnectionError("Prefect unreachable")
        await self.real(name, resource, payload, event_id, occurred)


def _senders(tmp_path: Path, node: str) -> tuple[Path, str]:
    key = new_secret()
    path = tmp_path / "senders.json"
    write_senders(path, {node: {"keys": [key], "nodes": [node], "hooks": [HOOK]}})
    return path, key


def _gateway(tmp_path: Path, senders: Path, emitter: Any = None) -> TestClient:
    return TestClient(create_app(GatewayConfig(SenderRegistry(senders), tmp_path / "gw", stale_after_s=600.0),
                                 emitter or PrefectEmitter()))


def _node_events(api_url: str, node: str, n: int) -> list[dict[str, Any]]:
    def found() -> list[dict[str, Any]]:
        r = httpx.post(f"{api_url}/events/filter", auth=api_auth(), timeout=10,
                       json={"filter": {"resource": {"id": [f"edgehaul.node.{node}"]}, "order": "ASC"}, "limit": 50})
        r.raise_for_status()
        return list(r.json()["events"])

    wait_for(lambda: len(found()) >= n, 30, f"{n} events of node {node} in Prefect", interval=0.5)
    time.sleep(1.0)  # and nothing more arrives after
    return found()


def _raise_node_history(box: Outbox, node: str, now: list[float]) -> list[int]:
    """What a node does while out of contact, through the product's `events.emit`: alerts of levels 1-3,
    link statistics, a run summary; the first ones two hours ago. Returns each event's alert id."""
    ids = []
    with events.routed(box.sink(clock=lambda: now[0])):
        for i in range(7):
            level = (i % 3) + 1
            assert events.emit(events.SPOOL_WATERMARK if level == 2 else events.LINK_STATS if level == 1
                               else events.RETRY_EXPIRED, f"edgehaul.spool.{node}",
                               {"level": level, "alert_id": i, "used_fraction": 0.9, "retransmission_rate": 0.2},
                               **{"edgehaul.node": node})
            ids.append(i)
            now[0] += 0.25 * HOURS
        assert events.emit(events.NODE_RUN_SUMMARY, f"edgehaul.node.{node}", {"alert_id": 7, "bundles": 3})
        ids.append(7)
    return ids


@pytest.fixture
def node() -> str:
    return f"n{uuid.uuid4().hex[:10]}"


@pytest.mark.integration
def test_forwarded_history_reaches_prefect_in_order_once_across_retry_cut_and_restart(
        stack: localstack.StackState, tmp_path: Path, node: str) -> None:
    senders, key = _senders(tmp_path, node)
    box = Outbox(tmp_path / "outbox.sqlite", node)
    now = [time.time() - 2 * HOURS]
    ids = _raise_node_history(box, node, now)
    assert len(box) == 8 and [e.priority for e in box.peek(3)] == [PRIO_ALERT_L1, 2, PRIO_ALERT_L3]
    assert box.peek(8)[-1].priority == PRIO_STATS

    # 1. The first 4 rows reach Prefect but the node never hears the answer: it re-sends them, same id.
    first = batch_body(node, box.peek(4))
    with _gateway(tmp_path, senders) as gw:
        for expect in (4, 0):
            r = gw.post(f"/hooks/{node}/{HOOK}", content=first, headers=signed_headers(key, first, msg_id="ob-x-1-4"))
            assert r.status_code == 202 and r.json()["emitted"] == expect, r.text
        assert r.json() == {"node_id": node, "emitted": 0, "skipped": 4, "seq": 4}

    # 2. Gateway restarted (same state dir) and Prefect lost after one more event: the forwarder's
    #    first batch (seq 1-3) is all skipped, the next is cut off, kept, and the retry resumes.
    with _gateway(tmp_path, senders, FlakyPrefect(fail_after=1)) as gw:
        fw = Forwarder(box, gw, node, key, batch_max=3)
        rep = fw.forward()
        assert rep.statuses == [202, 503] and "seq 4-6 kept" in rep.error and len(box) == 5, rep
        rep = fw.forward()
        assert rep.ok and rep.statuses == [202, 202] and len(box) == 0, rep

    got = _node_events(stack.prefect_api_url, node, len(ids))
    assert [e["payload"]["alert_id"] for e in got] == ids  # in seq order, each exactly once
    assert [e["payload"]["seq"] for e in got] == list(range(1, 9))
    assert [e["event"] for e in got][:3] == [events.LINK_STATS, events.SPOOL_WATERMARK, events.RETRY_EXPIRED]
    assert all(e["resource"]["prefect.resource.id"] == f"edgehaul.node.{node}" for e in got)
    assert [e["payload"].get("level") for e in got[:3]] == [1, 2, 3]
    # alert labels re-derived, so the level 1 and 2 automations still match
    assert got[1]["resource"][events.ALERT_LABELS["used_fraction"]] == "0900"
    occurred = [datetime.fromisoformat(e["occurred"]) for e in got]
    assert occurred == sorted(occurred) and abs(occurred[0].timestamp() - (now[0] - 7 * 0.25 * HOURS)) < 1
    first_age = got[0]["payload"]["age_s"]
    assert 2 * HOURS - 5 < first_age < 2 * HOURS + 120 and got[0]["resource"]["edgehaul.stale"] == "true"
    assert got[0]["payload"]["origin_resource"] == f"edgehaul.spool.{node}"


@pytest.mark.integration
def test_a_fresh_event_is_not_stale_and_a_node_cannot_forward_for_another(
        stack: localstack.StackState, tmp_path: Path, node: str) -> None:
    senders, key = _senders(tmp_path, node)
    mine, other = Outbox(tmp_path / "a.sqlite", node), Outbox(tmp_path / "b.sqlite", f"{node}x")
    with events.routed(mine.sink()):
        events.emit(events.LEDGER_COUNTS, f"edgehaul.node.{node}", {"dropped": {"edge/full": 2}})
    other.append(events.SPOOL_WATERMARK, {"level": 2}, priority=2)
    with _gateway(tmp_path, senders) as gw:
        assert Forwarder(mine, gw, node, key).forward().events == 1
        with pytest.raises(ForwardError, match=f"403 sender '{node}' may not speak for node '{node}x'"):
            Forwarder(other, gw, node, key).forward()
        assert len(other) == 1  # refused: kept, never deleted
        # an event that would start work centrally is not the node's to forward
        body = json.dumps({"node_id": node, "events": [{"seq": 9, "event": events.LANDING_BATCH, "priority": 9,
                                                        "occurred": datetime.now(UTC).isoformat(),
                                                        "payload": {"bundle_keys": ["x"]}}]}).encode()
        r = gw.post(f"/hooks/{node}/{HOOK}", content=body, headers=signed_headers(key, body))
        assert r.status_code == 422 and "may not be forwarded" in r.text
    (ev,) = _node_events(stack.prefect_api_url, node, 1)
    assert ev["event"] == events.LEDGER_COUNTS and ev["resource"]["edgehaul.stale"] == "false"
    assert ev["payload"]["age_s"] < 60 and ev["payload"]["dropped"] == {"edge/full": 2}


def test_nothing_leaves_while_the_link_or_the_gateway_is_down(tmp_path: Path, node: str) -> None:
    box = Outbox(tmp_path / "o.sqlite", node)
    box.append(events.LINK_STATS, {"level": 1}, priority=1)
    # outside a contact window: nothing sent, nothing charged to the cap
    link = Link(LinkProfile(bandwidth_bps=8e6, contact_period_s=3600, contact_duration_s=60),
                clock=lambda: 1000.0, epoch=0.0, emit_events=False)
    with httpx.Client(base_url="http://127.0.0.1:9") as dead:
        rep = Forwarder(box, dead, node, new_secret(), link=link).forward()
        assert "link down: outside contact window" in rep.error and link.shaper.granted_bytes == 0
        rep = Forwarder(box, dead, node, new_secret()).forward()
    assert rep.error.startswith("gateway unreachable: ConnectError") and rep.left == len(box) == 1


def test_forwarded_bytes_count_against_the_links_cap(tmp_path: Path, node: str) -> None:
    senders, key = _senders(tmp_path, node)
    box = Outbox(tmp_path / "o.sqlite", node)
    for i in range(40):
        box.append(events.NODE_RUN_SUMMARY, {"run": i, "pad": "x" * 200})
    link = Link(LinkProfile(bandwidth_bps=8e6), emit_events=False)

    async def sink(*_: Any, **__: Any) -> None:  # what Prefect received is not this test's concern
        return None

    with TestClient(create_app(GatewayConfig(SenderRegistry(senders), tmp_path / "gw"), sink)) as gw:
        rep = Forwarder(box, gw, node, key, link=link, batch_max=10).forward()
    assert rep.ok and rep.batches == 4 and len(box) == 0
    assert link.shaper.granted_bytes == rep.bytes == link.stats.control_bytes > 40 * 200


@given(st.sampled_from(["high", "normal", "low"]), st.floats(allow_nan=False), st.text(max_size=30))
def test_control_traffic_goes_before_every_bundle(tier: str, value: float, created: str) -> None:
    assert priority_key(tier, value, created) > CONTROL_PRIORITY


def test_an_oversized_history_is_split_under_the_gateway_body_cap(tmp_path: Path, node: str) -> None:
    box = Outbox(tmp_path / "o.sqlite", node)
    for i in range(50):
        box.append(events.NODE_RUN_SUMMARY, {"run": i, "pad": "y" * 2000})
    fw = Forwarder(box, httpx.Client(), node, new_secret(), batch_max=50, max_body_bytes=16 * 1024)
    rows, body, _ = fw._next_batch()
    assert len(body) <= 16 * 1024 and 1 <= len(rows) < 50 and [r.seq for r in rows] == list(range(1, len(rows) + 1))


def test_the_node_key_file_must_be_its_own(tmp_path: Path, node: str) -> None:
    path = tmp_path / "gateway-key"
    path.write_text(new_secret() + "\n")
    path.chmod(0o644)
    box = Outbox(tmp_path / "o.sqlite", node)
    with pytest.raises(ValueError, match=r"gateway-key: mode 0644 lets group/other read or write it; make it 0600"):
        Forwarder.to_gateway(box, "http://127.0.0.1:9", path)
    path.chmod(0o600)
    fw = Forwarder.to_gateway(box, "http://127.0.0.1:9", path)
    assert fw.sender_id == node and fw.key == path.read_text().strip()
    fw.client.close()
    path.write_text("hunter2")
    with pytest.raises(ValueError, match="expected one line 'whsec_<base64>'"):
        Forwarder.to_gateway(box, "http://127.0.0.1:9", path)
    with pytest.raises(ValueError, match="cannot read"):
        Forwarder.to_gateway(box, "http://127.0.0.1:9", tmp_path / "missing")


def test_a_waiting_batch_of_events_overtakes_a_waiting_bundle_chunk() -> None:
    # Same shaper, same cap: with the bucket empty, a bundle chunk queued first is still served after
    # the node's events, queued later (control first), and both are paced (never over the cap).
    link = Link(LinkProfile(bandwidth_bps=8 * 100_000 / 0.7, chunk_bytes=64 * 1024), emit_events=False)
    link.shaper.acquire(int(link.shaper.bucket.burst))  # empty the bucket
    order: list[str] = []
    data = threading.Thread(target=lambda: (link.shaper.acquire(64 * 1024, priority_key("high", 9.0, "t")),
                                            order.append("bundle")))
    data.start()
    time.sleep(0.05)
    link.shaper.acquire(2_000, CONTROL_PRIORITY)
    order.append("events")
    data.join(timeout=10)
    assert order == ["events", "bundle"]
    assert link.shaper.granted_bytes == int(link.shaper.bucket.burst) + 2_000 + 64 * 1024


@pytest.mark.integration
def test_the_task_forwards_through_the_stacks_gateway_process(stack: localstack.StackState, tmp_path: Path,
                                                              node: str) -> None:
    from edgehaul.blocks import EdgeNode
    from edgehaul.edge.outbox import node_outbox
    from edgehaul.tasks.forwarding import forward_node_events

    url = localstack.start_gateway(stack)  # the real uvicorn process, emitting to the session's Prefect
    sender, key = localstack.gateway_sender(stack)
    key_file = tmp_path / "gateway-key"
    key_file.write_text(key)
    key_file.chmod(0o600)
    edge = EdgeNode(node_id=node, spool_dir=str(tmp_path / "spool"))
    box = node_outbox(edge.spool_dir, node)
    with events.routed(box.sink()):
        events.emit(events.SPOOL_WATERMARK, f"edgehaul.spool.{node}", {"level": 2, "used_fraction": 0.91})
    box.close()
    out = forward_node_events.fn(edge, "http://127.0.0.1:9", str(key_file), sender_id=sender)
    assert out["events"] == 0 and out["left"] == 1 and out["error"].startswith("gateway unreachable")
    out = forward_node_events.fn(edge, url, str(key_file), sender_id=sender)
    assert out == {"events": 1, "announced": 0, "batches": 1, "bytes": out["bytes"], "left": 0, "error": "",
                   "dropped": {}}
    (ev,) = _node_events(stack.prefect_api_url, node, 1)
    assert ev["event"] == events.SPOOL_WATERMARK and ev["payload"]["level"] == 2
    assert ev["resource"][events.ALERT_LABELS["used_fraction"]] == "0910"


class Recorder:
    """Stands in for Prefect where the test is about what the gateway accepts, not about Prefect."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.payloads: list[dict[str, Any]] = []

    async def __call__(self, name: str, resource: dict[str, str], payload: dict[str, Any], event_id: uuid.UUID,
                       occurred: datetime | None = None) -> None:
        self.names.append(name)
        self.payloads.append(payload)

    def batch_keys(self) -> list[str]:
        return [k for n, p in zip(self.names, self.payloads, strict=True) if n == events.LANDING_BATCH
                for k in p["bundle_keys"]]


def test_an_event_the_gateway_refuses_is_set_aside_and_the_history_goes_on(tmp_path: Path, node: str) -> None:
    senders, key = _senders(tmp_path, node)
    box = Outbox(tmp_path / "o.sqlite", node)
    for i in range(5):
        box.append(events.LINK_STATS, {"i": i})
    bad = box.append("edgehaul.not.a.node.event", {"i": 99})  # e.g. written by an older or broken node version
    for i in range(5, 9):
        box.append(events.LINK_STATS, {"i": i})
    rec = Recorder()
    with _gateway(tmp_path, senders, rec) as gw:
        rep = Forwarder(box, gw, node, key, batch_max=4).forward()
    assert rep.ok and rep.set_aside == [bad] and rep.events == 9 and len(box) == 0, rep
    assert rec.names == [events.LINK_STATS] * 9  # every good event, in order, once
    ((seq, name, why),) = box.set_aside_events()
    assert (seq, name) == (bad, "edgehaul.not.a.node.event") and why.startswith("422 invalid node-events payload: events.")
    # a refused sender is not "content": it stops the forwarder and keeps everything
    box.append(events.LINK_STATS, {"i": 10})
    with _gateway(tmp_path, senders, rec) as gw, pytest.raises(ForwardError, match=r"401|403"):
        Forwarder(box, gw, node, new_secret()).forward()
    assert len(box) == 1


def _landed(node: str, i: int) -> dict[str, Any]:
    """The payload the uplink's Drainer emits as BUNDLE_LANDED for a verified bundle (keys relative to the store)."""
    b = f"b{i:04d}-{node}"
    return {"node_id": node, "bundle_id": b, "object_key": f"{node}/2026-12-05/{b}.parquet",
            "manifest_key": f"{node}/2026-12-05/{b}.manifest.json", "sha256": f"{i:064x}", "row_count": 10 + i,
            "contract": "landsat_patch.v1", "tier": "normal", "nbytes": 1000 + i, "bucket": "edgehaul-landing",
            "key": f"{node}/2026-12-05/{b}.parquet", "duplicate": False, "proof": "sha256", "readback_bytes": 0}


@settings(max_examples=8, deadline=None)
@given(kinds=st.lists(st.booleans(), min_size=1, max_size=25), batch_max=st.integers(1, 6))
def test_a_routed_node_announces_each_landed_bundle_through_the_gateway_never_a_batch_of_its_own(
        tmp_path_factory: pytest.TempPathFactory, kinds: list[bool], batch_max: int) -> None:
    """Landed bundles (True) among the node's own events (False), in any order: the node emits no landing batch;
    out of contact everything waits in the outbox; in contact every bundle reaches one of the gateway's landing
    batches once and every event is re-emitted once, in order; a lost answer (the same bundle sent again) is a
    409 that acknowledges it."""
    tmp = tmp_path_factory.mktemp("announce")
    node = f"n{uuid.uuid4().hex[:10]}"
    key = new_secret()
    senders = tmp / "senders.json"
    write_senders(senders, {node: {"keys": [key], "nodes": [node], "hooks": [HOOK, ANNOUNCE_HOOK]}})
    box = Outbox(tmp / "o.sqlite", node)
    keys = []
    with events.routed(box.sink()):
        for i, landed in enumerate(kinds):
            if landed:
                p = _landed(node, i)
                assert events.emit(events.BUNDLE_LANDED, f"edgehaul.bundle.{p['bundle_id']}", p)
                keys.append(p["object_key"])
            else:
                assert events.emit(events.NODE_RUN_SUMMARY, f"edgehaul.node.{node}", {"i": i})
        resource, payload = events.landing_batch("x", "uplink", [(k, node, k) for k in keys])
        assert not events.emit(events.LANDING_BATCH, resource["prefect.resource.id"], payload)  # withheld
    assert len(box) == len(kinds) and events.LANDING_BATCH not in {e.event for e in box.peek(100)}
    announced = [e for e in box.peek(100) if e.event == events.BUNDLE_LANDED]
    assert all(e.priority == PRIO_ANNOUNCE and "bucket" not in e.payload for e in announced)
    with httpx.Client(base_url="http://127.0.0.1:9") as dead:  # out of contact: kept, in order
        assert Forwarder(box, dead, node, key).forward().error.startswith("gateway unreachable")
    assert len(box) == len(kinds)
    rec = Recorder()
    with TestClient(create_app(GatewayConfig(SenderRegistry(senders), tmp / "gw", batch_window_s=0.05), rec)) as gw:
        rep = Forwarder(box, gw, node, key, batch_max=batch_max).forward()
        assert rep.ok and rep.events == len(kinds) and rep.announced == len(keys) and len(box) == 0, rep
        if keys:  # the gateway's answer was lost: the node sends the bundle again, same webhook-id
            with events.routed(box.sink()):
                events.emit(events.BUNDLE_LANDED, "edgehaul.bundle.again", _landed(node, kinds.index(True)))
            again = Forwarder(box, gw, node, key).forward()
            assert again.ok and again.statuses == [409] and len(box) == 0
    assert sorted(rec.batch_keys()) == sorted(keys)  # each bundle in a landing batch, once
    summaries = [p["i"] for n, p in zip(rec.names, rec.payloads, strict=True) if n == events.NODE_RUN_SUMMARY]
    assert summaries == [i for i, landed in enumerate(kinds) if not landed]
    box.close()


def test_a_sender_not_allowed_to_announce_stops_the_forwarder_and_keeps_the_bundle(tmp_path: Path, node: str) -> None:
    senders, key = _senders(tmp_path, node)  # node-events only: an operator must add bundle-uploaded
    box = Outbox(tmp_path / "o.sqlite", node)
    with events.routed(box.sink()):
        events.emit(events.LINK_STATS, f"edgehaul.link.{node}", {"level": 1})
        events.emit(events.BUNDLE_LANDED, "edgehaul.bundle.b", _landed(node, 1))
    with _gateway(tmp_path, senders, Recorder()) as gw, \
            pytest.raises(ForwardError, match=f"refused {ANNOUNCE_HOOK} .* 403 sender '{node}' may not send"):
        Forwarder(box, gw, node, key).forward()
    assert [e.event for e in box.peek(10)] == [events.BUNDLE_LANDED]  # the event before it went; the bundle waits


def test_an_outbox_announces_only_its_own_nodes_bundles(tmp_path: Path, node: str) -> None:
    box = Outbox(tmp_path / "o.sqlite", node)
    with events.routed(box.sink()):
        assert not events.emit(events.BUNDLE_LANDED, "edgehaul.bundle.b", _landed(f"{node}x", 1))
    assert len(box) == 0
