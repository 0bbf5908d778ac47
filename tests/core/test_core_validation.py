"""Batched validation: several bundles in one Great Expectations run give, bundle by bundle, the same
verdicts as one GE run per bundle (row-level failures attributed by GE's unexpected index, column
aggregates per bundle), and concurrent per-bundle callers share one run."""

from __future__ import annotations

import hashlib
import io
import logging
from dataclasses import replace

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgehaul.bundles import BundleManifest, write_bundle
from edgehaul.contracts import load_contract
from edgehaul.core.validation import (
    SPREAD_MIN_VALUES,
    run_expectations,
    validate_bundles,
)
from tests.builders import processed_rows

CONTRACT = load_contract("landsat_patch")
DEFECTS = ("none", "none", "dead_band", "x255", "dup_ids", "bad_label", "corrupt", "copy_of_first", "extra_column",
           "truncated")


PRE_GE = {"corrupt": "checksum", "extra_column": "schema_drift", "truncated": "unreadable"}


def _make(defect: str, n: int, seed: int, first: pa.Table | None) -> tuple[bytes, BundleManifest, pa.Table]:
    t = processed_rows(n, "node-a", seed=seed, start_seq=seed * 1000)
    if defect == "dead_band":
        t = t.set_column(t.schema.get_field_index("mean_b4_nir"), "mean_b4_nir", pa.array([0.0] * n, pa.float32()))
    elif defect == "x255":
        for name in CONTRACT.feature_columns:
            i = t.schema.get_field_index(name)
            t = t.set_column(i, name, pc.multiply(t.column(name), pa.scalar(255.0, pa.float32())))
    elif defect == "dup_ids":
        t = pa.concat_tables([t, t.slice(0, 3)])
    elif defect == "bad_label":
        t = t.set_column(t.schema.get_field_index("label"), "label", pa.array([9] * n, pa.int16()))
    elif defect == "copy_of_first" and first is not None:
        t = first.select(CONTRACT.bundle_schema.names)  # the same samples again: unique within each bundle
    data, m = write_bundle(t, CONTRACT, tier="normal")
    if defect == "corrupt":
        data = data[:50] + bytes(b ^ 0xFF for b in data[50:90]) + data[90:]
    elif defect in ("extra_column", "truncated"):  # checksums match: caught by the schema / Parquet checks
        if defect == "extra_column":
            t = t.append_column("gain", pa.array([1.0] * t.num_rows))
        sink = io.BytesIO()
        pq.write_table(t.replace_schema_metadata({b"edgehaul.contract": CONTRACT.id.encode()}), sink)
        data = sink.getvalue() if defect == "extra_column" else data[: len(data) // 2]
        m = replace(m, sha256=hashlib.sha256(data).hexdigest(), nbytes=len(data))
    return data, m, t


def _close(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-6 * max(1.0, abs(a), abs(b))
    return a == b


@settings(max_examples=8, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(defects=st.lists(st.sampled_from(DEFECTS), min_size=2, max_size=5), n=st.integers(20, 120), seed=st.integers(0, 50))
def test_property_batched_verdicts_equal_one_run_per_bundle(
    defects: list[str], n: int, seed: int, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.clear()
    caplog.set_level(logging.INFO, logger="edgehaul.core.validation")
    made: list[tuple[bytes, BundleManifest, pa.Table]] = []
    for i, d in enumerate(defects):
        made.append(_make(d, n, seed + i, made[0][2] if made else None))
    batch = validate_bundles([(d, m) for d, m, _ in made])
    assert len(batch) == len(made)
    for defect, (_, m, _), (table, res) in zip(defects, made, batch, strict=True):
        assert res.bundle_id == m.bundle_id
        if defect in PRE_GE:  # fails before GE, alone in its batch slot; the others are unaffected
            assert res.reason == PRE_GE[defect] and table is None, res
            continue
        assert table is not None
        ge = run_expectations(table, CONTRACT)  # GE alone on this bundle: the reference
        assert [(e.expectation, e.column) for e in res.expectations] == [(e.expectation, e.column) for e in ge]
        for got, want in zip(res.expectations, ge, strict=True):
            assert got.success == want.success, (got, want)
            assert got.unexpected_count == want.unexpected_count, (got, want)
            assert _close(got.observed_value, want.observed_value), (got, want)
        assert res.success == all(e.success for e in ge)
        assert res.reason == ("ok" if res.success else "expectations")
    assert "not split per bundle" not in caplog.text  # the batch path itself, not its per-bundle fallback
    # decoding only the columns validation reads gives the very same verdicts
    lean = validate_bundles([(d, m) for d, m, _ in made], full_tables=False)
    for (_, lean_res), (_, full_res) in zip(lean, batch, strict=True):
        # the same verdict; only the Parquet reader's wording of an unreadable file may differ
        head = lean_res.error.split(" (")[0], full_res.error.split(" (")[0]
        assert replace(lean_res, error=head[0]) == replace(full_res, error=head[1])
    assert all(t is None or "pixels" not in t.column_names for t, _ in lean)


def test_an_urgent_bundle_of_one_to_three_rows_passes_and_its_spread_check_is_recorded_not_applicable() -> None:
    """An urgent bundle of one to three samples: GE's sample stdev of one value is NaN, and two or three close
    values fall under the dead-sensor floor; both quarantined such bundles, spending their bytes for nothing.
    A spread check over fewer than SPREAD_MIN_VALUES values does not apply (recorded as such); every row-level
    check still does, and a real dead sensor (SPREAD_MIN_VALUES equal values) still fails."""
    for n in (1, 2, 3):
        rows = processed_rows(n, "node-a", seed=7 + n, start_seq=7000 + 10 * n)
        # the worst case for a spread check: every value the same
        rows = rows.set_column(rows.schema.get_field_index("mean_b4_nir"), "mean_b4_nir",
                               pa.array([0.3] * n, pa.float32()))
        data, m = write_bundle(rows, CONTRACT, tier="high")
        ((_, res),) = validate_bundles([(data, m)])
        assert res.success and res.reason == "ok", (n, res.error)
        (spread,) = [r for r in res.expectations if r.expectation == "expect_column_stdev_to_be_between"]
        assert spread.success and spread.details == f"not applicable: {n} value(s), a spread needs {SPREAD_MIN_VALUES}"

    one = processed_rows(1, "node-a", seed=7, start_seq=7000)
    bad_label = one.set_column(one.schema.get_field_index("label"), "label", pa.array([9], pa.int16()))
    data, m = write_bundle(bad_label, CONTRACT, tier="high")
    (_, res), = validate_bundles([(data, m)])
    assert not res.success and "expect_column_values_to_be_in_set(label)" in res.error

    many = processed_rows(SPREAD_MIN_VALUES, "node-a", seed=8, start_seq=8000)
    dead = many.set_column(many.schema.get_field_index("mean_b4_nir"), "mean_b4_nir",
                           pa.array([0.3] * SPREAD_MIN_VALUES, pa.float32()))
    data, m = write_bundle(dead, CONTRACT, tier="high")
    (_, res), = validate_bundles([(data, m), *[bundle_of(3, s) for s in (1, 2)]])[:1]
    assert not res.success and "expect_column_stdev_to_be_between(mean_b4_nir)" in res.error


def bundle_of(n: int, seed: int) -> tuple[bytes, BundleManifest]:
    data, m = write_bundle(processed_rows(n, "node-a", seed=seed, start_seq=seed * 100 + 50_000), CONTRACT, tier="normal")
    return data, m
