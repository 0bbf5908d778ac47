"""Tiering and batching: scored rows -> urgent bundles, normal bundles (with low-tier summary rows)
and raw-store bundles for the local spool.

- `route(values, policy)`: value >= high_threshold -> "high", value < low_threshold -> "low", else
  "normal".
- Every row has an inclusion probability (`inclusion_p`, written in the row). Without a byte budget a row travels
  in full iff `u(policy version, sample id) < inclusion_p` (`draw`: SHA-256 per sample in one native pass, so a
  rerun or retry sends the same rows and the bundle ids and caches hold; nested in p); with one, by a draw of
  fixed size per batch with each row's chance its p, spread over the batch's feature space (`draw_fixed` along
  `spread_order`: a Hilbert curve through its first two principal components, or clusters where those hold under
  half its variance; the same on a rerun of the batch). Without a byte budget p is 1 for high and normal and
  `sample_rate` for low; with `TieringPolicy.budget_share` it is
  value-proportional above a coverage floor, solved per batch so the expected bytes meet the budget
  (`inclusion_probabilities`). A cut by rank is never made: every landed row can be weighted by 1/p.
- `Batcher`: drawn high rows leave at once as urgent bundles (each <= urgent_max_bytes); the other drawn rows
  and the summary rows of the rows left (payload columns null, is_summary true; only where a summary is
  `summary_min_ratio` times smaller than its row, the contract's limit or else the policy's: `plan_bytes`) are
  buffered and flushed as a normal bundle when it reaches flush_max_samples rows or flush_max_bytes bytes, or
  when its first row is flush_max_seconds old (clock injectable), whichever first. The full rows left become
  "low" bundles that `Spool.put` keeps in the local raw store, never uplinked: every sample travels in full, or in the raw
  store, not both. One reordering `take` per batch, every bundle a slice of it.
- Byte limits hold for the written Parquet bundle itself: rows are cut by their uncompressed size
  (an upper bound for zstd Parquet plus a footer allowance) and a bundle that still comes out too
  large is split in half until it fits.
- `TierReport`: samples and bytes per tier, full and summary rows and bytes per row, value captured per
  uplinked byte, and the same metric for the no-tiering baseline (every sample sent in full).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import numpy as np
import polars as pl
import polars_hash as plh
import pyarrow as pa
import pyarrow.compute as pc

from edgehaul.bundles import BundleManifest, write_bundle
from edgehaul.contracts import INCLUSION_P, TIERS, Contract

if TYPE_CHECKING:
    from edgehaul.blocks.policies import TieringPolicy

_FOOTER_ALLOWANCE = 16 * 1024  # Parquet footer + page headers of one bundle, generous
_SCORED = ("value", "tier", "is_summary", INCLUSION_P)
_SCORED_ROW_BYTES = 4 + 7 + 1 + 4  # value, tier (a short string + offset), is_summary, inclusion_p
_SUMMARY_MAX_SHARE = 0.5  # of a budget (after urgent rows) that summaries may take
VALUE_LEVELS = 256  # a value is a multiple of 1/256: finer than any threshold needs, a byte a row in a bundle
P_STEPS_PER_OCTAVE = 32  # an inclusion_p is a power of 2**(1/32): within 1.1% of the solved one, a byte a row


def route(values: np.ndarray, policy: TieringPolicy) -> np.ndarray:
    """Tier per value (object array of 'high'/'normal'/'low')."""
    v = np.asarray(values, dtype=np.float64)
    out = np.full(v.shape, "normal", dtype=object)
    out[v >= policy.high_threshold] = "high"
    out[v < policy.low_threshold] = "low"
    return out


def uniforms(sample_ids: pa.Array | pa.ChunkedArray, salt: str) -> np.ndarray:
    """u in [0, 1) per sample from the first 8 bytes of sha256(salt | sample id), in one native pass
    (polars-hash; the same numbers as hashlib). The same sample gets the same u in any batch or order."""
    return uniform_pairs(sample_ids, salt, words=1)[0]


def uniform_pairs(sample_ids: pa.Array | pa.ChunkedArray, salt: str, words: int = 2) -> list[np.ndarray]:
    """`words` uniforms in [0, 1) per sample from one sha256(salt | sample id): the k-th from its bytes 8k to 8k + 8
    (the first is `uniforms`), so a draw that needs two numbers a row hashes once."""
    if len(sample_ids) == 0:
        return [np.zeros(0, dtype=np.float64) for _ in range(words)]
    frame = pl.DataFrame({"s": pl.Series(sample_ids, dtype=pl.String)})
    h = frame.select(plh.concat_str(pl.lit(f"{salt}|"), pl.col("s")).alias("s")).select(
        plh.col("s").chash.sha2_256()).to_series()
    out = []
    for k in range(words):
        hi = h.str.slice(16 * k, 8).str.to_integer(base=16).cast(pl.UInt64).to_numpy()
        lo = h.str.slice(16 * k + 8, 8).str.to_integer(base=16).cast(pl.UInt64).to_numpy()
        u64 = (hi << np.uint64(32)) | lo
        # Exact on the grid of 2**-53: u < p is decided as float64 on both sides.
        out.append((u64 >> np.uint64(11)).astype(np.float64) * 2.0**-53)
    return out


def draw(sample_ids: pa.Array | pa.ChunkedArray, p: np.ndarray, policy: TieringPolicy) -> np.ndarray:
    """Poisson sampling: a sample travels in full iff u(policy version, sample) < its inclusion_p. Per sample, so
    the same rows whatever the batch or retry; salted with the version only (a compression or flush setting never
    changes the draw); nested: a larger p keeps every sample drawn under a smaller one."""
    p64 = np.asarray(p, dtype=np.float32).astype(np.float64)  # the p written in the row decides, not a wider one
    return uniforms(sample_ids, policy.version) < p64


def hilbert_index(cells: np.ndarray, bits: int) -> np.ndarray:
    """Each point's position along a Hilbert curve through a d-dimensional grid (`cells`: points x d integers in
    [0, 2**bits), d x bits <= 63): points next on the curve are next in the grid, so a stretch of the curve is a
    compact region. Skilling's transform ("Programming the Hilbert curve", 2004), vectorised over the points: one
    step per bit and axis."""
    x = np.asarray(cells, dtype=np.int64).T.copy()  # d x points
    d = len(x)
    if d * bits > 63:
        raise ValueError(f"{d} axes of {bits} bits do not fit a 63-bit index")
    q = np.int64(1) << (bits - 1)
    while q > 1:  # undo excess work: invert or exchange low bits, axis by axis
        low = q - 1
        for i in range(d):
            hit = (x[i] & q) != 0
            t = (x[0] ^ x[i]) & low
            x[0] = np.where(hit, x[0] ^ low, x[0] ^ t)
            if i:
                x[i] = np.where(hit, x[i], x[i] ^ t)
        q >>= 1
    for i in range(1, d):  # Gray encode
        x[i] ^= x[i - 1]
    t = np.zeros(x.shape[1], dtype=np.int64)
    q = np.int64(1) << (bits - 1)
    while q > 1:
        t = np.where((x[d - 1] & q) != 0, t ^ (q - 1), t)
        q >>= 1
    x ^= t
    index = np.zeros(x.shape[1], dtype=np.int64)  # interleave: bit b of axis 0, of axis 1, ..., then bit b - 1
    for b in range(bits - 1, -1, -1):
        for i in range(d):
            index = (index << 1) | ((x[i] >> b) & 1)
    return index


SPREAD_AXES = 2  # principal components a budgeted draw spreads its rows over (3 and 4 measured no better)
# The curve is a good stratifier only where its plane holds the batch's structure: Landsat's first two components
# hold 71% of its 12 features' variance, digits' 32% of 18, gait's 41% of 9. Below this share the rows are grouped
# into clusters in the whole feature space instead (edge alone, 20 policy versions: class-mix L1 off the stream's,
# random order / curve / clusters: digits at 5% 30.8 / 31.5 / 23.9, gait at 5% 0.49 / 0.71 / 0.50; Landsat at 1%
# 15.0 / 10.9 / 13.6, which keeps the curve).
SPREAD_MIN_EXPLAINED = 0.5
SPREAD_MAX_CLUSTERS = 256  # one per row the batch draws, at most (gait at 5%, a batch of 1,000 rows draws 210)
SPREAD_FIT_ROWS = 4096  # clusters are fitted on the first rows of the canonical order (a random subset), then all
SPREAD_ITERATIONS = 8  # assigned


def _curve_index(points: np.ndarray, lo: float, span: float, bits: int) -> np.ndarray:
    """Hilbert index of points on one grid of `bits` per axis over [lo, lo + span] on every axis."""
    cells = ((points - lo) / (span if span > 0 else 1.0) * (1 << bits)).astype(np.int64)
    return hilbert_index(np.clip(cells, 0, (1 << bits) - 1), bits)


def _clusters(z: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(cluster per row, centroids): k-means (Lloyd) fitted on the first `SPREAD_FIT_ROWS` rows, started from the
    first k, then every row assigned. A function of the rows in their given order only."""
    fit = z[:SPREAD_FIT_ROWS]
    centroids = fit[:k].copy()

    def nearest(x: np.ndarray) -> np.ndarray:  # float32 distances: assigning every row is the cost
        c = centroids.astype(np.float32)
        return ((c**2).sum(axis=1)[None, :] - 2.0 * x.astype(np.float32) @ c.T).argmin(axis=1)

    for _ in range(SPREAD_ITERATIONS):
        labels = nearest(fit)
        counts = np.bincount(labels, minlength=k)
        sums = np.zeros_like(centroids)
        np.add.at(sums, labels, fit)
        filled = counts > 0  # an empty cluster keeps its centroid
        centroids[filled] = sums[filled] / counts[filled, None]
    return nearest(z), centroids


def spread_order(features: np.ndarray, axes: int = SPREAD_AXES, draws: float | None = None) -> np.ndarray:
    """An order of the rows (given in a canonical order) that walks the batch's feature space, so a systematic draw
    along it takes rows from every region in proportion to the p it holds (implicit stratification: a spatially
    balanced sample, as GRTS draws one), where a random order leaves a region's count to chance. The features are
    standardised within the batch (a null reading counts as the mean). The rows are laid along a Hilbert curve
    through their first `axes` principal components, on one grid for every axis, ties kept in the given order.
    Where those components hold under `SPREAD_MIN_EXPLAINED` of the variance and the batch draws `draws` >= 2 rows,
    neighbours on the curve are not neighbours in the features: the rows are grouped into that many clusters
    (k-means over every feature, at most `SPREAD_MAX_CLUSTERS`), the clusters laid along the curve by their
    centroids, each cluster's rows along the curve. Fewer than 3 rows or no feature: the given order."""
    f = np.asarray(features, dtype=np.float64)
    m = len(f)
    if m < 3 or f.ndim != 2 or f.shape[1] == 0:
        return np.arange(m)
    finite = np.isfinite(f)
    f = np.where(finite, f, 0.0)
    top = np.abs(f).max(axis=0)
    f /= np.where(top > 0, top, 1.0)  # each column within [-1, 1] first: no square overflows, whatever its scale
    seen = finite.sum(axis=0)
    mean = f.sum(axis=0) / np.maximum(seen, 1)
    z = np.where(finite, f - mean, 0.0)
    sd = z.std(axis=0)
    z /= np.where(sd > 0, sd, 1.0)
    # the components from the features' covariance (k x k): an SVD of the rows took 2.5 s for 100,000 rows of 64
    values, vectors = np.linalg.eigh(z.T @ z)
    n_axes = min(axes, f.shape[1])
    basis = vectors[:, ::-1][:, :n_axes]
    pcs = z @ basis
    bits = min(16, 63 // pcs.shape[1])
    # one scale for every axis: a cluster stays a compact blob (ranks per axis would stretch one apart from the
    # rest along PC 1 into a thin slab, which the curve crosses in many pieces)
    lo, span = float(pcs.min()), float(np.ptp(pcs))
    along = _curve_index(pcs, lo, span, bits)
    total = float(values.sum())
    explained = float(values[::-1][:n_axes].sum()) / total if total > 0 else 1.0
    if draws is None or draws < 2 or explained >= SPREAD_MIN_EXPLAINED:
        return np.argsort(along, kind="stable")
    k = int(min(round(draws), SPREAD_MAX_CLUSTERS, m))
    labels, centroids = _clusters(z, k)
    cluster_rank = np.empty(k, dtype=np.int64)
    cluster_rank[np.argsort(_curve_index(centroids @ basis, lo, span, bits), kind="stable")] = np.arange(k)
    return np.lexsort((np.arange(m), along, cluster_rank[labels]))


def draw_fixed(sample_ids: pa.Array | pa.ChunkedArray, p: np.ndarray, policy: TieringPolicy,
               features: np.ndarray | None = None) -> np.ndarray:
    """The budgeted draw of one batch: systematic sampling along an order of the rows. The rows with 0 < p < 1 are
    laid end to end on a line, each an interval of its p; a row travels iff a point start + k (k an integer) falls
    in its interval, start a uniform of the batch (the sum, mod 1, of a second uniform per row from the same hash:
    independent of the order, the same on a rerun). The order: by u(policy version, sample), then, given the
    batch's `features` (rows x columns, as the scorers read them), along its feature space (`spread_order`), so
    every region keeps rows in proportion to its p. Each row's chance is still exactly its p, and the batch draws
    floor or ceil of sum(p) rows where a Poisson draw's count has sd sqrt(sum p): digits at 2% planned 13.8 rows a
    round and one seed drew 5, under the 9 its pass carried. p 1 always, p 0 never travels. A function of the
    batch, not of a row alone: a rerun of the same batch, in any order, draws the same rows."""
    p64 = np.asarray(p, dtype=np.float32).astype(np.float64)  # the p written in the row decides, not a wider one
    out = p64 >= 1.0
    mid = np.flatnonzero((p64 > 0) & ~out)
    if not len(mid):
        return out
    u, v = uniform_pairs(sample_ids.take(pa.array(mid)), policy.version)
    order = mid[np.argsort(u, kind="stable")]
    if features is not None:
        order = order[spread_order(np.asarray(features)[order], draws=float(p64[mid].sum()))]
    start = float(np.sum(v)) % 1.0
    ends = np.cumsum(p64[order])
    points = np.floor(ends - start) - np.floor(np.concatenate(([0.0], ends[:-1])) - start)
    out[order] = points > 0
    return out


def drawn(sample_ids: pa.Array | pa.ChunkedArray, policy: TieringPolicy) -> np.ndarray:
    """Which of these (low-tier) samples travel in full without a byte budget: u(sample) < sample_rate."""
    return draw(sample_ids, np.full(len(sample_ids), policy.sample_rate), policy)


def _solve_scale(w: np.ndarray, cost: np.ndarray, target: float) -> float:
    """c with sum(min(1, c w) cost) = target (monotone in c): bisection on log c, vectorised per step."""
    if target <= 0 or not len(w):
        return 0.0
    if float(cost[w > 0].sum()) <= target:
        return float("inf")
    lo, hi = 0.0, 1.0
    while float((np.minimum(1.0, hi * w) * cost).sum()) < target:
        hi *= 2.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if float((np.minimum(1.0, mid * w) * cost).sum()) < target:
            lo = mid
        else:
            hi = mid
    return hi


def inclusion_probabilities(values: np.ndarray, full_bytes: np.ndarray, summary_bytes: np.ndarray,
                            policy: TieringPolicy) -> np.ndarray:
    """Each row's probability of travelling in full (float64).

    Without a byte budget (`budget_share` None): 1 for high and normal, `sample_rate` for low.
    With one, the expected bytes of the batch (full rows drawn + summaries of the rows left, where a summary
    earns its bytes: `summary_bytes` 0 otherwise) equal `budget_share` x its full-row bytes:
    - urgent (high tier) rows travel with p 1 while they take at most `urgent_max_share` of the budget; beyond
      it they are sampled with the other rows, by the same rule (their value still makes them the likeliest);
    - every other row gets p = min(1, c x w) with w = coverage + (1 - coverage) x value / mean value: a
      `coverage` share of the budget is spread evenly (every value stratum keeps rows: the floor), the rest in
      proportion to value (importance); c is solved so the expected bytes meet the budget exactly.
    """
    v = np.asarray(values, dtype=np.float64)
    n = len(v)
    high = v >= policy.high_threshold
    if policy.budget_share is None:
        return np.where(v < policy.low_threshold, policy.sample_rate, 1.0)
    b = np.asarray(full_bytes, dtype=np.float64)
    s = np.asarray(summary_bytes, dtype=np.float64)
    budget = policy.budget_share * float(b.sum())
    p = np.zeros(n, dtype=np.float64)
    hb = float(b[high].sum())
    if hb <= policy.urgent_max_share * budget:
        p[high] = 1.0
        rest = ~high
    else:  # more urgent rows than their share: they are sampled with the rest (by value, so still likeliest)
        rest = np.ones(n, dtype=bool)
    if rest.any():
        # A row left costs its summary; drawn it costs its full bytes: sum(s) + sum(p (b - s)) = what is left.
        left = budget - float((p[~rest] * b[~rest]).sum()) - float((s[rest]).sum())
        vr = v[rest]
        mean = float(vr.mean())
        w = policy.coverage + (1.0 - policy.coverage) * (vr / mean if mean > 0 else np.ones_like(vr))
        c = _solve_scale(w, np.maximum(b[rest] - s[rest], 0.0), left)
        p[rest] = np.minimum(1.0, c * w) if np.isfinite(c) else 1.0
    return p


def for_pass_rows(policy: TieringPolicy, rows_per_pass: float | None) -> TieringPolicy:
    """The policy a node draws with when a pass carries about `rows_per_pass` rows: as set from `tilt_full_rows`
    rows up; below, the value tilt fades linearly as the rows fall to 0, `coverage` rising toward 1 and
    `urgent_max_share` falling toward 0 (a uniform draw at the limit, urgent rows sampled with the rest by value).
    Where a pass holds about a row per class, the spread of p and half the pass given to the top of the ranking
    cost more than the tilt buys (bench_value, digits at 2%). To two significant digits: both are in the policy's
    fingerprint, which keys the batch cache."""
    if rows_per_pass is None or policy.tilt_full_rows == 0 or rows_per_pass >= policy.tilt_full_rows:
        return policy
    reach = max(rows_per_pass, 0.0) / policy.tilt_full_rows
    return policy.model_copy(update={
        "coverage": float(f"{1.0 - (1.0 - policy.coverage) * reach:.2g}"),
        "urgent_max_share": float(f"{policy.urgent_max_share * reach:.2g}")})


def on_value_grid(values: np.ndarray) -> np.ndarray:
    """Values clipped to [0, 1] and rounded to the nearest 1/`VALUE_LEVELS` (float32, exact there). A scorer's
    float carries no meaning in its low bits, and a bundle writes a few hundred distinct values in a byte a row
    where free floats took four."""
    v = np.clip(np.asarray(values, dtype=np.float64), 0.0, 1.0)
    return (np.round(v * VALUE_LEVELS) / VALUE_LEVELS).astype(np.float32)


def on_p_grid(p: np.ndarray) -> np.ndarray:
    """Inclusion probabilities rounded, in log2, to the nearest 1/`P_STEPS_PER_OCTAVE` (float32; 0 stays 0, 1
    stays 1). Rounded before the draw, so the p a row records is still exactly its chance of travelling; the
    expected bytes move by under 1.1% a row, either way. Gait rows packed to a pass: 50.3 B with both grids, 55.0
    with free floats (a pass of 9% more rows)."""
    q = np.asarray(p, dtype=np.float64)
    out = np.zeros(q.shape, dtype=np.float64)
    pos = q > 0
    out[pos] = np.exp2(np.minimum(0.0, np.round(np.log2(q[pos]) * P_STEPS_PER_OCTAVE) / P_STEPS_PER_OCTAVE))
    return out.astype(np.float32)


def inclusion_p(tiers: np.ndarray, policy: TieringPolicy) -> np.ndarray:
    """Probability that a row of each tier travels in full without a byte budget: 1 for high and normal,
    sample_rate for low."""
    return np.where(tiers == "low", np.float32(policy.sample_rate), np.float32(1.0)).astype(np.float32)


def summary_bytes(rows: pa.Table, contract: Contract, full: np.ndarray | None = None) -> np.ndarray:
    """Uncompressed bytes of each row's summary (the row less its payload)."""
    full = _row_bytes(rows) if full is None else full
    payload = np.zeros(rows.num_rows, dtype=np.int64)
    for name in contract.payload_columns:
        col = rows.column(name)
        typ = col.type
        if pa.types.is_binary(typ) or pa.types.is_string(typ) or pa.types.is_large_binary(typ):
            payload += pc.fill_null(pc.binary_length(col), 0).to_numpy(zero_copy_only=False).astype(np.int64)
        elif not pa.types.is_boolean(typ):
            payload += typ.bit_width // 8
    return full - payload


def summary_earns(full: np.ndarray, summary: np.ndarray, policy: TieringPolicy,
                  contract: Contract | None = None) -> np.ndarray:
    """A row left on the node sends a summary only where the row is `summary_min_ratio` times the summary's
    size (the contract's `limits.summary_min_ratio` where it sets one, else the policy's); otherwise the summary
    would cost nearly a row for no payload, and the row simply joins the sample."""
    ratio = contract.summary_min_ratio if contract is not None and contract.summary_min_ratio is not None else (
        policy.summary_min_ratio)
    return np.asarray(full, dtype=np.float64) >= ratio * np.maximum(summary, 1)


def plan_bytes(rows: pa.Table, values: np.ndarray, policy: TieringPolicy,
               contract: Contract) -> tuple[np.ndarray, np.ndarray]:
    """(full-row bytes, summary bytes or 0 where a left row sends none) per row, the same from `assign`'s
    preprocessed rows and the Batcher's scored ones. Under a budget, summaries that would take more than half
    of what the urgent rows leave are not sent at all: the budget buys rows first."""
    base = _wire_columns(rows, contract)
    full = _row_bytes(base) + _SCORED_ROW_BYTES
    summ = summary_bytes(base, contract, full)
    summ = np.where(summary_earns(full, summ, policy, contract), summ, 0)
    if policy.budget_share is not None and summ.any():
        v = np.asarray(values, dtype=np.float64)
        rest = v < policy.high_threshold
        budget = policy.budget_share * float(full.sum())
        urgent = min(float(full[~rest].sum()), policy.urgent_max_share * budget)
        if float(summ[rest].sum()) > _SUMMARY_MAX_SHARE * (budget - urgent):
            summ = np.zeros_like(summ)
    return full, summ


def _wire_columns(rows: pa.Table, contract: Contract) -> pa.Table:
    wire = set(contract.bundle_schema.names)  # what a bundle carries: no derived feature
    return rows.select([c for c in rows.column_names if c not in _SCORED and c in wire])


def full_row_bytes(rows: pa.Table, contract: Contract) -> np.ndarray:
    """Each preprocessed row's full-row bytes as a bundle carries it (uncompressed, scored columns included): the
    unit of `TieringPolicy.budget_share`."""
    return _row_bytes(_wire_columns(rows, contract)) + _SCORED_ROW_BYTES


PACKED_ROWS_SAMPLE = 2_000  # rows written to measure a packed row's bytes (a few ms)...
PACKED_SAMPLE_BYTES = 8 << 20  # ...and at most about this many of their bytes (a kind of large images)


def packed_row_bytes(rows: pa.Table, contract: Contract, policy: TieringPolicy) -> float | None:
    """A preprocessed row's bytes in a bundle packed to a pass, its fixed Parquet part aside: (the bytes of a bundle
    of its first rows, up to `PACKED_ROWS_SAMPLE` and `PACKED_SAMPLE_BYTES`, less those of a one-row bundle) over
    (rows - 1). What a pass's bytes buy, where `full_row_bytes` is what a budget share counts (digits: 132 B packed
    against a 293 B full row). None under two rows."""
    n = min(rows.num_rows, PACKED_ROWS_SAMPLE,
            max(2, int(PACKED_SAMPLE_BYTES * rows.num_rows / max(rows.nbytes, 1))))
    if n < 2:
        return None
    scored = assign(rows.slice(0, n), np.zeros(n), policy.model_copy(update={"budget_share": None}), contract)
    many = len(write_bundle(scored, contract, tier="normal")[0])
    one = len(write_bundle(scored.slice(0, 1), contract, tier="normal")[0])
    return max(many - one, 1) / (n - 1)


def bundle_cuts(sizes: np.ndarray, max_rows: int, max_bytes: int, start_rows: int = 0, start_bytes: int = 0) -> list[int]:
    """Row indices where a new bundle starts, so that no bundle exceeds max_rows or max_bytes
    (the first bundle already holds start_rows/start_bytes). One step per bundle, not per row."""
    csum = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
    n = len(sizes)
    cuts: list[int] = []
    i, rows0, bytes0 = 0, start_rows, start_bytes
    while i < n:
        # furthest end j with bytes0 + sum(sizes[i:j]) <= max_bytes and rows0 + (j - i) <= max_rows
        j_bytes = int(np.searchsorted(csum, csum[i] + max_bytes - bytes0, side="right")) - 1
        j = min(j_bytes, i + max_rows - rows0, n)
        if j <= i:
            if rows0 == 0:
                j = i + 1  # a single row larger than the limit still goes, alone
            else:
                cuts.append(i)
                rows0, bytes0 = 0, 0
                continue
        if j >= n:
            break
        cuts.append(j)
        i, rows0, bytes0 = j, 0, 0
    return cuts


def assign(accepted: pa.Table, values: np.ndarray, policy: TieringPolicy, contract: Contract) -> pa.Table:
    """Preprocessed rows + values -> bundle-schema rows (derived features dropped) with tier and inclusion_p
    (is_summary false everywhere; the Batcher sends the rows `draw`n and keeps the others on the node, with a
    summary where it earns its bytes)."""
    if len(values) != accepted.num_rows:
        raise ValueError(f"{len(values)} values for {accepted.num_rows} rows")
    v = np.asarray(values, dtype=np.float32)
    if np.isnan(v).any():
        raise ValueError(f"scorer returned NaN for {int(np.isnan(v).sum())} of {len(v)} rows")
    v = on_value_grid(v)
    tiers = route(v, policy)
    if policy.budget_share is None:
        p = inclusion_p(tiers, policy)
    else:
        p = on_p_grid(inclusion_probabilities(v, *plan_bytes(accepted, v, policy, contract), policy))
    t = accepted.append_column("value", pa.array(v, pa.float32()))
    t = t.append_column("tier", pa.array(tiers.tolist(), pa.string()))
    t = t.append_column("is_summary", pa.array(np.zeros(len(v), dtype=bool)))
    t = t.append_column(INCLUSION_P, pa.array(np.asarray(p, dtype=np.float32), pa.float32()))
    schema = contract.bundle_schema  # the derived features stay on the node: a core derives them
    return t.select(schema.names).cast(schema)


def summarise(rows: pa.Table, contract: Contract) -> pa.Table:
    """Low-tier summary rows: same columns, every payload column null (the tensor, the file, or a columns
    kind's data columns), features kept, is_summary true."""
    t = rows
    for name in contract.payload_columns:
        i = t.schema.get_field_index(name)
        t = t.set_column(i, t.schema.field(i), pa.nulls(t.num_rows, t.schema.field(i).type))
    j = t.schema.get_field_index("is_summary")
    return t.set_column(j, t.schema.field(j), pa.array(np.ones(rows.num_rows, dtype=bool)))


def _row_bytes(t: pa.Table) -> np.ndarray:
    """Uncompressed bytes per row: fixed-width columns + each variable-width value's length."""
    fixed = 0
    var = np.zeros(t.num_rows, dtype=np.int64)
    for col in t.columns:
        typ = col.type
        if pa.types.is_binary(typ) or pa.types.is_string(typ):
            var += pc.fill_null(pc.binary_length(col), 0).to_numpy(zero_copy_only=False).astype(np.int64) + 4
        elif pa.types.is_boolean(typ):
            fixed += 1
        else:
            fixed += typ.bit_width // 8
    return var + fixed


@dataclass(frozen=True)
class BuiltBundle:
    data: bytes
    manifest: BundleManifest
    reason: str  # urgent | samples | bytes | age | final | raw
    sent_value: float  # sum of values of full (non-summary) rows
    summary_rows: int


@dataclass
class TierReport:
    samples: dict[str, int] = field(default_factory=lambda: {"high": 0, "normal": 0, "low": 0})
    sampled_low: int = 0  # low-tier samples drawn to travel in full (the rest: summaries + raw store)
    uplink_bytes: dict[str, int] = field(default_factory=lambda: {"high": 0, "normal": 0})
    raw_store_bytes: int = 0
    bundles: dict[str, int] = field(default_factory=dict)  # flush reason -> count
    value_sent: float = 0.0
    value_total: float = 0.0
    baseline_bytes: int = 0  # bytes if every sample went up in full (measured or estimated)
    baseline_measured: bool = False
    # Bytes per row, by what a row became (uncompressed, as the Batcher cut them) and by bundle tier (written).
    full_rows: int = 0
    full_row_bytes: int = 0
    summary_rows: int = 0
    summary_row_bytes: int = 0
    bundle_rows: dict[str, int] = field(default_factory=dict)  # bundle tier -> rows written
    kind: str = ""  # the contract id the rows are of

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON fields (a task result); `merge` adds them back up."""
        return {f.name: (dict(v) if isinstance(v := getattr(self, f.name), dict) else v) for f in fields(self)}

    @classmethod
    def merge(cls, parts: list[dict[str, Any]]) -> TierReport:
        """Sum of per-batch reports (`to_dict`); a field a part lacks (a result cached by older code) adds 0."""
        total = cls()
        kinds: list[str] = []
        for part in parts:
            for f in fields(cls):
                v = part.get(f.name)
                if v is None:
                    continue
                if f.name == "kind":
                    kinds += [] if not v or v in kinds else [v]
                elif isinstance(v, dict):
                    cur = getattr(total, f.name)
                    for k, x in v.items():
                        cur[k] = cur.get(k, 0) + x
                elif isinstance(v, bool):
                    total.baseline_measured = total.baseline_measured or v
                else:
                    setattr(total, f.name, getattr(total, f.name) + v)
        total.kind = ",".join(kinds)
        return total

    def add(self, b: BuiltBundle) -> None:
        self.bundles[b.reason] = self.bundles.get(b.reason, 0) + 1
        self.bundle_rows[b.manifest.tier] = self.bundle_rows.get(b.manifest.tier, 0) + b.manifest.row_count
        if b.manifest.tier == "low":
            self.raw_store_bytes += b.manifest.nbytes
            return
        self.uplink_bytes[b.manifest.tier] = self.uplink_bytes.get(b.manifest.tier, 0) + b.manifest.nbytes
        self.value_sent += b.sent_value

    @property
    def bytes_sent(self) -> int:
        return sum(self.uplink_bytes.values())

    @property
    def value_per_mb(self) -> float:
        return self.value_sent / (self.bytes_sent / 1e6) if self.bytes_sent else 0.0

    @property
    def baseline_value_per_mb(self) -> float:
        # Estimate when not measured: the raw store holds exactly the low-tier payloads left behind.
        b = self.baseline_bytes or (self.bytes_sent + self.raw_store_bytes)
        return self.value_total / (b / 1e6) if b else 0.0

    @property
    def gain(self) -> float:
        base = self.baseline_value_per_mb
        return self.value_per_mb / base - 1.0 if base else 0.0

    def rows(self) -> list[dict[str, object]]:
        """One row per tier plus a total, for a table artifact."""
        out: list[dict[str, object]] = []
        for tier in TIERS:
            out.append({"tier": tier, "samples": self.samples[tier],
                        "uplink_bytes": self.uplink_bytes.get(tier, 0) if tier != "low" else 0,
                        "local_bytes": self.raw_store_bytes if tier == "low" else 0})
        out.append({"tier": "total", "samples": sum(self.samples.values()), "uplink_bytes": self.bytes_sent,
                    "local_bytes": self.raw_store_bytes})
        return out

    def bytes_per_row(self) -> dict[str, float]:
        """Written bytes per row of each bundle tier (high: urgent, normal: full rows + summaries, low: the raw
        store) and uncompressed bytes of a full row and of a summary row."""
        written = {**self.uplink_bytes, "low": self.raw_store_bytes}
        out = {t: round(written.get(t, 0) / r, 1) for t, r in self.bundle_rows.items() if r}
        if self.full_rows:
            out["full_row_raw"] = round(self.full_row_bytes / self.full_rows, 1)
        if self.summary_rows:
            out["summary_row_raw"] = round(self.summary_row_bytes / self.summary_rows, 1)
        return out

    def summary(self) -> dict[str, object]:
        return {"kind": self.kind, "full_rows": self.full_rows, "summary_rows": self.summary_rows,
                "bytes_per_row": self.bytes_per_row(),
            "samples": dict(self.samples), "sampled_low": self.sampled_low, "uplink_bytes": dict(self.uplink_bytes),
            "raw_store_bytes": self.raw_store_bytes,
            "bundles_by_reason": dict(self.bundles), "value_per_MB": round(self.value_per_mb, 3),
            "baseline_value_per_MB": round(self.baseline_value_per_mb, 3),
            "baseline": "measured" if self.baseline_measured else "estimated", "gain": round(self.gain, 3),
        }


class Batcher:
    """Cuts scored rows into bundles per the tiering policy. Feed with `add`, call `flush` at the end."""

    def __init__(
        self, policy: TieringPolicy, contract: Contract, *, clock: Callable[[], float] = time.monotonic,
        scorer_version: str = "", team: str = "default",
    ) -> None:
        self.policy = policy
        self.contract = contract
        self.clock = clock
        self.scorer_version = scorer_version
        self.team = team
        self._buf: list[pa.Table] = []
        self._buf_rows = 0
        self._buf_bytes = 0
        self._first_at: float | None = None
        self.report = TierReport(kind=contract.id)

    def _write(self, rows: pa.Table, tier: str, reason: str) -> BuiltBundle:
        level = self.policy.raw_store_zstd_level if tier == "low" else self.policy.zstd_level
        data, manifest = write_bundle(
            rows, self.contract, tier=tier, policy_version=self.policy.version,
            policy_fingerprint=self.policy.fingerprint, scorer_version=self.scorer_version, team=self.team,
            zstd_level=level, row_group_rows=self.policy.row_group_rows,
        )
        summary = rows.column("is_summary")
        sent_value = float(pc.sum(pc.filter(rows.column("value"), pc.invert(summary))).as_py() or 0.0)
        n_summary = int(pc.sum(summary.cast(pa.int64())).as_py() or 0)
        return BuiltBundle(data, manifest, reason, sent_value, n_summary)

    def _emit(self, rows: pa.Table, tier: str, reason: str, max_bytes: int | None = None) -> list[BuiltBundle]:
        """Write a bundle; one over `max_bytes` is split in half until each part fits (a single row
        always goes, so an oversized sample is never stuck)."""
        b = self._write(rows, tier, reason)
        if max_bytes is not None and b.manifest.nbytes > max_bytes and rows.num_rows > 1:
            half = rows.num_rows // 2
            return self._emit(rows.slice(0, half), tier, reason, max_bytes) + self._emit(
                rows.slice(half), tier, reason, max_bytes)
        self.report.add(b)
        return [b]

    def add(self, scored: pa.Table, features: np.ndarray | None = None) -> list[BuiltBundle]:
        """Route one scored batch (bundle-schema rows with tier and inclusion_p set). Returns bundles ready now.
        `features`: the batch's feature matrix (the derived features too, which `scored` no longer holds), for a
        budgeted draw to spread its rows over.

        One draw per batch (`draw`, or `draw_fixed` under a budget) and one reordering `take`: urgent rows, then
        the other rows drawn, then the rows left whose summary earns its bytes, then the rest left; every bundle is a
        slice of it."""
        out: list[BuiltBundle] = []
        tiers = scored.column("tier").to_numpy()
        n = scored.num_rows
        is_high, is_low = tiers == "high", tiers == "low"
        for tier, m in (("high", is_high), ("low", is_low)):
            self.report.samples[tier] += int(m.sum())
        self.report.samples["normal"] += n - int(is_high.sum()) - int(is_low.sum())
        self.report.value_total += float(pc.sum(scored.column("value")).as_py() or 0.0)
        out.extend(self.poll())
        p = scored.column(INCLUSION_P).to_numpy()
        # with a budget, a draw of fixed size per batch spread over its features (each p exact); without, the
        # per-sample draw at sample_rate
        ids = scored.column("sample_id")
        sent = draw(ids, p, self.policy) if self.policy.budget_share is None else draw_fixed(ids, p, self.policy,
                                                                                            features)
        self.report.sampled_low += int((sent & is_low).sum())
        full, summ = plan_bytes(scored, scored.column("value").to_numpy(), self.policy, self.contract)
        earns = summ > 0
        group = np.where(sent, np.where(is_high, 0, 1), np.where(earns, 2, 3)).astype(np.int8)
        counts = np.bincount(group, minlength=4)
        order = np.argsort(group, kind="stable")
        rows = scored if (order == np.arange(n)).all() else scored.take(pa.array(order))
        a, b, c = (int(x) for x in np.cumsum(counts)[:3])
        high, rest, to_sum = rows.slice(0, a), rows.slice(a, b - a), rows.slice(b, c - b)
        left = rows.slice(b)
        self.report.full_rows += int(sent.sum())
        self.report.full_row_bytes += int(full[sent].sum())
        self.report.summary_rows += c - b
        self.report.summary_row_bytes += int(summ[group == 2].sum())
        if high.num_rows:
            limit = self.policy.urgent_max_bytes
            sizes = full[order[:a]]
            bounds = [0, *bundle_cuts(sizes, high.num_rows, max(limit - _FOOTER_ALLOWANCE, 1)), high.num_rows]
            for x, y in itertools.pairwise(bounds):
                out.extend(self._emit(high.slice(x, y - x), "high", "urgent", limit))
        if left.num_rows:
            out.extend(self._emit(left, "low", "raw"))
        rest = pa.concat_tables([rest, summarise(to_sum, self.contract)]) if to_sum.num_rows else rest
        if rest.num_rows:
            out.extend(self._buffer(rest))
        return out

    def _buffer(self, rows: pa.Table) -> list[BuiltBundle]:
        out: list[BuiltBundle] = []
        max_rows = self.policy.flush_max_samples
        max_bytes = max(self.policy.flush_max_bytes - _FOOTER_ALLOWANCE, 1)
        sizes = _row_bytes(rows)
        cuts = bundle_cuts(sizes, max_rows, max_bytes, self._buf_rows, self._buf_bytes)
        bounds = [0, *cuts, rows.num_rows]
        for k, (a, b) in enumerate(itertools.pairwise(bounds)):
            if self._first_at is None:
                self._first_at = self.clock()
            self._buf.append(rows.slice(a, b - a))
            self._buf_rows += b - a
            self._buf_bytes += int(sizes[a:b].sum())
            if k < len(bounds) - 2:  # a cut follows: this bundle is full
                why = "samples" if self._buf_rows >= max_rows else "bytes"
                out.extend(self._flush(why))
        if self._buf_rows >= max_rows:
            out.extend(self._flush("samples"))
        return out

    def _flush(self, reason: str) -> list[BuiltBundle]:
        if not self._buf_rows:
            return []
        rows = pa.concat_tables(self._buf)
        self._buf, self._buf_rows, self._buf_bytes, self._first_at = [], 0, 0, None
        return self._emit(rows, "normal", reason, self.policy.flush_max_bytes)

    def poll(self) -> list[BuiltBundle]:
        """Flush the normal bundle if its first row is flush_max_seconds old."""
        if self._first_at is not None and self.clock() - self._first_at >= self.policy.flush_max_seconds:
            return self._flush("age")
        return []

    def flush(self) -> list[BuiltBundle]:
        """End of input: whatever is buffered goes out now."""
        return self._flush("final")

    @property
    def buffered_rows(self) -> int:
        return self._buf_rows

