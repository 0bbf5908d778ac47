"""Versioned datasets (Delta Lake) on the real S3 server: one commit per run, lineage, idempotent
re-landing, concurrent commits from two processes, time travel read identically by polars, pyarrow
and DuckDB, and compaction that leaves every version's content unchanged."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgehaul.blocks import ObjectStore
from edgehaul.bundles import read_bundle
from edgehaul.contracts import load_contract
from edgehaul.core import landed
from edgehaul.core.compaction import compact, file_set
from edgehaul.core.datasets import (
    BUNDLE_ID_COLUMN,
    DatasetError,
    ValidatedBundle,
    claim_bundles,
    commit_bundles,
    commit_info,
    content_sha256,
    ensure_table,
    lineage,
    open_table,
    read_version,
)
from edgehaul.core.validation import ValidationResult, validate_bundle
from tests.builders import bundle, processed_rows

CONTRACT = load_contract("landsat_patch")
KIND = CONTRACT.kind
READERS = ("pyarrow", "polars", "duckdb")


def _validated(n: int, node: str, seed: int) -> ValidatedBundle:
    data, m = bundle(n, node, seed=seed, start_seq=seed * 1000)
    table, result = validate_bundle(data, m)
    assert result.success and table is not None
    return ValidatedBundle(m, table, result)


def _expected(vbs: list[ValidatedBundle]) -> str:
    """Digest of what a version holding exactly these bundles must read back."""
    parts = [vb.table.append_column(BUNDLE_ID_COLUMN, pa.array([vb.manifest.bundle_id] * vb.table.num_rows))
             for vb in vbs]
    return content_sha256(pa.concat_tables(parts))


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 40), seed=st.integers(0, 1000), chunks=st.integers(1, 4))
def test_property_content_digest_ignores_row_order_and_chunking(n: int, seed: int, chunks: int) -> None:
    t = processed_rows(n, seed=seed).append_column(BUNDLE_ID_COLUMN, pa.array(["b"] * n))
    shuffled = t.take(pa.array(list(reversed(range(n)))))
    step = max(1, n // chunks)
    rechunked = pa.concat_tables([shuffled.slice(i, step) for i in range(0, n, step)])
    assert content_sha256(rechunked) == content_sha256(t)
    if n > 1:  # and it does see a changed value
        changed = t.set_column(t.schema.get_field_index("seq"), "seq", pa.array(range(1, n + 1), pa.int64()))
        assert content_sha256(changed) != content_sha256(t)


@pytest.mark.integration
def test_commit_lineage_and_relanding_is_a_no_op(store: ObjectStore) -> None:
    a1, a2, b1 = _validated(60, "node-a", 1), _validated(40, "node-a", 2), _validated(50, "node-b", 3)
    r1 = commit_bundles(store, CONTRACT, [a1, a2], run_id="run-1")
    assert r1.version == 1 and r1.rows == 100 and r1.nodes == ["node-a"]
    # a2 landed twice: only b1 is new; one commit, one version
    r2 = commit_bundles(store, CONTRACT, [a2, b1, b1], run_id="run-2")
    assert r2.version == 2 and r2.bundles == [b1.manifest.bundle_id]
    assert r2.already_committed == [a2.manifest.bundle_id]
    r3 = commit_bundles(store, CONTRACT, [a1, a2, b1], run_id="run-3")
    assert r3.version is None and sorted(r3.already_committed) == sorted(v.manifest.bundle_id for v in (a1, a2, b1))
    assert open_table(store, KIND).version() == 2

    lin = lineage(store, KIND, 2)
    assert lin.nodes == ["node-a", "node-b"] and lin.rows == 150
    by_id = {b["bundle_id"]: b for b in lin.bundles}
    assert by_id[a1.manifest.bundle_id] == {"bundle_id": a1.manifest.bundle_id, "node_id": "node-a", "rows": 60,
                                            "added_in": 1, "sha256": a1.manifest.sha256}
    assert by_id[b1.manifest.bundle_id]["added_in"] == 2
    info = lin.commit
    assert info["edgehaul.contract"] == CONTRACT.id and info["edgehaul.nodes"] == ["node-b"]
    assert info["edgehaul.stats"]["rows"] == 50 and info["edgehaul.validation"][0]["success"] is True
    assert [b["bundle_id"] for b in info["edgehaul.bundles"]] == [b1.manifest.bundle_id]
    assert lineage(store, KIND, 1).nodes == ["node-a"]
    # every sample id of every committed manifest is in the version, exactly once
    ids = read_version(store, KIND, 2, columns=["sample_id"]).column("sample_id").to_pylist()
    assert sorted(ids) == sorted(a1.manifest.sample_ids + a2.manifest.sample_ids + b1.manifest.sample_ids)


@pytest.mark.integration
def test_failed_validation_never_enters_a_version(store: ObjectStore) -> None:
    good = _validated(20, "node-a", 4)
    bad = ValidatedBundle(good.manifest, good.table, ValidationResult.from_dict(
        {**good.result.to_dict(), "success": False, "reason": "expectations"}))
    with pytest.raises(DatasetError, match="failed validation"):
        commit_bundles(store, CONTRACT, [good, bad])
    with pytest.raises(DatasetError, match="no dataset"):
        open_table(store, KIND)  # nothing, not even an empty version, was written


@pytest.mark.integration
def test_claims_defer_a_live_run_and_take_over_a_dead_one(store: ObjectStore) -> None:
    dt = ensure_table(store, CONTRACT)
    b1, b2 = ("node-a", "b-1"), ("node-a", "b-2")
    c1 = claim_bundles(store, dt, KIND, [b1, b2], "run-live")
    assert c1.claimed == [b1, b2]
    c2 = claim_bundles(store, dt, KIND, [b1], "run-other", lease_s=600)
    assert c2.deferred == [b1] and not c2.claimed
    # the same bundle id from another node is another bundle: its own claim
    assert claim_bundles(store, dt, KIND, [("node-b", "b-1")], "run-other", lease_s=600).claimed == [("node-b", "b-1")]
    time.sleep(0.2)
    c3 = claim_bundles(store, dt, KIND, [b2], "run-other", lease_s=0.1)  # run-live presumed dead
    assert c3.claimed == [b2]
    assert claim_bundles(store, dt, KIND, [b2], "run-other").claimed == [b2]  # own claim: retry ok


@pytest.mark.integration
def test_an_empty_claim_left_by_a_claimant_killed_mid_put_expires_like_any_other(store: ObjectStore) -> None:
    from edgehaul.core.datasets import _claim_key

    dt = ensure_table(store, CONTRACT)
    # some S3 servers keep a 0-byte object when the client dies after the PUT's headers
    b = ("node-a", "b-empty")
    store.client().put_object(Bucket=store.bucket("curated"), Key=_claim_key(store, KIND, b), Body=b"")
    assert claim_bundles(store, dt, KIND, [b], "run-next", lease_s=600).deferred == [b]
    time.sleep(1.1)  # LastModified has one-second resolution
    assert claim_bundles(store, dt, KIND, [b], "run-next", lease_s=1.0).claimed == [b]
    assert claim_bundles(store, dt, KIND, [b], "run-next").claimed == [b]  # now a real claim


@pytest.mark.integration
def test_a_failed_commit_releases_its_claims_so_the_next_run_commits_at_once(
    store: ObjectStore, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The write itself fails (injected at delta-rs: a store error mid-commit): nothing is in the table,
    the run's claims are gone, and the next run commits those bundles instead of deferring them for
    the lease (found by `make drills`, concurrent_ingest, under load)."""
    from deltalake.exceptions import DeltaError

    import edgehaul.core.datasets as ds

    vbs = [_validated(20, "node-a", 41), _validated(20, "node-b", 42)]
    ensure_table(store, CONTRACT)

    def failing_write(*args: object, **kwargs: object) -> None:
        raise DeltaError("injected: the store went away mid-commit")

    with monkeypatch.context() as m:
        m.setattr(ds, "write_deltalake", failing_write)
        with pytest.raises(DatasetError, match=r"nothing written \(2 claims released\): injected"):
            commit_bundles(store, CONTRACT, vbs, run_id="run-failed", lease_s=600)
    s3 = store.client()
    for vb in vbs:
        with pytest.raises(s3.exceptions.NoSuchKey):
            s3.get_object(Bucket=store.bucket("curated"), Key=ds._claim_key(store, KIND, ds.bundle_ref(vb.manifest)))
    res = commit_bundles(store, CONTRACT, vbs, run_id="run-next", lease_s=600)
    assert not res.deferred and sorted(res.bundles) == sorted(vb.manifest.bundle_id for vb in vbs)
    assert read_version(store, KIND).num_rows == 40


def _land(store: ObjectStore, vbs: list[ValidatedBundle], datas: list[bytes]) -> None:
    s3 = store.client()
    for vb, data in zip(vbs, datas, strict=True):
        s3.put_object(Bucket=store.bucket("landing"), Key=store.key("landing", vb.manifest.object_key), Body=data)
        s3.put_object(Bucket=store.bucket("landing"), Key=store.key("landing", vb.manifest.manifest_key),
                      Body=vb.manifest.to_json())


def commit_worker(prefix: str, job_file: str, start_at: float, out_file: str) -> None:
    """Subprocess body: commit bundles from landing, with validation results computed by the parent."""
    store = ObjectStore.from_env(prefix=prefix)
    jobs = json.loads(Path(job_file).read_text())
    vbs = []
    for job in jobs:
        lb = landed.fetch(store, job["key"])
        assert lb.data is not None and lb.manifest is not None
        result = ValidationResult.from_dict(job["result"])
        vbs.append(ValidatedBundle(lb.manifest, read_bundle(lb.data, lb.manifest), result))
    time.sleep(max(0.0, start_at - time.time()))
    r = commit_bundles(store, CONTRACT, vbs)
    Path(out_file).write_text(json.dumps(r.to_dict()))


@pytest.mark.integration
def test_two_processes_creating_and_committing_at_once_both_land(store: ObjectStore, tmp_path: Path) -> None:
    # Fresh prefix: the two processes also race to create the table (the FACTS.md hazard).
    made = [(bundle(30, node, seed=s, start_seq=s * 100), node) for s, node in
            ((11, "node-a"), (12, "node-a"), (13, "node-b"), (14, "node-b"), (15, "node-a"))]
    vbs, datas = [], []
    for (data, m), _ in made:
        table, result = validate_bundle(data, m)
        assert table is not None
        vbs.append(ValidatedBundle(m, table, result))
        datas.append(data)
    _land(store, vbs, datas)
    shared = vbs[4]  # the same bundle in both runs (delivered twice, triggered twice)
    sets = [[*vbs[0:2], shared], [*vbs[2:4], shared]]
    start_at = time.time() + 8  # both start committing at the same moment, after their imports
    procs, outs = [], []
    for i, group in enumerate(sets):
        job = tmp_path / f"job{i}.json"
        job.write_text(json.dumps([{"key": store.key("landing", vb.manifest.object_key), "result": vb.result.to_dict()}
                                   for vb in group]))
        out = tmp_path / f"out{i}.json"
        outs.append(out)
        code = (f"from tests.core.test_datasets import commit_worker; "
                f"commit_worker({store.prefix!r}, {str(job)!r}, {start_at!r}, {str(out)!r})")
        procs.append(subprocess.Popen([sys.executable, "-c", code], cwd=Path(__file__).parents[2],
                                      env=os.environ.copy(), stderr=subprocess.PIPE, text=True))
    for p in procs:
        _, err = p.communicate(timeout=180)
        assert p.returncode == 0, err[-3000:]
    results = [json.loads(o.read_text()) for o in outs]
    versions = sorted(r["version"] for r in results)
    assert None not in versions and versions[0] != versions[1]
    # the shared bundle: committed by exactly one run, skipped or deferred by the other
    owners = [r for r in results if shared.manifest.bundle_id in r["bundles"]]
    assert len(owners) == 1
    other = next(r for r in results if r is not owners[0])
    assert shared.manifest.bundle_id in other["already_committed"] + other["deferred"]
    final = read_version(store, KIND)
    assert final.num_rows == 150
    assert content_sha256(final) == _expected(vbs)
    assert sorted(b["bundle_id"] for b in lineage(store, KIND, versions[1]).bundles) == sorted(
        vb.manifest.bundle_id for vb in vbs)


@pytest.mark.integration
def test_time_travel_by_version_and_time_is_identical_in_three_readers(store: ObjectStore) -> None:
    v1 = [_validated(40, "node-a", 21), _validated(35, "node-b", 22)]
    v2 = [_validated(30, "node-a", 23)]
    assert commit_bundles(store, CONTRACT, v1).version == 1
    t_after_v1 = datetime.now(UTC)
    time.sleep(1.1)
    assert commit_bundles(store, CONTRACT, v2).version == 2
    want1, want2 = _expected(v1), _expected(v1 + v2)
    for reader in READERS:
        assert content_sha256(read_version(store, KIND, 1, reader=reader)) == want1, reader
        assert content_sha256(read_version(store, KIND, 2, reader=reader)) == want2, reader
        assert content_sha256(read_version(store, KIND, t_after_v1, reader=reader)) == want1, reader
    assert commit_info(store, KIND, 1)["edgehaul.nodes"] == ["node-a", "node-b"]  # an old version's own commit
    with pytest.raises(DatasetError, match="no version"):
        read_version(store, KIND, 7)
    with pytest.raises(DatasetError, match="no version"):
        read_version(store, KIND, t_after_v1 - timedelta(days=365))


@pytest.mark.integration
def test_compaction_is_its_own_commit_and_keeps_every_version(store: ObjectStore) -> None:
    groups = [[_validated(25, "node-a", 30 + i)] for i in range(4)]
    for g in groups:
        commit_bundles(store, CONTRACT, g)
    before = {(v, r): content_sha256(read_version(store, KIND, v, reader=r)) for v in (1, 2, 3, 4) for r in READERS}
    fs = file_set(store, KIND)
    assert len(fs.files) == 4
    res = compact(store, KIND, target_size=64 * 1024 * 1024)
    assert res.version == 5 and res.files_removed == 4 and res.files_added == 1
    assert res.input_fingerprint == fs.fingerprint
    after = file_set(store, KIND)
    assert len(after.files) == 1 and after.fingerprint != fs.fingerprint
    for (v, r), digest in before.items():
        assert content_sha256(read_version(store, KIND, v, reader=r)) == digest, (v, r)
    for r in READERS:
        assert content_sha256(read_version(store, KIND, 5, reader=r)) == before[(4, r)]
    assert commit_info(store, KIND, 5)["operation"] == "OPTIMIZE"
    assert lineage(store, KIND, 5).rows == 100  # lineage survives the rewrite
    again = compact(store, KIND, target_size=64 * 1024 * 1024)  # one file: nothing to do
    assert again.version is None and open_table(store, KIND).version() == 5
    with pytest.raises(DatasetError, match="target_size"):
        compact(store, KIND, target_size=10)



@pytest.mark.integration
def test_an_s3_error_inside_the_commit_releases_the_claims_so_the_next_run_commits_at_once(store: ObjectStore) -> None:
    """The store refuses the duplicate record a commit writes (a real S3 error from the server: the record is
    sent to a bucket that does not exist): the error reaches the caller, nothing is in the table, the run's
    claims are gone, and the next run commits those bundles at once instead of deferring them for the lease.
    main: the claims were released only on Delta and OS errors; this one kept them for the whole lease."""
    from botocore.exceptions import ClientError

    import edgehaul.core.datasets as ds

    first = _validated(10, "node-a", 51)
    commit_bundles(store, CONTRACT, [first])
    # a bundle re-sending 10 committed ids (so the commit records duplicates) and one of another node
    resend = _validated(30, "node-a", 51)
    other = _validated(20, "node-b", 52)
    assert set(first.manifest.sample_ids) < set(resend.manifest.sample_ids)
    s3 = store.client()

    def missing_bucket(params: dict[str, object], **_: object) -> None:
        if "/_duplicates/" in str(params.get("Key", "")):
            params["Bucket"] = "edgehaul-no-such-bucket"

    s3.meta.events.register("before-parameter-build.s3.PutObject", missing_bucket)
    with pytest.raises(ClientError, match="NoSuchBucket"):
        commit_bundles(store, CONTRACT, [resend, other], run_id="run-failed", lease_s=600, s3=s3)
    for vb in (resend, other):
        with pytest.raises(s3.exceptions.NoSuchKey):
            s3.get_object(Bucket=store.bucket("curated"), Key=ds._claim_key(store, KIND, ds.bundle_ref(vb.manifest)))
    assert open_table(store, KIND).version() == 1
    res = commit_bundles(store, CONTRACT, [resend, other], run_id="run-next", lease_s=600)
    assert not res.deferred and sorted(res.bundles) == sorted([resend.manifest.bundle_id, other.manifest.bundle_id])
    assert res.rows == 20 + 20 and read_version(store, KIND).num_rows == 10 + 40
