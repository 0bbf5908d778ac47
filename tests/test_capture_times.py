"""Generated observations carry real capture times (issue 22 item 4): the edge flow dates each batch when it
was first generated, recorded once (`landsat.CaptureLog`), so the uplink's capture-to-landed figures are
seconds, not the months since a fixed 2026-01-01, while a rerun regenerates the same batches (same sample
ids, times and cache keys: nothing is spooled or landed twice)."""

from __future__ import annotations

import ast
import json
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow.compute as pc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgehaul.edge.landsat import CaptureLog, generate, table_sha256
from edgehaul_dev import localstack


@settings(max_examples=15, deadline=None)
@given(n=st.integers(1, 120), batch=st.integers(1, 50), seed=st.integers(0, 3))
def test_a_logged_generation_is_dated_now_and_regenerates_the_same_batches(n: int, batch: int, seed: int) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        log = CaptureLog(Path(tmp) / "captures.sqlite")
        before = datetime.now(UTC) - timedelta(seconds=1)
        first = list(generate(n, "node-t", seed=seed, batch_size=batch, start_time=log))
        after = datetime.now(UTC) + timedelta(seconds=1)
        again = list(generate(n, "node-t", seed=seed, batch_size=batch, start_time=log))
        log.close()
        # a rerun (retry, second process, wiped spool) is the very same data: same cache keys
        assert [table_sha256(t) for t in again] == [table_sha256(t) for t in first]
        times = [t.as_py() for b in first for t in b.column("capture_time")]
        assert all(before <= t <= after for t in times), (before, times[:3], after)
        assert times == sorted(times)
        ids = [i for b in first for i in b.column("sample_id").to_pylist()]
        assert len(set(ids)) == n and ids[0] == "node-t-000000000000"
        # a reopened log keeps the times (it is a file, not this process's memory)
        reopened = CaptureLog(Path(tmp) / "captures.sqlite")
        assert table_sha256(next(generate(n, "node-t", seed=seed, batch_size=batch, start_time=reopened))) \
            == table_sha256(first[0])
        reopened.close()


def test_without_a_log_generation_stays_fixed_for_tests_and_benchmarks() -> None:
    a, b = next(generate(10, "node-t", seed=1)), next(generate(10, "node-t", seed=1))
    assert table_sha256(a) == table_sha256(b)
    assert pc.min(a.column("capture_time")).as_py() == datetime(2026, 1, 1, tzinfo=UTC)


def test_old_entries_are_pruned(tmp_path: Path) -> None:
    log = CaptureLog(tmp_path / "c.sqlite")
    first = log.time_of("k")
    assert log.time_of("k") == first
    log.close()
    log = CaptureLog(tmp_path / "c.sqlite", keep=timedelta(0))  # everything is older than now: pruned
    assert log.time_of("k") >= first
    assert log._db.execute("SELECT count(*) FROM captured").fetchone() == (1,)
    log.close()


@pytest.mark.integration
def test_uplink_reports_capture_to_landed_in_seconds_for_generated_data(
        stack: localstack.StackState, tmp_path: Path) -> None:
    from prefect.artifacts import Artifact

    from edgehaul.blocks import EdgeNode, LinkProfile
    from edgehaul.flows.edge_ingest import EdgeIngestParams, edge_ingest
    from edgehaul.flows.uplink_drain import UplinkDrainParams, uplink_drain
    from tests.conftest import store_for

    tag = uuid.uuid4().hex[:8]
    node_id = f"node-c{tag}"
    EdgeNode(node_id=node_id, spool_dir=str(tmp_path / "spool")).save(f"cap-node-{tag}")
    LinkProfile(bandwidth_bps=50e6).save(f"cap-link-{tag}")
    store_for(stack, prefix=f"t-{tag}").save(f"cap-store-{tag}")
    ingest = EdgeIngestParams(edge_node=f"cap-node-{tag}", object_store=f"cap-store-{tag}", n_samples=600,
                              batch_size=300, start_seq=0)  # numbered as given: a rerun is the same data
    drain = UplinkDrainParams(edge_node=f"cap-node-{tag}", link_profile=f"cap-link-{tag}",
                              object_store=f"cap-store-{tag}", simulate=True, max_seconds=120)
    edge = edge_ingest(ingest)
    assert edge["bundles"] > 0, edge
    metrics = uplink_drain(drain)
    assert metrics["bundles_landed"] > 0 and not any(metrics["queue_lengths"].values()), metrics  # all sent
    p99 = metrics["capture_to_landed_p99_s"]
    # seconds to minutes (generation, ingest and drain of this test on a loaded machine), never days
    assert p99 and all(0 <= v < 600 for v in p99.values()), p99
    table = Artifact.get(f"uplink-{node_id}")
    assert table is not None and isinstance(table.data, str)
    shown = {r["metric"]: r["value"] for r in json.loads(table.data)}  # what the UI's table shows
    assert ast.literal_eval(shown["capture_to_landed_p99_s"]) == p99, table.data[:800]
    print(f"capture-to-landed p99 by tier: {p99}")

    # the same run again regenerates the same batches: cached, nothing new spooled or landed
    assert edge_ingest(ingest)["bundles"] == edge["bundles"]
    assert uplink_drain(drain)["bundles_landed"] == 0


@settings(max_examples=20, deadline=None)
@given(sizes=st.lists(st.integers(0, 50), min_size=1, max_size=8), retried=st.integers(0, 7))
def test_each_run_of_a_node_numbers_its_samples_past_every_earlier_run(sizes: list[int], retried: int) -> None:
    """Sample ids never repeat on a node across runs (a process restart included); a retry of a run gets
    the very same ids, so its batches are the same data."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        ids: list[str] = []
        firsts = []
        for i, n in enumerate(sizes):
            log = CaptureLog(Path(tmp) / "captures.sqlite")  # each run opens the sensor's log anew
            first = log.first_seq(f"run-{i}", n)
            firsts.append(first)
            ids += [x for b in generate(n, "node-t", seed=0, batch_size=7, start_seq=first, start_time=log)
                    for x in b.column("sample_id").to_pylist()]
            log.close()
        assert len(ids) == len(set(ids)) == sum(sizes)
        log = CaptureLog(Path(tmp) / "captures.sqlite")
        k = retried % len(sizes)
        assert log.first_seq(f"run-{k}", sizes[k]) == firsts[k]  # a retry: same range
        log.close()
        log = CaptureLog(Path(tmp) / "captures.sqlite", keep=timedelta(0))  # old ranges pruned, the counter kept
        assert log.first_seq("later", 1) == sum(sizes)
        log.close()
