"""The byte budget a node tiers with comes from its link: a policy that does not fix `budget_share` gets the share
of what the node observes that its link plans to carry (`pass_plan.planned_share`); plain functions, no server."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from edgehaul.blocks import EdgeNode, LinkProfile, TieringPolicy
from edgehaul.edge.preprocess import preprocess
from edgehaul.edge.tiering import for_pass_rows, full_row_bytes, inclusion_probabilities
from edgehaul.tasks.edge import link_budget, node_link_budget, observed_rate
from edgehaul.uplink.pass_plan import PLAN_HEADROOM, Pass, draw_surplus, planned_share
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


def test_the_observed_rate_is_in_full_row_bytes_over_the_capture_span() -> None:
    """The share applies to full-row bytes, so the rate is in them: a gait reading's raw Arrow bytes are about half
    its full row (a share planned on them drew about twice what the link carries)."""
    raw = gait_raw(200, anomaly_rate=0.05, seed=1)  # readings 15 ms apart
    rows = preprocess(raw, GAIT).accepted
    full = float(full_row_bytes(rows, GAIT).sum())
    got = observed_rate(raw, GAIT)
    assert got.bytes_per_s == pytest.approx(full / (199 * 0.015))
    assert got.row_bytes == pytest.approx(full / 200)
    assert got.bytes_per_s > 1.5 * raw.nbytes / (199 * 0.015)  # not the raw Arrow bytes
    one = observed_rate(raw.slice(0, 1), GAIT)  # one reading spans no time, but has a row's bytes
    assert one.bytes_per_s is None and one.row_bytes == pytest.approx(full_row_bytes(rows.slice(0, 1), GAIT)[0])
    same = raw.set_column(raw.schema.get_field_index("capture_time"), "capture_time",
                          pa.array([raw.column("capture_time")[0].as_py()] * 200, raw.schema.field("capture_time").type))
    assert observed_rate(same, GAIT).bytes_per_s is None
    # a batch the edge rejects whole (no capture time: a required column) observes nothing
    assert observed_rate(raw.drop_columns(["capture_time"]), GAIT) == observed_rate(raw.slice(0, 0), GAIT)
    assert observed_rate(raw.slice(0, 0), GAIT).row_bytes is None


def test_a_node_with_passes_draws_a_surplus_its_pass_thins() -> None:
    """Over a pass schedule the plan is the passes' bytes times `draw_surplus` of the rows a pass carries: large for
    a pass of a few rows (a Poisson draw of ten falls short by a third at one sd), small for thousands; without a
    row size, or without passes (nothing thins), the link itself."""
    now = datetime(2026, 1, 1, tzinfo=UTC)
    passes = [Pass(now + timedelta(hours=h), 600.0, 8_000_000) for h in (1, 13)]
    per_pass = 600.0 * 1e6 * LINK.rate_cap_fraction
    bare = planned_share(LINK, raw_bytes_per_s=1e6, passes=passes, now=now)
    for row in (per_pass / 10, per_pass / 1500, 100.0):
        got = planned_share(LINK, raw_bytes_per_s=1e6, passes=passes, now=now, row_bytes=row)
        assert got == pytest.approx(min(1.0, bare * draw_surplus(PLAN_HEADROOM * per_pass / row)))
    assert draw_surplus(10) > 1.7 > 1.2 > draw_surplus(1500) > draw_surplus(1e9) > 1.1
    assert planned_share(LINK, raw_bytes_per_s=1e6, row_bytes=100.0) == planned_share(LINK, raw_bytes_per_s=1e6)


@given(rows=st.floats(min_value=0.0, max_value=1e9))
def test_the_draw_surplus_shrinks_with_the_rows_a_pass_carries(rows: float) -> None:
    assert 1.0 < draw_surplus(rows * 2 + 1) <= draw_surplus(rows) <= draw_surplus(0)


def test_a_node_plans_by_its_schedule_its_given_rate_or_its_first_batch(tmp_path: Path) -> None:
    raw = gait_raw(200, anomaly_rate=0.05, seed=1)
    rate = observed_rate(raw, GAIT).bytes_per_s
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
    # times the surplus its pass thins, counted in the first batch's full rows
    first = observed_rate(raw, GAIT)  # its rows counted packed, at the ratio it measured
    assert first.row_bytes is not None and first.wire_row_bytes is not None
    rows_per_pass = PLAN_HEADROOM * 60 * 1e6 * 0.5 / first.wire_row_bytes
    assert by_pass.budget_share == pytest.approx(PLAN_HEADROOM * 60 * 1e6 * 0.5 / 86400 / 1e5 * draw_surplus(
        rows_per_pass, first.row_bytes / first.wire_row_bytes), rel=0.05)
    # an unreadable schedule is said, and the profile plans
    lines.clear()
    broken = node.model_copy(update={"pass_schedule": str(tmp_path / "missing.yaml")})
    assert node_link_budget(TieringPolicy(), LINK, broken, raw, GAIT, 1e5, log).budget_share == \
        link_budget(TieringPolicy(), LINK, 1e5).budget_share
    assert "unreadable" in lines[0]


@given(rows=st.floats(min_value=0.0, max_value=1e6), coverage=st.floats(min_value=0.0, max_value=1.0),
       urgent=st.floats(min_value=0.0, max_value=1.0), full=st.integers(min_value=0, max_value=10_000))
def test_a_pass_of_fewer_rows_draws_nearer_uniform(rows: float, coverage: float, urgent: float, full: int) -> None:
    policy = TieringPolicy(coverage=coverage, urgent_max_share=urgent, tilt_full_rows=full)
    got = for_pass_rows(policy, rows)
    assert for_pass_rows(policy, None) == policy  # no pass: nothing to fade by
    if full == 0 or rows >= full:
        assert got == policy  # the policy as set
        return
    # between the policy's tilt and none (coverage 1, no urgent share), to the two digits of the cache key
    assert coverage - 0.01 <= got.coverage <= 1.0 and 0.0 <= got.urgent_max_share <= urgent + 0.01
    assert got.coverage == float(f"{got.coverage:.2g}") and got.urgent_max_share == float(f"{got.urgent_max_share:.2g}")
    fewer = for_pass_rows(policy, rows / 2)  # fewer rows: never more tilt, beyond rounding
    assert fewer.coverage >= got.coverage - 0.01 and fewer.urgent_max_share <= got.urgent_max_share + 0.01
    assert got.model_copy(update={"coverage": coverage, "urgent_max_share": urgent}) == policy  # nothing else


def test_a_node_whose_pass_carries_a_few_rows_plans_nearer_a_uniform_draw() -> None:
    """Digits at 2% carry about nine rows a pass: the value tilt (coverage 0.8) trained below random there, so a
    node planning such a pass draws with coverage near 1; a pass of thousands keeps the policy's 0.8."""
    now = datetime(2026, 1, 1, tzinfo=UTC)
    passes = [Pass(now + timedelta(hours=h), 600.0, 8_000_000) for h in (1, 13)]
    per_pass = 600.0 * 1e6 * LINK.rate_cap_fraction
    few = link_budget(TieringPolicy(), LINK, 1e6, passes=passes, now=now, row_bytes=PLAN_HEADROOM * per_pass / 9)
    many = link_budget(TieringPolicy(), LINK, 1e6, passes=passes, now=now, row_bytes=PLAN_HEADROOM * per_pass / 5000)
    assert few.coverage == pytest.approx(1 - 0.2 * 9 / 100, abs=0.005) and many.coverage == TieringPolicy().coverage
    assert few.urgent_max_share == pytest.approx(0.5 * 9 / 100, abs=0.005)
    assert many.urgent_max_share == TieringPolicy().urgent_max_share
    # without passes (nothing bounds a draw's rows) or without a row size, the policy's coverage
    assert link_budget(TieringPolicy(), LINK, 1e6, row_bytes=10.0).coverage == TieringPolicy().coverage
    assert link_budget(TieringPolicy(), LINK, 1e6, passes=passes, now=now).coverage == TieringPolicy().coverage
    # the coverage changes what a node draws: a flatter p over the same values
    values = np.linspace(0.0, 0.79, 500)
    full_b, summ = np.full(500, 100.0), np.zeros(500)
    p_few = inclusion_probabilities(values, full_b, summ, few.model_copy(update={"budget_share": 0.1}))
    p_many = inclusion_probabilities(values, full_b, summ, many.model_copy(update={"budget_share": 0.1}))
    assert p_few.sum() == pytest.approx(p_many.sum()) == pytest.approx(50)
    assert p_few.max() / p_few.min() < p_many.max() / p_many.min()


def test_a_node_with_passes_counts_a_passs_rows_packed_as_it_measured_them() -> None:
    """A pass's rows are packed into one bundle, where a gait row costs a third of its full row: the node measures a
    packed row on its first batch (`tiering.packed_row_bytes`) and draws the rows a pass's bytes buy in those, not
    the constant margin (which drew a third of what a gait pass carries)."""
    raw = gait_raw(400, anomaly_rate=0.05, seed=2)
    got = observed_rate(raw, GAIT)
    assert got.row_bytes is not None and got.wire_row_bytes is not None
    assert 0 < got.wire_row_bytes < 0.6 * got.row_bytes  # zstd Parquet of 400 readings
    now = datetime(2026, 1, 1, tzinfo=UTC)
    passes = [Pass(now + timedelta(hours=h), 60.0, 800_000) for h in (1, 13)]
    per_pass = 60.0 * 1e5 * LINK.rate_cap_fraction
    bare = planned_share(LINK, raw_bytes_per_s=1e6, passes=passes, now=now)
    packed = planned_share(LINK, raw_bytes_per_s=1e6, passes=passes, now=now, row_bytes=got.row_bytes,
                           wire_row_bytes=got.wire_row_bytes)
    rows = PLAN_HEADROOM * per_pass / got.wire_row_bytes
    assert packed == pytest.approx(bare * draw_surplus(rows, got.row_bytes / got.wire_row_bytes))
    assert packed > 2 * planned_share(LINK, raw_bytes_per_s=1e6, passes=passes, now=now, row_bytes=got.row_bytes)
    policy = link_budget(TieringPolicy(), LINK, 1e6, passes=passes, now=now, row_bytes=got.row_bytes,
                         wire_row_bytes=got.wire_row_bytes)
    assert policy.budget_share == pytest.approx(packed, rel=0.05)  # to two significant digits
