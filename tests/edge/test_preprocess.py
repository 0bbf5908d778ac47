"""Edge preprocessing: contract checks with rejects and reasons, features, content hashes."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgehaul.contracts import load_contract
from edgehaul.edge import preprocess as pp
from edgehaul.edge.landsat import generate

C = load_contract("landsat_patch")


@pytest.fixture(scope="module")
def raw() -> pa.Table:
    return next(generate(300, "node-a", seed=11, batch_size=300))


def _pixels(t: pa.Table) -> np.ndarray:
    return np.stack([np.frombuffer(b, np.uint8).reshape(C.shape) for b in t.column("pixels").to_pylist()])


def test_clean_batch_is_accepted_with_reference_features(raw: pa.Table) -> None:
    r = pp.preprocess(raw, C, node_id="node-a")
    assert r.rejects.num_rows == 0 and r.accepted.num_rows == 300 and r.accounted()
    assert r.accepted.schema.equals(pp.preprocessed_schema(C), check_metadata=True)
    px = _pixels(raw).astype(np.float64) * C.scale + C.offset
    for i, ch in enumerate(C.channels):
        np.testing.assert_allclose(r.accepted.column(f"mean_{ch}").to_numpy(), px[..., i].mean(axis=(1, 2)), atol=1e-6)
        np.testing.assert_allclose(r.accepted.column(f"std_{ch}").to_numpy(), px[..., i].std(axis=(1, 2)), atol=1e-6)
    want = [hashlib.sha256(b).hexdigest() for b in raw.column("pixels").to_pylist()]
    assert r.accepted.column("content_sha256").to_pylist() == want


def _set(t: pa.Table, name: str, values: list) -> pa.Table:
    i = t.schema.get_field_index(name)
    return t.set_column(i, t.schema.field(i), pa.array(values, t.schema.field(i).type))


def test_bad_samples_go_to_rejects_with_reasons(raw: pa.Table) -> None:
    t = raw.slice(0, 10)
    pix = t.column("pixels").to_pylist()
    pix[1] = pix[1][:-3]  # wrong shape
    ids = t.column("sample_id").to_pylist()
    ids[3] = ids[2]  # duplicate of row 2
    ids[9] = None
    labels = t.column("label").to_pylist()
    labels[4] = 42
    labels[8] = None  # unlabelled is allowed
    nodes = t.column("node_id").to_pylist()
    nodes[5] = "node-b"
    times = t.column("capture_time").to_pylist()
    times[6] = None
    t = _set(_set(_set(_set(_set(t, "pixels", pix), "sample_id", ids), "label", labels), "node_id", nodes),
             "capture_time", times)
    r = pp.preprocess(t, C, node_id="node-a")
    got = dict(zip(r.rejects.column("sample_id").to_pylist(), r.rejects.column("reason").to_pylist(), strict=True))
    assert got == {
        ids[1]: pp.WRONG_SHAPE, ids[3]: pp.DUPLICATE_ID, ids[4]: pp.BAD_LABEL, ids[5]: pp.WRONG_NODE,
        ids[6]: pp.MISSING_FIELD, "<no-id:row 9>": pp.MISSING_FIELD,
    }
    details = dict(zip(r.rejects.column("sample_id").to_pylist(), r.rejects.column("detail").to_pylist(), strict=True))
    assert "1533 pixel bytes" in details[ids[1]] and "42" in details[ids[4]] and "node-b" in details[ids[5]]
    assert "capture_time" in details[ids[6]]
    assert r.accepted.column("sample_id").to_pylist() == [ids[i] for i in (0, 2, 7, 8)]
    assert r.accounted() and r.reject_counts[pp.MISSING_FIELD] == 2


def test_missing_column_rejects_the_batch_and_a_bad_type_only_its_rows(raw: pa.Table) -> None:
    r = pp.preprocess(raw.slice(0, 5).drop_columns(["seq"]), C)
    assert r.accepted.num_rows == 0 and set(r.reject_counts) == {pp.MISSING_FIELD}
    assert all("'seq'" in d for d in r.rejects.column("detail").to_pylist())
    t = raw.slice(0, 5)
    t = t.set_column(t.schema.get_field_index("label"), "label", pa.array(["x"] * 5))
    r = pp.preprocess(t, C)
    assert r.reject_counts == {pp.BAD_TYPE: 5} and "label" in r.rejects.column("detail")[0].as_py()
    # one string in a numeric label column rejects its row, not the 39 valid rows beside it
    t = raw.slice(0, 40)
    labels = [str(v) for v in t.column("label").to_pylist()]
    labels[17] = "cloudy"
    t = t.set_column(t.schema.get_field_index("label"), "label", pa.array(labels))
    r = pp.preprocess(t, C)
    assert r.accepted.num_rows == 39 and r.reject_counts == {pp.BAD_TYPE: 1}
    assert r.rejects.column("sample_id")[0].as_py() == t.column("sample_id")[17].as_py()
    assert "'cloudy'" in r.rejects.column("detail")[0].as_py()
    assert r.accepted.column("label").to_pylist() == [int(v) for i, v in enumerate(labels) if i != 17]


@given(values=st.lists(st.one_of(st.integers(-1000, 1000).map(str), st.sampled_from(["x", "1.5", "", "NaN"]),
                                 st.none()), max_size=200))
def test_cast_rows_rejects_exactly_the_values_that_do_not_convert(values: list[str | None]) -> None:
    def converts(v: str | None) -> bool:
        try:
            pa.array([v], pa.string()).cast(pa.int16())
            return True
        except pa.ArrowInvalid:
            return False

    out, bad = pp.cast_rows(pa.array(values, pa.string()), pa.int16())
    assert bad.tolist() == [not converts(v) for v in values]
    assert out.to_pylist() == [None if b or v is None else int(v) for v, b in zip(values, bad.tolist(), strict=True)]


def test_nan_beyond_contract_fraction_is_rejected_for_float_tensors(tmp_path: Path) -> None:
    text = (Path(__file__).resolve().parents[2] / "data_contracts" / "landsat_patch.v1.yaml").read_text()
    text = text.replace("kind: landsat_patch", "kind: floaty").replace("dtype: uint8", "dtype: float32")
    text = text.replace("max_nan_fraction: 0.0", "max_nan_fraction: 0.1").replace("scale: 0.00392156862745098", "scale: 1.0")
    (tmp_path / "floaty.v1.yaml").write_text(text)
    fc = load_contract("floaty", 1, tmp_path)
    rng = np.random.default_rng(0)
    px = rng.random((4, 16, 16, 6), dtype=np.float32)
    px[1].reshape(-1)[: int(0.05 * 1536)] = np.nan  # 5%: allowed
    px[2].reshape(-1)[: int(0.5 * 1536)] = np.nan  # 50%: rejected
    from edgehaul.edge.landsat import raw_table

    t = raw_table(px, np.array([1, 2, 3, 4], np.int16), "node-a", contract=fc)
    r = pp.preprocess(t, fc)
    assert r.reject_counts == {pp.NAN: 1}
    assert r.rejects.column("sample_id")[0].as_py() == t.column("sample_id")[2].as_py()
    assert "0.500" in r.rejects.column("detail")[0].as_py()
    means = r.accepted.column("mean_b1_blue").to_numpy()
    np.testing.assert_allclose(means[1], np.nanmean(px[1][..., 0]), rtol=1e-5)
    assert r.accepted.num_rows == 3 and not np.isnan(means).any()


@settings(max_examples=30, deadline=None)
@given(st.lists(st.sampled_from(["ok", "short", "dup", "label", "null_seq"]), min_size=1, max_size=40))
def test_every_row_is_accepted_or_rejected_exactly_once(kinds: list[str]) -> None:
    base = next(generate(len(kinds), "node-a", seed=3, batch_size=len(kinds)))
    ids = base.column("sample_id").to_pylist()
    pix = base.column("pixels").to_pylist()
    labels = base.column("label").to_pylist()
    seq = base.column("seq").to_pylist()
    expect: dict[int, str | None] = {}
    for i, k in enumerate(kinds):
        expect[i] = None
        if k == "short":
            pix[i] = pix[i][:100]
            expect[i] = pp.WRONG_SHAPE
        elif k == "dup" and i > 0 and expect[0] is None:
            ids[i] = ids[0]
            expect[i] = pp.DUPLICATE_ID
        elif k == "label":
            labels[i] = 0
            expect[i] = pp.BAD_LABEL
        elif k == "null_seq":
            seq[i] = None
            expect[i] = pp.MISSING_FIELD
    t = _set(_set(_set(_set(base, "sample_id", ids), "pixels", pix), "label", labels), "seq", seq)
    r = pp.preprocess(t, C)
    assert r.accounted()
    want_rejects = sorted((ids[i], why) for i, why in expect.items() if why)
    assert sorted(zip(r.rejects.column("sample_id").to_pylist(), r.rejects.column("reason").to_pylist(),
                      strict=True)) == want_rejects
    assert pc.count_distinct(r.accepted.column("sample_id")).as_py() == r.accepted.num_rows
