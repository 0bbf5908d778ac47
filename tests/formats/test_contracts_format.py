"""The contract format (docs/CONTRACTS.md): every malformed field is an error naming the field; any tensor shape,
dtype and channel axis gives a bundle schema and a decode that round-trips what preprocessing accepted."""

from __future__ import annotations

import copy
import io
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgehaul.blocks import TieringPolicy
from edgehaul.bundles import write_bundle
from edgehaul.contracts import Contract, ContractInvalid, load_contract
from edgehaul.decode import decode_tensors, grid_means, normalise, with_derived_features
from edgehaul.edge.preprocess import preprocess, preprocessed_schema
from edgehaul.edge.tiering import assign

TENSOR: dict[str, Any] = {
    "kind": "k", "version": 1,
    "tensor": {"column": "x", "shape": [4, 3], "dtype": "float32", "channel_axis": -1, "channels": ["a", "b", "c"]},
    "label": {"column": "y", "kind": "class", "values": [1, 2]},
    "training": {"model": "cnn1d"},
}
FILE: dict[str, Any] = {
    "kind": "k", "version": 1,
    "file": {"column": "img", "media_type": "image/png", "max_bytes": 100,
             "decode": {"shape": [2, 2, 1], "dtype": "uint8", "channels": ["g"]}},
}
COLUMNS: dict[str, Any] = {
    "kind": "k", "version": 1,
    "columns": {"t": {"type": "float32", "min": 0, "max": 1}, "s": {"type": "category", "values": ["u", "v"]}},
    "label": {"column": "flag", "kind": "anomaly"},
}


def _load(tmp_path: Path, doc: dict[str, Any]) -> Contract:
    """Load `doc` as k.v1 from a folder of its own (loaded contracts are cached per folder)."""
    folder = tmp_path / uuid.uuid4().hex
    folder.mkdir()
    (folder / "k.v1.yaml").write_text(yaml.safe_dump(doc))
    return load_contract("k", 1, folder)


def _set(doc: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    d = copy.deepcopy(doc)
    *parents, last = path.split(".")
    node = d
    for p in parents:
        node = node[p]
    if value is _DEL:
        del node[last]
    else:
        node[last] = value
    return d


_DEL = object()

MALFORMED = [
    (TENSOR, "tensor.shape", [4, 0], "tensor.shape[1]"),
    (TENSOR, "tensor.shape", [], "tensor.shape"),
    (TENSOR, "tensor.dtype", "complex64", "tensor.dtype"),
    (TENSOR, "tensor.dtype", "notatype", "tensor.dtype"),
    (TENSOR, "tensor.channel_axis", 2, "tensor.channel_axis"),
    (TENSOR, "tensor.channels", ["a", "b"], "tensor.channels"),
    (TENSOR, "tensor.channels", ["a", "a", "c"], "tensor.channels"),
    (TENSOR, "tensor.channels", ["a", "b", "c-d"], "tensor.channels[2]"),
    (TENSOR, "tensor.max_nan_fraction", 1.5, "tensor.max_nan_fraction"),
    (TENSOR, "tensor.scale", "big", "tensor.scale"),
    (TENSOR, "tensor.colour", "red", "tensor has unknown keys"),
    (TENSOR, "label.kind", "ordinal", "label.kind"),
    (TENSOR, "label.values", _DEL, "label.values"),
    (TENSOR, "label.values", [1, 1], "label.values"),
    (TENSOR, "label.names", ["one"], "label.names"),
    (TENSOR, "label.column", "x y", "label.column"),
    (TENSOR, "training.model", "cnn2d", "training.model"),
    (TENSOR, "training.model", "transformer", "training.model"),
    (TENSOR, "training.lr", 0, "training.lr"),
    (TENSOR, "training.epochs", 0, "training.epochs"),
    (TENSOR, "features", [{"per": "channel", "stats": ["median"]}], "features[0].stats"),
    (TENSOR, "features", [{"per": "column"}], "features[0].per"),
    (TENSOR, "features", [{"function": "nocolon", "outputs": ["f"]}], "features[0].function"),
    (TENSOR, "features", [{"function": "m:f"}], "features[0].outputs"),
    (TENSOR, "limits", {"max_rows": 0}, "limits.max_rows"),
    (TENSOR, "version", 0, "version"),
    (TENSOR, "kind", _DEL, "kind"),
    (TENSOR, "raw_columns", {"x": "blob"}, "raw_columns.x"),
    (TENSOR, "expectations", [{"type": "expect_x"}], "expectations[0]"),
    (TENSOR, "features", [{"per": "grid", "cells": [2, 1]}], "features[0].per"),  # one spatial axis
    (FILE, "features", [{"per": "grid"}], "cells"),
    (FILE, "features", [{"per": "grid", "cells": [3, 1]}], "features[0].cells"),  # 3 rows of a 2-row image
    (FILE, "features", [{"per": "grid", "cells": [0, 1]}], "features[0].cells[0]"),
    (FILE, "features", [{"per": "grid", "cells": [2]}], "features[0].cells"),
    (FILE, "features", [{"per": "grid", "cells": [1, 1], "stats": ["std"]}], "features[0].stats"),
    (FILE, "features", [{"per": "channel", "cells": [2, 2]}], "features[0].cells"),
    (FILE, "features", [{"per": "grid", "cells": [1, 1]}, {"per": "grid", "cells": [2, 2]}], "grid_g_r0c0"),
    (FILE, "file.media_type", "image/gif", "file.media_type"),
    (FILE, "file.max_bytes", -1, "file.max_bytes"),
    (FILE, "file.max_bytes", _DEL, "file.max_bytes"),
    (FILE, "file.decode", {"shape": [2], "dtype": "uint8"}, "file.decode.channels"),
    (COLUMNS, "columns.t.type", "decimal", "columns.t.type"),
    (COLUMNS, "columns.t.min", 5, "columns.t.min"),
    (COLUMNS, "columns.s.values", _DEL, "columns.s.values"),
    (COLUMNS, "columns.t.values", ["x"], "columns.t.values"),
    (COLUMNS, "columns.t.nullable", "yes", "columns.t.nullable"),
    (COLUMNS, "columns.t.unit", 3, "columns.t.unit"),
    (COLUMNS, "columns.s.min", 0, "columns.s"),
    (COLUMNS, "columns.seq", {"type": "int64"}, "columns.seq"),
    (COLUMNS, "label.values", [0, 2], "label.values"),
    (COLUMNS, "label.column", "t", "label.column"),
    (COLUMNS, "features", [{"per": "column", "columns": ["s"]}], "features[0].columns"),
    (COLUMNS, "features", [{"per": "channel"}], "features[0].per"),
    (COLUMNS, "features", [{"per": "grid", "cells": [1, 1]}], "features[0].per"),
    (COLUMNS, "training", {"model": "mlp"}, "training"),  # an anomaly label is fine; see below for none
]


@pytest.mark.parametrize(("base", "path", "value", "field"), MALFORMED,
                         ids=[f"{m[1]}={m[2]!r}"[:60] for m in MALFORMED])
def test_each_malformed_field_is_an_error_naming_it(tmp_path: Path, base: dict[str, Any], path: str, value: Any,
                                                    field: str) -> None:
    doc = _set(base, path, value)
    if path == "training" and field == "training":
        doc = _set(doc, "label", {"kind": "none"})  # nothing to train on
    with pytest.raises(ContractInvalid) as e:
        _load(tmp_path, doc)
    assert f"field {field}" in str(e.value) or field in str(e.value), str(e.value)
    assert "k.v1.yaml" in str(e.value)  # and the file


def test_exactly_one_of_tensor_file_columns(tmp_path: Path) -> None:
    with pytest.raises(ContractInvalid, match="exactly one of tensor, file or columns; it has \\['tensor', 'file'\\]"):
        _load(tmp_path, {**TENSOR, "file": FILE["file"]})
    with pytest.raises(ContractInvalid, match="it has none"):
        _load(tmp_path, {"kind": "k", "version": 1})


def test_the_three_example_layouts_load(tmp_path: Path) -> None:
    for doc in (TENSOR, FILE, COLUMNS):
        c = _load(tmp_path, doc)
        assert c.layout in ("tensor", "file", "columns")


_DTYPES = ["uint8", "int16", "uint16", "int32", "float32", "float64"]


@st.composite
def tensors(draw: st.DrawFn) -> tuple[dict[str, Any], np.ndarray]:
    rank = draw(st.integers(1, 4))
    shape = draw(st.lists(st.integers(1, 5), min_size=rank, max_size=rank))
    axis = draw(st.integers(-rank, rank - 1))
    dtype = draw(st.sampled_from(_DTYPES))
    scale = draw(st.sampled_from([1.0, 0.5, -2.0]))
    spec = {"column": "x", "shape": shape, "dtype": dtype, "channel_axis": axis, "scale": scale,
            "channels": [f"c{i}" for i in range(shape[axis])]}
    m = draw(st.integers(1, 6))  # (an empty bundle is never written)
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    dt = np.dtype(dtype)
    x = (rng.normal(0, 100, (m, *shape)) if dt.kind == "f" else
         rng.integers(np.iinfo(dt).min, np.iinfo(dt).max, (m, *shape), endpoint=True)).astype(dt)
    return spec, x


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(drawn=tensors())
def test_any_tensor_round_trips_through_preprocess_bundle_and_decode(tmp_path: Path,
                                                                     drawn: tuple[dict[str, Any], np.ndarray]) -> None:
    spec, x = drawn
    doc = {"kind": "k", "version": 1, "tensor": spec,
           "features": [{"per": "channel", "stats": ["mean", "std", "min", "max"]}]}
    c = _load(tmp_path, doc)
    m = len(x)
    raw = pa.table({"sample_id": [f"s{i}" for i in range(m)], "node_id": ["n"] * m,
                    "capture_time": pa.array([datetime(2026, 1, 1, tzinfo=UTC)] * m, pa.timestamp("ms", tz="UTC")),
                    "seq": pa.array(range(m), pa.int64()), "x": pa.array([a.tobytes() for a in x], pa.binary())})
    r = preprocess(raw, c)
    assert r.rejects.num_rows == 0 and r.accepted.schema.equals(preprocessed_schema(c), check_metadata=True)
    names = c.bundle_schema.names
    assert names[:5] == ["sample_id", "node_id", "capture_time", "seq", "content_sha256"]
    assert len(c.feature_columns) == 4 * len(spec["channels"])
    assert names[-4:] == ["value", "tier", "is_summary", "inclusion_p"]
    rows = assign(r.accepted, np.zeros(m), TieringPolicy(), c)
    data, manifest = write_bundle(rows, c, tier="normal")
    back = pq.read_table(io.BytesIO(data))  # (read_bundle looks the contract up in the configured folder)
    assert back.schema.equals(c.bundle_schema) and manifest.row_count == m
    y = decode_tensors(back.column("x"), c)
    assert y.dtype == x.dtype and y.shape == x.shape and np.array_equal(y.view(np.uint8), x.view(np.uint8))
    # the channel statistics are those of the normalised tensor along the declared channel axis
    xn = np.moveaxis(normalise(x, c.tensor).astype(np.float64), 1 + c.tensor.channel_axis, -1)
    xn = xn.reshape(m, -1, len(spec["channels"]))
    for j, ch in enumerate(spec["channels"]):
        for stat, ref in (("mean", xn[..., j].mean(axis=1)), ("min", xn[..., j].min(axis=1)),
                          ("max", xn[..., j].max(axis=1)), ("std", xn[..., j].std(axis=1))):
            got = back.column(f"{stat}_{ch}").to_numpy().astype(np.float64)
            np.testing.assert_allclose(got, ref.astype(np.float32), rtol=2e-5, atol=1e-5 * (1 + np.abs(ref).max()))


@st.composite
def images(draw: st.DrawFn) -> tuple[dict[str, Any], np.ndarray, list[int]]:
    """A tensor with two spatial axes and a channel axis anywhere, and a grid that fits it."""
    shape = draw(st.lists(st.integers(1, 7), min_size=3, max_size=3))
    axis = draw(st.integers(0, 2))
    spatial = [s for i, s in enumerate(shape) if i != axis]
    cells = [draw(st.integers(1, s)) for s in spatial]
    dtype = draw(st.sampled_from(["uint8", "int16", "float32"]))
    spec = {"column": "x", "shape": shape, "dtype": dtype, "channel_axis": axis, "scale": 0.5, "offset": -1.0,
            "channels": [f"c{i}" for i in range(shape[axis])]}
    m = draw(st.integers(1, 5))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    x = (rng.normal(0, 50, (m, *shape)) if dtype == "float32" else rng.integers(0, 200, (m, *shape))).astype(dtype)
    return spec, x, cells


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(drawn=images())
def test_grid_features_describe_the_image_and_a_core_derives_the_same(
        tmp_path: Path, drawn: tuple[dict[str, Any], np.ndarray, list[int]]) -> None:
    spec, x, cells = drawn
    doc = {"kind": "k", "version": 1, "tensor": spec,
           "features": [{"per": "channel", "stats": ["mean"]}, {"per": "grid", "cells": cells}]}
    c = _load(tmp_path, doc)
    m, rows, cols = len(x), cells[0], cells[1]
    raw = pa.table({"sample_id": [f"s{i}" for i in range(m)], "node_id": ["n"] * m,
                    "capture_time": pa.array([datetime(2026, 1, 1, tzinfo=UTC)] * m, pa.timestamp("ms", tz="UTC")),
                    "seq": pa.array(range(m), pa.int64()), "x": pa.array([a.tobytes() for a in x], pa.binary())})
    acc = preprocess(raw, c).accepted
    grid = c.grid_feature_columns
    assert len(grid) == len(spec["channels"]) * rows * cols and set(grid) <= set(acc.column_names)
    # derived: the edge scores on the grid, no bundle carries it, a core derives the same numbers from the payload
    bundle = assign(acc, np.zeros(m), TieringPolicy(), c)
    assert not set(grid) & set(bundle.column_names) and bundle.schema.equals(c.bundle_schema)
    core = with_derived_features(bundle, c)
    for n in grid:
        np.testing.assert_array_equal(core.column(n).to_numpy(), acc.column(n).to_numpy())
    # the cell means, weighted by cell size, are the channel mean; a 1x1 grid is the channel mean itself
    assert c.tensor is not None
    xn = np.moveaxis(normalise(x, c.tensor).astype(np.float64), 1 + c.tensor.channel_axis, -1)
    h, w = xn.shape[1:3]
    sizes = np.diff([i * h // rows for i in range(rows + 1)])[:, None] * np.diff([j * w // cols for j in range(cols + 1)])
    for ch in spec["channels"]:
        cell = np.stack([acc.column(f"grid_{ch}_r{i}c{j}").to_numpy() for i in range(rows) for j in range(cols)], 1)
        np.testing.assert_allclose((cell * sizes.reshape(1, -1)).sum(1) / (h * w), acc.column(f"mean_{ch}").to_numpy(),
                                   rtol=1e-4, atol=1e-4 * (1 + np.abs(xn).max()))
    # one cell per pixel: the normalised image itself, row-major per channel
    assert grid_means(x, c.tensor, (h, w)).shape == (m, len(spec["channels"]) * h * w)
    per_pixel = grid_means(x, c.tensor, (h, w)).reshape(m, -1, h, w)
    np.testing.assert_allclose(per_pixel, np.moveaxis(xn, -1, 1).astype(np.float32), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(grid_means(x, c.tensor, (1, 1)), acc.select([f"mean_{ch}" for ch in spec["channels"]])
                               .to_pandas().to_numpy(), rtol=1e-4, atol=1e-4 * (1 + np.abs(xn).max()))


def test_grid_of_a_float_image_skips_nans_and_a_summary_row_gets_none(tmp_path: Path) -> None:
    doc = {"kind": "k", "version": 1,
           "tensor": {"column": "x", "shape": [2, 2, 1], "dtype": "float32", "channels": ["g"], "max_nan_fraction": 0.5},
           "features": [{"per": "grid", "cells": [1, 2]}]}
    c = _load(tmp_path, doc)
    assert c.tensor is not None
    x = np.array([[[[1.0], [np.nan]], [[3.0], [np.nan]]]], np.float32)  # left column 1, 3; right column all NaN
    got = grid_means(x, c.tensor, (1, 2))
    assert got[0, 0] == 2.0 and np.isnan(got[0, 1])
    rows = pa.table({"x": pa.array([x[0].tobytes(), None], pa.binary())})
    derived = with_derived_features(rows, c)
    assert derived.column("grid_g_r0c0").to_pylist()[0] == 2.0
    assert all(v != v for v in derived.column("grid_g_r0c0").to_pylist()[1:])  # the null payload: NaN
