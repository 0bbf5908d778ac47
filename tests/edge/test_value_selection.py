"""Selection that knows its byte budget and stays unbiased: every row's inclusion_p is its chance of reaching the
centre (the tier draw and the link's thinning both), value raises it, coverage keeps a floor; and, on a kind
written here (a pump's vibration sensors, rare bearing faults, no label read at the edge), the default scorer
lands more rare events than a random sample of the same bytes, and the product's trainer learns at least as well
from them."""

from __future__ import annotations

import hashlib
import itertools
import logging
import math
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgehaul.blocks import TieringPolicy
from edgehaul.bundles import read_bundle, write_bundle
from edgehaul.contracts import Contract, load_contract
from edgehaul.edge.batch import ingest_batch
from edgehaul.edge.preprocess import batch_key
from edgehaul.edge.scorer_registry import ScorerContext, build_scorer, scorer_state_dir
from edgehaul.edge.spool import Spool, SpoolError
from edgehaul.edge.tiering import inclusion_probabilities, uniform_pairs, uniforms
from edgehaul.training.data import sample_weights, trainable

log = logging.getLogger(__name__)

PUMP = """
kind: pump_vibration
version: 1
description: A pump's vibration and temperature sensors, one row a second; bearing_fault 1 while a bearing fails.
columns:
  vib_x: {type: float32, unit: mm_s, min: -50, max: 50}
  vib_y: {type: float32, unit: mm_s, min: -50, max: 50}
  vib_z: {type: float32, unit: mm_s, min: -50, max: 50}
  temp_bearing: {type: float32, unit: degC, min: 0, max: 150}
  temp_motor: {type: float32, unit: degC, min: 0, max: 150}
  current_a: {type: float32, unit: A, min: 0, max: 100}
  pressure_bar: {type: float32, unit: bar, min: 0, max: 20}
  flow_lpm: {type: float32, unit: lpm, min: 0, max: 500}
label:
  column: bearing_fault
  kind: anomaly
training:
  model: mlp
  model_name: pump-fault
  epochs: 8
  batch_size: 64
  lr: 0.01
  width: 16
  balance_classes: true
expectations:
  - type: expect_column_values_to_be_unique
    kwargs: {column: sample_id}
"""
_MEAN = np.array([0.0, 0.0, 0.0, 60.0, 55.0, 40.0, 8.0, 250.0])
_SD = np.array([4.0, 4.0, 4.0, 5.0, 5.0, 4.0, 1.0, 20.0])
FAULT_RATE = 0.02


@pytest.fixture
def pump(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Contract:
    d = tmp_path / "contracts"
    d.mkdir()
    (d / "pump_vibration.v1.yaml").write_text(PUMP)
    monkeypatch.setenv("EDGEHAUL_CONTRACTS_DIR", str(d))
    return load_contract("pump_vibration", directory=d)


def pump_raw(contract: Contract, n: int, *, seed: int, start_seq: int = 0, node: str = "node-a") -> pa.Table:
    """n readings; a bearing fault (share FAULT_RATE) shakes the pump and heats the bearing: about 3 sigma on
    four sensors, so it stands out without being trivially far."""
    rng = np.random.default_rng(seed)
    fault = rng.random(n) < FAULT_RATE
    x = rng.normal(_MEAN, _SD, (n, len(_MEAN)))
    shift = np.array([3.0, 3.0, 2.5, 3.0, 0.0, 0.0, 0.0, 0.0]) * _SD
    x[fault] += shift * rng.choice([-1.0, 1.0], (int(fault.sum()), len(_MEAN))) * np.array([1, 1, 1, 0, 0, 0, 0, 0]) \
        + shift * np.array([0, 0, 0, 1, 0, 0, 0, 0])
    seq = np.arange(start_seq, start_seq + n)
    t0 = datetime(2026, 6, 1, tzinfo=UTC)
    data: dict[str, pa.Array] = {
        "sample_id": pa.array([f"{node}-pump-{s:09d}" for s in seq]),
        "node_id": pa.array([node] * n),
        "capture_time": pa.array([t0 + timedelta(seconds=int(s)) for s in seq], pa.timestamp("ms", tz="UTC")),
        "seq": pa.array(seq, pa.int64()),
        "bearing_fault": pa.array(fault.astype(np.int16)),
    }
    for j, c in enumerate(contract.columns):
        data[c.name] = pa.array(x[:, j].astype(np.float32))
    return pa.table(data).cast(contract.raw_schema)


def run_edge(contract: Contract, policy: TieringPolicy, root: Path, *, n: int, batch: int, seed: int) -> Spool:
    """The stream through the product's edge path (preprocess, the policy's scorer, tiering) into a spool."""
    spool = Spool(root / "spool", cap_bytes=2**34, node_id="node-a", emit=lambda *a, **k: True)
    ctx = ScorerContext(contract=contract, policy=policy, store=None,
                        state_dir=scorer_state_dir(root / "spool", policy.scorer, contract))
    scorer = build_scorer(policy.scorer, ctx)
    for s in range(0, n, batch):
        raw = pump_raw(contract, batch, seed=seed + s, start_seq=s)
        key, hashes = batch_key(raw, contract.payload_column or "pixels")
        ingest_batch(raw, contract, policy, spool, scorer, key=key, hashes=hashes, node_id="node-a")
    return spool


def landed(spool: Spool) -> pa.Table:
    """Every waiting bundle's rows (what the link carries when everything fits)."""
    parts = [read_bundle(spool.read(e.bundle_id), e.manifest) for e in spool.pending()]
    return pa.concat_tables(parts).combine_chunks()


# ------------------------------------------------------------------------------------------------- unit
@settings(max_examples=60, deadline=None)
@given(n=st.integers(5, 400), share=st.floats(0.01, 0.9), coverage=st.floats(0.0, 1.0), seed=st.integers(0, 999),
       summary=st.booleans())
def test_expected_bytes_meet_the_budget_and_p_follows_value_above_a_floor(n: int, share: float, coverage: float,
                                                                          seed: int, summary: bool) -> None:
    rng = np.random.default_rng(seed)
    v = rng.random(n) ** 3
    b = rng.integers(100, 3000, n).astype(np.float64)
    s = (b / 10).round() if summary else np.zeros(n)
    policy = TieringPolicy(budget_share=share, coverage=coverage, high_threshold=0.9, low_threshold=0.3)
    urgent = min(float(b[v >= 0.9].sum()), 0.5 * share * b.sum())
    if s[v < 0.9].sum() > 0.5 * (share * b.sum() - urgent):  # as plan_bytes: the budget buys rows first
        s = np.zeros(n)
    p = inclusion_probabilities(v, b, s, policy)
    assert ((p >= 0) & (p <= 1)).all()
    high = v >= policy.high_threshold
    if (p[high] < 1).any():  # urgent rows over their share: sampled with the rest, summaries count for them too
        high = np.zeros(n, dtype=bool)
    expected = float((p * b).sum() + ((1 - p) * s)[~high].sum())
    budget = share * b.sum()
    if (p[~high] < 1).any():  # not everything fits: the budget is met exactly (in expectation)
        assert expected == pytest.approx(budget, rel=1e-6, abs=1.0)
    else:
        assert expected <= budget * (1 + 1e-6) + 1.0
    rest = ~high
    assert (np.diff(p[np.argsort(v)]) >= -1e-12).all() or high.any()  # a higher value never lowers p
    order = np.argsort(v[rest])
    assert (np.diff(p[rest][order]) >= -1e-12).all()  # a higher value never lowers p
    if coverage > 0 and rest.any() and budget > float(((p * b)[high]).sum() + s[rest].sum()):
        assert (p[rest] > 0).all()  # the floor: every row can land


def test_without_a_budget_p_is_one_above_the_low_threshold_and_the_rate_below() -> None:
    v = np.array([0.1, 0.5, 0.95])
    p = inclusion_probabilities(v, np.ones(3), np.zeros(3), TieringPolicy(sample_rate=0.07))
    assert p.tolist() == [0.07, 1.0, 1.0]


def test_uniforms_are_the_sha256_of_version_and_sample_id() -> None:
    ids = [f"node-a-{i}" for i in range(50)]
    u = uniforms(pa.array(ids), "v7")
    want = [int.from_bytes(hashlib.sha256(f"v7|{i}".encode()).digest()[:8], "big") / 2**64 for i in ids]
    assert np.allclose(u, want, atol=2**-52)
    first, second = uniform_pairs(pa.array(ids), "v7")
    want2 = [int.from_bytes(hashlib.sha256(f"v7|{i}".encode()).digest()[8:16], "big") / 2**64 for i in ids]
    assert np.array_equal(first, u) and np.allclose(second, want2, atol=2**-52)


def _features_with_gaps(n: int, k: int, seed: int) -> np.ndarray | None:
    """n rows of k features on scales 0.1-100 (a null reading NaN, one column constant), or None for k 0 (no
    features given)."""
    if k == 0:
        return None
    rng = np.random.default_rng(seed)
    f = rng.normal(size=(n, k)) * rng.uniform(0.1, 100, k)
    f[rng.random((n, k)) < 0.05] = np.nan
    f[:, 0] = 7.0
    return f


@settings(max_examples=40, deadline=None)
@given(p=st.lists(st.sampled_from([0.0, 1.0]) | st.floats(1e-4, 1.0), min_size=1, max_size=300),
       version=st.text(min_size=1, max_size=8), seed=st.integers(0, 2**32 - 1), k=st.integers(0, 5))
def test_a_budgeted_draw_is_of_fixed_size_and_the_same_in_any_order(p: list[float], version: str, seed: int,
                                                                    k: int) -> None:
    """Whatever the p and the features (none, constant, null readings): a batch draws floor or ceil of its sum of
    p (a Poisson draw's count has an sd of sqrt(sum p)), p 1 always and p 0 never, and the batch in another order
    draws the same rows."""
    from edgehaul.edge.tiering import draw_fixed, on_p_grid

    q = on_p_grid(np.asarray(p))
    ids = pa.array([f"n-{seed}-{i}" for i in range(len(q))])
    feats = _features_with_gaps(len(q), k, seed)
    policy = TieringPolicy(version=version)
    got = draw_fixed(ids, q, policy, feats)
    total = float(q.astype(np.float64).sum())
    assert math.floor(total + 1e-9) <= int(got.sum()) <= math.ceil(total - 1e-9)
    assert got[q >= 1].all() and not got[q == 0].any()
    order = np.random.default_rng(seed).permutation(len(q))
    again = draw_fixed(ids.take(pa.array(order)), q[order], policy, None if feats is None else feats[order])
    assert np.array_equal(again, got[order])


@pytest.mark.parametrize("k", [0, 4, 8])  # no features, along the curve, by clusters (2 of 7 axes hold < half)
def test_a_budgeted_draw_lands_each_row_with_its_p(k: int) -> None:
    """Over 4,000 draws (policy versions) of one batch of 60 rows, in a random order or along its features, each
    row lands its p of the time (every row within 4.5 binomial sds), and every draw holds 8 or 9 rows (sum p
    8.76)."""
    from edgehaul.edge.tiering import draw_fixed, on_p_grid

    q = on_p_grid(np.random.default_rng(3).uniform(0.02, 0.5, 60) ** 1.5)
    ids = pa.array([f"node-a-{i}" for i in range(60)])
    feats = _features_with_gaps(60, k, 5)
    draws = np.array([draw_fixed(ids, q, TieringPolicy(version=f"v{j}"), feats) for j in range(4000)])
    p = q.astype(np.float64)
    assert set(draws.sum(axis=1).tolist()) == {math.floor(p.sum()), math.ceil(p.sum())}
    assert (np.abs(draws.mean(axis=0) - p) < 4.5 * np.sqrt(p * (1 - p) / 4000)).all()


def test_a_budgeted_draw_along_the_features_keeps_a_clusters_share() -> None:
    """1,000 rows at p 0.04, 60 of them a cluster apart in feature space (2.4 rows of the draw's 40 by p). In a
    random order the cluster's count is left to chance (sd about 1.4 over 400 draws, 0 in some); drawn along the
    features it stays near its share (sd under 0.9, never 0), and the mean is still its p."""
    from edgehaul.edge.tiering import draw_fixed, on_p_grid

    rng = np.random.default_rng(0)
    feats = rng.normal(size=(1000, 3))
    feats[:60] += [4.0, -3.0, 2.0]
    q = on_p_grid(np.full(1000, 0.04))
    ids = pa.array([f"node-a-{i}" for i in range(1000)])

    def cluster_counts(f: np.ndarray | None) -> np.ndarray:
        return np.array([draw_fixed(ids, q, TieringPolicy(version=f"v{j}"), f)[:60].sum() for j in range(400)])

    scattered, spread = cluster_counts(None), cluster_counts(feats)
    share = 60 * float(q[0])
    assert scattered.std() > 1.2 and (scattered == 0).any()
    assert spread.std() < 0.9 and spread.min() >= 1
    assert abs(spread.mean() - share) < 4 * spread.std() / np.sqrt(400) + 0.05


def test_a_budgeted_draw_in_many_dimensions_keeps_each_clusters_share(monkeypatch: pytest.MonkeyPatch) -> None:
    """1,000 rows in 10 clusters of 100, each apart along its own axis of 16 (as digits' grid features: the first
    two components hold a fifth of the variance), p 0.03: 3 rows a cluster by p. In a random order a cluster's
    count is left to chance (sd about 1.6 over 300 draws); along a curve through two components, clusters that
    the plane overlays share stretches of it; grouped into clusters over every feature, each keeps 2-4 rows
    (sd under 0.8), the mean still its p."""
    from edgehaul.edge import tiering

    rng = np.random.default_rng(1)
    feats = rng.normal(size=(1000, 16))
    feats[np.arange(1000), np.arange(1000) // 100] += 6.0
    q = tiering.on_p_grid(np.full(1000, 0.03))
    ids = pa.array([f"node-a-{i}" for i in range(1000)])

    def cluster_counts(f: np.ndarray | None) -> np.ndarray:
        draws = np.array([tiering.draw_fixed(ids, q, TieringPolicy(version=f"v{j}"), f) for j in range(300)])
        return draws.reshape(300, 10, 100).sum(axis=2)

    scattered, grouped = cluster_counts(None), cluster_counts(feats)
    monkeypatch.setattr(tiering, "SPREAD_MIN_EXPLAINED", 0.0)  # the curve, whatever its plane holds
    curve = cluster_counts(feats)
    assert scattered.std(axis=0).mean() > 1.3
    assert grouped.std(axis=0).mean() < 0.8 and grouped.min() >= 1
    assert grouped.std(axis=0).mean() < 0.8 * curve.std(axis=0).mean()
    share = 100 * float(q[0])
    assert (np.abs(grouped.mean(axis=0) - share) < 4 * grouped.std(axis=0) / np.sqrt(300) + 0.05).all()


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.lists(st.floats(allow_nan=True, allow_infinity=True), min_size=3, max_size=3), max_size=40))
def test_a_spread_order_is_a_permutation_whatever_the_readings(rows: list[list[float]]) -> None:
    """Any readings (null, infinite, 1e308 beside 1e-300, a constant column) order every row once, without a
    warning (an overflow squaring them was one)."""
    import warnings

    from edgehaul.edge.tiering import spread_order

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        order = spread_order(np.array(rows, dtype=np.float64).reshape(len(rows), 3))
    assert sorted(order.tolist()) == list(range(len(rows)))


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.lists(st.floats(allow_nan=True, allow_infinity=True) | st.floats(-3, 3), min_size=7,
                              max_size=7), max_size=60),
       draws=st.none() | st.floats(0.0, 400.0))
def test_a_spread_order_by_clusters_is_a_permutation_and_a_function_of_the_batch(rows: list[list[float]],
                                                                                  draws: float | None) -> None:
    """Seven features, whose first two components often hold under half the variance, so the rows are grouped into
    clusters: whatever the readings and the rows drawn, every row once, without a warning, and the same order on a
    second call."""
    import warnings

    from edgehaul.edge.tiering import spread_order

    f = np.array(rows, dtype=np.float64).reshape(len(rows), 7)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        order = spread_order(f, draws=draws)
    assert sorted(order.tolist()) == list(range(len(rows)))
    assert np.array_equal(spread_order(f, draws=draws), order)


@pytest.mark.parametrize("axes", [1, 2, 3, 4])
@pytest.mark.parametrize("bits", [1, 2, 3])
def test_the_hilbert_curve_visits_every_cell_once_by_unit_steps(axes: int, bits: int) -> None:
    """The index is a bijection of the grid onto 0 .. 2**(axes x bits) - 1, and cells next on the curve are next
    in the grid (one step along one axis): what makes a stretch of the curve a compact region."""
    from edgehaul.edge.tiering import hilbert_index

    cells = np.array(list(itertools.product(range(1 << bits), repeat=axes)))
    index = hilbert_index(cells, bits)
    assert sorted(index.tolist()) == list(range(len(cells)))
    walk = cells[np.argsort(index)]
    assert (np.abs(np.diff(walk, axis=0)).sum(axis=1) == 1).all()


def test_a_hilbert_index_that_would_not_fit_63_bits_is_refused() -> None:
    from edgehaul.edge.tiering import hilbert_index

    with pytest.raises(ValueError, match="4 axes of 16 bits"):
        hilbert_index(np.zeros((3, 4), dtype=np.int64), 16)


def test_a_batch_sends_its_budget_and_p_is_the_chance_of_landing(pump: Contract, tmp_path: Path) -> None:
    """Budget 5%: the full rows sent are ~5% of the full-row bytes; over 30 disjoint draws (policy versions),
    each row lands about inclusion_p of the time; 1/p weights give the stream's fault rate back."""
    raw = pump_raw(pump, 4000, seed=1)
    from edgehaul.edge.preprocess import preprocess
    from edgehaul.edge.tiering import Batcher, assign

    rows = preprocess(raw, pump, node_id="node-a").accepted
    v = np.random.default_rng(0).random(rows.num_rows) ** 4  # any values
    hits = np.zeros(rows.num_rows)
    p_ref = None
    for k in range(30):
        policy = TieringPolicy(version=f"v{k}", budget_share=0.05)
        scored = assign(rows, v, policy, pump)
        b = Batcher(policy, pump)
        out = b.add(scored) + b.flush()
        p = scored.column("inclusion_p").to_numpy().astype(np.float64)
        p_ref = p if p_ref is None else p_ref
        assert np.array_equal(p, p_ref)  # p depends on values and bytes, not on the draw
        sent = {i for bb in out if bb.manifest.tier != "low" for i in bb.manifest.sample_ids}
        hits += np.isin(rows.column("sample_id").to_numpy(zero_copy_only=False), list(sent))
        assert b.report.summary_rows == 0  # a pump row's summary would cost as much as the row
    assert p_ref is not None
    assert abs(float(p_ref.sum()) / rows.num_rows - 0.05) < 0.01  # rows of equal size: 5% of them on average
    # Landing frequency against p, pooled by p decile (binomial noise ~ sqrt(p/30n) per pool)
    edges = np.quantile(p_ref, np.linspace(0, 1, 6))
    for lo, hi in itertools.pairwise(edges):
        m = (p_ref >= lo) & (p_ref <= hi)
        assert abs(hits[m].mean() / 30 - p_ref[m].mean()) < 0.25 * p_ref[m].mean() + 0.01


def test_a_pass_short_of_the_plan_thins_at_random_and_p_follows(pump: Contract, tmp_path: Path) -> None:
    """The default policy (no budget) sends far more than the link carries: thin_to brings the waiting bytes
    under capacity by a random draw per row (every urgent row kept, its p unchanged, packed first with the rows
    kept), multiplies inclusion_p by keep, and moves the rows thinned out to the raw store: every sample is sent
    or kept, never both, never lost."""
    spool = run_edge(pump, TieringPolicy(), tmp_path, n=12_000, batch=4000, seed=5)
    before = landed(spool)
    before_p = dict(zip(before.column("sample_id").to_pylist(), before.column("inclusion_p").to_pylist(), strict=True))
    urgent_ids = {i for e in spool.pending() if e.tier == "high" for i in e.manifest.sample_ids}
    total = sum(e.manifest.nbytes for e in spool.pending())
    urgent = sum(e.manifest.nbytes for e in spool.pending() if e.tier == "high")
    capacity = urgent + (total - urgent) // 4
    rounds = spool.thin_to(capacity, salt="pass-1")
    assert rounds and sum(e.manifest.nbytes for e in spool.pending()) <= capacity
    pending = spool.pending()
    in_urgent = {i for e in pending if e.tier == "high" for i in e.manifest.sample_ids}
    assert urgent_ids and urgent_ids <= in_urgent  # every urgent row still waits, in an urgent bundle
    order = [i for e in pending for i in e.manifest.sample_ids]
    assert set(order[: len(urgent_ids)]) == urgent_ids  # and drains first
    after = landed(spool)
    after_p = dict(zip(after.column("sample_id").to_pylist(), after.column("inclusion_p").to_pylist(), strict=True))
    assert all(after_p[i] == before_p[i] for i in urgent_ids)
    keep = float(np.prod([r.keep for r in rounds]))
    ratios = {round(p / before_p[i], 5) for i, p, t in zip(after.column("sample_id").to_pylist(),
                                                            after.column("inclusion_p").to_pylist(),
                                                            after.column("tier").to_pylist(), strict=True)
              if t != "high"}
    assert all(r < 1 for r in ratios) and min(ratios) >= round(keep, 5) - 1e-4
    raw_ids = {i for e in spool.raw_entries() for i in e.manifest.sample_ids}
    sent_ids = set(after.column("sample_id").to_pylist())
    assert sent_ids.isdisjoint(raw_ids) and len(sent_ids) + len(raw_ids) == 12_000
    # a rerun of the edge batches rebuilds the bundles thinned away: the spool does not take them back
    again = run_edge(pump, TieringPolicy(), tmp_path, n=12_000, batch=4000, seed=5)
    assert {e.bundle_id for e in again.pending()} == {e.bundle_id for e in spool.pending()}


def test_thinning_small_bundles_lands_close_to_capacity_and_packs_the_rows_kept(pump: Contract,
                                                                               tmp_path: Path) -> None:
    """A budgeted edge with small batches spools many bundles of a few rows each, mostly fixed Parquet part. Thinned
    to a third of what waits (urgent bundles over half of it are thinned too), what is left lands close to the
    capacity (never a spool emptied because the footers alone were over it), in bundles packed to the policy's
    row count, with p multiplied by the keep of every round and every sample sent or kept on the node."""
    policy = TieringPolicy(version="small", budget_share=0.2, flush_max_samples=16, flush_max_bytes=64 * 1024)
    spool = run_edge(pump, policy, tmp_path, n=3000, batch=100, seed=21)
    before = landed(spool)
    before_p = dict(zip(before.column("sample_id").to_pylist(), before.column("inclusion_p").to_pylist(), strict=True))
    pending = spool.pending()
    total = sum(e.manifest.nbytes for e in pending)
    assert len(pending) >= 40 and before.num_rows / len(pending) < 10  # small bundles: the footers dominate
    capacity = total // 3
    raw_before = {e.bundle_id for e in spool.raw_entries()}
    rounds = spool.thin_to(capacity, salt="pass-small", pack_rows=policy.flush_max_samples)
    after_entries = spool.pending()
    left = sum(e.manifest.nbytes for e in after_entries)
    assert 0.75 * capacity <= left <= capacity, (left, capacity, [r.keep for r in rounds])
    after = landed(spool)
    # the rows kept outnumber a third of those waiting: packed bundles pay their fixed part fewer times
    assert after.num_rows > before.num_rows / 3
    assert max(e.manifest.row_count for e in after_entries) == policy.flush_max_samples
    keep = float(np.prod([r.keep for r in rounds]))
    for sid, p in zip(after.column("sample_id").to_pylist(), after.column("inclusion_p").to_pylist(), strict=True):
        assert p == pytest.approx(before_p[sid] * keep, rel=1e-5) or any(
            p == pytest.approx(before_p[sid] * float(np.prod([r.keep for r in rounds[:k]])), rel=1e-5)
            for k in range(1, len(rounds)))
    raw_ids = {i for e in spool.raw_entries() for i in e.manifest.sample_ids}
    sent_ids = set(after.column("sample_id").to_pylist())
    assert sent_ids.isdisjoint(raw_ids) and len(sent_ids) + len(raw_ids) == 3000
    # the rows thinned out of dozens of bundles went to the raw store together: a bundle per draw, not one per
    # bundle thinned (each a small file that every later put counted)
    out = [e for e in spool.raw_entries() if e.bundle_id not in raw_before]
    assert 1 <= len(out) <= len(rounds) < len(pending) // 4


def test_a_pass_tighter_than_the_summaries_thins_them_too_and_is_met(tmp_path: Path) -> None:
    """Landsat's summaries (a row left on the node sends its features, 195 B against 1,731) were never thinned: a
    pass that carried less than they weighed thinned every full row away and still overran (a quarter of 63
    bundles: 32 full rows kept, 246,778 B left for 145,022 B). A summary now stays with the draw's keep, and one
    thinned out is dropped, as the row it summarises waits in the raw store: the pass is met, with full rows."""
    from edgehaul.edge import landsat

    contract = load_contract("landsat_patch")
    policy = TieringPolicy(version="tight", budget_share=0.325, flush_max_samples=16, flush_max_bytes=48 * 1024,
                           urgent_max_bytes=48 * 1024)
    spool = Spool(tmp_path / "spool", cap_bytes=2**34, node_id="node-a", emit=lambda *a, **k: True)
    scorer = build_scorer("novelty", ScorerContext(contract, policy, None, tmp_path / "state"))
    for raw in landsat.generate(1000, batch_size=500, seed=3):
        key, hashes = batch_key(raw)
        ingest_batch(raw, contract, policy, spool, scorer, key=key, hashes=hashes, node_id="node-a")
    before = landed(spool)
    summary_ids = set(before.filter(before.column("is_summary")).column("sample_id").to_pylist())
    raw_ids = {i for e in spool.raw_entries() for i in e.manifest.sample_ids}
    assert len(summary_ids) > before.num_rows / 2 and summary_ids <= raw_ids  # each summarised row waits on the node
    capacity = sum(e.manifest.nbytes for e in spool.pending()) // 4
    rounds = spool.thin_to(capacity, salt="tight", pack_rows=16)
    assert sum(e.manifest.nbytes for e in spool.pending()) <= capacity
    after = landed(spool)
    is_summary = np.asarray(after.column("is_summary"))
    full_before = before.num_rows - len(summary_ids)
    assert int((~is_summary).sum()) > full_before / 5  # about the pass's share of the full rows, not a handful
    assert 0 < int(is_summary.sum()) < len(summary_ids) and sum(r.summaries_out for r in rounds) == len(
        summary_ids) - int(is_summary.sum())
    # every sample is sent in full or kept on the node with its payload, never both
    sent = set(after.filter(pc.invert(after.column("is_summary"))).column("sample_id").to_pylist())
    kept = {i for e in spool.raw_entries() for i in e.manifest.sample_ids}
    assert sent.isdisjoint(kept) and sent | kept == set(before.column("sample_id").to_pylist())


def test_a_raw_store_with_no_room_for_the_thinned_rows_leaves_them_whole_and_ledgers_nothing(
        pump: Contract, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A full node cannot keep the rows a pass would thin out: their bundles stay whole (the pass overruns; the
    link carries the rest later) and the ledger records nothing, as no sample left the normal path (it once
    recorded them all as refused while they still waited, counting each twice)."""
    policy = TieringPolicy(version="full", budget_share=0.2, flush_max_samples=16, flush_max_bytes=64 * 1024)
    run_edge(pump, policy, tmp_path, n=1000, batch=250, seed=8)
    roomy = Spool(tmp_path / "spool", cap_bytes=2**34, node_id="node-a", emit=lambda *a, **k: True)
    before = landed(roomy)
    raw_bytes = sum(e.nbytes for e in roomy.raw_entries())
    # reopened with room for what waits to be sent and little more: the clean-up evicts the raw store, and a raw
    # bundle of thinned rows still cannot fit
    spool = Spool(tmp_path / "spool", cap_bytes=roomy.usage().used_bytes - raw_bytes + 2048,
                  full_policy="reject-new", node_id="node-a", emit=lambda *a, **k: True)
    capacity = sum(e.manifest.nbytes for e in spool.pending()) // 3
    with caplog.at_level(logging.WARNING, logger="edgehaul.edge.spool"):
        spool.thin_to(capacity, salt="pass-full", pack_rows=policy.flush_max_samples)
    assert "still held elsewhere" in caplog.text
    after = landed(spool)
    waiting = after.column("sample_id").to_pylist()
    assert sorted(waiting) == sorted(before.column("sample_id").to_pylist())
    assert spool.ledger.lookup(waiting) == {}
    assert {reason for _, reason in spool.ledger.counts()} <= {"raw-evicted"}


@pytest.mark.parametrize("which", [0, -1])  # the first bundle (the fixed part is measured on it) or the last
def test_a_bundle_corrupt_on_disk_is_ledgered_and_the_pass_thins_the_rest(
        pump: Contract, tmp_path: Path, caplog: pytest.LogCaptureFixture, which: int) -> None:
    """A bundle whose bytes the disk changed stopped a pass's thinning (SpoolError: every pass of the node planned
    nothing). It is now dropped with its samples in the ledger as corrupt, an error says which, and the other
    bundles are thinned to the pass as if it had not been there: every other sample sent or kept on the node."""
    policy = TieringPolicy(version="rot", budget_share=0.2, flush_max_samples=16, flush_max_bytes=64 * 1024)
    spool = run_edge(pump, policy, tmp_path, n=1500, batch=250, seed=12)
    pending = spool.pending()
    bad = pending[which]
    bad_ids = list(bad.manifest.sample_ids)
    raw = bytearray(bad.path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # one flipped byte: the size still matches, so only the digest tells
    bad.path.write_bytes(bytes(raw))
    others = [i for e in pending if e.bundle_id != bad.bundle_id for i in e.manifest.sample_ids]
    raw_before = {i for e in spool.raw_entries() for i in e.manifest.sample_ids}
    capacity = sum(e.manifest.nbytes for e in pending) // 3
    with caplog.at_level(logging.ERROR, logger="edgehaul.edge.spool"):
        rounds = spool.thin_to(capacity, salt="pass-rot", pack_rows=policy.flush_max_samples)
    assert f"bundle {bad.bundle_id} corrupt on disk" in caplog.text and rounds
    assert bad.bundle_id not in {e.bundle_id for e in spool.pending()}
    assert sum(e.manifest.nbytes for e in spool.pending()) <= capacity
    assert set(spool.ledger.lookup(bad_ids)) == set(bad_ids)
    assert {r for _, r in spool.ledger.counts()} == {"corrupt-on-disk"}
    sent = set(landed(spool).column("sample_id").to_pylist())
    kept = {i for e in spool.raw_entries() for i in e.manifest.sample_ids} - raw_before
    assert sent.isdisjoint(kept) and sent | kept == set(others) - raw_before


def test_a_spool_over_its_cap_plans_its_pass_unthinned_and_loses_nothing(
        pump: Contract, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A spool over its cap (an operator lowered it) with nothing it may displace had no room for a thinning's packs:
    thin_to raised, and every pass of the node planned nothing, so nothing was sent to free the room. It now logs
    why and returns; the bundles wait as they were, every sample in one of them."""
    policy = TieringPolicy(version="full", budget_share=0.2, flush_max_samples=16, flush_max_bytes=64 * 1024)
    spool = run_edge(pump, policy, tmp_path, n=600, batch=200, seed=14)
    before = {e.bundle_id: e.manifest.sample_ids for e in spool.pending()}
    used = spool.usage().used_bytes
    small = Spool(spool.root, cap_bytes=used // 4, node_id="node-a", full_policy="reject-new",
                  emit=lambda *a, **k: True)
    capacity = sum(e.manifest.nbytes for e in small.pending()) * 9 // 10  # most bundles keep every row: packs only
    with caplog.at_level(logging.WARNING, logger="edgehaul.edge.spool"):
        small.thin_to(capacity, salt="pass-full", pack_rows=policy.flush_max_samples)
    assert "no room for a thinned bundle" in caplog.text and "the pass plans the bundles as they wait" in caplog.text
    assert {e.bundle_id: e.manifest.sample_ids for e in small.pending()} == before
    # the lowered cap evicted the raw store (rows left on the node, not the pass's) at open; nothing else left
    assert set(small.ledger.counts()) <= {("spool-raw", "raw-evicted")}


def test_a_thinning_whose_packs_lose_the_room_to_another_writer_takes_its_thinned_out_rows_back(
        pump: Contract, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The uplink thins while the ingest process spools into the same folder. Between a thinning's two writes (the
    raw bundle of the rows thinned out, then the packs of the rows kept) the other writer can take the room: the
    packs' write evicts the raw store, the new raw bundle with it, and then finds none. The bundles stay whole, so
    their rows wait to be sent; the ledger once said they were evicted from the raw store, so each was counted as
    gone and later as delivered. Now the thinning takes its raw bundles back, ledger rows and all."""
    policy = TieringPolicy(version="race", budget_share=0.2, flush_max_samples=16, flush_max_bytes=64 * 1024)
    run_edge(pump, policy, tmp_path, n=600, batch=200, seed=15)

    class RacedSpool(Spool):
        """The spool as the uplink opens it, with the ingest's writes landing right before the packs'."""

        raced = 0

        def _write_packs(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            if not self.raced:  # another process's staged writes, as big as the whole cap
                RacedSpool.raced = len(self.raw_entries())
                (self.staging_dir / "ingest-part").write_bytes(b"\0" * self.cap_bytes)
            return super()._write_packs(*args, **kwargs)

    roomy = Spool(tmp_path / "spool", cap_bytes=2**34, node_id="node-a", emit=lambda *a, **k: True)
    cap = 2 * roomy.usage().used_bytes
    spool = RacedSpool(tmp_path / "spool", cap_bytes=cap, node_id="node-a", emit=lambda *a, **k: True)
    before = landed(spool).column("sample_id").to_pylist()
    raw_before = {e.bundle_id: e.manifest.sample_ids for e in spool.raw_entries()}
    capacity = sum(e.manifest.nbytes for e in spool.pending()) // 3
    with caplog.at_level(logging.WARNING, logger="edgehaul.edge.spool"):
        assert spool.thin_to(capacity, salt="pass-race", pack_rows=policy.flush_max_samples) == []
    assert RacedSpool.raced > len(raw_before)  # the thinning had written its raw bundle when the room went
    assert "no room for a thinned bundle" in caplog.text and "thinned-out rows taken back" in caplog.text
    waiting = landed(spool).column("sample_id").to_pylist()
    assert sorted(waiting) == sorted(before)  # every bundle whole
    assert spool.ledger.lookup(waiting) == {}  # none of them recorded as gone
    assert spool.raw_entries() == []  # the clean-up evicted the raw store: the rows it held before are ledgered
    evicted = {i for ids in raw_before.values() for i in ids}
    assert set(spool.ledger.lookup(sorted(evicted))) == evicted
    assert spool.ledger.counts() == {("spool-raw", "raw-evicted"): len(evicted)}


@pytest.mark.parametrize("salt", [f"pass-fill-{i}" for i in range(6)])
def test_a_thinned_pass_of_few_rows_is_filled_to_within_a_row(pump: Contract, tmp_path: Path, salt: str) -> None:
    """A pass that carries about half of 48 waiting rows once they share one footer (digits at 2%: about ten rows a
    pass): every draw, not only their mean, fills it to within a row's bytes (footer share included) and never
    over. A Poisson thinning at the expected bytes lands 24 +- 4 rows, so about a third of its draws leave more
    idle, and the pass cannot add it."""
    policy = TieringPolicy(version="fill", flush_max_samples=8, low_threshold=0.0, high_threshold=1.0)
    spool = run_edge(pump, policy, tmp_path, n=48, batch=48, seed=6)
    pending = spool.pending()
    assert len(pending) == 6 and sum(e.manifest.row_count for e in pending) == 48
    total = sum(e.manifest.nbytes for e in pending)
    capacity = total // 4  # six footers, four rows' bytes in each: one footer and about 24 rows
    rounds = spool.thin_to(capacity, salt=salt, pack_rows=48)
    after = spool.pending()
    left = sum(e.manifest.nbytes for e in after)
    kept = sum(e.manifest.row_count for e in after)
    row = left / max(kept, 1)  # a packed bundle's bytes per row, its footer included
    assert left <= capacity and capacity - left < row, (capacity, left, kept, [(r.keep, r.rows_kept) for r in rounds])
    assert kept + sum(e.manifest.row_count for e in spool.raw_entries()) == 48  # every row sent or kept


def test_rows_from_small_bundles_that_fit_one_pack_are_packed_as_one(pump: Contract, tmp_path: Path) -> None:
    """A pack's rows are reckoned at their bundles' bytes per row, more than a pack carries them in where the bundles
    are small: rows that fit the pass as one pack were cut into two, the second paying a footer of its own, and the
    pass was thinned again (digits at 2%: 8 rows sent where 9 fit). What fits as one pack is now packed as one."""
    policy = TieringPolicy(version="one-pack", flush_max_samples=2, low_threshold=0.0, high_threshold=1.0)
    spool = run_edge(pump, policy, tmp_path, n=24, batch=24, seed=8)
    pending = spool.pending()
    assert len(pending) == 12 and {e.manifest.row_count for e in pending} == {2}
    rows = pa.concat_tables([read_bundle(spool.read(e.bundle_id), e.manifest) for e in pending])
    one = len(write_bundle(rows, pump, tier="normal")[0])
    fixed = spool.fixed_part(pending[0])
    reckoned = fixed + sum(max(e.manifest.nbytes - fixed, 0) // e.manifest.row_count * 2 for e in pending)
    assert reckoned > one + 16  # as reckoned, the rows overrun one pack of `one + 16` bytes
    spool.thin(1.0, salt="one-pack", repack=True, pack_bytes=one + 16)
    after = spool.pending()
    assert [e.manifest.row_count for e in after] == [24] and after[0].manifest.nbytes <= one + 16
    assert sorted(after[0].manifest.sample_ids) == sorted(rows.column("sample_id").to_pylist())


def test_thinning_urgent_and_normal_together_packs_their_rows_together_urgent_first(pump: Contract,
                                                                                    tmp_path: Path) -> None:
    """When the urgent bundles are thinned too (over half the capacity), their rows are packed with the normal
    ones: as few bundles as the rows kept need (one footer per `pack_rows` rows, not one more per tier), urgent
    rows first, each bundle urgent when it holds an urgent row, else normal."""
    policy = TieringPolicy(version="pack", budget_share=0.2, flush_max_samples=16, flush_max_bytes=64 * 1024)
    spool = run_edge(pump, policy, tmp_path, n=3000, batch=100, seed=22)
    pending = spool.pending()
    total = sum(e.manifest.nbytes for e in pending)
    urgent = sum(e.manifest.nbytes for e in pending if e.tier == "high")
    capacity = urgent  # under twice the urgent bytes: urgent bundles are thinned with the rest
    assert any(e.tier == "normal" for e in pending) and total > capacity
    # pack_rows caps a packed bundle, below the originals' rows too (an urgent bundle flushes by bytes and can hold
    # more than a normal one: packing up to it gave a tiered edge fewer footers than a random one at the same rows)
    pack = 12
    assert max(e.manifest.row_count for e in pending) > pack
    spool.thin_to(capacity, salt="pass-pack", pack_rows=pack)
    after = spool.pending()
    rows = [read_bundle(spool.read(e.bundle_id), e.manifest) for e in after]
    n = sum(t.num_rows for t in rows)
    assert len(after) == math.ceil(n / pack)  # no part-empty bundle per tier
    assert all(t.num_rows <= pack for t in rows)
    tiers = [t for tb in rows for t in tb.column("tier").to_pylist()]  # drain order; "low": a sampled low row
    urgent_rows = tiers.count("high")
    assert 0 < urgent_rows < len(tiers) and set(tiers[:urgent_rows]) == {"high"}
    for e, t in zip(after, rows, strict=True):
        assert e.tier == ("high" if "high" in t.column("tier").to_pylist() else "normal")


# ------------------------------------------------------------------------------------------ integration
def _macro_f1(truth: np.ndarray, pred: np.ndarray) -> float:
    f1 = []
    for k in (0, 1):
        tp = float(((pred == k) & (truth == k)).sum())
        fp = float(((pred == k) & (truth != k)).sum())
        fn = float(((pred != k) & (truth == k)).sum())
        f1.append(2 * tp / (2 * tp + fp + fn) if tp else 0.0)
    return float(np.mean(f1))


@pytest.fixture
def s3_store(stack: object) -> Iterator[object]:
    from tests.conftest import store_for

    yield store_for(stack, prefix=f"t-{uuid.uuid4().hex[:10]}")  # type: ignore[arg-type]


@pytest.mark.integration
def test_at_5_percent_the_default_scorer_lands_more_faults_than_random_and_trains_no_worse(
        pump: Contract, tmp_path: Path, s3_store: object) -> None:
    from deltalake import write_deltalake

    from edgehaul.blocks import ObjectStore
    from edgehaul.edge.model_scorer import ModelScorer
    from edgehaul.edge.preprocess import preprocess
    from edgehaul.training.trainer import TrainConfig, train

    store = s3_store
    assert isinstance(store, ObjectStore)
    n, batch, share = 30_000, 3000, 0.05
    policy = TieringPolicy(budget_share=share)  # the default scorer (novelty), no label read at the edge
    assert policy.scorer == "novelty" and not policy.use_labels
    spool = run_edge(pump, policy, tmp_path, n=n, batch=batch, seed=11)
    sent = trainable(landed(spool).to_batches()[0], pump)
    stream = pa.concat_tables([preprocess(pump_raw(pump, batch, seed=11 + s, start_seq=s), pump,
                                          node_id="node-a").accepted for s in range(0, n, batch)])
    faults_stream = int(pc.sum(stream.column("bearing_fault")).as_py())
    # random at the same bytes: rows are all the same size, so the same number of rows, drawn uniformly
    pick = np.sort(np.random.default_rng(3).choice(n, sent.num_rows, replace=False))
    rnd = stream.take(pa.array(pick))
    rnd = rnd.append_column("value", pa.array(np.zeros(len(pick), np.float32))).append_column(
        "tier", pa.array(["normal"] * len(pick))).append_column(
        "is_summary", pa.array(np.zeros(len(pick), bool))).append_column(
        "inclusion_p", pa.array(np.full(len(pick), len(pick) / n, np.float32))).select(
        pump.bundle_schema.names).cast(pump.bundle_schema)
    f_sent = int(pc.sum(sent.column("bearing_fault")).as_py())
    f_rnd = int(pc.sum(rnd.column("bearing_fault")).as_py())
    bytes_sent = sum(e.manifest.nbytes for e in spool.pending())
    log.info("5%%: %d rows sent (%d B), %d faults; random %d faults; stream %d faults in %d", sent.num_rows,
             bytes_sent, f_sent, f_rnd, faults_stream, n)
    assert abs(sent.num_rows / n - share) < 0.01  # the budget, kept
    assert f_sent > 1.5 * f_rnd  # more rare events than random
    # 1/p weights give the stream's fault rate back (what training sees is the population, reweighted)
    w = sample_weights(sent)
    fault_rate = float(w[np.asarray(sent.column("bearing_fault").to_numpy()) == 1].sum() / w.sum())
    assert abs(fault_rate - faults_stream / n) < 0.01

    test = preprocess(pump_raw(pump, 8000, seed=999, start_seq=10**6), pump, node_id="node-a").accepted
    truth = np.asarray(test.column("bearing_fault").to_numpy())
    scores = {}
    for name, rows in (("tiered", sent), ("random", rnd)):
        uri = store.uri("curated", f"{pump.kind}-{name}")
        write_deltalake(uri, rows.append_column("bundle_id", pa.array(["b"] * rows.num_rows)),
                        storage_options=store.storage_options(), mode="append")
        assert pump.training is not None
        cfg = TrainConfig(run_id=f"pump-{name}", dataset_uri=uri, dataset_version=0, model_name=f"pump-{name}",
                          contract_id=pump.id, seed=1, epochs=pump.training.epochs, batch_size=pump.training.batch_size,
                          lr=pump.training.lr, width=pump.training.width, num_threads=1, emit_events=False,
                          augment=False, val_fraction=0.1)
        result = train(cfg, store)
        model = ModelScorer(str(result.lineage["model_uri"]), store)
        pred = np.argmax(model.probabilities(test), axis=1)
        scores[name] = _macro_f1(truth, np.asarray(model.contract.label_values)[pred])
    log.info("macro-F1 on %d held-out rows: %s", test.num_rows, scores)
    assert scores["tiered"] >= scores["random"] - 0.01, scores


def test_a_pass_packed_to_its_bytes_pays_one_fixed_part_and_carries_more_rows(pump: Contract, tmp_path: Path) -> None:
    """Packed by the originals' size, a pass of small rows paid one Parquet fixed part per 8 rows (digits at 5%: 18
    rows went as 16 + 2, the second bundle 1.7 KB for two rows); packed to the pass's bytes (`pack_bytes`, as a
    node's pass drain and the bench pack), the same capacity goes as one bundle and carries more rows, every row
    sent or kept."""
    policy = TieringPolicy(version="fill", flush_max_samples=8, low_threshold=0.0, high_threshold=1.0)
    kept = {}
    for how in ("originals", "pass"):
        spool = run_edge(pump, policy, tmp_path / how, n=192, batch=96, seed=4)
        total = sum(e.manifest.nbytes for e in spool.pending())
        largest = max(e.manifest.nbytes for e in spool.pending())
        capacity = total // 6  # packed in one bundle, the 192 rows take about 0.12 of their 24 bundles' bytes
        spool.thin_to(capacity, salt="pass-bytes", pack_bytes=capacity if how == "pass" else None)
        after = spool.pending()
        assert sum(e.manifest.nbytes for e in after) <= capacity
        kept[how] = sum(e.manifest.row_count for e in after)
        assert kept[how] + sum(e.manifest.row_count for e in spool.raw_entries()) == 192
        if how == "pass":  # rows packed many to a bundle cost less than in theirs, and are priced so (_packed_scale)
            assert len(after) == 1 and kept[how] < 192 and sum(e.manifest.nbytes for e in after) > 0.95 * capacity
        else:
            assert len(after) > 1 and max(e.manifest.nbytes for e in after) <= 1.05 * largest  # rows estimated
    assert kept["pass"] > 1.3 * kept["originals"], kept


def test_an_urgent_pack_over_the_pass_has_its_normal_rows_thinned_and_its_urgent_rows_kept(
        pump: Contract, tmp_path: Path) -> None:
    """A pack holding an urgent row is an urgent bundle. While only the normal tier is thinned, its normal rows are
    still drawn from (by each row's own tier) and its urgent rows kept whole with p unchanged: a 5% digits pass
    packed into one urgent bundle 131 B over the link once had nothing left to thin, and the pass sent nothing."""
    policy = TieringPolicy(version="mixed", budget_share=0.3, flush_max_samples=16, flush_max_bytes=64 * 1024)
    spool = run_edge(pump, policy, tmp_path, n=600, batch=200, seed=9)
    spool.thin(1.0, salt="pack-all", tiers=("normal",), pack_with=("high",), repack=True, pack_bytes=2**30)
    [pack] = spool.pending()
    before = landed(spool)
    tiers = before.column("tier").to_pylist()
    urgent = {i for i, t in zip(before.column("sample_id").to_pylist(), tiers, strict=True) if t == "high"}
    p_before = dict(zip(before.column("sample_id").to_pylist(), before.column("inclusion_p").to_pylist(), strict=True))
    assert pack.tier == "high" and urgent and len(urgent) < pack.manifest.row_count
    capacity = pack.manifest.nbytes * 2 // 3
    raw_before = {i for e in spool.raw_entries() for i in e.manifest.sample_ids}
    spool.thin_to(capacity, salt="over", urgent_share=1.0, pack_bytes=capacity)  # urgent rows fit their share
    after = landed(spool)
    assert sum(e.manifest.nbytes for e in spool.pending()) <= capacity
    ids = after.column("sample_id").to_pylist()
    assert urgent <= set(ids) and len(ids) < len(before)
    for i, p in zip(ids, after.column("inclusion_p").to_pylist(), strict=True):
        assert (p == p_before[i]) if i in urgent else (p < p_before[i])
    raw = {i for e in spool.raw_entries() for i in e.manifest.sample_ids} - raw_before
    assert raw.isdisjoint(ids) and len(raw) + len(ids) == len(before)


def test_a_pass_that_fits_once_its_rows_share_footers_repacks_and_thins_nothing(pump: Contract,
                                                                               tmp_path: Path) -> None:
    """Bundles of two rows are mostly footer: what waits is over the capacity, the same rows packed 16 to a bundle
    are under it. thin_to packs them with keep 1 (no row to the raw store, every p unchanged) instead of leaving
    the spool over capacity, where the link would carry a prefix of the drain order (the urgent bundles alone)."""
    policy = TieringPolicy(version="tiny", flush_max_samples=2, low_threshold=0.0)  # every row travels
    spool = run_edge(pump, policy, tmp_path, n=96, batch=48, seed=3)
    before = landed(spool)
    pending = spool.pending()
    total = sum(e.manifest.nbytes for e in pending)
    assert len(pending) >= 30
    capacity = total // 2
    rounds = spool.thin_to(capacity, salt="pass-pack", pack_rows=16)
    after_entries = spool.pending()
    assert rounds[0].keep == 1.0 and sum(r.rows_out for r in rounds) == 0 and not spool.raw_entries()
    assert sum(e.manifest.nbytes for e in after_entries) <= capacity and len(after_entries) < len(pending) / 4
    after = landed(spool)
    assert sorted(after.column("sample_id").to_pylist()) == sorted(before.column("sample_id").to_pylist())
    p_before = dict(zip(before.column("sample_id").to_pylist(), before.column("inclusion_p").to_pylist(), strict=True))
    assert all(p == p_before[i] for i, p in zip(after.column("sample_id").to_pylist(),
                                                after.column("inclusion_p").to_pylist(), strict=True))


def test_a_pass_a_few_bytes_short_ends_with_a_fixed_size_draw_that_fits(pump: Contract, tmp_path: Path) -> None:
    """Eight rows in one bundle, a capacity three bytes under it: the expected bytes say all eight fit once packed,
    and the packed bundle is still over, so the link would carry nothing this pass (bench, digits at 2%: a packed
    bundle of 5 rows 3 bytes over). thin_to's next draw is a row fewer: exactly k rows stay, those with the smallest
    u, each p times k/8 (its chance given the eight that waited), the rest to the raw store, and what waits fits."""
    policy = TieringPolicy(version="few", flush_max_samples=8, low_threshold=0.0, high_threshold=1.0)
    spool = run_edge(pump, policy, tmp_path, n=8, batch=8, seed=4)
    [entry] = spool.pending()
    before = landed(spool)
    p_before = dict(zip(before.column("sample_id").to_pylist(), before.column("inclusion_p").to_pylist(), strict=True))
    capacity = entry.manifest.nbytes - 3
    rounds = spool.thin_to(capacity, salt="pass-few", pack_rows=8)
    # the repack kept all eight and was over; the draw of fixed size after it brought it under
    assert [r.rows_kept for r in rounds][:2] == [8, 7], [(r.salt, r.keep, r.rows_kept, r.rows_out) for r in rounds]
    after_entries = spool.pending()
    assert after_entries and sum(e.manifest.nbytes for e in after_entries) <= capacity
    after = landed(spool)
    kept = after.column("sample_id").to_pylist()
    assert 0 < len(kept) < 8
    keep = float(np.prod([r.keep for r in rounds]))
    assert all(p == pytest.approx(p_before[i] * keep, rel=1e-5)
               for i, p in zip(kept, after.column("inclusion_p").to_pylist(), strict=True))
    raw_ids = {i for e in spool.raw_entries() for i in e.manifest.sample_ids}
    assert raw_ids.isdisjoint(kept) and len(raw_ids) + len(kept) == 8
    # the draw of fixed size itself: exactly k stay, those with the smallest u under its salt, p times k/n
    spool2 = run_edge(pump, policy, tmp_path / "fixed", n=8, batch=8, seed=4)
    res = spool2.thin(1.0, salt="fixed-5", tiers=("normal",), keep_rows=5, pack_rows=8, repack=True)
    assert (res.rows_kept, res.rows_out, res.keep) == (5, 3, 5 / 8)
    stayed = landed(spool2)
    ids = sorted(p_before)
    u = dict(zip(ids, uniforms(pa.array(ids), "fixed-5").tolist(), strict=True))
    assert set(stayed.column("sample_id").to_pylist()) == set(sorted(ids, key=u.__getitem__)[:5])
    assert all(p == pytest.approx(p_before[i] * 5 / 8, rel=1e-6) for i, p in zip(
        stayed.column("sample_id").to_pylist(), stayed.column("inclusion_p").to_pylist(), strict=True))
    with pytest.raises(SpoolError, match="keep_rows 6 is outside \\[0, 5\\]"):
        spool2.thin(1.0, salt="fixed-6", keep_rows=6)
