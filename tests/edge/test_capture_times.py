"""Generated observations carry real capture times: the edge flow dates each batch when it
was first generated, recorded once (`landsat.CaptureLog`), so the uplink's capture-to-landed figures are
seconds, not the months since a fixed 2026-01-01, while a rerun regenerates the same batches (same sample
ids, times and cache keys: nothing is spooled or landed twice)."""

from __future__ import annotations

import ast
import json
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow.compute as pc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgehaul.contracts import Contract
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


# ---- capture times as tools write them (raw files at the edge) ------------------------------------------------

GAIT_YAML = """
kind: gait_raw
version: 1
columns:
  ankle: {type: float32, unit: mg, min: -5000, max: 5000}
label: {column: is_anomaly, kind: anomaly}
"""


def _gait(tmp_path: Path, raw: str = "") -> Contract:
    from edgehaul.contracts import load_contract

    d = tmp_path / f"contracts-{abs(hash(raw))}"
    d.mkdir(exist_ok=True)
    (d / "gait_raw.v1.yaml").write_text(GAIT_YAML + raw)
    return load_contract("gait_raw", 1, d)


def _times(contract: Contract, values: Sequence[object]) -> tuple[list[object], list[str]]:
    import pyarrow as pa

    from edgehaul.edge.preprocess import preprocess

    n = len(values)
    raw = pa.table({"sample_id": [f"s{i}" for i in range(n)], "capture_time": values, "seq": list(range(n)),
                    "ankle": [1.0] * n})
    r = preprocess(raw, contract, node_id="node-a")
    got = dict(zip(r.accepted.column("sample_id").to_pylist(), r.accepted.column("capture_time").to_pylist(),
                   strict=True))
    assert r.accounted()
    return [got.get(f"s{i}") for i in range(n)], r.rejects.column("detail").to_pylist()


T0 = datetime(2026, 1, 1, 0, 0, 0, 100000, tzinfo=UTC)


def test_iso_8601_as_tools_write_it_is_read_to_the_millisecond(tmp_path: Path) -> None:
    c = _gait(tmp_path)
    forms = [T0.isoformat(),  # Python: 2026-01-01T00:00:00.100000+00:00
             "2026-01-01T00:00:00.1Z", "2026-01-01 00:00:00.100Z", "2026-01-01T02:00:00.100+02:00",
             "2026-01-01T00:00:00.100999999Z",  # nanoseconds: truncated to the ms
             "2025-12-31T19:00:00.100-05:00"]
    got, _ = _times(c, forms)
    assert got == [T0] * len(forms)


def test_a_time_without_zone_or_an_undeclared_epoch_is_rejected_with_what_is_accepted(tmp_path: Path) -> None:
    got, details = _times(_gait(tmp_path), ["2026-01-01T00:00:00", "1767225600100", "yesterday"])
    assert got == [None, None, None]
    assert all("is not ISO 8601 with a zone offset" in d for d in details)
    assert "raw.capture_time" in details[1]  # says how to declare an epoch unit


@pytest.mark.parametrize(("unit", "values"), [
    ("epoch_s", [1767225600.1, "1767225600.1", " 1767225600.100 "]),
    ("epoch_ms", [1767225600100, "1767225600100", "+1767225600100"]),
    ("epoch_us", [1767225600100000, "1767225600100000", "1767225600100999"]),
])
def test_epoch_times_in_the_declared_unit_numbers_or_text(tmp_path: Path, unit: str, values: list[object]) -> None:
    c = _gait(tmp_path, f"raw: {{capture_time: {unit}}}\n")
    for v in values:  # one column type per table, as a file has
        row = [v, T0.isoformat()] if isinstance(v, str) else [v]  # ISO stays readable beside a declared epoch
        got, details = _times(c, row)
        assert got == [T0] * len(row), (v, details)
    got, details = _times(c, ["17e", "nan", "99999999999999999999999999"])
    assert got == [None, None, None] and len(details) == 3


@settings(max_examples=60, deadline=None)
@given(ms=st.integers(0, 4_102_444_800_000), unit=st.sampled_from(["epoch_s", "epoch_ms", "epoch_us"]),
       text=st.booleans(), offset_min=st.integers(-12 * 60, 14 * 60))
def test_any_time_round_trips_in_every_form(ms: int, unit: str, text: bool, offset_min: int) -> None:
    """An instant written as epoch s/ms/us (number or text) or as ISO 8601 at any offset reads back to the ms."""
    from datetime import timezone

    import pyarrow as pa

    from edgehaul.edge.preprocess import parse_times

    at = datetime.fromtimestamp(ms / 1000, UTC)
    if unit == "epoch_s":  # a float of seconds reads back to its ms (binary fractions are rounded, not cut)
        v: object = f"{ms // 1000}.{ms % 1000:03d}" if text else ms / 1000
    else:
        n = ms * (1000 if unit == "epoch_us" else 1)
        v = str(n) if text else n
    arr = pa.array([v])
    got, bad = parse_times(arr, unit)
    assert not bad.any() and got[0].as_py() == at, (v, got)
    iso = at.astimezone(timezone(timedelta(minutes=offset_min))).isoformat()
    got, bad = parse_times(pa.array([iso]), "iso8601")
    assert not bad.any() and got[0].as_py() == at, iso
