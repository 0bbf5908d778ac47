"""The process's open dataset table (`datasets.table_handle`): its transaction index, built from the
latest checkpoint plus the commits after it, answers "already committed?" exactly as delta-rs does;
it sees commits made by other writers; and a bundle whose claim object is gone (moved by the
lifecycle) is still a no-op, because the dataset's own txn ids are the source of truth."""

from __future__ import annotations

import dataclasses
import json
import time

import pyarrow as pa
import pytest
from deltalake import CommitProperties, Transaction, write_deltalake

from edgehaul.blocks import ObjectStore
from edgehaul.bundles import write_bundle
from edgehaul.contracts import load_contract
from edgehaul.core.datasets import (
    BUNDLE_ID_COLUMN,
    CHECKPOINT_INTERVAL,
    ID_INDEX_PROPERTY,
    ValidatedBundle,
    _claim_key,
    _ids_key,
    commit_bundles,
    committed_bundle_ids,
    dataset_schema,
    ensure_table,
    forget_handle,
    open_table,
    read_version,
    table_handle,
    table_uri,
    txn_app_id,
)
from edgehaul.core.validation import validate_bundle
from tests.builders import bundle

CONTRACT = load_contract("landsat_patch")
KIND = CONTRACT.kind
pytestmark = pytest.mark.integration


def _validated(seed: int, node: str = "node-a") -> ValidatedBundle:
    data, m = bundle(8, node, seed=seed, start_seq=seed * 100)
    table, result = validate_bundle(data, m)
    assert result.success and table is not None
    return ValidatedBundle(m, table, result)


def test_txn_index_from_checkpoint_matches_delta_and_sees_other_writers(store: ObjectStore) -> None:
    vbs = [_validated(s) for s in range(CHECKPOINT_INTERVAL + 2)]
    for vb in vbs:  # one commit each: the log gets a checkpoint, then commits after it
        assert commit_bundles(store, CONTRACT, [vb]).version is not None
    s3 = store.client()
    assert s3.list_objects_v2(Bucket=store.bucket("curated"),
                              Prefix=store.key("curated", f"{KIND}/_delta_log/_last_checkpoint"))["KeyCount"] == 1

    forget_handle(store, KIND)  # as a fresh process: index = checkpoint's txn column + later commits
    h = table_handle(store, CONTRACT)
    assert h.txns is None  # built on first need only
    ids = [(vb.manifest.node_id, vb.manifest.bundle_id) for vb in vbs]
    assert h.is_committed(ids[0], s3)
    assert h.exact and h.indexed_upto == open_table(store, KIND).version() == len(vbs)
    dt = open_table(store, KIND)
    assert h.txns is not None and set(h.txns) == {txn_app_id(*r) for r in ids}
    for r in [*ids, ("node-a", "never-landed"), ("node-b", ids[0][1])]:  # a bundle id of node-a is not node-b's
        assert h.is_committed(r, s3) == (dt.transaction_version(txn_app_id(*r)) is not None)

    # another writer (its own DeltaTable, as another process would) commits a bundle: seen after refresh
    other = _validated(99, "node-b")
    rows = other.table.cast(CONTRACT.bundle_schema)
    rows = rows.append_column(dataset_schema(CONTRACT).field(BUNDLE_ID_COLUMN),
                              pa.array([other.manifest.bundle_id] * rows.num_rows))
    write_deltalake(table_uri(store, KIND), rows, mode="append", storage_options=store.storage_options(),
                    commit_properties=CommitProperties(
                        app_transactions=[Transaction(app_id=txn_app_id("node-b", other.manifest.bundle_id),
                                                      version=1)]))
    oref = ("node-b", other.manifest.bundle_id)
    # a committing run leaves its claim (every product commit claims first; a writer that bypasses claims
    # and the id index is not supported: docs/ARCHITECTURE.md)
    s3.put_object(Bucket=store.bucket("curated"), Key=_claim_key(store, KIND, oref),
                  Body=json.dumps({"run": "other-process", "at": time.time()}).encode())
    assert not h.is_committed(oref, s3)  # not refreshed yet
    assert committed_bundle_ids(store, KIND, [oref, ("node-b", "never-landed")]) == {oref}
    r = commit_bundles(store, CONTRACT, [other, vbs[0]])
    assert r.version is None and sorted(r.already_committed) == sorted([other.manifest.bundle_id, ids[0][1]])


def test_committed_bundle_without_its_claim_is_still_a_no_op(store: ObjectStore) -> None:
    vb = _validated(7)
    first = commit_bundles(store, CONTRACT, [vb], run_id="run-1")
    assert first.version == 1
    s3 = store.client()  # the lifecycle moved the claim object away (claims are plain curated objects)
    claim = store.key("curated", f"_claims/{KIND}/node-a/{vb.manifest.bundle_id}.json")
    s3.delete_object(Bucket=store.bucket("curated"), Key=claim)
    for fresh in (False, True):  # with this process's index, and as a fresh process
        if fresh:
            forget_handle(store, KIND)
        again = commit_bundles(store, CONTRACT, [vb], run_id="run-2")
        assert again.version is None and again.already_committed == [vb.manifest.bundle_id]
    assert open_table(store, KIND).version() == 1


def test_ids_owned_by_a_dead_run_are_taken_over_and_by_a_live_run_wait(store: ObjectStore) -> None:
    """The id index is written before the Delta commit: a run that reserved ids and died keeps them only while
    its claim is live. A later bundle carrying those ids is deferred while it is, and takes them over (all its
    rows kept) once the claim is gone or stale; the dead run's bundle, retried, then drops them as duplicates."""
    from edgehaul.core.datasets import _ensure_id_index, _reserve_ids, bundle_ref, claim_bundles

    dead = _validated(1)
    h = table_handle(store, CONTRACT)
    s3 = store.client()
    with h.lock:  # the dead run: claim, reserve its ids, then nothing (killed before its Delta commit)
        _ensure_id_index(store, CONTRACT, h, s3)
        assert claim_bundles(store, h.dt, KIND, [bundle_ref(dead.manifest)], "run-dead", s3=s3, handle=h).claimed
        res = _reserve_ids(store, h, [dead], "run-dead", 600, s3)
        assert not res.held and not res.deferred
    # the same rows in another bundle (other policy: another bundle id) carry the same sample ids
    data, m = write_bundle(dead.table, CONTRACT, tier="normal", policy_fingerprint="other")
    table, result = validate_bundle(data, m)
    assert table is not None and m.bundle_id != dead.manifest.bundle_id
    later = ValidatedBundle(m, table, result)
    waiting = commit_bundles(store, CONTRACT, [later], run_id="run-later", lease_s=600)
    assert waiting.version is None and waiting.deferred == [m.bundle_id]  # run-dead's claim is still live
    took = commit_bundles(store, CONTRACT, [later], run_id="run-later", lease_s=0.01)  # now presumed dead
    assert took.version is not None and took.rows == 8 and not took.duplicates
    retried = commit_bundles(store, CONTRACT, [dead], run_id="run-retry", lease_s=0.01)
    assert retried.version is None and retried.already_committed == [dead.manifest.bundle_id]
    assert sorted(retried.duplicates[f"node-a/{dead.manifest.bundle_id}"]) == sorted(dead.manifest.sample_ids)
    ids = read_version(store, KIND, columns=["sample_id"]).column("sample_id").to_pylist()
    assert sorted(ids) == sorted(dead.manifest.sample_ids)  # each id once


def test_a_new_table_is_born_with_its_id_index_and_a_fresh_process_needs_no_marker(store: ObjectStore) -> None:
    """ensure_table creates the table with its (empty) id index and says so in a table property, so a fresh
    process's first commit reads no marker: with the marker object gone, no rebuild runs (it would write
    the marker again) and a re-sent sample id is still a duplicate for its node only."""
    dt = ensure_table(store, CONTRACT)
    assert dt.metadata().configuration[ID_INDEX_PROPERTY] == "1"
    assert dt.metadata().configuration["delta.checkpointInterval"] == str(CHECKPOINT_INTERVAL)
    s3, bucket, marker = store.client(), store.bucket("curated"), _ids_key(store, KIND, "_index.json")
    assert json.loads(s3.get_object(Bucket=bucket, Key=marker)["Body"].read())["ids"] == 0
    first = _validated(7)
    assert commit_bundles(store, CONTRACT, [first]).version == 1
    s3.delete_object(Bucket=bucket, Key=marker)

    forget_handle(store, KIND)  # a fresh process
    again = _validated(8)
    resend = ValidatedBundle(dataclasses.replace(first.manifest, bundle_id="b" * 12), first.table, first.result)
    r = commit_bundles(store, CONTRACT, [again, resend])
    assert r.version == 2 and r.rows == again.table.num_rows
    assert sorted(r.duplicates[f"node-a/{'b' * 12}"]) == sorted(first.table.column("sample_id").to_pylist())
    assert s3.list_objects_v2(Bucket=bucket, Prefix=marker)["KeyCount"] == 0  # no rebuild ran
