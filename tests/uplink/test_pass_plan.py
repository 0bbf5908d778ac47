"""The pass planner (edgehaul.uplink.pass_plan): unit and property tests, and one pass drained for real."""

from __future__ import annotations

import hashlib
import json
import random
import uuid
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgehaul.blocks import EdgeNode, LinkProfile, ObjectStore
from edgehaul.bundles import BundleManifest, write_bundle
from edgehaul.contracts import load_contract
from edgehaul.edge.spool import Spool
from edgehaul.flows.uplink_drain import UplinkDrainParams, uplink_drain
from edgehaul.uplink.link import SimulatedLink
from edgehaul.uplink.pass_drain import thin_for_the_wire
from edgehaul.uplink.pass_plan import (
    Overhead,
    Pass,
    PassScheduleError,
    Pending,
    load_passes,
    pending_from_spool,
    plan_pass,
    plan_passes,
    upcoming,
)
from edgehaul.uplink.transfer import Drainer, Uplink
from edgehaul_dev import localstack
from tests.builders import bundle, processed_rows
from tests.conftest import api_auth
from tests.doubles import MemorySource

T0 = datetime(2026, 12, 4, 10, 0, tzinfo=UTC)
MB = 1_000_000
MiB = 1024 * 1024


def _e(i: int, nbytes: int, value: float, tier: str = "normal", **kw: object) -> Pending:
    return Pending(bundle_id=f"b{i:04d}", tier=tier, value=value, max_value=value / 10, nbytes=nbytes,
                   created_at=f"2026-12-04T09:{i % 60:02d}:00+00:00", **kw)  # type: ignore[arg-type]


def _window(capacity_bytes: int, start: datetime = T0) -> Pass:
    return Pass(start, 8.0, float(capacity_bytes))  # exactly capacity_bytes at a cap fraction of 1.0


# -- unit -------------------------------------------------------------------------------------------

def test_urgent_first_then_value_per_byte_and_the_rest_waits() -> None:
    pending = [_e(1, 40 * MB, 4.0), _e(2, 30 * MB, 30.0), _e(3, 30 * MB, 29.0), _e(4, 10 * MB, 1.0, "high"),
               _e(5, 35 * MB, 3.0)]
    plan = plan_passes(pending, [_window(100 * MB)], cap_fraction=1.0, overhead=Overhead())
    (pp,) = plan.passes
    assert pp.bundle_ids[0] == "b0004"  # urgent first
    assert set(pp.bundle_ids) == {"b0004", "b0002", "b0003"} and pp.planned_bytes == 70 * MB
    assert sorted(plan.waits) == ["b0001", "b0005"]  # neither fits the 30 MB left
    assert pp.planned_value == pytest.approx(60.0)


def test_exact_knapsack_beats_density_order_and_fill_uses_small_bundles() -> None:
    # Density order takes the 51 MB bundle first (1.02/MB); then neither 49.9 MB one fits, only the 1 MB one.
    # The two 49.9 MB bundles (1.0/MB) are worth more together.
    pending = [_e(1, 51 * MB, 52.0), _e(2, 49_900_000, 50.0), _e(3, 49_900_000, 50.0), _e(4, 1 * MB, 0.5)]
    w = [_window(100 * MB)]
    dp = plan_passes(pending, w, cap_fraction=1.0, overhead=Overhead(), method="dp")
    greedy = plan_passes(pending, w, cap_fraction=1.0, overhead=Overhead(), method="greedy")
    assert dp.value == pytest.approx(100.0) and set(dp.passes[0].bundle_ids) == {"b0002", "b0003"}
    assert greedy.value == pytest.approx(52.5) and set(greedy.passes[0].bundle_ids) == {"b0001", "b0004"}
    assert plan_passes(pending, w, cap_fraction=1.0, overhead=Overhead()).value == pytest.approx(100.0)


def test_auto_keeps_greedy_where_dp_rounding_loses() -> None:
    # 51 + 50 MB fill 101 MB exactly: the DP's sizes, rounded up to 1/4096 of the pass, no longer fit
    # together; the greedy plan does, and "auto" keeps the better of the two.
    pending = [_e(1, 51 * MB, 52.0), _e(2, 50 * MB, 50.0), _e(3, 50 * MB, 50.0)]
    w = [_window(101 * MB)]
    assert plan_passes(pending, w, cap_fraction=1.0, overhead=Overhead(), method="dp").value == pytest.approx(100.0)
    assert plan_passes(pending, w, cap_fraction=1.0, overhead=Overhead()).value == pytest.approx(102.0)


def test_overhead_counts_manifest_and_round_trips() -> None:
    ov = Overhead(rtt_s=0.5, concurrency=2, multipart_threshold_bytes=16 * MiB, part_bytes=8 * MiB)
    small = _e(1, MB, 1.0, manifest_bytes=2000)
    big = _e(2, 20 * MiB, 1.0, manifest_bytes=9000)
    urgent = _e(3, MB, 1.0, "high", manifest_bytes=2000)
    cap = 100_000.0
    assert ov.requests(small) == 3 and ov.requests(urgent) == 2  # urgent skips the HEAD
    assert ov.requests(big) == 2 + 3 + 2  # HEAD, create, 3 parts, complete, manifest
    assert ov.bytes(small, cap) == 2000 + 3 * 0.5 * cap / 2
    # a 1 MB pass with 1 s of round trips per bundle carries fewer bundles than without
    many = [_e(i, 100_000, 1.0, manifest_bytes=2000) for i in range(20)]
    w = Pass(T0, 10.0, 8 * cap)
    with_rtt, _ = plan_pass(many, w, cap_fraction=1.0, overhead=ov)
    without, _ = plan_pass(many, w, cap_fraction=1.0, overhead=Overhead())
    assert len(without.items) == 9 and len(with_rtt.items) == 5  # 100 kB + 2 kB (+ 75 kB of round trips) each
    assert with_rtt.planned_cost <= with_rtt.capacity_bytes


def test_resumable_bundle_fills_the_tail_with_whole_parts_and_finishes_later() -> None:
    ov = Overhead(multipart_threshold_bytes=16 * MiB, part_bytes=8 * MiB)
    big = _e(1, 40 * MiB, 10.0, resumable=True)
    fixed = _e(2, 40 * MiB, 10.0)  # as large, not resumable: never split
    plan = plan_passes([big, fixed], [_window(30 * MiB), _window(30 * MiB, T0 + timedelta(hours=1))],
                       cap_fraction=1.0, overhead=ov)
    first, second = plan.passes
    assert [(p.bundle_id, p.nbytes, p.completes, p.value) for p in first.items] == [("b0001", 24 * MiB, False, 0.0)]
    assert [(p.bundle_id, p.nbytes, p.completes) for p in second.items] == [("b0001", 16 * MiB, True)]
    assert second.planned_value == 10.0 and plan.waits == ["b0002"]


def test_current_pass_counts_only_its_remaining_time() -> None:
    w = Pass(T0, 600.0, 2_000_000)
    assert w.capacity_bytes(0.65) == int(600 * 250_000 * 0.65)
    assert w.capacity_bytes(0.65, now=T0 + timedelta(seconds=300)) == int(300 * 250_000 * 0.65)
    assert upcoming([w, Pass(T0 + timedelta(hours=2), 60, 1e6)], T0 + timedelta(minutes=11))[0].start > T0


def test_pass_schedule_yaml(tmp_path: Path) -> None:
    f = tmp_path / "passes.yaml"
    f.write_text("passes:\n  - {start: '2026-12-04T12:00:00Z', duration_s: 540, rate_bps: 2000000}\n"
                 "  - {start: 2026-12-04T10:00:00+00:00, duration_s: 600, rate_bps: 2.0e6}\n")
    passes = load_passes(f)
    assert [p.start.hour for p in passes] == [10, 12] and passes[0].duration_s == 600
    f.write_text("passes:\n  - {start: '2026-12-04T12:00:00Z', duration_s: 0, rate_bps: 2000000}\n")
    with pytest.raises(PassScheduleError, match=r"passes.yaml pass #0: duration_s \(0.0\)"):
        load_passes(f)
    f.write_text("passes:\n  - {start: '2026-12-04T12:00:00Z', duration_s: 600, rate_bps: 1}\n"
                 "  - {start: '2026-12-04T12:05:00Z', duration_s: 600, rate_bps: 1}\n")
    with pytest.raises(PassScheduleError, match="overlap"):
        load_passes(f)


def test_pending_from_spool_reads_value_and_resume_state(tmp_path: Path) -> None:
    data, m = bundle(20, "node-p", seed=3)
    part = 5 * MiB
    entry = type("E", (), {"manifest": m, "tier": m.tier})()
    (p,) = pending_from_spool([entry], tmp_path, multipart_threshold_bytes=1, part_bytes=part)
    assert not p.resumable and p.nbytes == m.nbytes == len(data) and p.value == pytest.approx(m.value_sum)
    assert p.manifest_bytes == len(m.to_json())
    (tmp_path / f"{m.bundle_id}.mpu.json").write_text(json.dumps({"sha256": m.sha256, "part_bytes": part, "parts": {}}))
    (p,) = pending_from_spool([entry], tmp_path, multipart_threshold_bytes=1, part_bytes=part)
    assert p.resumable and p.nbytes == m.nbytes


# -- properties -------------------------------------------------------------------------------------

@st.composite
def _backlogs(draw: st.DrawFn) -> tuple[list[Pending], list[Pass]]:
    n = draw(st.integers(0, 40))
    items = []
    for i in range(n):
        nbytes = draw(st.integers(1_000, 30 * MB))
        tier = draw(st.sampled_from(["high", "normal", "normal", "normal"]))
        value = draw(st.floats(0.0, 1000.0, allow_nan=False))
        resumable = nbytes >= 16 * MiB and draw(st.booleans())
        items.append(_e(i, nbytes, value, tier, resumable=resumable, manifest_bytes=draw(st.integers(0, 50_000))))
    passes = []
    t = T0
    for _ in range(draw(st.integers(1, 4))):
        t += timedelta(seconds=draw(st.integers(0, 3600)))
        passes.append(Pass(t, draw(st.floats(10.0, 900.0)), draw(st.floats(1e5, 4e6))))
        t = passes[-1].end
    return items, passes


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_backlogs(), st.sampled_from(["auto", "dp", "greedy"]), st.floats(0.0, 5.0))
def test_plan_invariants(backlog: tuple[list[Pending], list[Pass]], method: str, rtt: float) -> None:
    pending, passes = backlog
    ov = Overhead(rtt_s=rtt, multipart_threshold_bytes=16 * MiB, part_bytes=8 * MiB)
    plan = plan_passes(pending, passes, cap_fraction=0.65, overhead=ov, method=method)  # type: ignore[arg-type]
    by_id = {e.bundle_id: e for e in pending}
    finished = Counter(p.bundle_id for pp in plan.passes for p in pp.items if p.completes)
    # every pending bundle finishes in exactly one pass, or waits
    assert all(n == 1 for n in finished.values())
    assert set(finished).isdisjoint(plan.waits) and set(finished) | set(plan.waits) == set(by_id)
    assert len(plan.waits) == len(set(plan.waits))
    sent: Counter[str] = Counter()
    available = dict(by_id)
    for pp in plan.passes:
        assert pp.planned_cost <= pp.capacity_bytes  # never over the pass at the cap
        cap_bps = pp.window.rate_bps / 8 * 0.65
        for p in pp.items:
            e = by_id[p.bundle_id]
            sent[p.bundle_id] += p.nbytes
            if not e.resumable:
                assert p.completes and p.nbytes == e.nbytes  # never split
        # urgent bundles are never left out while a non-urgent one is in: each urgent one deferred
        # from this pass did not fit what the urgent ones left
        ids = set(pp.bundle_ids)
        if any(not p.urgent for p in pp.items):
            urgent_cost = sum(p.cost for p in pp.items if p.urgent)
            for e in available.values():
                if e.urgent and e.bundle_id not in ids:
                    assert e.nbytes + ov.bytes(e, cap_bps) > pp.capacity_bytes - urgent_cost
        for p in pp.items:
            if p.completes:
                available.pop(p.bundle_id, None)
            else:
                available[p.bundle_id] = Pending(**{**available[p.bundle_id].__dict__,
                                                    "nbytes": available[p.bundle_id].nbytes - p.nbytes})
    for b in finished:
        assert sent[b] == by_id[b].nbytes  # a split bundle's pieces add up to the bundle
    assert plan.value == pytest.approx(sum(by_id[b].value for b in finished))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 200), st.floats(0.0, 100.0)), min_size=1, max_size=12),
       st.integers(50, 600))
def test_dp_is_optimal_on_small_instances(items: list[tuple[int, float]], capacity: int) -> None:
    """Against brute force, with sizes on the DP's own grid (capacity <= DP_UNITS: unit of 1 byte)."""
    from itertools import combinations

    pending = [_e(i, n, v) for i, (n, v) in enumerate(items)]
    plan = plan_passes(pending, [_window(capacity)], cap_fraction=1.0, overhead=Overhead(), method="dp")
    best = max(sum(v for _, v in c) for r in range(len(items) + 1) for c in combinations(items, r)
               if sum(n for n, _ in c) <= capacity)
    assert plan.value == pytest.approx(best, abs=1e-6)


def test_a_pass_is_thinned_to_its_wire_bytes_manifests_and_round_trips_included(tmp_path: Path) -> None:
    """The thinning before a pass counts what the plan counts: each bundle's manifest and its requests' round trips
    besides its bytes. Thinned to the bundle bytes alone, what waits overran the pass, and the plan cut whole
    bundles (one pack of every row kept: the pass left nearly empty)."""
    spool = Spool(tmp_path / "spool", cap_bytes=2**32, node_id="node-w", emit=lambda *a, **k: True)
    for i, n in enumerate((120, 150, 90, 200)):
        assert spool.put(*bundle(n, "node-w", seed=40 + i, start_seq=1000 * i)) is not None
    overhead = Overhead(rtt_s=0.2, concurrency=1)  # round trips: 120 KB a bundle at 200 KB/s

    def waiting() -> list[Pending]:
        return pending_from_spool(spool.pending(), None, multipart_threshold_bytes=16 * MiB, part_bytes=8 * MiB)

    def wire(e: Pending) -> int:
        return e.nbytes + overhead.bytes(e, 200_000)

    room = sum(wire(e) for e in waiting()) // 3
    pending = thin_for_the_wire(spool, room, waiting, wire, salt="pass-w", skip=frozenset())
    assert 0.9 * room <= sum(wire(e) for e in pending) <= room
    assert sum(e.nbytes for e in pending) < 0.9 * room  # room was left for the overhead, not filled with rows
    # a pass of exactly that room at 200 KB/s takes every bundle the thinning left
    plan, left = plan_pass(pending, Pass(T0, room / 200_000, 8 * 200_000), cap_fraction=1.0, overhead=overhead)
    assert plan.capacity_bytes <= room and not left and len(plan.items) == len(pending)


# -- one pass drained for real ------------------------------------------------------------------------

@pytest.mark.integration
def test_drain_by_plan_sends_the_planned_bundles_and_leaves_the_rest_spooled(
    stack: localstack.StackState, store: ObjectStore, tmp_path: Path
) -> None:
    tag = uuid.uuid4().hex[:8]
    node_id = f"node-p{tag}"
    node = EdgeNode(node_id=node_id, spool_dir=str(tmp_path / "spool"), spool_cap_bytes=200 * MiB)
    spool = Spool.from_block(node)
    items = [bundle(n, node_id, seed=90 + i, start_seq=10_000 * i) for i, n in enumerate((80, 150, 220, 300, 120, 260))]
    items.append(write_bundle(processed_rows(40, node_id, seed=99, start_seq=99_000, tier="high"),
                              load_contract("landsat_patch"), tier="high"))
    for d, m in items:
        assert spool.put(d, m) is not None
    backlog = sum(m.nbytes + len(m.to_json()) for _, m in items)
    # One pass that carries about half the backlog at the cap, opening once the flow has started (a run
    # starts in seconds; the drain waits for the pass).
    cap_fraction, duration = 0.7, 5.0
    rate_bps = 0.5 * backlog * 8 / (duration * cap_fraction)
    start = datetime.now(UTC) + timedelta(seconds=20)
    sched = tmp_path / "passes.yaml"
    sched.write_text(yaml.safe_dump({"passes": [
        {"start": start.isoformat(), "duration_s": duration, "rate_bps": rate_bps},
        {"start": (start + timedelta(hours=1)).isoformat(), "duration_s": 600, "rate_bps": rate_bps},
    ]}))
    node.pass_schedule = str(sched)
    node.save(f"pass-node-{tag}")
    # 20 ms one way: the round trips of local requests, in the overhead model
    LinkProfile(bandwidth_bps=8 * MiB, rate_cap_fraction=cap_fraction, latency_ms=20,
                chunk_bytes=64 * 1024).save(f"pass-link-{tag}")
    store.save(f"pass-store-{tag}")

    params = UplinkDrainParams(edge_node=f"pass-node-{tag}", link_profile=f"pass-link-{tag}",
                               object_store=f"pass-store-{tag}", max_active=2, contact_wait_s=60, by_plan=True)
    metrics = uplink_drain(params)
    pp = metrics["pass_plan"]
    planned = pp["planned_ids"]
    by_id = {m.bundle_id: m for _, m in items}
    assert 0 < len(planned) < len(items) and pp["capacity_bytes"] < backlog
    assert planned[0] == items[-1][1].bundle_id  # the urgent bundle first
    assert pp["planned_bytes"] + pp["planned_overhead_bytes"] <= pp["capacity_bytes"]
    assert pp["fill"] > 0.6  # small bundles fill what the large ones leave
    # the planned bundles landed, and only them; the rest stay spooled
    assert pp["sent_bundles"] == len(planned) and pp["not_sent"] == [] and metrics["bundles_failed"] == 0
    assert {k.rsplit("/", 1)[1].removesuffix(".parquet") for k in metrics["landed_keys"]} == set(planned)
    assert {e.bundle_id for e in spool.pending()} == set(by_id) - set(planned)
    assert all(spool.is_acked(b) for b in planned)
    s3 = store.client()
    listed = s3.list_objects_v2(Bucket=store.bucket("landing"), Prefix=store.key("landing", f"{node_id}/"))
    assert {o["Key"].rsplit("/", 1)[1].split(".")[0] for o in listed.get("Contents", [])} == set(planned)
    # planned vs sent: the bundle bytes exactly, plus manifests, within the modelled overhead
    manifests = sum(len(by_id[b].to_json()) for b in planned)
    assert pp["sent_bytes"] == pp["planned_bytes"] + manifests
    assert pp["planned_bytes"] == sum(by_id[b].nbytes for b in planned)
    assert manifests <= pp["planned_overhead_bytes"]
    assert pp["sent_value"] == pytest.approx(pp["planned_value"], abs=1e-2)
    assert pp["planned_value"] == pytest.approx(sum(by_id[b].value_sum for b in planned), abs=1e-2)
    # the next pass is planned to carry the rest, and the table artifact shows both
    (nxt,) = metrics["later_passes"]
    assert nxt["planned_bundles"] == len(items) - len(planned)
    arts = httpx.post(f"{stack.prefect_api_url}/artifacts/filter",
                      json={"artifacts": {"key": {"any_": [f"uplink-{node_id}"]}}}, timeout=10, auth=api_auth()).json()
    assert arts and any(r["metric"] == "pass sent_bytes" for r in _table_rows(arts[0]))
    spool.close()


def _table_rows(artifact: dict[str, Any]) -> list[dict[str, Any]]:
    data = artifact["data"]
    return list(json.loads(data) if isinstance(data, str) else data)


@pytest.mark.integration
def test_only_a_resumable_bundle_is_split_and_its_later_pass_sends_only_missing_parts(
    store: ObjectStore, tmp_path: Path
) -> None:
    part, cap = 5 * MiB, 5 * MiB  # one part per second at the cap
    profile = LinkProfile(bandwidth_bps=8 * cap / 0.7, chunk_bytes=256 * 1024, multipart_threshold_bytes=part,
                          part_bytes=part)
    ov = Overhead(multipart_threshold_bytes=part, part_bytes=part)
    src = MemorySource()
    ms = []
    for i in range(2):  # two bundles of 4 parts (5, 5, 5, 1 MiB)
        data = random.Random(i).randbytes(16 * MiB)
        m = BundleManifest(bundle_id=f"big{i}", node_id="node-r", contract="landsat_patch.v1", tier="normal",
                           row_count=1, sample_ids=[f"s{i}"], sha256=hashlib.sha256(data).hexdigest(),
                           nbytes=len(data), min_capture_time="2026-12-04T00:00:00+00:00",
                           max_capture_time="2026-12-04T00:00:00+00:00", value_sum=10.0 - i, max_value=0.5)
        src.put(data, m)
        ms.append(m)
    state = tmp_path / "uplink"

    def drain(ids: list[str], seconds: float) -> Any:
        link = SimulatedLink(profile, outages=[(seconds, 1e9)], emit_events=False)  # the pass ends: link cut
        up = Uplink(store, link, state)
        link.epoch = link.clock()
        return Drainer(up, src, plan=ids, attempts=1, emit_events=False).run(max_seconds=seconds + 1)

    # An unplanned drain cut mid-upload (1.8 parts' time) leaves big0 with a saved multipart state.
    drain(["big0"], 1.8)
    pend = {p.bundle_id: p for p in pending_from_spool(src.pending(), state, multipart_threshold_bytes=part,
                                                        part_bytes=part)}
    done_parts = (16 * MiB - pend["big0"].nbytes) // part
    assert pend["big0"].resumable and done_parts >= 1 and not pend["big1"].resumable

    # A pass that carries 5.5 MiB: one more part of big0; big1 (no state) is not split, it waits.
    w1 = Pass(T0, 1.1, 8 * cap / 0.7)
    pp1, _ = plan_pass(list(pend.values()), w1, cap_fraction=0.7, overhead=ov)
    assert [(p.bundle_id, p.nbytes, p.completes) for p in pp1.items] == [("big0", part, False)]
    drain(pp1.bundle_ids, 1.9)  # the link gets the part's round trips on a loaded machine too
    assert len(src) == 2  # nothing finished

    # The next pass finishes big0, sending only the parts the server lacks.
    pend = {p.bundle_id: p for p in pending_from_spool(src.pending(), state, multipart_threshold_bytes=part,
                                                        part_bytes=part)}
    assert pend["big0"].nbytes <= 16 * MiB - (done_parts + 1) * part
    w2 = Pass(T0 + timedelta(hours=1), 2.0, 8 * cap / 0.7)  # 10 MiB: the rest of big0, not big1
    pp2, left = plan_pass(list(pend.values()), w2, cap_fraction=0.7, overhead=ov)
    assert [(p.bundle_id, p.completes) for p in pp2.items] == [("big0", True)] and [e.bundle_id for e in left] == ["big1"]
    rep = drain(pp2.bundle_ids, 4.0)  # (the link stays up longer: this pass is about parts, not timing)
    (r,) = rep.landed
    assert r.bundle_id == "big0" and r.verified_by == "etag-multipart" and r.parts_total == 4
    assert r.parts_skipped >= done_parts + 1 and r.parts_sent == 4 - r.parts_skipped
    assert src.acked.keys() == {"big0"}


def test_planned_share_is_what_the_links_carry_of_what_the_node_observes() -> None:
    from edgehaul.blocks.policies import LinkProfile
    from edgehaul.uplink.pass_plan import PLAN_HEADROOM, Pass, planned_share

    link = LinkProfile(bandwidth_bps=8_000_000, rate_cap_fraction=0.5)  # 500 kB/s data plane
    assert planned_share(link, raw_bytes_per_s=5_000_000) == pytest.approx(PLAN_HEADROOM * 0.1)
    assert planned_share(link, raw_bytes_per_s=1_000) == 1.0  # the link carries everything
    lossy = link.model_copy(update={"loss_rate": 0.5})
    assert planned_share(lossy, raw_bytes_per_s=5_000_000) == pytest.approx(PLAN_HEADROOM * 0.05)
    orbit = link.model_copy(update={"contact_period_s": 6000.0, "contact_duration_s": 600.0})
    assert planned_share(orbit, raw_bytes_per_s=5_000_000) == pytest.approx(PLAN_HEADROOM * 0.01)
    assert planned_share(link, raw_bytes_per_s=5_000_000, measured_bytes_per_s=250_000) == pytest.approx(
        PLAN_HEADROOM * 0.05)
    # a schedule: two 10-minute passes at 8 Mbit/s in the next day
    now = datetime(2026, 1, 1, tzinfo=UTC)
    passes = [Pass(now + timedelta(hours=h), 600.0, 8_000_000) for h in (1, 13, 30)]
    day = 2 * 600 * 8_000_000 / 8 * 0.5
    assert planned_share(link, raw_bytes_per_s=100_000, passes=passes, now=now) == pytest.approx(
        PLAN_HEADROOM * day / 86400 / 100_000)
    backup = LinkProfile(bandwidth_bps=1e6, monthly_budget_bytes=30 * 86400 * 100)  # 100 B/s over a month
    assert planned_share(orbit, raw_bytes_per_s=5_000_000, backup=backup) == pytest.approx(
        PLAN_HEADROOM * (50_000 + 100) / 5_000_000)


def test_capacity_until_counts_the_passes_up_to_a_deadline_only() -> None:
    from edgehaul.uplink.pass_plan import Pass, capacity_until

    now = datetime(2026, 1, 1, tzinfo=UTC)
    passes = [Pass(now - timedelta(seconds=100), 400.0, 8_000), Pass(now + timedelta(hours=1), 600.0, 8_000)]
    # the open pass's 300 s left, then the next pass cut at the deadline 1 h 5 min from now: 300 s of it
    got = capacity_until(passes, now, now + timedelta(hours=1, minutes=5), 0.5)
    assert got == int(300 * 1000 * 0.5) + int(300 * 1000 * 0.5)
    assert capacity_until(passes, now, now, 0.5) == 0


def test_a_thinning_packs_to_one_pass_or_to_a_quarter_of_the_smallest_of_several() -> None:
    """One pass ahead: its rows go as one bundle (one fixed Parquet part, not one per 16 rows). Several: each pack a
    quarter of the smallest pass at most, so the plan can fill every pass with whole bundles."""
    from edgehaul.uplink.pass_plan import PACKS_PER_PASS, Pass, pack_bytes_for, pass_capacities

    now = datetime(2026, 1, 1, tzinfo=UTC)
    passes = [Pass(now - timedelta(seconds=100), 400.0, 8_000), Pass(now + timedelta(hours=1), 600.0, 8_000)]
    caps = pass_capacities(passes, now, now + timedelta(hours=1, minutes=5), 0.5)
    assert caps == [150_000, 150_000]
    assert pack_bytes_for(caps) == 150_000 // PACKS_PER_PASS
    assert pack_bytes_for(pass_capacities(passes, now, now + timedelta(minutes=30), 0.5)) == 150_000
    assert pass_capacities(passes, now, now, 0.5) == [] and pack_bytes_for([]) is None
    from edgehaul.uplink.pass_plan import PACK_MAX_BYTES

    assert pack_bytes_for([10 * PACK_MAX_BYTES]) == PACK_MAX_BYTES  # a long fast pass: packs a core accepts
