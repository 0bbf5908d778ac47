"""The fleet benchmark's quick variant as a test: a small fleet against its own central stack (Prefect on
PostgreSQL, SeaweedFS, the gateway, core_ingest served with prefect.yaml's landing-batch trigger).

The invariants the full benchmark reports at 1,000 nodes, asserted on 10 nodes at 18x the capacity model's
rate (1 bundle/s) and a burst of every node with a backlog: every landed bundle is committed exactly once,
the backlog drains, no Prefect API error, and landed bundles are coalesced into fewer runs than bundles.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.bench_fleet import Phase, Serving, fleet, summary

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("serving", ["process", "warm"])
def test_small_fleet_is_committed_exactly_once_with_no_api_errors(tmp_path: Path, serving: Serving) -> None:
    # process: Prefect's runner, a fresh process per run; warm: every run in one process (edgehaul.services.warm)
    (res,) = fleet([Phase("coalesced", 10, 10, 2, rate_scale=18, drain_timeout_s=150, serving=serving)], work=tmp_path)
    s = summary(res)
    assert s["landed"] == 10 + 10 * 2 and res.landing_failures == 0 and res.hook_errors == 0
    # every landed bundle committed, each once, with its manifest's rows; no sample id twice
    assert set(res.committed) == set(res.landed), f"not committed: {sorted(set(res.landed) - set(res.committed))}"
    assert res.wrong_rows == [] and res.duplicates == 0 and res.extra_bundles == 0
    assert s["final_backlog"] == 0 and s["recovery_s"] is not None
    assert s["api_errors"] == 0, s["api_error_sources"]
    # coalesced: far fewer core_ingest runs than bundles, each one a dataset version at most
    assert 1 <= s["flow_runs"] <= s["landed"] // 2, s["flow_runs"]
    assert 1 <= s["commits"] <= s["flow_runs"]
    # every run completed; a run whose process was still flushing when the bench stopped the runner (after
    # the last commit) is cancelled by that shutdown, and counted as such
    states = [state for _, state in res.flow_runs]
    assert states.count("CANCELLED") == res.stopped_runs, (res.stopped_runs, states)
    assert states.count("COMPLETED") + res.stopped_runs == len(states), {st: states.count(st) for st in set(states)}
    # the latencies are real measurements: a commit never precedes its landing
    assert min(res.committed[b] - t for b, t in res.landed.items()) > 0
    # validation is a task run per run's chunk (up to validate_batch bundles), not per bundle; recorded (warm:
    # flushed on stop)
    assert 1 <= s["validation_tasks"] <= s["runs_started"] < s["landed"], s
