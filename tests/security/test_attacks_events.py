"""Events from a node are data, never commands: what a hostile node holding its own gateway key can no
longer do to the fleet view, the core's pages or the other nodes.

On main at e80770e: a node forwarded `edgehaul.checkpoint.failed` (20 level-3 pages, checkpoint success
0.048), one `link.stats` with a non-numeric queue length failed `fleet_report` for the whole fleet, a
seq pushed past 2**62 had every later event skipped, one sender filling the shared replay store made
every other node get 429, and some signed bodies got a 500.
"""

from __future__ import annotations

import json
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from edgehaul import events
from edgehaul.edge.outbox import Outbox
from edgehaul.services.gateway import (
    MAX_SEQ,
    MAX_SEQ_JUMP,
    NODE_EVENT_SCHEMAS,
    GatewayConfig,
    SenderRegistry,
    create_app,
    new_secret,
    parse_senders,
    signed_headers,
    write_senders,
)
from edgehaul.uplink.forwarder import HOOK, Forwarder
from tests.services.test_gateway import Recorder
from tests.waiting import wait_for

NOW = 1_800_000_000.0


class Clock:
    def __init__(self, t: float = NOW) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _app(tmp_path: Path, senders: dict[str, dict[str, Any]], clock: Clock, **kw: Any) -> tuple[TestClient, Recorder]:
    write_senders(tmp_path / "senders.json", senders)
    central = Recorder()
    app = create_app(GatewayConfig(SenderRegistry(tmp_path / "senders.json"), tmp_path / "gw", clock=clock, **kw),
                     central)
    return TestClient(app), central


def _node(name: str, key: str, **over: Any) -> dict[str, Any]:
    return {name: {"keys": [key], "nodes": [name], "hooks": [HOOK]} | over}


def _ev(seq: int, event: str = events.LINK_STATS, **payload: Any) -> dict[str, Any]:
    return {"seq": seq, "event": event, "occurred": datetime.fromtimestamp(NOW - 60, UTC).isoformat(),
            "priority": 1, "payload": payload or {"level": 1, "retransmission_rate": 0.01}}


def _post(gw: TestClient, node: str, key: str, evs: list[dict[str, Any]], clock: Clock,
          msg_id: str | None = None) -> Any:
    body = json.dumps({"node_id": node, "events": evs}).encode()
    return gw.post(f"/hooks/{node}/{HOOK}", content=body, headers=signed_headers(key, body, msg_id=msg_id, now=clock()))


def test_the_node_event_types_are_the_forwardable_ones_and_never_the_cores() -> None:
    assert set(NODE_EVENT_SCHEMAS) == events.NODE_FORWARDED
    assert events.CHECKPOINT_FAILED not in events.NODE_FORWARDED


def test_a_node_cannot_forward_checkpoint_failed_and_no_senders_file_can_allow_it(tmp_path: Path) -> None:
    key, clock = new_secret(), Clock()
    gw, central = _app(tmp_path, _node("node-a", key), clock)
    with gw:
        r = _post(gw, "node-a", key, [_ev(1, events.CHECKPOINT_FAILED, level=3, run_id="r", step=1)], clock)
        assert r.status_code == 422 and "core's own" in json.dumps(r.json()), r.text
    assert central.events == []
    with pytest.raises(ValueError, match="core's own"):
        parse_senders({"senders": _node("node-a", key, events=[events.CHECKPOINT_FAILED])})


def test_each_sender_forwards_only_the_event_types_on_its_allow_list(tmp_path: Path) -> None:
    ka, kb, clock = new_secret(), new_secret(), Clock()
    senders = _node("node-a", ka, events=[events.LINK_STATS]) | _node("node-b", kb)
    gw, central = _app(tmp_path, senders, clock)
    with gw:
        r = _post(gw, "node-a", ka, [_ev(1, events.SPOOL_WATERMARK, level=2, used_fraction=0.9)], clock)
        assert r.status_code == 422 and "allow-list" in r.json()["error"], r.text
        assert _post(gw, "node-a", ka, [_ev(1)], clock).status_code == 202
        assert _post(gw, "node-b", kb, [_ev(1, events.SPOOL_WATERMARK, level=2, used_fraction=0.9)],
                     clock).status_code == 202
    assert [e[0] for e in central.events] == [events.LINK_STATS, events.SPOOL_WATERMARK]


@pytest.mark.parametrize(("payload", "field"), [
    ({"queue_lengths": {"high": "lots"}}, "queue_lengths.high"),
    ({"queue_lengths": "lots"}, "queue_lengths"),
    ({"retransmission_rate": "0.2x"}, "retransmission_rate"),
    ({"retransmission_rate": 1e300}, "retransmission_rate"),
    ({"goodput_bps": -1}, "goodput_bps"),
    ({"capture_to_landed_p99_s": {"high": [1, 2]}}, "capture_to_landed_p99_s"),
    ({"level": 7}, "level"),
    ({"node_id": "node-b"}, "node_id"),
    ({"note": "x" * 5000}, "note"),
    ({"deep": [[[[[[1]]]]]]}, "deep"),
    ({"big": 2**60}, "big"),
])
def test_a_link_stats_payload_outside_its_schema_is_refused_naming_the_field(tmp_path: Path, payload: dict[str, Any],
                                                                              field: str) -> None:
    key, clock = new_secret(), Clock()
    gw, central = _app(tmp_path, _node("node-a", key), clock)
    with gw:
        r = _post(gw, "node-a", key, [_ev(1, **payload)], clock)
    assert r.status_code == 422 and field in json.dumps(r.json()), r.text
    assert central.events == []


def test_the_forwarder_sets_a_refused_event_aside_and_the_rest_arrives(tmp_path: Path) -> None:
    key, clock = new_secret(), Clock(time.time())  # the forwarder signs with the wall clock
    gw, central = _app(tmp_path, _node("node-a", key), clock)
    box = Outbox(tmp_path / "outbox.sqlite", "node-a")
    box.append(events.LINK_STATS, {"level": 1, "retransmission_rate": 0.02})
    box.append(events.LINK_STATS, {"level": 1, "queue_lengths": {"high": "lots"}})  # forged
    box.append(events.CHECKPOINT_FAILED, {"level": 3, "run_id": "r", "step": 1})  # forged
    box.append(events.SPOOL_WATERMARK, {"level": 2, "used_fraction": 0.9})
    with gw:
        rep = Forwarder(box, gw, "node-a", key).forward()
    assert rep.ok and len(box) == 0 and rep.set_aside == [2, 3], rep
    assert [e[0] for e in central.events] == [events.LINK_STATS, events.SPOOL_WATERMARK]
    why = {seq: w for seq, _, w in box.set_aside_events()}
    assert "queue_lengths" in why[2] and "core's own" in why[3], why


def test_a_seq_past_the_bound_is_refused_and_the_nodes_later_events_still_arrive(tmp_path: Path) -> None:
    key, clock = new_secret(), Clock()
    gw, central = _app(tmp_path, _node("node-a", key), clock)
    with gw:
        assert _post(gw, "node-a", key, [_ev(1)], clock).status_code == 202
        for seq in (2**62, MAX_SEQ + 1, 2**64 + 5):
            r = _post(gw, "node-a", key, [_ev(seq)], clock)
            assert r.status_code == 422 and "seq" in json.dumps(r.json()), r.text
        r = _post(gw, "node-a", key, [_ev(2), _ev(2 + MAX_SEQ_JUMP + 1)], clock)
        assert r.status_code == 422 and "jumps more than" in r.json()["error"], r.text
        r = _post(gw, "node-a", key, [_ev(2), _ev(3)], clock)
        assert r.status_code == 202 and r.json()["emitted"] == 2 and r.json()["seq"] == 3, r.text
    assert len(central.events) == 3


def test_one_sender_filling_its_replay_share_gets_429_and_the_others_do_not(tmp_path: Path) -> None:
    ka, kb, clock = new_secret(), new_secret(), Clock()
    gw, _ = _app(tmp_path, _node("node-a", ka) | _node("node-b", kb), clock, replay_capacity=20,
                 rate_per_s=1e6, rate_burst=1e6)
    with gw:
        codes = [_post(gw, "node-a", ka, [_ev(i)], clock).status_code for i in range(1, 26)]
        assert codes == [202] * 20 + [429] * 5
        r = _post(gw, "node-a", ka, [_ev(30)], clock)
        assert "its share of the replay store" in r.json()["error"] and int(r.headers["retry-after"]) >= 1
        assert [_post(gw, "node-b", kb, [_ev(i)], clock).status_code for i in range(1, 21)] == [202] * 20
        clock.t += 302  # node-a's ids expire with their timestamps: its share is free again
        assert _post(gw, "node-a", ka, [_ev(30)], clock).status_code == 202


def test_one_sender_over_its_rate_gets_429_and_the_others_do_not(tmp_path: Path) -> None:
    ka, kb, clock = new_secret(), new_secret(), Clock()
    gw, _ = _app(tmp_path, _node("node-a", ka) | _node("node-b", kb), clock, rate_per_s=2, rate_burst=5)
    with gw:
        codes = [_post(gw, "node-a", ka, [_ev(i)], clock).status_code for i in range(1, 9)]
        assert codes == [202] * 5 + [429] * 3
        r = _post(gw, "node-a", ka, [_ev(9)], clock)
        assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
        assert [_post(gw, "node-b", kb, [_ev(i)], clock).status_code for i in range(1, 6)] == [202] * 5
        # an unsigned flood in node-a's name spends nothing of its quota
        clock.t += 10
        for _ in range(20):
            assert gw.post(f"/hooks/node-a/{HOOK}", content=b"{}", headers={"webhook-id": "x"}).status_code == 401
        assert _post(gw, "node-a", ka, [_ev(6)], clock).status_code == 202


# ---- no signed body gets a 500 ----------------------------------------------------------------------

_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=30),
    lambda kids: st.lists(kids, max_size=5) | st.dictionaries(st.text(max_size=12), kids, max_size=5),
    max_leaves=30)
_payload = st.dictionaries(st.sampled_from(["level", "node_id", "queue_lengths", "retransmission_rate", "goodput_bps",
                                            "capture_to_landed_p50_s", "totals", "items", "why", "generation",
                                            "origin_resource", "x"]), _json, max_size=6)
_event = st.fixed_dictionaries({
    "seq": st.integers(-5, 2**70) | st.sampled_from([1, 2, MAX_SEQ, MAX_SEQ + 1]) | _json,
    "event": st.sampled_from([*sorted(NODE_EVENT_SCHEMAS), events.CHECKPOINT_FAILED, "edgehaul.x", "x"]) | _json,
    "occurred": st.sampled_from(["2026-12-05T00:00:00Z", "2026-12-05T00:00:00", "yesterday", "9999-12-31T23:59:59Z"])
    | _json,
    "priority": st.integers(-1, 120) | _json,
    "payload": _payload | _json,
})
_bodies = st.one_of(
    st.binary(max_size=300),
    _json.map(lambda d: json.dumps(d).encode()),
    st.fixed_dictionaries({"node_id": st.sampled_from(["node-a", "node-b", "", "node-a/.."]) | _json,
                           "events": st.lists(_event, max_size=4) | _json}).map(lambda d: json.dumps(d).encode()),
    st.sampled_from([b"[" * 60_000 + b"]" * 60_000, b'{"node_id": "node-a", "events": [' + b"9" * 5000 + b"]}",
                     b'{"node_id": "node-a", "events": [{"seq": NaN}]}', b'{"a": Infinity}',
                     b'{"node_id": "node-a", "events": [{"seq": 1, "payload": ' + b'{"a":' * 3000 + b"1" + b"}" * 3000
                     + b"}]}", "\udcff".encode("utf-8", "surrogatepass"), b"\xff\xfe{}"]),
)


@pytest.fixture(scope="module")
def fuzz_gw(tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("fuzz")
    key = new_secret()
    hooks = ["node-events", "bundle-uploaded", "contact-window-opened"]
    write_senders(root / "senders.json", {"node-a": {"keys": [key], "nodes": ["node-a"], "hooks": hooks}})
    with TestClient(create_app(GatewayConfig(SenderRegistry(root / "senders.json"), root / "gw", max_body_bytes=256 * 1024,
                                             rate_per_s=1e6, rate_burst=1e6, replay_capacity=10**6), Recorder())) as gw:
        yield gw, key


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.sampled_from(["node-events", "bundle-uploaded", "contact-window-opened"]), _bodies)
def test_no_signed_body_gets_a_500(fuzz_gw: tuple[TestClient, str], kind: str, body: bytes) -> None:
    gw, key = fuzz_gw
    r = gw.post(f"/hooks/node-a/{kind}", content=body, headers=signed_headers(key, body))
    assert r.status_code < 500, (r.status_code, r.text[:300], body[:200])
    assert len(r.content) < 8000 and "Traceback" not in r.text


# ---- on the real stack ------------------------------------------------------------------------------


@pytest.mark.integration
def test_forged_node_events_never_reach_prefect_and_the_honest_ones_do(stack: Any, tmp_path: Path) -> None:
    """The real gateway app emitting into the session's real Prefect, fed by the node's real forwarder."""
    import httpx

    from edgehaul.services.gateway import PrefectEmitter
    from tests.conftest import api_auth

    node, key = f"n{uuid.uuid4().hex[:10]}", new_secret()
    write_senders(tmp_path / "senders.json", _node(node, key))
    box = Outbox(tmp_path / "outbox.sqlite", node)
    box.append(events.CHECKPOINT_FAILED, {"level": 3, "run_id": "forged", "step": 1})
    box.append(events.LINK_STATS, {"level": 1, "queue_lengths": {"high": "lots"}})
    box.append(events.LINK_STATS, {"level": 1, "retransmission_rate": 0.02, "queue_lengths": {"high": 2}})
    with TestClient(create_app(GatewayConfig(SenderRegistry(tmp_path / "senders.json"), tmp_path / "gw"),
                               PrefectEmitter())) as gw:
        rep = Forwarder(box, gw, node, key).forward()
        assert rep.ok and rep.set_aside == [1, 2] and len(box) == 0, rep
        body = json.dumps({"node_id": node, "events": [_ev(2**62)]}).encode()
        r = gw.post(f"/hooks/{node}/{HOOK}", content=body, headers=signed_headers(key, body))
        assert r.status_code == 422, r.text
    flt = {"filter": {"resource": {"id": [f"edgehaul.node.{node}"]}, "order": "ASC"}, "limit": 50}
    wait_for(lambda: httpx.post(f"{stack.prefect_api_url}/events/filter", auth=api_auth(), json=flt,
                                timeout=10).json()["events"], 30, f"an event of node {node} in Prefect", interval=0.5)
    time.sleep(1.0)  # and nothing more arrives after
    got = httpx.post(f"{stack.prefect_api_url}/events/filter", auth=api_auth(), json=flt, timeout=10).json()["events"]
    assert [(e["event"], e["payload"]["seq"]) for e in got] == [(events.LINK_STATS, 3)], got


@pytest.mark.integration
def test_a_malformed_stored_event_costs_one_line_not_the_fleet_report(stack: Any, tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """Records stored before the gateway checked payloads (or by any API client): the report still runs,
    the honest node's figures are there, the bad node's figure is NaN, one warning names it; a forwarded
    checkpoint.failed does not count against the core's checkpoint success."""
    import logging
    import math

    from prefect.events import emit_event

    from edgehaul.blocks import EdgeNode
    from edgehaul.flows.fleet_report import FleetReportParams, fleet_report
    from tests.conftest import store_for
    from tests.ops.test_fleet import _wait_for_events

    uid = uuid.uuid4().hex[:8]
    good, bad = f"fleet-{uid}-good", f"fleet-{uid}-bad"
    for n in (good, bad):
        EdgeNode(node_id=n, spool_dir=str(tmp_path / n)).save(n, overwrite=True)
    store = store_for(stack, prefix=f"t-{uid}")
    store.save(f"fleet-{uid}", overwrite=True)
    now = datetime.now(UTC)
    since = now - timedelta(seconds=5)
    link = {"retransmission_rate": 0.03, "rate_cap_use": 0.5, "queue_lengths": {"high": 1}, "retry_queue": 1}
    events.emit(events.LINK_STATS, f"edgehaul.link.{good}", link, **{"edgehaul.node": good})
    events.emit(events.LINK_STATS, f"edgehaul.link.{bad}", {**link, "queue_lengths": {"high": "lots"},
                                                              "rate_cap_use": "most"}, **{"edgehaul.node": bad})
    for _ in range(5):
        events.emit(events.CHECKPOINT_FAILED, f"edgehaul.node.{bad}", {"level": 3},
                    **{"edgehaul.node": bad, "edgehaul.forwarded": "true"})
    # the core's records of one of good's bundles: announced 30 s before its commit receipt
    emit_event(event=events.LANDING_BATCH, resource={"prefect.resource.id": f"edgehaul.landing.batch.{uid}"},
               payload={"bundle_keys": [f"{good}/2026-12-05/b-{uid}.parquet"], "bundle_ids": [f"b-{uid}"]},
               occurred=now - timedelta(seconds=31))
    emit_event(event=events.BUNDLE_RECEIPT, resource={"prefect.resource.id": f"edgehaul.bundle.b-{uid}",
                                                      "edgehaul.node.id": good},
               payload={"status": "committed", "node_id": good}, occurred=now - timedelta(seconds=1))
    _wait_for_events({good, bad}, since)
    time.sleep(1.0)
    with caplog.at_level(logging.WARNING):
        out = fleet_report(FleetReportParams(store_block=f"fleet-{uid}", window_s=600))
    assert {good, bad} <= set(out["nodes"])
    view = __import__("edgehaul.ops.fleet", fromlist=["read_view"]).read_view(store)
    assert view is not None
    assert view.nodes[good].uplink_queue == 2 and view.nodes[good].link_utilisation == 0.5
    assert view.nodes[good].latency_s == {"0.5": 30.0, "0.99": 30.0}
    assert math.isnan(view.nodes[bad].uplink_queue) and math.isnan(view.nodes[bad].link_utilisation)
    assert view.nodes[bad].retransmission_rate == 0.03
    assert view.core.checkpoints_failed == 0
    lines = [r.getMessage() for r in caplog.records if bad in r.getMessage() and "unusable" in r.getMessage()]
    assert len(lines) == 1 and "queue_lengths" in lines[0] and "rate_cap_use" in lines[0], lines


def test_what_the_product_itself_forwards_passes_the_schemas(tmp_path: Path) -> None:
    """The honest side of the schemas: the node's own emitters (link stats of a drain, a run summary and
    ledger totals, a retry expiry, downlink results) are all accepted, nothing set aside."""
    from edgehaul.edge.outbox import record_run
    from edgehaul.tasks.uplink import publish_link_stats

    key, clock = new_secret(), Clock(time.time())
    gw, central = _app(tmp_path, _node("node-a", key), clock)
    box = Outbox(tmp_path / "outbox.sqlite", "node-a")
    with events.routed(box.sink()):
        publish_link_stats.fn("node-a", {"retransmission_rate": 0.01, "goodput_bps": 3e5, "rate_cap_use": 0.4,
                                         "queue_lengths": {"high": 0, "normal": 3}, "retry_queue": 1,
                                         "capture_to_landed_p50_s": {"high": None, "normal": -1.5},
                                         "capture_to_landed_p99_s": {"normal": 80.0}, "spool_used_fraction": None})
        events.emit(events.RETRY_EXPIRED, "edgehaul.uplink.node-a",
                    {"bundle_id": "b-1", "samples": 40, "reason": "retry-expired", "detail": "x" * 300})
        events.emit(events.CONTACT_OPENED, "edgehaul.link.node-a", {"waited_s": 12.5})
    record_run(box, "edge_ingest", {"batches": 2, "samples_in": 900, "rejected": {"decode": 3}, "bundles": 4,
                                    "spool_used_fraction": 0.2}, {"ingest/accepted": 897, "ingest/decode": 3})
    box.append(events.DOWNLINK_APPLIED, {"generation": 3, "previous": 2, "items": ["model/landcover@7"]})
    box.append(events.DOWNLINK_REFUSED, {"generation": 4, "in_force": 3, "why": "sha256 mismatch"})
    with gw:
        rep = Forwarder(box, gw, "node-a", key).forward()
    assert rep.ok and rep.set_aside == [] and len(box) == 0, (rep, box.set_aside_events())
    assert len(central.events) == 7
