"""Core validation of every layout: a tensor's byte length, a file's size and media type, typed
columns' nulls, ranges and categories; summary rows carry no payload; GE never reads a tensor's or file's bytes."""

from __future__ import annotations

import dataclasses
import hashlib
import io
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from PIL import Image

from edgehaul.blocks import TieringPolicy
from edgehaul.bundles import BundleError, read_bundle, write_bundle
from edgehaul.contracts import Contract, load_contract
from edgehaul.core import validation
from edgehaul.core.validation import row_problems, validate_bundle, validate_bundles
from edgehaul.decode import with_derived_features
from edgehaul.edge.preprocess import preprocess
from edgehaul.edge.tiering import assign, summarise

MOTIONS = load_contract("basic_motions")
DIGITS = load_contract("digits_png")
GAIT = load_contract("daphnet_gait")


def _identity(n: int) -> dict[str, pa.Array]:
    return {"sample_id": pa.array([f"v{i}" for i in range(n)]), "node_id": pa.array(["node-a"] * n),
            "capture_time": pa.array([datetime(2026, 3, 1, tzinfo=UTC)] * n, pa.timestamp("ms", tz="UTC")),
            "seq": pa.array(range(n), pa.int64())}


def _png(a: np.ndarray) -> bytes:
    b = io.BytesIO()
    Image.fromarray(a).save(b, format="PNG")
    return b.getvalue()


def _rows(contract: Contract, n: int = 30) -> pa.Table:
    """Valid bundle rows of a kind (the first third summaries), as the edge makes them."""
    rng = np.random.default_rng(n)
    if contract is MOTIONS:
        x = rng.normal(size=(n, 6, 100)).astype(np.float32)
        raw = pa.table({**_identity(n), "activity": pa.array([1 + i % 4 for i in range(n)], pa.int16()),
                        "series": [a.tobytes() for a in x]})
    elif contract is DIGITS:
        raw = pa.table({**_identity(n), "digit": pa.array([i % 10 for i in range(n)], pa.int16()),
                        "image": [_png(rng.integers(0, 256, (8, 8), dtype=np.uint8)) for _ in range(n)]})
    else:  # readings around 1 g on the vertical axes: what the gait contract's expectation wants
        cols = {c: rng.normal(1000 if c.endswith("vert") else 0, 200, n).astype(np.float32)
                for c in contract.numeric_columns}
        raw = pa.table({**_identity(n), "is_anomaly": pa.array([i % 2 for i in range(n)], pa.int16()), **cols})
    r = preprocess(raw, contract, node_id="node-a")
    assert r.rejects.num_rows == 0
    scored = assign(r.accepted, np.linspace(0, 1, n), TieringPolicy(), contract)
    k = n // 3
    return pa.concat_tables([summarise(scored.slice(0, k), contract), scored.slice(k)])


def _set(t: pa.Table, name: str, i: int, value: object) -> pa.Table:
    j = t.schema.get_field_index(name)
    values = t.column(name).to_pylist()
    values[i] = value
    return t.set_column(j, t.schema.field(j), pa.array(values, t.schema.field(j).type))


@pytest.mark.parametrize("contract", [MOTIONS, DIGITS, GAIT], ids=lambda c: c.kind)
def test_valid_bundles_of_every_kind_pass_and_ge_never_sees_the_payload_bytes(
        contract: Contract, monkeypatch: pytest.MonkeyPatch) -> None:
    rows = _rows(contract)
    assert row_problems(rows, contract) == ("", "")
    seen: list[list[str]] = []
    frame = validation._ge_frame
    monkeypatch.setattr(validation, "_ge_frame", lambda tables, columns, slot: seen.append(
        [c for t in tables for c in t.column_names if c in columns]) or frame(tables, columns, slot))
    data, m = write_bundle(rows, contract, tier="normal")
    [(table, res)] = validate_bundles([(data, m)], full_tables=False)
    assert res.success and res.reason == "ok", res
    assert table is not None
    binary = contract.payload_column
    if binary is not None:  # read for the row checks, then dropped: GE and the caller never hold the bytes
        assert binary not in table.column_names and all(binary not in cols for cols in seen)
    else:  # a columns kind's data are what its expectations read; the bundle carries each reading once,
        # and the norm_<column> an expectation names is derived here from the reading
        assert "norm_trunk_vert" in seen[0] and "norm_trunk_vert" not in read_bundle(data, m).column_names


def test_tensor_rows_of_the_wrong_length_or_a_summary_with_a_tensor_are_named() -> None:
    rows = _rows(MOTIONS)
    bad = _set(rows, "series", 20, b"\0" * 2396)
    reason, error = row_problems(bad, MOTIONS)
    assert reason == "tensor_length" and "series not 2400 bytes" in error and "v20" in error and "2396" in error
    full = rows.column("series")[25].as_py()
    assert row_problems(_set(rows, "series", 0, full), MOTIONS)[0] == "tensor_length"  # a summary with a tensor


@pytest.mark.parametrize(("i", "value", "why"), [
    (20, b"\x89PNG\r\n\x1a\n" + bytes(5000), "image over 4096 bytes"),
    (21, b"\xff\xd8\xff a JPEG", "image not starting like image/png"),
    (22, None, "image missing"),
    (1, b"\x89PNG\r\n\x1a\n", "image a summary row with a file"),
])
def test_file_rows_too_large_of_another_media_type_or_missing_are_named(i: int, value: bytes | None, why: str) -> None:
    reason, error = row_problems(_set(_rows(DIGITS), "image", i, value), DIGITS)
    assert reason == "file_invalid" and error.startswith(f"1 rows with {why}") and f"v{i}" in error


@pytest.mark.parametrize(("column", "i", "value", "why"), [
    ("ankle_vert", 20, 6000.0, "ankle_vert above 5000"),
    ("leg_vert", 21, -5000.5, "leg_vert below -5000"),
    ("trunk_vert", 22, None, "trunk_vert null"),
    ("ankle_vert", 2, 1.0, "ankle_vert a summary row with a value"),
])
def test_column_rows_out_of_range_null_or_in_a_summary_are_named(column: str, i: int, value: float | None,
                                                                 why: str) -> None:
    reason, error = row_problems(_set(_rows(GAIT), column, i, value), GAIT)
    assert reason == "column_values" and error.startswith(f"1 rows with {why}") and f"v{i}" in error


def test_categories_and_nullable_columns(tmp_path: Path) -> None:
    (tmp_path / "weather.v1.yaml").write_text("""
kind: weather
version: 1
columns:
  temp: {type: float32, min: -80, max: 60, nullable: true}
  sky: {type: category, values: [clear, rain]}
""")
    c = load_contract("weather", 1, tmp_path)
    raw = pa.table({**_identity(4), "temp": pa.array([1.0, None, 3.0, 4.0], pa.float32()),
                    "sky": ["clear", "rain", "clear", "rain"]})
    acc = preprocess(raw, c).accepted
    assert np.isnan(acc.column("norm_temp")[1].as_py())  # the edge's feature of a null reading: NaN
    rows = assign(acc, np.full(4, 0.5), TieringPolicy(), c)
    assert "norm_temp" not in rows.column_names  # derived, so not carried
    assert np.isnan(with_derived_features(rows, c).column("norm_temp")[1].as_py())
    assert row_problems(rows, c) == ("", "")  # a null reading is allowed, a NaN one is not
    assert row_problems(_set(rows, "temp", 0, float("nan")), c)[0] == "non_finite"
    reason, error = row_problems(_set(rows, "sky", 3, "snow"), c)
    assert reason == "column_values" and "sky not in ['clear', 'rain']" in error and "v3" in error
    assert pc.sum(rows.column("is_summary")).as_py() == 0


def test_a_file_that_only_starts_like_a_png_is_refused_naming_the_sample() -> None:
    """The PNG signature and junk pass the media-type check; the core decodes every full row's file as
    training will (`edge.decode`) and refuses the bundle, naming the row; a valid file passes."""
    rows = _rows(DIGITS)
    assert row_problems(rows, DIGITS) == ("", "")
    junk = b"\x89PNG\r\n\x1a\n" + np.random.default_rng(1).bytes(200)
    reason, error = row_problems(_set(rows, "image", 20, junk), DIGITS)
    assert reason == "file_invalid" and error.startswith("1 rows with image that do not decode to [8, 8, 1] uint8")
    assert "v20" in error
    big = _png(np.zeros((16, 16), dtype=np.uint8))  # a real PNG, of another shape
    reason, error = row_problems(_set(rows, "image", 21, big), DIGITS)
    assert reason == "file_invalid" and "v21" in error and "shape" in error


def test_an_expectation_on_a_derived_feature_still_judges_the_readings() -> None:
    """The gait gravity check names norm_trunk_vert, which no bundle carries: a core derives it from trunk_vert, so
    a detached trunk sensor (reading 0 g) still fails the bundle."""
    rows = _rows(GAIT)
    data, m = write_bundle(rows, GAIT, tier="normal")
    assert validate_bundle(data, m)[1].success
    i = rows.schema.get_field_index("trunk_vert")
    flat = pc.if_else(rows.column("is_summary"), rows.column("trunk_vert"), pa.scalar(0.0, pa.float32()))
    data, m = write_bundle(rows.set_column(i, rows.schema.field(i), flat), GAIT, tier="normal")
    _, res = validate_bundle(data, m)
    failed = [e for e in res.expectations if not e.success]
    assert not res.success and [(e.expectation, e.column) for e in failed] == [
        ("expect_column_mean_to_be_between", "norm_trunk_vert")]
    assert failed[0].observed_value == pytest.approx(0.5)  # 0 mg on the contract's [-5000, 5000]


def test_a_bundle_that_still_carries_derived_features_is_read_without_them() -> None:
    """A node on older code sent norm_<column> beside each reading: accepted, and read as the new schema; a
    column of another name is still schema drift."""
    rows = _rows(GAIT)
    old = with_derived_features(rows, GAIT)
    _, m = write_bundle(rows, GAIT, tier="normal")
    for extra, ok in ((old, True), (rows.append_column("norm_nothing", pa.array(np.zeros(30, np.float32))), False)):
        sink = io.BytesIO()
        pq.write_table(extra.replace_schema_metadata({b"edgehaul.contract": GAIT.id.encode()}), sink)
        data = sink.getvalue()
        mm = dataclasses.replace(m, sha256=hashlib.sha256(data).hexdigest(), nbytes=len(data))
        if not ok:
            with pytest.raises(BundleError, match=r"unexpected columns \['norm_nothing'\]"):
                read_bundle(data, mm)
            continue
        assert read_bundle(data, mm).schema == GAIT.bundle_schema
        table, res = validate_bundle(data, mm)
        assert res.success, res.error
        assert table is not None and "norm_trunk_vert" not in table.column_names
