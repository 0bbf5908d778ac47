"""The fleet view: figures per node and for the core, as the artifact's JSON and as OpenMetrics for Prometheus."""

from __future__ import annotations

import math
import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from edgehaul import events
from edgehaul.blocks import EdgeNode, ObjectStore
from edgehaul.ops import fleet
from edgehaul.ops.metrics_endpoint import CONTENT_TYPE, make_server
from edgehaul.tasks.fleet import latest_events
from edgehaul.tasks.uplink import publish_link_stats
from edgehaul.uplink.pass_plan import Pass
from tests.waiting import wait_for

T0 = datetime(2026, 6, 1, tzinfo=UTC)
finite = st.floats(0, 1e6, allow_nan=False)
maybe = st.one_of(st.just(float("nan")), finite)


@st.composite
def views(draw: st.DrawFn) -> fleet.FleetView:
    names = draw(st.lists(st.from_regex(r"[a-z][a-z0-9-]{0,10}", fullmatch=True), max_size=5, unique=True))
    nodes = {n: fleet.NodeFigures(
        n, last_seen=draw(st.one_of(st.none(), st.just(T0 - timedelta(seconds=draw(finite))))),
        link_utilisation=draw(maybe), retransmission_rate=draw(maybe),
        latency_s={"0.5": draw(maybe), "0.99": draw(maybe)}, spool_used=draw(maybe), uplink_queue=draw(maybe),
        accelerator_utilisation=draw(maybe), silence_s=draw(maybe)) for n in names}
    core = fleet.CoreFigures(queue_s={"0.5": draw(maybe), "0.95": draw(maybe)}, checkpoint_success=draw(maybe),
                             checkpoints_committed=draw(st.integers(0, 99)), checkpoints_failed=draw(st.integers(0, 99)),
                             write_bps=draw(maybe), model_versions_behind=draw(maybe), model_age_s=draw(maybe))
    return fleet.FleetView(T0, 3600, nodes, core)


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def scrape(text: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """Family name -> {sorted labels: value} of an OpenMetrics exposition (parsed by prometheus_client)."""
    return {f.name: {tuple(sorted(s.labels.items())): s.value for s in f.samples}
            for f in text_string_to_metric_families(text)}


@given(views())
def test_openmetrics_carries_every_guide_metric_for_every_node_and_survives_the_json(view: fleet.FleetView) -> None:
    again = fleet.FleetView.from_json(view.to_json())
    assert again.nodes.keys() == view.nodes.keys()
    got = scrape(fleet.openmetrics(again, now=T0).decode())
    for m in fleet.METRICS:
        assert m.name in got, m.name
        owners = list(view.nodes) if m.scope == "node" else [fleet.CORE]
        for node in owners:
            src = view.nodes[node] if m.scope == "node" else view.core
            value = getattr(src, m.field)
            for q in m.quantiles or (None,):
                labels = (("node", node), ("quantile", q)) if q else (("node", node),)
                assert _same(got[m.name][labels], value[q] if q else value), (m.name, labels)
    assert got["edgehaul_fleet_report_age_seconds"][()] == 0


@given(st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 10_000)), max_size=30))
def test_queue_time_percentiles_are_observed_delays(pairs: list[tuple[int, int]]) -> None:
    runs = [(T0, T0 + timedelta(seconds=d)) for d, _ in pairs]
    q = fleet.queue_times([*runs, (None, T0)])  # a run that never started is no sample
    delays = sorted(d for d, _ in pairs)
    if not delays:
        assert math.isnan(q["0.5"]) and math.isnan(q["0.95"])
    else:
        assert q["0.5"] in delays and q["0.95"] in delays and q["0.5"] <= q["0.95"] <= delays[-1]
        assert sum(d <= q["0.95"] for d in delays) >= 0.95 * len(delays)


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(60, 3600)), min_size=1, max_size=6),
       st.one_of(st.none(), st.integers(-100, 40_000)), st.integers(0, 40_000))
def test_a_node_is_silent_exactly_when_it_missed_the_last_pass_that_ended(
        gaps: list[tuple[int, int]], heard: int | None, now_s: int) -> None:
    passes, t = [], T0
    for gap_min, dur in gaps:
        t += timedelta(minutes=gap_min)
        passes.append(Pass(t, dur, 1e6))
        t += timedelta(seconds=dur)
    now = T0 + timedelta(seconds=now_s)
    last_seen = None if heard is None else T0 + timedelta(seconds=heard)
    s = fleet.silence("n", last_seen, passes, now, default_s=60, grace_s=30)
    ended = [p for p in passes if p.end + timedelta(seconds=30) <= now]
    missed = bool(ended) and (last_seen is None or last_seen < ended[-1].start)
    assert (s is not None) == missed
    if s is not None:
        assert s.allowed_s == (now - ended[-1].start).total_seconds()


def test_without_a_contact_plan_the_default_bound_applies() -> None:
    assert fleet.silence("n", T0, None, T0 + timedelta(seconds=60), default_s=60, grace_s=0) is None
    late = fleet.silence("n", T0, None, T0 + timedelta(seconds=61), default_s=60, grace_s=0)
    assert late is not None and late.allowed_s == 60
    assert fleet.silence("n", None, None, T0, default_s=60, grace_s=0) is not None  # never heard from


@given(st.integers(0, 20), st.integers(0, 20), st.floats(0, 1e6), st.floats(1, 1e6), st.integers(0, 10))
def test_a_model_is_stale_when_newer_data_waited_past_the_bound(trained: int, newer: int, age: float, bound: float,
                                                                max_behind: int) -> None:
    s = fleet.ModelStatus("m", "s3://x/y", trained, trained + newer, T0, age)
    assert fleet.is_stale(s, max_age_s=bound, max_versions_behind=max_behind) == (
        newer > max_behind or (newer > 0 and age > bound))


@pytest.fixture
def metrics_url(store: ObjectStore) -> Iterator[str]:
    server = make_server(store, port=0, cache_s=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    server.shutdown()


def _wait_for_events(nodes: set[str], since: datetime) -> None:
    """Emitted events reach the server asynchronously: wait until its event store has one per node."""
    def seen() -> set[str | None]:
        return {r.get("edgehaul.node") for _, _, _, r in latest_events([events.LINK_STATS], since,
                                                                      datetime.now(UTC) + timedelta(seconds=5))}

    wait_for(lambda: nodes <= seen(), 60, f"LINK_STATS of {sorted(nodes)} on the server", interval=0.5)


@pytest.mark.integration
def test_a_scrape_of_the_endpoint_has_every_guide_metric_for_every_node(
        stack: Any, store: ObjectStore, metrics_url: str, tmp_path: Path) -> None:
    from edgehaul.flows.fleet_report import FleetReportParams, fleet_report

    assert httpx.get(metrics_url).status_code == 503  # nothing stored yet: a failed scrape, not empty figures
    uid = uuid.uuid4().hex[:8]
    talking, quiet = f"fleet-{uid}-a", f"fleet-{uid}-b"
    for n in (talking, quiet):
        EdgeNode(node_id=n, spool_dir=str(tmp_path / n)).save(n, overwrite=True)
    store_block = f"fleet-{uid}"
    store.save(store_block, overwrite=True)
    since = datetime.now(UTC) - timedelta(seconds=5)
    drain = {"retransmission_rate": 0.031, "goodput_bps": 4e5, "rate_cap_use": 0.62, "retry_queue": 3,
             "queue_lengths": {"high": 1, "normal": 4}, "bundles_landed": 7, "spool_used_fraction": 0.4375,
             "capture_to_landed_p50_s": {"high": 2.5, "normal": 40.0}, "capture_to_landed_p99_s": {"normal": 95.0}}
    assert publish_link_stats.fn(talking, drain)  # what uplink_drain publishes after each drain
    _wait_for_events({talking}, since)

    state = fleet_report(FleetReportParams(store_block=store_block), return_state=True)
    out = state.result()
    assert {talking, quiet} <= set(out["nodes"])

    r = httpx.get(metrics_url)
    assert r.status_code == 200 and r.headers["content-type"] == CONTENT_TYPE
    got = scrape(r.text)
    for m in fleet.METRICS:
        nodes = [talking, quiet] if m.scope == "node" else [fleet.CORE]
        for n in nodes:
            for q in m.quantiles or (None,):
                labels = (("node", n), ("quantile", q)) if q else (("node", n),)
                assert labels in got.get(m.name, {}), f"{m.name}{dict(labels)} missing from the scrape"
    one = {m: got[m][(("node", talking),)] for m in got if (("node", talking),) in got[m]}
    assert one["edgehaul_link_utilisation_ratio"] == 0.62
    assert one["edgehaul_link_retransmission_ratio"] == 0.031
    assert one["edgehaul_spool_used_ratio"] == 0.4375
    assert one["edgehaul_uplink_queue_length"] == 8  # 5 waiting in the spool + 3 in the retry queue
    assert 0 <= one["edgehaul_node_silence_seconds"] < 120
    # latency is the core's own landed -> committed (none of talking's bundles committed): not the node's claim
    assert math.isnan(got["edgehaul_landing_latency_seconds"][(("node", talking), ("quantile", "0.99"))])
    # never heard from: no figure is made up
    assert math.isnan(got["edgehaul_link_utilisation_ratio"][(("node", quiet),)])
    assert math.isnan(got["edgehaul_node_silence_seconds"][(("node", quiet),)])
    assert quiet in out["silent"] and talking not in out["silent"]
    # the same figures as the stored JSON behind the artifact
    view = fleet.read_view(store)
    assert view is not None and view.nodes[talking].link_utilisation == 0.62
    # ... and as the run's keyed artifacts: a table row per node + the core, the chart inline
    arts = _artifacts(state.state_details.flow_run_id)
    rows = {r["node"]: r for r in arts["fleet-view"]}
    assert rows[talking]["link_util"] == "0.620" and rows[quiet]["last_seen"] == "never" and fleet.CORE in rows
    assert "](data:image/png;base64," in arts["fleet-view-chart"]


def _artifacts(run_id: Any) -> dict[str, Any]:
    import json

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        arts = client.read_artifacts(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])))
    return {a.key: json.loads(a.data) if a.type == "table" and isinstance(a.data, str) else a.data
            for a in arts if a.key}


@given(st.dictionaries(st.sampled_from(["rate_cap_use", "retransmission_rate", "spool_used_fraction", "queue_lengths",
                                        "retry_queue", "accelerator_utilisation", "used_fraction"]),
                       st.one_of(st.none(), st.text(max_size=5), st.floats(), st.integers(), st.booleans(),
                                 st.lists(st.integers(), max_size=3),
                                 st.dictionaries(st.text(max_size=3), st.one_of(st.integers(), st.text(max_size=3),
                                                                                st.floats()), max_size=3))))
def test_any_event_payload_gives_figures_or_nan_and_a_named_problem_never_an_error(payload: dict[str, Any]) -> None:
    problems: list[str] = []
    f = fleet.node_figures("n", (T0, payload), (T0 + timedelta(seconds=1), payload), T0, None, problems)
    for v in (f.link_utilisation, f.retransmission_rate, f.spool_used, f.uplink_queue, f.accelerator_utilisation):
        assert isinstance(v, float) and (math.isnan(v) or math.isfinite(v))
    assert len(problems) <= 1 and all(p.startswith("node n: ") for p in problems)
    bad = [k for k in ("rate_cap_use", "retransmission_rate", "spool_used_fraction", "accelerator_utilisation",
                       "used_fraction") if payload.get(k) is not None and not fleet._is_num(payload[k])]
    assert all(f"{k}=" in problems[0] for k in bad)  # each unusable figure named (an IndexError if none is)


@given(st.lists(st.tuples(st.sampled_from(["a", "b"]), st.sampled_from(["b1", "b2", "b3"]), st.integers(0, 100),
                          st.integers(0, 100)), max_size=12))
def test_commit_latency_is_receipt_minus_first_announcement_per_node_and_bundle(
        rows: list[tuple[str, str, int, int]]) -> None:
    batches: list[tuple[datetime, dict[str, Any]]] = [
        (T0 + timedelta(seconds=t), {"bundle_keys": [f"{n}/d/{b}.parquet"], "bundle_ids": [b]}) for n, b, t, _ in rows]
    batches.append((T0, {"bundle_keys": "not a list", "bundle_ids": []}))  # skipped, not an error
    first: dict[tuple[str, str], int] = {}
    for n, b, t, _ in rows:
        first[(n, b)] = min(t, first.get((n, b), t))
    receipts = [(T0 + timedelta(seconds=200 + d), n, b) for n, b, _, d in rows]
    got = fleet.commit_latencies(batches, receipts)
    for node in {"a", "b"}:
        waits = [200 + d - first[(n, b)] for n, b, _, d in rows if n == node]
        assert (node in got) == bool(waits)
        if waits:
            assert got[node] == {"0.5": fleet.percentile(waits, 0.5), "0.99": fleet.percentile(waits, 0.99)}


def test_dashboard_and_scrape_config_cover_every_guide_metric() -> None:
    import json

    import yaml

    root = Path(__file__).resolve().parents[2] / "infra" / "monitoring"
    dash = json.loads((root / "grafana-dashboard.json").read_text())
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p["targets"])
    assert [m.name for m in fleet.METRICS if m.name not in exprs] == []
    scrape_cfg = yaml.safe_load((root / "prometheus.yml").read_text())
    job = next(j for j in scrape_cfg["scrape_configs"] if j["job_name"] == "edgehaul-fleet")
    assert job["metrics_path"] == "/metrics"
    assert all(t.endswith(":9464") for sc in job["static_configs"] for t in sc["targets"])  # the endpoint's default port
