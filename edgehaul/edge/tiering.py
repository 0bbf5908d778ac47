"""Tiering and batching: scored rows -> urgent bundles, normal bundles (with low-tier summary rows)
and raw-store bundles for the local spool.

- `route(values, policy)`: value >= high_threshold -> "high", value < low_threshold -> "low", else
  "normal".
- `Batcher`: high rows leave at once as urgent bundles (each <= urgent_max_bytes); normal rows and
  the summary rows of low-tier samples (payload columns null, is_summary true) are buffered and flushed as a
  normal bundle when it reaches flush_max_samples rows or flush_max_bytes bytes, or when its first
  row is flush_max_seconds old (clock injectable), whichever first. The full low-tier rows (payload
  kept) become "low" bundles that `Spool.put` keeps in the local raw store, never uplinked.
- Byte limits hold for the written Parquet bundle itself: rows are cut by their uncompressed size
  (an upper bound for zstd Parquet plus a footer allowance) and a bundle that still comes out too
  large is split in half until it fits.
- `TierReport`: samples and bytes per tier, value captured per uplinked byte, and the same metric
  for the no-tiering baseline (every sample sent in full).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from edgehaul.bundles import BundleManifest, write_bundle
from edgehaul.contracts import TIERS, Contract

if TYPE_CHECKING:
    from edgehaul.blocks.policies import TieringPolicy

_FOOTER_ALLOWANCE = 16 * 1024  # Parquet footer + page headers of one bundle, generous


def route(values: np.ndarray, policy: TieringPolicy) -> np.ndarray:
    """Tier per value (object array of 'high'/'normal'/'low')."""
    v = np.asarray(values, dtype=np.float64)
    out = np.full(v.shape, "normal", dtype=object)
    out[v >= policy.high_threshold] = "high"
    out[v < policy.low_threshold] = "low"
    return out


def assign(accepted: pa.Table, values: np.ndarray, policy: TieringPolicy, contract: Contract) -> pa.Table:
    """Preprocessed rows + values -> bundle-schema rows with tier (is_summary false everywhere)."""
    if len(values) != accepted.num_rows:
        raise ValueError(f"{len(values)} values for {accepted.num_rows} rows")
    v = np.asarray(values, dtype=np.float32)
    if np.isnan(v).any():
        raise ValueError(f"scorer returned NaN for {int(np.isnan(v).sum())} of {len(v)} rows")
    v = np.clip(v, 0.0, 1.0)
    t = accepted.append_column("value", pa.array(v, pa.float32()))
    t = t.append_column("tier", pa.array(route(v, policy).tolist(), pa.string()))
    t = t.append_column("is_summary", pa.array(np.zeros(len(v), dtype=bool)))
    return t.cast(contract.bundle_schema)


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
    uplink_bytes: dict[str, int] = field(default_factory=lambda: {"high": 0, "normal": 0})
    raw_store_bytes: int = 0
    bundles: dict[str, int] = field(default_factory=dict)  # flush reason -> count
    value_sent: float = 0.0
    value_total: float = 0.0
    baseline_bytes: int = 0  # bytes if every sample went up in full (measured or estimated)
    baseline_measured: bool = False

    def add(self, b: BuiltBundle) -> None:
        self.bundles[b.reason] = self.bundles.get(b.reason, 0) + 1
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

    def summary(self) -> dict[str, object]:
        return {
            "samples": dict(self.samples), "uplink_bytes": dict(self.uplink_bytes), "raw_store_bytes": self.raw_store_bytes,
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
        self.report = TierReport()

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

    @staticmethod
    def _cuts(sizes: np.ndarray, max_rows: int, max_bytes: int, start_rows: int = 0, start_bytes: int = 0) -> list[int]:
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

    def add(self, scored: pa.Table) -> list[BuiltBundle]:
        """Route one scored batch (bundle-schema rows with tier set). Returns bundles ready now."""
        out: list[BuiltBundle] = []
        tiers = scored.column("tier")
        masks = {tier: pc.equal(tiers, tier) for tier in TIERS}
        for tier, mask in masks.items():
            self.report.samples[tier] += int(pc.sum(mask.cast(pa.int64())).as_py() or 0)
        self.report.value_total += float(pc.sum(scored.column("value")).as_py() or 0.0)
        out.extend(self.poll())
        # One filter per tier: each row's payload is copied once (summaries drop it, no copy).
        high = scored.filter(masks["high"])
        if high.num_rows:
            limit = self.policy.urgent_max_bytes
            sizes = _row_bytes(high)
            bounds = [0, *self._cuts(sizes, high.num_rows, max(limit - _FOOTER_ALLOWANCE, 1)), high.num_rows]
            for a, b in itertools.pairwise(bounds):
                out.extend(self._emit(high.slice(a, b - a), "high", "urgent", limit))
        low = scored.filter(masks["low"])
        if low.num_rows:
            out.extend(self._emit(low, "low", "raw"))
        rest = pa.concat_tables([scored.filter(masks["normal"]), summarise(low, self.contract)])
        if rest.num_rows:
            out.extend(self._buffer(rest))
        return out

    def _buffer(self, rows: pa.Table) -> list[BuiltBundle]:
        out: list[BuiltBundle] = []
        max_rows = self.policy.flush_max_samples
        max_bytes = max(self.policy.flush_max_bytes - _FOOTER_ALLOWANCE, 1)
        sizes = _row_bytes(rows)
        cuts = self._cuts(sizes, max_rows, max_bytes, self._buf_rows, self._buf_bytes)
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

