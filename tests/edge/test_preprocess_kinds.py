"""Preprocessing for every contract layout: tensors of any rank (bytes or lists), files (size,
media type, decode), typed columns (ranges, categories, nulls); a bad value rejects its row only; features per
contract; summaries and the novelty scorer for every kind."""

from __future__ import annotations

import hashlib
import io
import struct
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from edgehaul.blocks import TieringPolicy
from edgehaul.contracts import Contract, ContractInvalid, load_contract
from edgehaul.decode import with_derived_features
from edgehaul.edge import preprocess as pp
from edgehaul.edge.scoring import BatchSketch, NoveltyScorer
from edgehaul.edge.tiering import Batcher, assign, summarise

MOTIONS = load_contract("basic_motions")
DIGITS = load_contract("digits_png")
GAIT = load_contract("daphnet_gait")
T0 = datetime(2026, 3, 1, tzinfo=UTC)


def _identity(n: int, prefix: str = "s") -> dict[str, pa.Array]:
    return {"sample_id": pa.array([f"{prefix}{i}" for i in range(n)]), "node_id": pa.array(["node-a"] * n),
            "capture_time": pa.array([T0] * n, pa.timestamp("ms", tz="UTC")), "seq": pa.array(range(n), pa.int64())}


def _contract(tmp_path: Path, text: str, kind: str) -> Contract:
    (tmp_path / f"{kind}.v1.yaml").write_text(text)
    return load_contract(kind, 1, tmp_path)


# ---- tensor kinds ------------------------------------------------------------------------------------------

def _series(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, 6, 100)).astype(np.float32)


def _motions(x: np.ndarray, payload: pa.Array | None = None, labels: list[int | None] | None = None) -> pa.Table:
    n = len(x)
    series = payload if payload is not None else pa.array([a.tobytes() for a in x], pa.binary())
    return pa.table({**_identity(n), "activity": pa.array(labels or [1 + i % 4 for i in range(n)], pa.int16()),
                     "series": series})


def test_channels_first_tensor_gets_channel_stats_of_every_kind() -> None:
    x = _series(20)
    r = pp.preprocess(_motions(x), MOTIONS, node_id="node-a")
    assert r.rejects.num_rows == 0 and r.accepted.num_rows == 20
    assert r.accepted.schema.equals(pp.preprocessed_schema(MOTIONS), check_metadata=True)
    for j, ch in enumerate(MOTIONS.channels):  # channel axis 0: statistics over each row of the [6, 100] window
        want = {"mean": x[:, j].mean(axis=1), "std": x[:, j].std(axis=1), "min": x[:, j].min(axis=1),
                "max": x[:, j].max(axis=1)}
        for stat, v in want.items():
            np.testing.assert_allclose(r.accepted.column(f"{stat}_{ch}").to_numpy(), v, rtol=1e-5, atol=1e-6)
    assert r.accepted.column("content_sha256").to_pylist() == [hashlib.sha256(a.tobytes()).hexdigest() for a in x]
    assert r.accepted.column("series").to_pylist() == [a.tobytes() for a in x]  # the payload travels as it came


@pytest.mark.parametrize("typ", [pa.list_(pa.float64()), pa.large_list(pa.float32()), pa.list_(pa.float32(), 600)])
def test_tensor_given_as_numbers_is_packed_and_a_wrong_count_rejects_only_its_row(typ: pa.DataType) -> None:
    x = _series(6, seed=1)
    lists = [a.ravel().tolist() for a in x]
    fixed = pa.types.is_fixed_size_list(typ)
    if not fixed:
        lists[2] = lists[2][:-1]  # 599 numbers
    lists[4] = None  # type: ignore[call-overload]
    r = pp.preprocess(_motions(x, pa.array(lists, typ)), MOTIONS)
    want_bad = {"s4": pp.MISSING_FIELD} | ({} if fixed else {"s2": pp.WRONG_SHAPE})
    assert dict(zip(r.rejects.column("sample_id").to_pylist(), r.rejects.column("reason").to_pylist(),
                    strict=True)) == want_bad
    if not fixed:
        detail = r.rejects.filter(pc.equal(r.rejects.column("sample_id"), "s2")).column("detail")[0].as_py()
        assert "599 elements" in detail and "600" in detail
    ok = [i for i in range(6) if f"s{i}" not in want_bad]
    assert r.accepted.column("series").to_pylist() == [x[i].tobytes() for i in ok]
    # the same tensors as bytes: the same rows, features and digests
    same = pp.preprocess(_motions(x), MOTIONS).accepted.take(ok)
    assert r.accepted.equals(same)


def test_integer_tensor_from_numbers_rejects_values_the_dtype_cannot_hold(tmp_path: Path) -> None:
    c = _contract(tmp_path, """
kind: counts
version: 1
tensor: {column: counts, shape: [2, 3], dtype: uint8, channel_axis: -1, channels: [a, b, c]}
features: [{per: channel, stats: [mean, max]}]
""", "counts")
    rows = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 300], [1, 2, 3, 4, 5, 1.5], [0, 0, 0, 0, 0, 255]]
    t = pa.table({**_identity(4), "counts": pa.array(rows, pa.list_(pa.float64()))})
    r = pp.preprocess(t, c)
    assert r.reject_counts == {pp.BAD_TYPE: 2} and r.rejects.column("sample_id").to_pylist() == ["s1", "s2"]
    assert r.accepted.column("max_c").to_pylist() == [6.0, 255.0] and r.accepted.column("mean_a").to_pylist() == [2.5, 0]
    assert "label" not in r.accepted.column_names  # label kind none: no label column at all


# ---- file kinds --------------------------------------------------------------------------------------------

def _png(a: np.ndarray) -> bytes:
    b = io.BytesIO()
    Image.fromarray(a).save(b, format="PNG")
    return b.getvalue()


def _digits(files: list[bytes | None]) -> pa.Table:
    n = len(files)
    return pa.table({**_identity(n), "digit": pa.array([i % 10 for i in range(n)], pa.int16()),
                     "image": pa.array(files, pa.binary())})


def test_file_kind_rejects_too_large_wrong_media_and_undecodable_files_per_row() -> None:
    rng = np.random.default_rng(2)
    imgs = [rng.integers(0, 256, (8, 8), dtype=np.uint8) for _ in range(7)]
    files: list[bytes | None] = [_png(a) for a in imgs]
    files[1] = b"\x89PNG\r\n\x1a\n" + b"\0" * 5000  # over max_bytes (4096)
    files[2] = b"\xff\xd8\xff\xe0 a JPEG"  # the wrong media type
    files[3] = _png(imgs[3])[:40]  # truncated: the right magic, not decodable
    files[4] = _png(rng.integers(0, 256, (9, 8), dtype=np.uint8))  # decodes, the wrong shape
    files[5] = None
    r = pp.preprocess(_digits(files), DIGITS)
    assert r.accounted()
    got = dict(zip(r.rejects.column("sample_id").to_pylist(), r.rejects.column("reason").to_pylist(), strict=True))
    assert got == {"s1": pp.TOO_LARGE, "s2": pp.BAD_FILE, "s3": pp.BAD_FILE, "s4": pp.BAD_FILE,
                   "s5": pp.MISSING_FIELD}
    details = dict(zip(r.rejects.column("sample_id").to_pylist(), r.rejects.column("detail").to_pylist(), strict=True))
    assert "5008 bytes" in details["s1"] and "4096" in details["s1"]
    assert "image/png" in details["s2"]
    assert "not a readable image" in details["s3"] and "[9, 8, 1]" in details["s4"]
    assert r.accepted.column("sample_id").to_pylist() == ["s0", "s6"]
    assert r.accepted.column("content_sha256").to_pylist() == [hashlib.sha256(files[i]).hexdigest()  # type: ignore[arg-type]
                                                               for i in (0, 6)]
    np.testing.assert_allclose(r.accepted.column("mean_grey").to_numpy(), [imgs[0].mean() / 255, imgs[6].mean() / 255],
                               rtol=1e-5)
    np.testing.assert_allclose(r.accepted.column("std_grey").to_numpy(), [imgs[0].std() / 255, imgs[6].std() / 255],
                               rtol=1e-5)


def test_file_kind_hashes_from_batch_key_are_used() -> None:
    files = [_png(np.full((8, 8), v, np.uint8)) for v in (0, 9, 200)]
    raw = _digits(list(files))
    key, hashes = pp.batch_key(raw, "image")
    assert hashes is not None
    assert pp.preprocess(raw, DIGITS, key=key, hashes=hashes).accepted.equals(pp.preprocess(raw, DIGITS).accepted)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.sampled_from(["ok", "big", "jpeg", "truncated", "null", "dup", "label"]), min_size=1, max_size=20))
def test_every_file_row_is_accounted_exactly_once(kinds: list[str]) -> None:
    good = [_png(np.full((8, 8), i, np.uint8)) for i in range(len(kinds))]
    files: list[bytes | None] = list(good)
    ids = [f"s{i}" for i in range(len(kinds))]
    labels: list[int | None] = [i % 10 for i in range(len(kinds))]
    expect: dict[int, str] = {}
    for i, k in enumerate(kinds):
        if k == "big":
            files[i] = good[i] + bytes(5000)
            expect[i] = pp.TOO_LARGE
        elif k == "jpeg":
            files[i] = b"\xff\xd8\xff" + good[i]
            expect[i] = pp.BAD_FILE
        elif k == "truncated":
            files[i] = good[i][:30]
            expect[i] = pp.BAD_FILE
        elif k == "null":
            files[i] = None
            expect[i] = pp.MISSING_FIELD
        elif k == "dup" and i > 0 and 0 not in expect:
            ids[i] = ids[0]
            expect[i] = pp.DUPLICATE_ID
        elif k == "label":
            labels[i] = 10
            expect[i] = pp.BAD_LABEL
    t = pa.table({**_identity(len(kinds)), "digit": pa.array(labels, pa.int16()), "image": pa.array(files, pa.binary())})
    t = t.set_column(0, "sample_id", pa.array(ids))
    r = pp.preprocess(t, DIGITS)
    assert r.accounted()
    assert sorted(zip(r.rejects.column("sample_id").to_pylist(), r.rejects.column("reason").to_pylist(),
                      strict=True)) == sorted((ids[i], why) for i, why in expect.items())
    key, hashes = pp.batch_key(t, "image")  # the cache key's hashes, filtered along with the rows
    with_hashes = pp.preprocess(t, DIGITS, key=key, hashes=hashes)
    assert with_hashes.accepted.equals(r.accepted) and with_hashes.rejects.equals(r.rejects)
    assert r.accepted.column("image").to_pylist() == [good[i] for i in range(len(kinds)) if i not in expect]


# ---- columns kinds -----------------------------------------------------------------------------------------

def _gait(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {c: rng.uniform(-1000, 1000, n).astype(np.float32) for c in GAIT.numeric_columns}


def _gait_table(cols: dict[str, object], labels: list[int | None] | None = None) -> pa.Table:
    n = len(next(iter(cols.values())))  # type: ignore[arg-type]
    return pa.table({**_identity(n), "is_anomaly": pa.array(labels or [i % 2 for i in range(n)], pa.int16()),
                     **cols})


def _row_digest(values: list[float | None]) -> str:
    """The documented content_sha256 of a columns row, written out independently: per column a validity byte,
    then the float32 little-endian (zeros when null)."""
    b = b"".join(b"\x01" + struct.pack("<f", v) if v is not None else b"\x00" + b"\0" * 4 for v in values)
    return hashlib.sha256(b).hexdigest()


def test_columns_kind_rejects_per_row_and_names_column_and_value() -> None:
    cols: dict[str, object] = {k: v.tolist() for k, v in _gait(6).items()}
    cols["ankle_vert"][1] = 5000.5  # type: ignore[index]
    cols["leg_vert"][2] = None  # type: ignore[index]
    cols["trunk_vert"] = [str(v) for v in cols["trunk_vert"]]  # type: ignore[attr-defined]
    cols["trunk_vert"][3] = "n/a"  # type: ignore[index]
    cols["leg_horiz_fwd"][4] = float("nan")  # type: ignore[index]
    r = pp.preprocess(_gait_table(cols), GAIT, node_id="node-a")
    assert r.accounted()
    got = dict(zip(r.rejects.column("sample_id").to_pylist(),
                   zip(r.rejects.column("reason").to_pylist(), r.rejects.column("detail").to_pylist(), strict=True),
                   strict=True))
    assert got["s1"] == (pp.OUT_OF_RANGE, "column 'ankle_vert': 5000.5 outside [-5000, 5000]")
    assert got["s2"] == (pp.MISSING_FIELD, "leg_vert is null")
    assert got["s3"][0] == pp.BAD_TYPE and "'trunk_vert'" in got["s3"][1] and "n/a" in got["s3"][1]
    assert got["s4"] == (pp.NAN, "column 'leg_horiz_fwd': nan")
    assert r.accepted.column("sample_id").to_pylist() == ["s0", "s5"]
    acc = r.accepted
    for c in GAIT.numeric_columns:  # norm_<col> = (x - min) / (max - min); the reading itself travels
        x = np.asarray(acc.column(c).to_numpy(), np.float64)
        np.testing.assert_allclose(acc.column(f"norm_{c}").to_numpy(), (x + 5000) / 10000, rtol=1e-6)
    want = [_row_digest([acc.column(c)[i].as_py() for c in GAIT.numeric_columns]) for i in range(acc.num_rows)]
    assert acc.column("content_sha256").to_pylist() == want


def test_columns_kind_categories_strings_and_nullable(tmp_path: Path) -> None:
    c = _contract(tmp_path, """
kind: weather
version: 1
columns:
  temp: {type: float64, unit: degC, min: -80, max: 60, nullable: true}
  sky: {type: category, values: [clear, cloudy, rain]}
  station: {type: string}
  windy: {type: bool, nullable: true}
  seen: {type: timestamp, nullable: true}
label: {column: alarm, kind: anomaly}
""", "weather")
    seen = pa.array([T0, None, T0, T0, T0], pa.timestamp("ms", tz="UTC"))
    t = pa.table({**_identity(5), "alarm": pa.array([0, 1, 0, None, 0], pa.int16()),
                  "temp": [12.5, None, 70.0, -3.0, 1.0], "sky": ["clear", "rain", "clear", "fog", "cloudy"],
                  "station": ["a", "b", "c", "d", None], "windy": [True, None, False, True, False], "seen": seen})
    r = pp.preprocess(t, c)
    assert dict(zip(r.rejects.column("sample_id").to_pylist(), r.rejects.column("reason").to_pylist(),
                    strict=True)) == {"s2": pp.OUT_OF_RANGE, "s3": pp.BAD_VALUE, "s4": pp.MISSING_FIELD}
    assert "'fog' not in ['clear', 'cloudy', 'rain']" in r.rejects.column("detail")[1].as_py()
    acc = r.accepted
    assert acc.column("temp").to_pylist() == [12.5, None] and acc.column("windy").to_pylist() == [True, None]
    norm = acc.column("norm_temp").to_numpy(zero_copy_only=False)
    assert norm[0] == pytest.approx((12.5 + 80) / 140) and np.isnan(norm[1])  # a null reading: NaN feature
    # the digest covers every data column, strings by length and bytes, nulls by their validity byte
    ms = int(T0.timestamp() * 1000)
    ref = (b"\x01" + struct.pack("<d", 12.5) + b"\x01" + struct.pack("<I", 5) + b"clear" + b"\x01"
           + struct.pack("<I", 1) + b"a" + b"\x01\x01" + b"\x01" + struct.pack("<q", ms))
    assert acc.column("content_sha256")[0].as_py() == hashlib.sha256(ref).hexdigest()
    ref1 = (b"\x00" + b"\0" * 8 + b"\x01" + struct.pack("<I", 4) + b"rain" + b"\x01" + struct.pack("<I", 1) + b"b"
            + b"\x00\x00" + b"\x00" + b"\0" * 8)
    assert acc.column("content_sha256")[1].as_py() == hashlib.sha256(ref1).hexdigest()
    # a nullable column the instrument does not write at all is null in every row; a required one is missing
    r = pp.preprocess(t.drop_columns(["windy", "seen"]), c)
    assert r.accepted.num_rows == 2 and r.accepted.column("windy").null_count == 2
    r = pp.preprocess(t.drop_columns(["station"]), c)
    assert r.accepted.num_rows == 0 and "column 'station' absent" in r.rejects.column("detail")[0].as_py()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(["ok", "range", "null", "text", "nan", "dup", "label", "no_id"]), min_size=1,
                max_size=30))
def test_every_columns_row_is_accounted_exactly_once(kinds: list[str]) -> None:
    n = len(kinds)
    cols: dict[str, list[object]] = {k: v.tolist() for k, v in _gait(n, seed=n).items()}
    cols["trunk_vert"] = [str(v) for v in cols["trunk_vert"]]
    ids: list[str | None] = [f"s{i}" for i in range(n)]
    labels: list[int | None] = [0] * n
    expect: dict[int, str] = {}
    for i, k in enumerate(kinds):
        if k == "range":
            cols["ankle_vert"][i] = -7000.0
            expect[i] = pp.OUT_OF_RANGE
        elif k == "null":
            cols["trunk_horiz_fwd"][i] = None
            expect[i] = pp.MISSING_FIELD
        elif k == "text":
            cols["trunk_vert"][i] = "?"
            expect[i] = pp.BAD_TYPE
        elif k == "nan":
            cols["leg_vert"][i] = float("inf")
            expect[i] = pp.NAN
        elif k == "dup" and i > 0 and 0 not in expect:
            ids[i] = ids[0]
            expect[i] = pp.DUPLICATE_ID
        elif k == "label":
            labels[i] = 7
            expect[i] = pp.BAD_LABEL
        elif k == "no_id":
            ids[i] = None
            expect[i] = pp.MISSING_FIELD
    t = _gait_table(cols, labels).set_column(0, "sample_id", pa.array(ids, pa.string()))  # type: ignore[arg-type]
    r = pp.preprocess(t, GAIT)
    assert r.accounted()
    got = sorted(zip(r.rejects.column("sample_id").to_pylist(), r.rejects.column("reason").to_pylist(), strict=True))
    assert got == sorted((ids[i] or f"<no-id:row {i}>", why) for i, why in expect.items())
    assert r.accepted.column("sample_id").to_pylist() == [ids[i] for i in range(n) if i not in expect]


@settings(max_examples=25, deadline=None)
@given(st.lists(st.sampled_from(["ok", "short", "long", "null", "label"]), min_size=1, max_size=20))
def test_every_tensor_row_from_lists_is_accounted_exactly_once(kinds: list[str]) -> None:
    x = _series(len(kinds), seed=len(kinds))
    lists: list[list[float] | None] = [a.ravel().tolist() for a in x]
    labels: list[int | None] = [1] * len(kinds)
    expect = {}
    for i, k in enumerate(kinds):
        if k in ("short", "long"):
            lists[i] = lists[i][:10] if k == "short" else lists[i] + [0.0]  # type: ignore[index,operator]
            expect[f"s{i}"] = pp.WRONG_SHAPE
        elif k == "null":
            lists[i] = None
            expect[f"s{i}"] = pp.MISSING_FIELD
        elif k == "label":
            labels[i] = 0
            expect[f"s{i}"] = pp.BAD_LABEL
    r = pp.preprocess(_motions(x, pa.array(lists, pa.list_(pa.float32())), labels), MOTIONS)
    assert r.accounted()
    assert dict(zip(r.rejects.column("sample_id").to_pylist(), r.rejects.column("reason").to_pylist(),
                    strict=True)) == expect


# ---- feature functions ---------------------------------------------------------------------------------------

def spread(table: pa.Table, contract: Contract) -> dict[str, np.ndarray]:
    """A feature function for the tests: the spread of the ankle readings (inf when the first is 1234)."""
    a = np.stack([table.column(c).to_numpy() for c in ("ankle_horiz_fwd", "ankle_vert", "ankle_horiz_lateral")])
    out = (a.max(axis=0) - a.min(axis=0)).astype(np.float32)
    out[a[0] == 1234] = np.inf
    return {"ankle_spread": out}


def _with_function(tmp_path: Path, function: str) -> Contract:
    text = Path(GAIT.source).read_text().replace("kind: daphnet_gait", "kind: gait_fn")
    text = text.replace("  - per: column  #", f"  - function: {function}\n    outputs: [ankle_spread]\n  - per: column  #")
    return _contract(tmp_path, text, "gait_fn")


def test_feature_function_adds_its_outputs_and_a_non_finite_value_rejects_its_row(tmp_path: Path) -> None:
    c = _with_function(tmp_path, "tests.edge.test_preprocess_kinds:spread")
    cols = _gait(5)
    cols["ankle_horiz_fwd"][3] = 1234
    r = pp.preprocess(_gait_table(dict(cols)), c)
    assert r.reject_counts == {pp.BAD_FEATURE: 1} and r.rejects.column("sample_id").to_pylist() == ["s3"]
    assert "ankle_spread=inf" in r.rejects.column("detail")[0].as_py()
    a = np.stack([cols[k] for k in ("ankle_horiz_fwd", "ankle_vert", "ankle_horiz_lateral")])[:, [0, 1, 2, 4]]
    np.testing.assert_allclose(r.accepted.column("ankle_spread").to_numpy(), a.max(axis=0) - a.min(axis=0), rtol=1e-6)
    assert r.accepted.num_rows == 4 and r.accepted.column("norm_ankle_vert").length() == 4


def test_feature_function_that_does_not_import_names_the_contract_field(tmp_path: Path) -> None:
    c = _with_function(tmp_path, "tests.no_such_module:spread")
    with pytest.raises(ContractInvalid, match=r"features\[0\]\.function 'tests.no_such_module:spread'"):
        pp.preprocess(_gait_table(dict(_gait(2))), c)


# ---- summaries and scoring for every kind --------------------------------------------------------------------

@pytest.mark.parametrize("contract", [GAIT, MOTIONS, DIGITS], ids=lambda c: c.kind)
def test_summaries_null_the_payload_and_keep_features(contract: Contract) -> None:
    if contract is GAIT:
        raw = _gait_table(dict(_gait(40)))
    elif contract is MOTIONS:
        raw = _motions(_series(40))
    else:
        raw = _digits([_png(np.full((8, 8), v * 6, np.uint8)) for v in range(40)])
    acc = pp.preprocess(raw, contract).accepted
    scorer = NoveltyScorer(contract)
    values = scorer.score(acc, "k1")
    assert values.shape == (40,) and values.min() >= 0 and values.max() <= 1 and not np.isnan(values).any()
    scored = assign(acc, values, TieringPolicy(), contract)
    s = summarise(scored, contract)
    for name in contract.payload_columns:
        assert s.column(name).null_count == 40
    derived = contract.derived_feature_columns
    # a gait row's norm_<column>: the reading again, scaled; a digit's grid of cell means: its image, coarser
    assert bool(derived) == (contract is not MOTIONS)
    for name in contract.feature_columns:
        if name in derived:  # the edge scores on it; no bundle carries it: a core derives the same numbers
            assert name in acc.column_names and name not in scored.column_names
            got = with_derived_features(scored, contract).column(name)
            np.testing.assert_array_equal(got.to_numpy(), acc.column(name).to_numpy())
            # a summary row has no payload to derive from: NaN, never a number made up
            assert np.isnan(with_derived_features(s, contract).column(name).to_numpy()).all()
        else:
            assert s.column(name).equals(scored.column(name))
    assert s.column("is_summary").to_pylist() == [True] * 40 and s.schema.equals(contract.bundle_schema)
    # low rows travel as summaries in the normal bundle, their full rows stay in the raw store
    policy = TieringPolicy(low_threshold=0.5, high_threshold=0.9)
    batcher = Batcher(policy, contract)
    built = batcher.add(assign(acc, np.zeros(40), policy, contract)) + batcher.flush()  # everything low
    assert sorted(b.manifest.tier for b in built) == ["low", "normal"]
    # (a sample_rate share of the low tier travels in full instead: tier sampling); a summary goes only where it is
    # a quarter of its row or less: a pixel or motion tensor, never a gait reading
    left = 40 - batcher.report.sampled_low
    assert sum(b.summary_rows for b in built) in ((0,) if contract is GAIT else (0, left) if contract is DIGITS
                                                  else (left,))


def test_novelty_scores_a_far_off_reading_higher_on_a_kind_without_channels() -> None:
    cols = _gait(200, seed=3)
    for v in cols.values():
        v[:] = np.random.default_rng(4).normal(0, 50, 200)
    cols["ankle_vert"][17] = 4900.0
    acc = pp.preprocess(_gait_table(dict(cols), [0] * 200), GAIT).accepted
    v = NoveltyScorer(GAIT).score(acc, "k")
    assert int(np.argmax(v)) == 17 and v[17] > 0.9 and np.median(v) < 0.2


def test_novelty_without_a_label_and_state_of_another_width_is_not_mixed(tmp_path: Path) -> None:
    channels = ", ".join(f"c{i}" for i in range(64))
    c = _contract(tmp_path, "kind: spectra\nversion: 1\nfeatures: [{per: channel, stats: [mean]}]\n"
                  "tensor: {column: spectrum, shape: [64], dtype: float32, channel_axis: 0, channels: [" + channels
                  + "]}\n", "spectra")
    x = np.random.default_rng(5).normal(size=(30, 64)).astype(np.float32)
    acc = pp.preprocess(pa.table({**_identity(30), "spectrum": pa.array([a.tobytes() for a in x])}), c).accepted
    assert "label" not in acc.column_names and len(c.feature_columns) == 64
    s = NoveltyScorer(c)
    other = pp.preprocess(_motions(_series(10)), MOTIONS).accepted
    s.state.fold("other-kind", BatchSketch.of(other, MOTIONS))  # 24 features: another kind's sketch
    v = s.score(acc, "mine")
    assert v.shape == (30,) and np.isfinite(v).all() and v.min() >= 0 and v.max() <= 1
