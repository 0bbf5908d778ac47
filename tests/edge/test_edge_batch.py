"""One batch through the edge path (edgehaul.edge.batch) and the batch content key: the key sees
every change and no chunking, its per-sample hashes are the content hashes, rows without an id stay distinct
across batches in the ledger, and the bundle's Parquet settings per column."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgehaul.blocks import TieringPolicy
from edgehaul.bundles import GRID_DICT_MIN_ROWS, read_bundle, write_bundle
from edgehaul.contracts import load_contract
from edgehaul.edge.batch import ingest_batch
from edgehaul.edge.landsat import generate
from edgehaul.edge.ledger import STAGE_PREPROCESS
from edgehaul.edge.preprocess import MISSING_FIELD, batch_key, content_hashes, preprocess
from edgehaul.edge.scoring import NoveltyScorer
from edgehaul.edge.spool import Spool

C = load_contract("landsat_patch")


@pytest.fixture(scope="module")
def raw() -> pa.Table:
    return next(generate(200, "node-a", seed=21, batch_size=200))


def _set(t: pa.Table, name: str, values: list) -> pa.Table:
    i = t.schema.get_field_index(name)
    return t.set_column(i, t.schema.field(i), pa.array(values, t.schema.field(i).type))


def _spool(tmp_path: Path) -> Spool:
    return Spool(tmp_path / "spool", cap_bytes=2**30, emit=lambda *a, **k: True)


def test_batch_key_hashes_are_the_content_hashes(raw: pa.Table) -> None:
    key, hashes = batch_key(raw)
    assert hashes is not None and hashes.type == pa.string()
    assert hashes.to_pylist() == [hashlib.sha256(b).hexdigest() for b in raw.column("pixels").to_pylist()]
    with_hashes = preprocess(raw, C, key=key, hashes=hashes).accepted
    assert with_hashes.equals(preprocess(raw, C).accepted)
    with pytest.raises(ValueError, match="10 content hashes for a batch of 200 rows"):
        preprocess(raw, C, hashes=hashes[:10])


def test_content_hashes_of_chunked_sliced_and_null_values() -> None:
    values = [b"abc", None, b"", b"x" * 3000, b"yy"]
    arr = pa.chunked_array([pa.array(values[:3], pa.binary()), pa.array([b"drop", *values[3:]], pa.binary()).slice(1)])
    want = [None if v is None else hashlib.sha256(v).hexdigest() for v in values]
    assert content_hashes(arr).to_pylist() == want
    assert content_hashes(pa.array(values, pa.large_binary())).to_pylist() == want
    assert content_hashes(pa.array([], pa.binary())).to_pylist() == []


@settings(max_examples=25, deadline=None)
@given(row=st.integers(0, 199), what=st.sampled_from(["pixel", "id", "seq", "null-pixels", "empty-pixels", "label"]),
       cut=st.integers(1, 199))
def test_batch_key_sees_every_change_and_no_chunking(raw: pa.Table, row: int, what: str, cut: int) -> None:
    key, _ = batch_key(raw)
    assert batch_key(pa.concat_tables([raw.slice(0, cut), raw.slice(cut)]))[0] == key  # chunking is not content
    pix = raw.column("pixels").to_pylist()
    if what == "pixel":
        b = bytearray(pix[row])
        b[row % len(b)] ^= 1
        pix[row] = bytes(b)
        changed = _set(raw, "pixels", pix)
    elif what in ("null-pixels", "empty-pixels"):
        pix[row] = None if what == "null-pixels" else b""
        changed = _set(raw, "pixels", pix)
    elif what == "id":
        changed = _set(raw, "sample_id", [*raw.column("sample_id").to_pylist()[:row], "other",
                                          *raw.column("sample_id").to_pylist()[row + 1 :]])
    elif what == "seq":
        seq = raw.column("seq").to_pylist()
        seq[row] += 1
        changed = _set(raw, "seq", seq)
    else:
        labels = raw.column("label").to_pylist()
        labels[row] = None if labels[row] is not None else 1
        changed = _set(raw, "label", labels)
    assert batch_key(changed)[0] != key
    # null and empty pixels differ from each other too (the validity is part of the key)
    if what == "null-pixels":
        pix[row] = b""
        assert batch_key(_set(raw, "pixels", pix))[0] != batch_key(changed)[0]


def test_rows_without_an_id_stay_distinct_across_batches_in_the_ledger(tmp_path: Path) -> None:
    batches = list(generate(600, "node-a", seed=3, batch_size=300))
    spool = _spool(tmp_path)
    scorer = NoveltyScorer(C)
    rejected: list[str] = []
    for raw in batches:
        ids = raw.column("sample_id").to_pylist()
        ids[3] = ids[7] = None  # the same row numbers in both batches
        raw = _set(raw, "sample_id", ids)
        key, hashes = batch_key(raw)
        res = ingest_batch(raw, C, TieringPolicy(), spool, scorer, key=key, hashes=hashes, node_id="node-a")
        assert res.reject_counts == {MISSING_FIELD: 2} and res.accepted == 298
        rejected += [f"<no-id:{key[:16]}:row 3>", f"<no-id:{key[:16]}:row 7>"]
    assert len(set(rejected)) == 4
    assert spool.ledger.counts()[(STAGE_PREPROCESS, MISSING_FIELD)] == 4  # none lost to INSERT OR IGNORE
    assert set(spool.ledger.lookup(rejected)) == set(rejected)
    spool.close()


def test_ingest_batch_spools_every_accepted_sample_once_with_or_without_hashes(raw: pa.Table, tmp_path: Path) -> None:
    key, hashes = batch_key(raw)
    out = []
    for name, d in (("a", hashes), ("b", None)):
        spool = Spool(tmp_path / name, cap_bytes=2**30, emit=lambda *a, **k: True)
        res = ingest_batch(raw, C, TieringPolicy(), spool, NoveltyScorer(C), key=key, hashes=d, node_id="node-a")
        held = [i for e in spool.pending() for i in e.manifest.sample_ids]
        assert sorted(held) == sorted(raw.column("sample_id").to_pylist())  # full rows + summaries, once each
        assert all(b["spooled"] for b in res.bundles)
        out.append(sorted(b["bundle_id"] for b in res.bundles))
        spool.close()
    assert out[0] == out[1]  # the same content hashes, so the same bundle ids


def test_bundle_parquet_settings_per_column(raw: pa.Table, tmp_path: Path) -> None:
    key, hashes = batch_key(raw)
    spool = _spool(tmp_path)
    res = ingest_batch(raw, C, TieringPolicy(), spool, NoveltyScorer(C), key=key, hashes=hashes, node_id="node-a")
    data = max((spool.read(b["bundle_id"]) for b in res.bundles), key=len)  # statistics: STATS_MIN_BYTES and up
    spool.close()
    meta = pq.ParquetFile(io.BytesIO(data)).metadata.row_group(0)
    cols = {meta.column(i).path_in_schema: meta.column(i) for i in range(meta.num_columns)}
    assert cols["pixels"].statistics is None and cols["content_sha256"].statistics is None
    assert cols["mean_b1_blue"].statistics is None and cols["std_b7_swir2"].statistics is None
    assert cols["capture_time"].statistics is not None and cols["value"].statistics is not None
    assert cols["sample_id"].statistics is not None
    assert not any("DICT" in e for e in cols["pixels"].encodings + cols["sample_id"].encodings)
    assert all(any("DICT" in e for e in cols[c].encodings) for c in ("node_id", "value", "inclusion_p"))
    assert all(c.compression == "ZSTD" for c in cols.values())
    assert "BYTE_STREAM_SPLIT" in cols["mean_b1_blue"].encodings
    t = pq.read_table(io.BytesIO(data))
    assert t.num_rows >= GRID_DICT_MIN_ROWS
    # Under GRID_DICT_MIN_ROWS rows a dictionary page costs more than it saves: value is written as the features are
    small, _ = write_bundle(read_bundle(data).slice(0, GRID_DICT_MIN_ROWS - 1), C, tier="normal")
    meta = pq.ParquetFile(io.BytesIO(small)).metadata.row_group(0)
    cols = {meta.column(i).path_in_schema: meta.column(i) for i in range(meta.num_columns)}
    assert "BYTE_STREAM_SPLIT" in cols["value"].encodings and not any("DICT" in e for e in cols["value"].encodings)
    assert np.array_equal(np.asarray(t.column("content_sha256").to_pylist()),
                          [hashlib.sha256(b).hexdigest() for b in t.column("pixels").to_pylist()])


def test_a_small_bundle_carries_no_statistics_and_reads_back_the_same(raw: pa.Table, tmp_path: Path) -> None:
    """Below STATS_MIN_BYTES a bundle is read whole anyway: its footer carries no min/max, and the rows read back
    the same."""
    from edgehaul.bundles import STATS_MIN_BYTES

    key, hashes = batch_key(raw)
    spool = _spool(tmp_path)
    res = ingest_batch(raw, C, TieringPolicy(), spool, NoveltyScorer(C), key=key, hashes=hashes, node_id="node-a")
    rows = read_bundle(max((spool.read(b["bundle_id"]) for b in res.bundles), key=len))
    spool.close()
    small = rows.slice(0, 3)
    assert small.nbytes < STATS_MIN_BYTES <= rows.nbytes
    data, manifest = write_bundle(small, C, tier="normal")
    meta = pq.ParquetFile(io.BytesIO(data)).metadata.row_group(0)
    assert all(meta.column(i).statistics is None for i in range(meta.num_columns))
    back = read_bundle(data, manifest)
    assert back.equals(small)
