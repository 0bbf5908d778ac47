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
from edgehaul.decode import decode_tensors, normalise
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
