"""Tiering and batching: routing per policy, flush on N/B/T, urgent bundles, summaries, report."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgehaul.blocks import TieringPolicy
from edgehaul.bundles import read_bundle
from edgehaul.contracts import Contract, load_contract
from edgehaul.edge.landsat import generate, table_sha256
from edgehaul.edge.preprocess import preprocess
from edgehaul.edge.scoring import NoveltyScorer
from edgehaul.edge.tiering import (
    P_STEPS_PER_OCTAVE,
    VALUE_LEVELS,
    Batcher,
    assign,
    draw,
    drawn,
    inclusion_probabilities,
    on_p_grid,
    on_value_grid,
    plan_bytes,
    route,
)

C = load_contract("landsat_patch")


@pytest.fixture(scope="module")
def accepted() -> pa.Table:
    return preprocess(next(generate(1200, "node-a", seed=9, batch_size=1200)), C).accepted


class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0, 1), min_size=1, max_size=50), st.floats(0.01, 0.5), st.floats(0.51, 1.0))
def test_route_follows_thresholds(values: list[float], low: float, high: float) -> None:
    p = TieringPolicy(low_threshold=low, high_threshold=high)
    tiers = route(np.array(values), p)
    for v, t in zip(values, tiers, strict=True):
        assert t == ("high" if v >= high else "low" if v < low else "normal")


def test_assign_rejects_nan_values(accepted: pa.Table) -> None:
    v = np.full(accepted.num_rows, 0.5, np.float32)
    v[3] = np.nan
    with pytest.raises(ValueError, match="NaN for 1 of"):
        assign(accepted, v, TieringPolicy(), C)


def _values(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).random(n).astype(np.float32)


def test_routing_bundles_and_summaries_account_for_every_sample(accepted: pa.Table) -> None:
    p = TieringPolicy(flush_max_samples=400, urgent_max_bytes=200_000)
    scored = assign(accepted, _values(accepted.num_rows), p, C)
    b = Batcher(p, C)
    out = b.add(scored) + b.flush()
    tiers = dict(zip(scored.column("sample_id").to_pylist(), scored.column("tier").to_pylist(), strict=True))
    low_ids = [i for i, t in tiers.items() if t == "low"]
    sampled = {i for i, d in zip(low_ids, drawn(pa.array(low_ids), p), strict=True) if d}
    assert 0 < len(sampled) < len(low_ids)  # the default rate draws some low rows, not all
    seen_full: list[str] = []
    seen_summary: list[str] = []
    raw_store: list[str] = []
    for bb in out:
        t = read_bundle(bb.data, bb.manifest)
        ids = t.column("sample_id").to_pylist()
        summ = t.column("is_summary").to_pylist()
        if bb.manifest.tier == "high":
            assert bb.reason == "urgent" and bb.manifest.nbytes <= p.urgent_max_bytes
            assert {tiers[i] for i in ids} == {"high"}
        if bb.manifest.tier == "low":
            raw_store += ids
            assert t.column("pixels").null_count == 0
            continue
        assert t.num_rows <= p.flush_max_samples
        for i, s, px in zip(ids, summ, t.column("pixels").to_pylist(), strict=True):
            if s:
                assert tiers[i] == "low" and px is None
                seen_summary.append(i)
            else:
                assert (tiers[i] in ("high", "normal") or i in sampled) and px is not None
                seen_full.append(i)
    # every sample travels once, in full or as a summary; the raw store keeps exactly the summaries' pixels
    assert sorted(seen_full) == sorted([i for i, t in tiers.items() if t != "low"] + sorted(sampled))
    assert sorted(seen_summary) == sorted(raw_store) == sorted(set(low_ids) - sampled)
    assert b.report.sampled_low == len(sampled)
    assert len(seen_full) == len(set(seen_full))
    assert b.report.samples == {k: sum(1 for t in tiers.values() if t == k) for k in ("high", "normal", "low")}


def test_flush_on_samples_bytes_and_age(accepted: pa.Table) -> None:
    clock = Clock()
    normal = np.full(accepted.num_rows, 0.5, np.float32)
    scored = assign(accepted, normal, TieringPolicy(), C)
    # N: 1200 rows at N=500 -> 500, 500 now, 200 buffered
    b = Batcher(TieringPolicy(flush_max_samples=500), C, clock=clock)
    out = b.add(scored)
    assert [(x.reason, x.manifest.row_count) for x in out] == [("samples", 500), ("samples", 500)]
    assert b.buffered_rows == 200
    # T: the buffered rows leave once their first row is flush_max_seconds old
    b2 = Batcher(TieringPolicy(flush_max_seconds=30), C, clock=clock)
    assert b2.add(scored.slice(0, 100)) == []
    clock.t += 29
    assert b2.poll() == []
    clock.t += 1
    aged = b2.poll()
    assert [(x.reason, x.manifest.row_count) for x in aged] == [("age", 100)] and b2.buffered_rows == 0
    # B: bytes limit well below what 1200 full rows take
    limit = 400_000
    b3 = Batcher(TieringPolicy(flush_max_bytes=limit), C, clock=clock)
    out3 = b3.add(scored) + b3.flush()
    assert {x.reason for x in out3[:-1]} == {"bytes"} and len(out3) >= 4
    assert all(x.manifest.nbytes <= limit for x in out3)
    assert sum(x.manifest.row_count for x in out3) == 1200


@settings(max_examples=15, deadline=None)
@given(
    n_rows=st.integers(1, 300), max_rows=st.integers(1, 400), max_bytes=st.integers(30_000, 400_000),
    urgent=st.integers(20_000, 200_000), seed=st.integers(0, 1000), chunks=st.integers(1, 3),
)
def test_batcher_never_exceeds_n_or_b(accepted: pa.Table, n_rows: int, max_rows: int, max_bytes: int, urgent: int,
                                      seed: int, chunks: int) -> None:
    p = TieringPolicy(flush_max_samples=max_rows, flush_max_bytes=max_bytes, urgent_max_bytes=urgent)
    scored = assign(accepted.slice(0, n_rows), _values(n_rows, seed), p, C)
    b = Batcher(p, C)
    out = []
    step = -(-n_rows // chunks)
    for a in range(0, n_rows, step):
        out += b.add(scored.slice(a, step))
    out += b.flush()
    for x in out:
        if x.manifest.tier == "normal":
            assert x.manifest.row_count <= max_rows and x.manifest.nbytes <= max_bytes
        elif x.manifest.tier == "high":
            assert x.manifest.nbytes <= urgent or x.manifest.row_count == 1
    uplinked = [i for x in out if x.manifest.tier != "low" for i in x.manifest.sample_ids]
    assert sorted(uplinked) == sorted(scored.column("sample_id").to_pylist())


def test_tiering_raises_value_per_uplinked_byte_over_sending_everything() -> None:
    raw = next(generate(3000, "node-a", seed=2, batch_size=3000))
    t = preprocess(raw, C).accepted
    p = TieringPolicy()
    values = NoveltyScorer(C).score(t, table_sha256(raw))
    scored = assign(t, values, p, C)
    b = Batcher(p, C)
    b.add(scored)
    b.flush()
    # measured baseline: every sample sent in full in normal bundles
    everything = scored.set_column(scored.schema.get_field_index("tier"), "tier", pa.array(["normal"] * t.num_rows))
    everything = everything.set_column(everything.schema.get_field_index("inclusion_p"), "inclusion_p",
                                       pa.array(np.ones(t.num_rows, np.float32)))
    base = Batcher(p, C)
    base.add(everything)
    base.flush()
    assert base.report.value_per_mb > 0
    assert b.report.value_per_mb > 1.3 * base.report.value_per_mb
    assert b.report.samples["low"] > 0 and b.report.samples["high"] > 0
    assert pc.sum(scored.column("value")).as_py() == pytest.approx(b.report.value_total, rel=1e-5)


def test_raw_store_level_applies_to_low_tier_bundles_only(accepted: pa.Table) -> None:
    """Low-tier raw bundles (kept on the node) use raw_store_zstd_level; uplinked bundles keep zstd_level."""
    values = _values(accepted.num_rows, seed=3)

    def bundles(raw_level: int) -> dict[str, bytes]:
        p = TieringPolicy(raw_store_zstd_level=raw_level)
        b = Batcher(p, C)
        out = b.add(assign(accepted, values, p, C)) + b.flush()
        assert sorted(x.manifest.tier for x in out) == ["high", "low", "normal"]
        return {x.manifest.tier: x.data for x in out}

    fast, slow = bundles(1), bundles(19)
    assert fast["high"] == slow["high"] and fast["normal"] == slow["normal"]
    assert fast["low"] != slow["low"]
    assert read_bundle(fast["low"]).equals(read_bundle(slow["low"]))  # same rows, only the compression differs


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(0, 1), min_size=1, max_size=60), st.floats(0.0, 1.0), st.integers(0, 10_000))
def test_inclusion_p_is_one_for_high_and_normal_and_the_rate_for_low(
    accepted: pa.Table, values: list[float], rate: float, offset: int,
) -> None:
    p = TieringPolicy(sample_rate=rate)
    rows = accepted.slice(offset % (accepted.num_rows - len(values)), len(values))
    scored = assign(rows, np.array(values, np.float32), p, C)
    tiers = np.array(scored.column("tier").to_pylist())
    incl = scored.column("inclusion_p").to_numpy()
    assert scored.schema.field("inclusion_p").type == pa.float32()
    assert (incl[tiers != "low"] == 1.0).all()
    assert (incl[tiers == "low"] == np.float32(rate)).all()


def test_the_draw_is_per_sample_deterministic_nested_and_close_to_the_rate() -> None:
    ids = pa.array([f"node-a-{i:08d}" for i in range(40_000)])
    p10, p20 = TieringPolicy(sample_rate=0.1), TieringPolicy(sample_rate=0.2)
    d10 = drawn(ids, p10)
    # the same sample is drawn alone, in another batch order, under other non-version settings
    assert (drawn(ids.take(pa.array(range(39_999, -1, -1))), p10)[::-1] == d10).all()
    assert (drawn(ids, TieringPolicy(sample_rate=0.1, zstd_level=9, flush_max_samples=7)) == d10).all()
    assert [bool(drawn(ids.slice(i, 1), p10)[0]) for i in range(50)] == d10[:50].tolist()
    # raising the rate keeps every sample drawn before; the share drawn is the rate (binomial, 4 sigma)
    d20 = drawn(ids, p20)
    assert (d20[d10]).all()
    for rate, d in ((0.1, d10), (0.2, d20)):
        assert abs(d.mean() - rate) < 4 * np.sqrt(rate * (1 - rate) / len(ids))
    # another policy version is another draw; rate 0 and 1 are none and all
    assert (drawn(ids, TieringPolicy(version="2", sample_rate=0.1)) != d10).any()
    assert not drawn(ids, TieringPolicy(sample_rate=0.0)).any() and drawn(ids, TieringPolicy(sample_rate=1.0)).all()


def test_a_rerun_of_a_batch_builds_the_same_bundles(accepted: pa.Table) -> None:
    """Retries and reruns send the same rows: the bundle ids (content-derived) come out identical."""
    p = TieringPolicy(sample_rate=0.3, flush_max_samples=300)
    values = _values(accepted.num_rows, seed=5)

    def run() -> list[tuple[str, str, int]]:
        b = Batcher(p, C)
        return [(x.manifest.bundle_id, x.manifest.tier, x.summary_rows)
                for x in b.add(assign(accepted, values, p, C)) + b.flush()]

    first = run()
    assert first == run() and any(n for _, tier, n in first if tier == "normal")


def test_sample_rate_bounds_are_checked() -> None:
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="sample_rate"):
            TieringPolicy(sample_rate=bad)


@settings(max_examples=15, deadline=None)
@given(share=st.floats(0.01, 0.6), seed=st.integers(0, 999))
def test_under_a_budget_every_sample_is_sent_or_kept_once_and_urgent_rows_go_first(
        accepted: pa.Table, share: float, seed: int) -> None:
    p = TieringPolicy(budget_share=share, flush_max_samples=400)
    v = _values(accepted.num_rows, seed) ** 2
    scored = assign(accepted, v, p, C)
    incl = scored.column("inclusion_p").to_numpy()
    assert ((incl > 0) & (incl <= 1)).all()
    b = Batcher(p, C)
    out = b.add(scored) + b.flush()
    sent: list[str] = []
    kept: list[str] = []
    summaries: list[str] = []
    for bb in out:
        t = read_bundle(bb.data, bb.manifest)
        summ = np.asarray(t.column("is_summary").to_numpy(zero_copy_only=False), dtype=bool)
        ids = np.asarray(t.column("sample_id").to_pylist())
        if bb.manifest.tier == "low":
            kept += ids.tolist()
        else:
            sent += ids[~summ].tolist()
            summaries += ids[summ].tolist()
        if bb.manifest.tier == "high":
            assert set(t.column("tier").to_pylist()) == {"high"}
    assert len(sent) + len(kept) == accepted.num_rows == len(set(sent) | set(kept))
    assert set(summaries) <= set(kept)
    # sent bytes (uncompressed, full rows + summaries) near the budget: Poisson noise only
    full = b.report.full_row_bytes + b.report.summary_row_bytes
    planned = share * (b.report.full_row_bytes / max(len(sent), 1)) * accepted.num_rows
    assert abs(full - planned) < 0.35 * planned + 20_000


def test_a_summary_goes_only_where_the_contracts_ratio_says_it_earns_its_bytes(tmp_path: Path) -> None:
    """A gait reading's summary (identity, no readings) is not a quarter of its row: by the policy's ratio the
    rows left send none and only join the sample. A contract that sets `limits.summary_min_ratio` decides for
    its kind: at 1 every row left sends one."""
    import dataclasses

    from edgehaul.contracts import ContractInvalid
    from tests.gait_rows import GAIT, gait_rows

    acc = gait_rows(400, anomaly_rate=0.05, seed=2)
    policy = TieringPolicy(low_threshold=0.5, high_threshold=0.9)  # every row low: left unless drawn

    def summaries(contract: Contract) -> tuple[int, int]:
        b = Batcher(policy, contract)
        b.add(assign(acc, np.zeros(400), policy, contract))
        b.flush()
        return b.report.summary_rows, 400 - b.report.sampled_low

    assert GAIT.summary_min_ratio is None and summaries(GAIT)[0] == 0
    rows, left = summaries(dataclasses.replace(GAIT, summary_min_ratio=1.0))
    assert left > 300 and rows == left
    text = Path(GAIT.source).read_text()
    for ratio, ok in (("1.5", True), ("0.5", False)):
        d = tmp_path / ratio
        d.mkdir()
        (d / "daphnet_gait.v1.yaml").write_text(text + f"limits: {{summary_min_ratio: {ratio}}}\n")
        if ok:
            assert load_contract("daphnet_gait", 1, d).summary_min_ratio == 1.5
        else:
            with pytest.raises(ContractInvalid, match=r"limits\.summary_min_ratio.*>= 1"):
                load_contract("daphnet_gait", 1, d)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0, 1, allow_subnormal=False), min_size=1, max_size=200))
def test_values_and_probabilities_on_their_grids_stay_near_and_in_range(xs: list[float]) -> None:
    x = np.asarray(xs)
    v = on_value_grid(x)
    assert v.dtype == np.float32 and ((v >= 0) & (v <= 1)).all()
    assert np.abs(v - x).max() <= 0.5 / VALUE_LEVELS + 1e-7
    assert np.array_equal(v * VALUE_LEVELS, np.round(v * VALUE_LEVELS))
    q = on_p_grid(x)
    assert q.dtype == np.float32 and ((q >= 0) & (q <= 1)).all()
    assert np.array_equal(q == 0, x == 0) or (x[q == 0] < 1e-30).all()  # a chance of 0 stays 0; only one
    pos = x > 1e-30  # that float32 cannot hold (under 1e-38) becomes 0, as it did in the column before the grid
    step = 2.0 ** (0.5 / P_STEPS_PER_OCTAVE)  # half a step, in ratio
    assert (q[pos] / x[pos] <= step * (1 + 1e-6)).all() and (x[pos] / q[pos] <= step * (1 + 1e-6)).all()
    assert on_p_grid(np.array([1.0]))[0] == 1.0


def test_a_budgeted_batch_records_the_p_it_was_drawn_with_in_a_byte_a_row(accepted: pa.Table) -> None:
    """The p a row records is the p its draw used (rounded before the draw, so inclusion_p stays exact), within
    1.1% of the solved one; and a bundle of such rows writes value and inclusion_p in about a byte a row each,
    where free float32s took near four."""
    policy = TieringPolicy(budget_share=0.2)
    v = _values(accepted.num_rows, 3)
    scored = assign(accepted, v, policy, C)
    p = scored.column("inclusion_p").to_numpy()
    vq = on_value_grid(v)
    assert np.array_equal(scored.column("value").to_numpy(), vq)
    solved = inclusion_probabilities(vq, *plan_bytes(accepted, vq, policy, C), policy)
    assert np.array_equal(p, on_p_grid(solved))
    assert len(np.unique(p)) <= 3 * P_STEPS_PER_OCTAVE * 8  # a few octaves of steps, not a float per row
    sent = draw(scored.column("sample_id"), p, policy)
    assert 0.8 * p.sum() < sent.sum() < 1.2 * p.sum()
    from edgehaul.bundles import write_bundle

    def col_bytes(t: pa.Table, name: str) -> int:
        meta = pq.ParquetFile(io.BytesIO(write_bundle(t, C, tier="normal")[0])).metadata.row_group(0)
        return next(meta.column(i).total_compressed_size for i in range(meta.num_columns)
                    if meta.column(i).path_in_schema == name)

    free = scored.set_column(scored.schema.get_field_index("inclusion_p"), "inclusion_p",
                             pa.array(solved.astype(np.float32)))
    free = free.set_column(free.schema.get_field_index("value"), "value", pa.array(v))
    n = scored.num_rows
    assert col_bytes(scored, "value") + col_bytes(scored, "inclusion_p") < 2.5 * n
    assert col_bytes(free, "value") + col_bytes(free, "inclusion_p") > 5 * n
