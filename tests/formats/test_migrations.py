"""Migration to per-row inclusion probabilities (docs/MIGRATIONS.md): bundles written before `inclusion_p`
existed are still accepted (p = 1), and a dataset table written with the old schema evolves by a Delta
schema merge in its next commit, without rewriting history; old versions still read as they were."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable, write_deltalake

from edgehaul.blocks import ObjectStore, TieringPolicy
from edgehaul.bundles import BundleError, BundleManifest, read_bundle, write_bundle
from edgehaul.contracts import load_contract
from edgehaul.core.compaction import compact
from edgehaul.core.datasets import (
    BUNDLE_ID_COLUMN,
    ValidatedBundle,
    commit_bundles,
    content_sha256,
    dataset_schema,
    ensure_table,
    open_table,
    read_version,
    table_uri,
)
from edgehaul.core.validation import validate_bundle
from edgehaul.edge.tiering import Batcher, assign
from edgehaul.training.data import DatasetRef, Position, open_fragments, sample_weights, stream, trainable
from tests.builders import processed_rows

CONTRACT = load_contract("landsat_patch")
KIND = CONTRACT.kind


def legacy_rows(n: int, seed: int) -> pa.Table:
    """Rows exactly as the bundle schema had them before tier sampling: no inclusion_p."""
    t = processed_rows(n, seed=seed, start_seq=seed * 10_000)
    return t.drop_columns(["inclusion_p"])


def legacy_bundle(n: int, seed: int) -> tuple[bytes, BundleManifest]:
    """A bundle as the old `write_bundle` wrote it (same Parquet, same manifest fields)."""
    rows = legacy_rows(n, seed)
    _, m = write_bundle(rows, CONTRACT, tier="normal")  # the manifest's content fields (ids, values, times)
    sink = io.BytesIO()
    pq.write_table(rows.replace_schema_metadata({b"edgehaul.contract": CONTRACT.id.encode()}), sink,
                   compression="zstd")
    data = sink.getvalue()
    return data, dataclasses.replace(m, sha256=hashlib.sha256(data).hexdigest(), nbytes=len(data))


def test_a_bundle_without_inclusion_p_is_read_with_p_one_and_other_drift_still_fails() -> None:
    data, m = legacy_bundle(30, seed=1)
    assert "inclusion_p" not in pq.read_schema(io.BytesIO(data)).names
    t = read_bundle(data, m)
    assert t.schema == CONTRACT.bundle_schema
    assert t.column("inclusion_p").to_pylist() == [1.0] * 30
    assert sample_weights(t).tolist() == [1.0] * 30
    table, result = validate_bundle(data, m)
    assert result.success, result.error
    assert table is not None and table.column("inclusion_p").to_pylist() == [1.0] * 30
    # only added columns may be absent: a bundle lacking an original column is still schema drift
    rows = legacy_rows(5, seed=2).drop_columns(["value"])
    sink = io.BytesIO()
    pq.write_table(rows, sink)
    with pytest.raises(BundleError, match=r"missing columns \['value'\]"):
        read_bundle(sink.getvalue())


def test_sample_weights_are_one_over_p_one_when_absent_or_null_and_refuse_bad_p() -> None:
    b = pa.table({"sample_id": ["a", "b", "c"], "inclusion_p": pa.array([0.25, None, 1.0], pa.float32())})
    assert sample_weights(b).tolist() == [4.0, 1.0, 1.0]
    assert sample_weights(pa.table({"sample_id": ["a", "b"]})).tolist() == [1.0, 1.0]
    for bad in (0.0, 1.5, float("nan"), -0.1):
        t = pa.table({"sample_id": ["ok", "bad-one"], "inclusion_p": pa.array([0.5, bad], pa.float32())})
        with pytest.raises(ValueError, match=r"inclusion_p .* of sample bad-one is outside \(0, 1\]; 1 of 2 rows"):
            sample_weights(t)


def _old_table(store: ObjectStore) -> str:
    """A dataset table created and written by the old code: old schema, one version of legacy rows; returns
    the digest of version 1's content."""
    old_schema = dataset_schema(CONTRACT).remove(dataset_schema(CONTRACT).get_field_index("inclusion_p"))
    uri, opts = table_uri(store, KIND), store.storage_options()
    DeltaTable.create(uri, old_schema, mode="error", storage_options=opts, name=KIND)
    rows = legacy_rows(40, seed=3)
    rows = rows.append_column(BUNDLE_ID_COLUMN, pa.array(["legacy-bundle"] * rows.num_rows))
    write_deltalake(uri, rows.cast(old_schema), mode="append", storage_options=opts)
    return content_sha256(read_version(store, KIND, 1))


@pytest.mark.integration
def test_an_old_table_evolves_in_its_next_commit_and_time_travel_still_reads(store: ObjectStore) -> None:
    v1_digest = _old_table(store)
    assert "inclusion_p" not in pa.schema(open_table(store, KIND).schema()).names
    ensure_table(store, CONTRACT)  # the old table is accepted as it is: nothing written yet
    assert open_table(store, KIND).version() == 1

    # one commit: a legacy bundle (landed before the upgrade) and a new one with sampled low rows
    legacy = legacy_bundle(25, seed=4)
    p = TieringPolicy(sample_rate=0.5)
    scored = assign(processed_rows(300, seed=5, start_seq=50_000).drop_columns(["value", "tier", "is_summary",
                                                                               "inclusion_p"]),
                    np.linspace(0.0, 0.6, 300, dtype=np.float32), p, CONTRACT)
    b = Batcher(p, CONTRACT)
    normal = [x for x in b.add(scored) + b.flush() if x.manifest.tier == "normal"]
    assert len(normal) == 1
    vbs = []
    for data, m in (legacy, (normal[0].data, normal[0].manifest)):
        table, result = validate_bundle(data, m)
        assert result.success and table is not None, result.error
        vbs.append(ValidatedBundle(m, table, result))
    r = commit_bundles(store, CONTRACT, vbs, run_id="migrate")
    assert r.version == 2 and r.rows == 325

    dt = open_table(store, KIND)
    field = pa.schema(dt.schema()).field("inclusion_p")
    assert field.type == pa.float32() and field.nullable
    # history is not rewritten: version 1's files are still the table's, and version 1 reads as before
    v1_files = DeltaTable(table_uri(store, KIND), version=1, storage_options=store.storage_options()).file_uris()
    assert v1_files and set(v1_files) <= set(dt.file_uris())
    for reader in ("pyarrow", "polars", "duckdb"):
        v1 = read_version(store, KIND, 1, reader=reader)  # type: ignore[arg-type]
        assert "inclusion_p" not in v1.column_names and content_sha256(v1) == v1_digest
    latest = read_version(store, KIND, 2)
    p_by_bundle: dict[str, set[float | None]] = {}
    for bid, pv in zip(latest.column(BUNDLE_ID_COLUMN).to_pylist(), latest.column("inclusion_p").to_pylist(),
                       strict=True):
        p_by_bundle.setdefault(bid, set()).add(pv)
    assert p_by_bundle["legacy-bundle"] == {None}  # committed before the column: null, read as 1
    assert p_by_bundle[legacy[1].bundle_id] == {1.0}  # a legacy bundle committed after: p = 1 by definition
    assert p_by_bundle[normal[0].manifest.bundle_id] == {1.0, 0.5}  # normal rows 1, low rows the rate

    # the trainer's view: old rows weigh 1, sampled low rows 1/p; summaries are never training rows
    rows = trainable(latest.combine_chunks().to_batches()[0], CONTRACT)
    w = sample_weights(rows)
    low = np.array([t == "low" for t in rows.column("tier").to_pylist()])
    assert not any(rows.column("is_summary").to_pylist()) and low.any()
    assert (w[low] == 2.0).all() and (w[~low] == 1.0).all()

    # the trainer's stream reads p where a file has it: files from before the merge weigh 1
    ref = DatasetRef(table_uri(store, KIND), 2, store.storage_options())
    frags, columns = open_fragments(ref, CONTRACT)
    assert "inclusion_p" in columns
    streamed = [b for _, b in stream(frags, list(range(len(frags))), Position(), 1024, columns)]
    w_all = np.concatenate([sample_weights(trainable(b, CONTRACT)) for b in streamed])
    assert sorted(w_all.tolist()) == sorted(w.tolist()) and len(streamed) == 2
    assert {"inclusion_p" in b.schema.names for b in streamed} == {True, False}

    # the evolved table takes later commits without another merge, whatever its column order
    ensure_table(store, CONTRACT)
    more = processed_rows(20, seed=6, start_seq=90_000)
    data, m = write_bundle(more, CONTRACT, tier="normal")
    table, result = validate_bundle(data, m)
    assert table is not None
    assert commit_bundles(store, CONTRACT, [ValidatedBundle(m, table, result)]).version == 3
    assert read_version(store, KIND, 3).num_rows == 40 + 325 + 20
    assert content_sha256(read_version(store, KIND, 1)) == v1_digest

    # compaction merges files from before and after the schema merge without changing a row
    v3_digest = content_sha256(read_version(store, KIND, 3))
    done = compact(store, KIND, min_files=2)
    assert done.version == 4 and done.files_removed >= 3
    assert content_sha256(read_version(store, KIND, 4)) == v3_digest
    assert content_sha256(read_version(store, KIND, 1)) == v1_digest


# ------------------------------------------------------------------ identity-scoped ids (docs/MIGRATIONS.md)


def _validated(rows: pa.Table) -> ValidatedBundle:
    data, m = write_bundle(rows, CONTRACT, tier="normal")
    table, result = validate_bundle(data, m)
    assert result.success and table is not None, result.error
    return ValidatedBundle(m, table, result)


def _as_node(t: pa.Table, node: str) -> pa.Table:
    return t.set_column(t.schema.get_field_index("node_id"), "node_id",
                        pa.array([node] * t.num_rows, t.schema.field("node_id").type))


@pytest.mark.integration
def test_a_table_from_before_scoped_ids_gets_its_id_index_on_the_next_commit(store: ObjectStore) -> None:
    """A table the old code wrote: txn ids `edgehaul/bundle/<bundle>`, claims without a node, no id index. The
    first commit builds the index (one scan), with no new version for it; then a re-landed old bundle is
    already committed for its own node only, a re-sent old sample id is a duplicate for its own node only."""
    from deltalake import CommitProperties, Transaction

    from edgehaul.core.datasets import _ids_key, committed_bundle_ids, forget_handle

    old = _validated(processed_rows(30, "node-a", seed=21, start_seq=7_000))
    uri, opts = table_uri(store, KIND), store.storage_options()
    # created as the old code created tables: no id index, so no `edgehaul.idIndex` property
    DeltaTable.create(uri, dataset_schema(CONTRACT), storage_options=opts,
                      configuration={"delta.checkpointInterval": "10"})
    rows = old.table.append_column(BUNDLE_ID_COLUMN, pa.array([old.manifest.bundle_id] * 30))
    write_deltalake(uri, rows.cast(dataset_schema(CONTRACT)), mode="append", storage_options=opts,
                    commit_properties=CommitProperties(app_transactions=[
                        Transaction(app_id=f"edgehaul/bundle/{old.manifest.bundle_id}", version=1)]))
    assert open_table(store, KIND).version() == 1
    forget_handle(store, KIND)  # a process of the new code

    same_on_b = _validated(_as_node(old.table, "node-b"))  # node-b's bundle: same ids, same bundle id
    assert same_on_b.manifest.bundle_id == old.manifest.bundle_id
    resend = _validated(processed_rows(40, "node-a", seed=22, start_seq=7_010))  # 20 old ids of node-a, 20 new
    r = commit_bundles(store, CONTRACT, [old, same_on_b, resend], run_id="first-after-upgrade")
    assert r.version == 2  # the index build made no version of its own
    assert r.already_committed == [old.manifest.bundle_id] and r.refs["already_committed"] == [
        f"node-a/{old.manifest.bundle_id}"]
    assert sorted(r.refs["bundles"]) == sorted([f"node-b/{same_on_b.manifest.bundle_id}",
                                                f"node-a/{resend.manifest.bundle_id}"])
    assert r.rows == 30 + 20 and len(r.duplicates[f"node-a/{resend.manifest.bundle_id}"]) == 20
    s3 = store.client()
    marker = json.loads(s3.get_object(Bucket=store.bucket("curated"), Key=_ids_key(store, KIND, "_index.json"))
                        ["Body"].read())
    assert marker["ids"] == 30 and marker["version"] == 1 and marker["legacy_bundles"] == 1
    data = read_version(store, KIND)
    assert data.num_rows == 30 + 30 + 20
    pairs = list(zip(data.column("node_id").to_pylist(), data.column("sample_id").to_pylist(), strict=True))
    assert len(pairs) == len(set(pairs))  # unique per node; node-b holds the same ids as node-a

    forget_handle(store, KIND)  # another fresh process: the old bundle is node-a's, not node-b's
    assert committed_bundle_ids(store, KIND, [("node-a", old.manifest.bundle_id), ("node-c", old.manifest.bundle_id)]) \
        == {("node-a", old.manifest.bundle_id)}
    again = commit_bundles(store, CONTRACT, [old, same_on_b], run_id="later")
    assert again.version is None and sorted(again.refs["already_committed"]) == sorted(
        [f"node-a/{old.manifest.bundle_id}", f"node-b/{old.manifest.bundle_id}"])


@pytest.mark.integration
def test_an_old_table_with_derived_features_keeps_them_derived_by_each_commit(store: ObjectStore) -> None:
    """A gait table made when bundles carried norm_<column> beside each reading: accepted as it is, and a commit
    of new bundles (which carry each reading once) fills those columns, derived from the readings."""
    from edgehaul.decode import with_derived_features
    from tests.gait_rows import GAIT, gait_rows

    new = dataset_schema(GAIT)
    old = pa.schema([*new, *(pa.field(n, pa.float32(), nullable=False) for n in GAIT.derived_feature_columns)])
    DeltaTable.create(table_uri(store, GAIT.kind), old, mode="error", storage_options=store.storage_options())
    ensure_table(store, GAIT)  # accepted: the derived columns are known
    scored = assign(gait_rows(50, anomaly_rate=0.1, seed=7), np.full(50, 0.5, np.float32), TieringPolicy(), GAIT)
    data, m = write_bundle(scored, GAIT, tier="normal")
    table, result = validate_bundle(data, m)
    assert result.success and table is not None, result.error
    assert commit_bundles(store, GAIT, [ValidatedBundle(m, table, result)], run_id="derived").rows == 50
    got = read_version(store, GAIT.kind, 1)
    assert set(GAIT.derived_feature_columns) <= set(got.column_names)
    want = with_derived_features(got.select(new.names), GAIT)
    for n in GAIT.derived_feature_columns:
        np.testing.assert_array_equal(got.column(n).to_numpy(), want.column(n).to_numpy())
    x = got.column("trunk_vert").to_numpy().astype(np.float64)
    np.testing.assert_allclose(got.column("norm_trunk_vert").to_numpy(), (x + 5000) / 10000, rtol=1e-6)
