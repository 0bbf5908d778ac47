"""The byte budget a node tiers with comes from its link: a policy that does not fix `budget_share` gets the share
of what the node observes that its link plans to carry (`pass_plan.planned_share`); plain functions, no server."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from edgehaul.blocks import EdgeNode, LinkProfile, TieringPolicy
from edgehaul.tasks.edge import link_budget, node_link_budget, observed_bytes_per_s
from edgehaul.uplink.pass_plan import PLAN_HEADROOM, Pass, planned_share
from tests.gait_rows import GAIT, gait_raw

LINK = LinkProfile(bandwidth_bps=8_000_000, rate_cap_fraction=0.5)  # 500 kB/s data plane


def test_a_policy_without_a_share_gets_what_the_link_carries_and_one_with_a_share_keeps_it() -> None:
    got = link_budget(TieringPolicy(), LINK, 5_000_000)
    assert got.budget_share == pytest.approx(float(f"{PLAN_HEADROOM * 0.1:.2g}"))
    assert got.model_copy(update={"budget_share": None}) == TieringPolicy()  # nothing else changes
    assert link_budget(TieringPolicy(budget_share=0.3), LINK, 5_000_000).budget_share == 0.3  # the operator's
    assert link_budget(TieringPolicy(), LINK, 1_000).budget_share == 1.0  # the link carries everything
    assert link_budget(TieringPolicy(), LINK, None).budget_share is None  # no rate known: no plan
    # a pass schedule plans by its passes: two 10-minute passes at 8 Mbit/s in the next day
    now = datetime(2026, 1, 1, tzinfo=UTC)
    passes = [Pass(now + timedelta(hours=h), 600.0, 8_000_000) for h in (1, 13)]
    want = planned_share(LINK, raw_bytes_per_s=100_000, passes=passes, now=now)
    assert link_budget(TieringPolicy(), LINK, 100_000, passes=passes, now=now).budget_share == pytest.approx(
        want, rel=0.05)


@given(rate=st.floats(min_value=1.0, max_value=1e12))
def test_the_planned_share_is_a_share_and_within_rounding_of_the_plan(rate: float) -> None:
    share = link_budget(TieringPolicy(), LINK, rate).budget_share
    assert share is not None and 0 < share <= 1
    assert share == pytest.approx(planned_share(LINK, raw_bytes_per_s=rate), rel=0.05)
    # two significant digits: a rate measured 0.1% differently moves the share (and the policy's fingerprint, the
    # batch cache key) by at most one step of its second digit
    other = link_budget(TieringPolicy(), LINK, rate * 1.001).budget_share
    assert other is not None and abs(other - share) <= 10 ** (math.floor(math.log10(share)) - 1) * 1.0001


def test_the_observed_rate_is_a_batch_bytes_over_its_capture_span() -> None:
    raw = gait_raw(200, anomaly_rate=0.05, seed=1)  # readings 15 ms apart
    assert observed_bytes_per_s(raw, GAIT) == pytest.approx(raw.nbytes / (199 * 0.015))
    assert observed_bytes_per_s(raw.slice(0, 1), GAIT) is None  # one reading spans no time
    same = raw.set_column(raw.schema.get_field_index("capture_time"), "capture_time",
                          pa.array([raw.column("capture_time")[0].as_py()] * 200, raw.schema.field("capture_time").type))
    assert observed_bytes_per_s(same, GAIT) is None
    assert observed_bytes_per_s(raw.drop_columns(["capture_time"]), GAIT) is None


def test_a_node_plans_by_its_schedule_its_given_rate_or_its_first_batch(tmp_path: Path) -> None:
    raw = gait_raw(200, anomaly_rate=0.05, seed=1)
    rate = raw.nbytes / (199 * 0.015)
    node = EdgeNode(node_id="node-a", spool_dir=str(tmp_path / "spool"))
    lines: list[str] = []
    log = lambda msg, *a: lines.append(msg % a)  # noqa: E731
    assert node_link_budget(TieringPolicy(), LINK, node, raw, GAIT, log=log).budget_share == \
        link_budget(TieringPolicy(), LINK, rate).budget_share
    assert node_link_budget(TieringPolicy(), LINK, node, raw, GAIT, 1_000.0).budget_share == 1.0  # as given
    assert "planned for the link" in lines[0]
    # with a pass schedule: its passes, not the profile's rate cap (one short pass a day: a much smaller share)
    start = datetime.now(UTC) + timedelta(hours=1)
    sched = tmp_path / "passes.yaml"
    sched.write_text(yaml.safe_dump({"passes": [{"start": start.isoformat(), "duration_s": 60, "rate_bps": 8e6}]}))
    by_pass = node_link_budget(TieringPolicy(), LINK, node.model_copy(update={"pass_schedule": str(sched)}), raw,
                               GAIT, 1e5)
    assert by_pass.budget_share == pytest.approx(PLAN_HEADROOM * 60 * 1e6 * 0.5 / 86400 / 1e5, rel=0.05)
    # an unreadable schedule is said, and the profile plans
    lines.clear()
    broken = node.model_copy(update={"pass_schedule": str(tmp_path / "missing.yaml")})
    assert node_link_budget(TieringPolicy(), LINK, broken, raw, GAIT, 1e5, log).budget_share == \
        link_budget(TieringPolicy(), LINK, 1e5).budget_share
    assert "unreadable" in lines[0]
