"""Validation of landed bundles with real Great Expectations: good bundles pass, each kind of bad
bundle fails with its specific reason, and the contract's distribution checks catch a dead sensor
band and a wrong scale."""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import replace

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgehaul.bundles import BundleManifest, write_bundle
from edgehaul.contracts import load_contract
from edgehaul.core.validation import ValidationResult, suite_for, validate_bundle
from tests.builders import bundle, processed_rows

CONTRACT = load_contract("landsat_patch")


def _rebundle(table: pa.Table) -> tuple[bytes, BundleManifest]:
    return write_bundle(table, CONTRACT, tier="normal")


def _raw_bundle(table: pa.Table, like: BundleManifest) -> tuple[bytes, BundleManifest]:
    """Parquet bytes of any table (even off-contract) with a manifest whose checksum matches."""
    sink = io.BytesIO()
    pq.write_table(table.replace_schema_metadata({b"edgehaul.contract": CONTRACT.id.encode()}), sink)
    data = sink.getvalue()
    return data, replace(like, sha256=hashlib.sha256(data).hexdigest(), nbytes=len(data), row_count=table.num_rows)


def _failed(result: ValidationResult) -> dict[tuple[str, str | None], object]:
    return {(e.expectation, e.column): e.observed_value for e in result.expectations if not e.success}


def test_good_bundle_passes_every_expectation_and_round_trips_as_json() -> None:
    data, m = bundle(120, seed=3)
    table, r = validate_bundle(data, m)
    assert r.success and r.reason == "ok" and r.error == ""
    assert table is not None and table.num_rows == 120
    assert len(r.expectations) == len(CONTRACT.expectations)
    assert all(e.success for e in r.expectations)
    assert r.bundle_sha256 == m.sha256 and r.contract_sha256 == CONTRACT.sha256
    doc = json.loads(json.dumps(r.to_dict()))
    assert ValidationResult.from_dict(doc) == r
    rows = r.table_rows()
    assert len(rows) == len(CONTRACT.expectations) and {"check", "column", "success", "observed"} <= set(rows[0])


def test_suite_is_built_once_per_contract() -> None:
    assert suite_for(CONTRACT) is suite_for(CONTRACT)


def test_dead_sensor_band_fails_the_distribution_checks() -> None:
    t = processed_rows(200, seed=5)
    # A dead NIR detector reads zeros: its per-sample band mean (and its spread) collapse to 0.
    t = t.set_column(t.schema.get_field_index("mean_b4_nir"), "mean_b4_nir", pa.array([0.0] * 200, pa.float32()))
    _, r = validate_bundle(*_rebundle(t))
    assert not r.success and r.reason == "expectations"
    failed = _failed(r)
    assert failed[("expect_column_mean_to_be_between", "mean_b4_nir")] == 0.0
    assert ("expect_column_stdev_to_be_between", "mean_b4_nir") in failed
    assert "mean_b4_nir" in r.error
    # the other bands are fine
    assert ("expect_column_mean_to_be_between", "mean_b3_red") not in failed


def test_wrong_scale_x255_fails_range_and_mean_checks() -> None:
    t = processed_rows(200, seed=6)
    for name in CONTRACT.feature_columns:  # features computed from raw counts, scale not applied
        i = t.schema.get_field_index(name)
        t = t.set_column(i, name, pc.multiply(t.column(name), pa.scalar(255.0, pa.float32())))
    _, r = validate_bundle(*_rebundle(t))
    assert not r.success and r.reason == "expectations"
    rows = {(e.expectation, e.column): e for e in r.expectations}
    between = rows[("expect_column_values_to_be_between", "mean_b4_nir")]
    assert not between.success and between.unexpected_count == 200
    mean = rows[("expect_column_mean_to_be_between", "mean_b4_nir")]
    assert not mean.success and isinstance(mean.observed_value, float) and mean.observed_value > 1.0
    assert not rows[("expect_column_mean_to_be_between", "mean_b3_red")].success


def test_duplicate_sample_ids_and_bad_labels_fail() -> None:
    t = processed_rows(50, seed=7)
    dup = pa.concat_tables([t, t.slice(0, 5)])
    _, r = validate_bundle(*_rebundle(dup))
    assert not r.success
    uniq = next(e for e in r.expectations if e.expectation == "expect_column_values_to_be_unique")
    assert not uniq.success and uniq.unexpected_count == 10
    bad_label = t.set_column(t.schema.get_field_index("label"), "label", pa.array([9] * 50, pa.int16()))
    _, r = validate_bundle(*_rebundle(bad_label))
    assert ("expect_column_values_to_be_in_set", "label") in _failed(r)


def test_corrupted_and_truncated_bytes_fail_on_checksum() -> None:
    data, m = bundle(40, seed=8)
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0xFF
    table, r = validate_bundle(bytes(flipped), m)
    assert table is None and r.reason == "checksum" and m.bundle_id in r.error
    _, r = validate_bundle(data[: len(data) // 3], m)
    assert r.reason == "checksum" and f"{len(data) // 3} of {len(data)} bytes" in r.error


def test_truncated_bytes_with_a_matching_manifest_are_unreadable() -> None:
    data, m = bundle(40, seed=9)
    cut = data[: len(data) // 2]
    _, r = validate_bundle(cut, replace(m, sha256=hashlib.sha256(cut).hexdigest(), nbytes=len(cut)))
    assert not r.success and r.reason == "unreadable" and "Parquet" in r.error


def test_unknown_contract_version_is_named() -> None:
    data, m = bundle(20, seed=10)
    _, r = validate_bundle(data, replace(m, contract="landsat_patch.v9"))
    assert r.reason == "unknown_contract" and "landsat_patch.v9" in r.error


def test_row_count_mismatch_is_reported() -> None:
    data, m = bundle(20, seed=11)
    _, r = validate_bundle(data, replace(m, row_count=25))
    assert r.reason == "row_count" and "25" in r.error


def test_manifest_listing_other_samples_is_a_mismatch() -> None:
    data, m = bundle(20, seed=12)
    ids = list(m.sample_ids)
    ids[0] = "someone-else"
    _, r = validate_bundle(data, replace(m, sample_ids=ids))
    assert r.reason == "manifest_mismatch"


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (lambda t: t.append_column("humidity", pa.array([0.5] * t.num_rows)), "unexpected columns ['humidity']"),
        (lambda t: t.set_column(t.schema.get_field_index("seq"), "seq", t.column("seq").cast(pa.int32())), "seq: int32"),
        (lambda t: t.drop_columns(["value"]), "missing columns ['value']"),
    ],
    ids=["new-column", "changed-type", "missing-column"],
)
def test_schema_drift_names_the_columns(change, needle: str) -> None:  # type: ignore[no-untyped-def]
    t = processed_rows(30, seed=13)
    _, m = _rebundle(t)
    _, r = validate_bundle(*_raw_bundle(change(t), m))
    assert r.reason == "schema_drift" and needle in r.error


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(min_value=1, max_value=60), seed=st.integers(min_value=0, max_value=10_000),
       node=st.sampled_from(["node-a", "node-b", "sat-7"]))
def test_property_real_bundles_pass_and_one_result_row_per_expectation(n: int, seed: int, node: str) -> None:
    data, m = bundle(n, node, seed=seed)
    _, r = validate_bundle(data, m)
    # A one-row bundle has no spread: the stdev check may legitimately fail; all else passes.
    failed = {e.expectation for e in r.expectations if not e.success}
    assert failed <= ({"expect_column_stdev_to_be_between"} if n < 3 else set())
    assert len(r.table_rows()) == len(CONTRACT.expectations)
    assert r.node_id == node and r.rows == n


_HONEST = bundle(40, "node-a", seed=21)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(edits=st.lists(st.tuples(st.integers(0, 10**9), st.binary(min_size=1, max_size=8)), min_size=1, max_size=4),
       cut=st.none() | st.integers(0, 10**9))
def test_property_any_bytes_get_a_verdict_never_an_exception(edits: list[tuple[int, bytes]], cut: int | None) -> None:
    """Whatever bytes a node sends under a manifest that matches them (checksum, size), validation returns a
    verdict (a reason and an error naming the bundle) and never raises: garbled pages, footers, page headers,
    truncation. Read bounded, an honest bundle is exactly what Arrow reads."""
    from edgehaul.bundles import read_bounded, unpacked_budget

    data, m = _HONEST
    assert read_bounded(data, None, unpacked_budget(CONTRACT, m.row_count)).equals(pq.read_table(io.BytesIO(data)))
    bad = bytearray(data)
    for at, junk in edits:
        i = at % len(bad)
        bad[i:i + len(junk)] = junk
    if cut is not None:
        bad = bad[: cut % len(bad)]
    raw = bytes(bad)
    m2 = replace(m, sha256=hashlib.sha256(raw).hexdigest(), nbytes=len(raw))
    _, res = validate_bundle(raw, m2)
    assert res.reason in ("ok", "unreadable", "too_large", "manifest_mismatch", "schema_drift", "row_count",
                          "tensor_length", "non_finite", "inclusion_p", "expectations", "bundle_error", "wrong_node",
                          "unknown_contract")
    assert res.success == (res.reason == "ok") and (res.success or res.error)
