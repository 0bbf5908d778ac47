"""The core treats every landed bundle as untrusted input.

Each attack is reproduced with an edge node's own identity (`store_for(stack, "node-a")`: it can write
only under `node-a/` in landing) against the real stack, through the real `core_ingest` flow where the
flow is what failed. On main at ec886de each of these was let through or broke the run (noted per test).
Unit tests of the plain checks (ids, row checks, contract errors, duplicate split) need no stack.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgehaul.blocks import ObjectStore
from edgehaul.bundles import BUNDLE_ID_PATTERN, NODE_ID_PATTERN, BundleError, BundleManifest, id_problem, write_bundle
from edgehaul.contracts import ContractInvalid, load_contract
from edgehaul.core import datasets, ingest, landed, quarantine
from edgehaul.core.datasets import BUNDLE_ID_COLUMN, ValidatedBundle, commit_bundles, read_version
from edgehaul.core.quarantine import read_record
from edgehaul.core.validation import row_problems, suite_for, validate_bundle
from edgehaul.flows.core_ingest import CoreIngestParams, core_ingest
from edgehaul_dev import localstack
from tests.builders import bundle, processed_rows
from tests.conftest import store_for

CONTRACT = load_contract("landsat_patch")
KIND = CONTRACT.kind
CONTRACT_FILE = Path(CONTRACT.source)


def _seq() -> int:
    """A fresh block of sequence numbers: sample ids (`<node>-<seq>`) never collide across tests, which
    share the root landing prefix (a node identity writes only there) and so the root dataset."""
    return random.randrange(10**9, 10**11) * 1000


def _table(n: int, node: str = "node-a", start: int | None = None) -> pa.Table:
    return processed_rows(n, node, seed=random.randrange(10**6), start_seq=_seq() if start is None else start)


def _set(t: pa.Table, name: str, values: list[Any], typ: pa.DataType) -> pa.Table:
    return t.set_column(t.schema.get_field_index(name), name, pa.array(values, typ))


def _land(node_store: ObjectStore, data: bytes, m: BundleManifest, *, node: str = "", manifest: bytes | None = None,
          with_manifest: bool = True) -> str:
    """Upload as the node does (data, then manifest) under `node`'s prefix (default: the manifest's)."""
    key = f"{node or m.node_id}/{m.min_capture_time[:10]}/{m.bundle_id}.parquet"
    s3 = node_store.client()
    s3.put_object(Bucket=node_store.bucket("landing"), Key=node_store.key("landing", key), Body=data)
    if with_manifest:
        s3.put_object(Bucket=node_store.bucket("landing"), Key=node_store.key("landing", quarantine.manifest_key_for(key)),
                      Body=m.to_json() if manifest is None else manifest)
    return key


def _exists(store: ObjectStore, zone: Any, key: str) -> bool:
    try:
        store.client().head_object(Bucket=store.bucket(zone), Key=store.key(zone, key))
        return True
    except Exception:
        return False


@pytest.fixture(scope="module")
def ingest_block(stack: localstack.StackState) -> str:
    """The core ingest identity at the root prefix, where the nodes' own identities land bundles."""
    name = f"attacks-ingest-{uuid.uuid4().hex[:8]}"
    store_for(stack, "ingest").save(name, overwrite=True)
    return name


def _run(**params: Any) -> tuple[Any, Any]:
    state = core_ingest(CoreIngestParams(**params), return_state=True)
    return state.result(raise_on_failure=False), state


def _dataset_ids(stack: localstack.StackState) -> list[str]:
    ids: list[str] = read_version(store_for(stack, "ingest"), KIND, columns=["sample_id"]).column("sample_id").to_pylist()
    return ids


def _dataset_pairs(stack: localstack.StackState) -> list[tuple[str, str]]:
    """(node, sample id) of every row: ids are unique per node (another node may hold the same id, as
    tests/security/test_attacks_ids.py makes nodes do in the root dataset this module shares)."""
    t = read_version(store_for(stack, "ingest"), KIND, columns=["node_id", "sample_id"])
    return list(zip(t.column("node_id").to_pylist(), t.column("sample_id").to_pylist(), strict=True))


# ------------------------------------------------------------------------------------------ unit: ids


@given(st.text(max_size=40))
def test_property_unsafe_ids_never_pass(value: str) -> None:
    unsafe = any(c not in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_" for c in value)
    if unsafe or not value or value[0] in "-_":
        assert id_problem(value, "b" * 32) and id_problem("node-a", value)
    assert "/" not in value or id_problem("node-a", value)


@given(st.from_regex(NODE_ID_PATTERN, fullmatch=True), st.from_regex(BUNDLE_ID_PATTERN, fullmatch=True))
def test_property_safe_ids_pass_and_name_the_owner(node: str, bid: str) -> None:
    assert id_problem(node, bid) == ""
    store = ObjectStore(prefix="tenant")
    assert ingest.landing_owner(store, store.key("landing", f"{node}/2026-12-04/{bid}.parquet")) == (node, bid)


@pytest.mark.parametrize("rel", ["node-a/2026-12-04/../x.parquet", "../node-b/2026-12-04/b.parquet",
                                 "node-a//b.parquet", "node-a/2026-12-04/a..b.parquet", "node-a/2026-12-04/b.json",
                                 "NODE/2026-12-04/b.parquet", "node-a/today/b.parquet"])
def test_landing_keys_that_are_not_a_bundle_are_named(rel: str) -> None:
    store = ObjectStore()
    why = ingest.landing_owner(store, store.key("landing", rel))
    assert isinstance(why, str) and rel.split("/")[0][:5] in why


def test_manifest_fields_are_type_checked() -> None:
    _, m = bundle(3, start_seq=_seq())
    doc = json.loads(m.to_json())
    for field_, bad in (("row_count", "3"), ("sample_ids", [1, 2, 3]), ("bundle_id", ["x"]), ("value_sum", True)):
        with pytest.raises(BundleError, match=f"field {field_}"):
            BundleManifest.from_json(json.dumps({**doc, field_: bad}))
    assert BundleManifest.from_json(m.to_json()) == m


# ------------------------------------------------------------------------------------------ unit: rows


def test_row_checks_catch_tensor_lengths_and_non_finite_values_naming_samples() -> None:
    t = _table(6)
    ids = t.column("sample_id").to_pylist()
    good = t.column("pixels").to_pylist()
    assert row_problems(t, CONTRACT) == ("", "")
    for i, px in ((1, b"1234567"), (2, bytes(40 * 2**20)), (3, None)):
        reason, error = row_problems(_set(t, "pixels", [px if j == i else p for j, p in enumerate(good)], pa.binary()),
                                     CONTRACT)
        assert reason == "tensor_length" and ids[i] in error and "1536" in error
    summary = _set(t, "is_summary", [True] + [False] * 5, pa.bool_())  # a summary row carries no pixels
    assert row_problems(summary, CONTRACT)[0] == "tensor_length"
    assert row_problems(_set(summary, "pixels", [None, *good[1:]], pa.binary()), CONTRACT) == ("", "")
    for col, v in (("value", math.nan), ("mean_b4_nir", math.nan), ("std_b3_red", math.inf)):
        vals = t.column(col).to_pylist()
        reason, error = row_problems(_set(t, col, [v, *vals[1:]], pa.float32()), CONTRACT)
        assert reason == "non_finite" and col in error and ids[0] in error
    allowing = replace(CONTRACT, allow_nonfinite=("value",))
    assert row_problems(_set(t, "value", [math.nan] * 6, pa.float32()), allowing) == ("", "")
    assert row_problems(t, replace(CONTRACT, max_rows=5))[0] == "too_large"


# ------------------------------------------------------------------------------------------ unit: contracts


def _contract_copy(tmp_path: Path, text: str) -> Path:
    d = tmp_path / "contracts"
    d.mkdir(exist_ok=True)
    (d / CONTRACT_FILE.name).write_text(text)
    return d


@pytest.mark.parametrize(("edit", "field_"), [
    (lambda s: s.replace("kind: landsat_patch", "kind: [landsat_patch"), "landsat_patch.v1.yaml"),
    (lambda s: s.replace("max_rows: 250000", "max_rows: -1"), "limits.max_rows"),
    (lambda s: s.replace("max_rows: 250000", "max_rowz: 250000"), "max_rowz"),
    (lambda s: s.replace("  dtype: uint8", "  dtype: uint7"), "landsat_patch.v1.yaml"),
    (lambda s: s.replace("label:\n  column: label", "label:\n  kolumn: label"), "column"),
])
def test_a_broken_contract_file_is_contract_invalid_naming_file_and_field(tmp_path: Path, edit: Any, field_: str) -> None:
    d = _contract_copy(tmp_path, edit(CONTRACT_FILE.read_text()))
    with pytest.raises(ContractInvalid, match=field_) as e:
        load_contract(KIND, 1, d)
    assert str(d / CONTRACT_FILE.name) in str(e.value)


def test_an_unknown_expectation_is_contract_invalid_naming_it(tmp_path: Path) -> None:
    d = _contract_copy(tmp_path, CONTRACT_FILE.read_text().replace("expect_column_values_to_be_unique",
                                                                  "expect_column_values_to_be_purple"))
    c = load_contract(KIND, 1, d)
    with pytest.raises(ContractInvalid, match=r"expectations\[0\] \(expect_column_values_to_be_purple\)"):
        suite_for(c)


# ------------------------------------------------------------------------------------------ unit: duplicates


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(0, 30), min_size=1, max_size=12, unique=True), min_size=1, max_size=4),
       st.sets(st.integers(0, 30), max_size=10))
def test_property_duplicate_split_accounts_for_every_sample_id(bundles: list[list[int]], held: set[int]) -> None:
    base = _table(31, start=0)
    todo = []
    for i, seqs in enumerate(bundles):
        t = base.take(pa.array(seqs))
        m = BundleManifest(bundle_id=f"b{i:02d}", node_id="node-a", contract=CONTRACT.id, tier="normal",
                           row_count=t.num_rows, sample_ids=t.column("sample_id").to_pylist(), sha256="", nbytes=0,
                           min_capture_time="", max_capture_time="", value_sum=0.0, max_value=0.0)
        todo.append(ValidatedBundle(m, t, None))  # type: ignore[arg-type]
    held_ids = {f"node-a-{s:012d}": "old" for s in held}
    data, kept, dups = datasets._without_duplicates(CONTRACT, todo, {("node-a", s) for s in held_ids})
    rows = data.column("sample_id").to_pylist()
    assert len(rows) == len(set(rows)) and not set(rows) & set(held_ids)
    for vb in todo:
        b, ref = vb.manifest.bundle_id, datasets.bundle_ref(vb.manifest)
        mine = data.filter(pc.equal(data.column(BUNDLE_ID_COLUMN), b)).column("sample_id").to_pylist()
        assert len(mine) == kept[ref]
        assert sorted(mine + dups.get(ref, [])) == sorted(vb.manifest.sample_ids)  # nothing lost, nothing twice
    assert set(rows) | set(held_ids) == {i for vb in todo for i in vb.manifest.sample_ids} | set(held_ids)


# ------------------------------------------------------------------------------------------ the real stack

@pytest.mark.integration
def test_a_dotdot_manifest_is_quarantined_and_fails_no_other_bundle(stack: localstack.StackState, ingest_block: str) -> None:
    """main: the store answered 400, the run failed, every later discover run failed on it and node-b's
    valid bundle stayed uncommitted; the error did not name the bundle."""
    node_a, node_b = store_for(stack, "node-a"), store_for(stack, "node-b")
    d_bad, m_bad = bundle(12, "node-a", start_seq=_seq())
    bad_key = _land(node_a, d_bad, m_bad, manifest=replace(m_bad, bundle_id="../../_claims/x", node_id="..").to_json())
    d_bad2, m_bad2 = bundle(7, "node-a", start_seq=_seq())
    bad2_key = _land(node_a, d_bad2, m_bad2, manifest=replace(m_bad2, bundle_id="a/../../b").to_json())
    d_ok, m_ok = bundle(20, "node-b", start_seq=_seq())
    _land(node_b, d_ok, m_ok)

    summary, state = _run(store_block=ingest_block)
    assert state.is_completed(), state.message
    reasons = {q["bundle_id"]: q for q in summary["quarantined"]}
    assert reasons[m_bad.bundle_id]["reason"] == "bad_id" and reasons[m_bad2.bundle_id]["reason"] == "bad_id"
    rec = read_record(store_for(stack, "ingest"), "node-a", m_bad.bundle_id)  # quarantined under the key's ids
    assert m_bad.bundle_id in rec.error and "'..'" in rec.error
    assert sorted(rec.sample_ids) == sorted(m_bad.sample_ids)  # accounted for from the file itself
    assert m_ok.bundle_id in summary["commits"][0]["bundles"]
    assert set(m_ok.sample_ids) <= set(_dataset_ids(stack))
    ingest_store = store_for(stack, "ingest")
    # landing is write-once: quarantine copied them out and left them where they landed
    assert _exists(ingest_store, "landing", bad_key) and _exists(ingest_store, "landing", bad2_key)

    again, state2 = _run(store_block=ingest_block)  # the next discover run is clean
    assert state2.is_completed() and not again["errors"]
    assert not {m_bad.bundle_id, m_bad2.bundle_id, m_ok.bundle_id} & {q["bundle_id"] for q in again["quarantined"]}
    assert {ingest_store.key("landing", k) for k in (bad_key, bad2_key)} <= set(again["already_quarantined"])


@pytest.mark.integration
def test_a_hook_key_outside_a_node_prefix_is_skipped_by_name(stack: localstack.StackState, ingest_block: str) -> None:
    d, m = bundle(5, "node-b", start_seq=_seq())
    _land(store_for(stack, "node-b"), d, m)
    hook = f"node-a/../node-b/{m.min_capture_time[:10]}/{m.bundle_id}.parquet"
    summary, state = _run(store_block=ingest_block, bundle_keys=[hook])
    assert state.is_completed() and summary["valid"] == 0 and not summary["quarantined"]
    assert "node-a/../node-b" in next(iter(summary["skipped"].values()))
    assert _exists(store_for(stack, "ingest"), "landing", f"node-b/{m.min_capture_time[:10]}/{m.bundle_id}.parquet")


@pytest.mark.integration
def test_a_node_cannot_land_a_bundle_for_another_node(stack: localstack.StackState, ingest_block: str) -> None:
    """main: node-a's upload whose rows and manifest say node-b was committed, credited to node-b."""
    node_a = store_for(stack, "node-a")
    d1, m1 = write_bundle(_table(15, "node-b"), CONTRACT, tier="normal")  # rows and manifest say node-b
    k1 = _land(node_a, d1, m1, node="node-a")
    d2, m2 = write_bundle(_table(15, "node-b"), CONTRACT, tier="normal")  # rows node-b, manifest node-a
    k2 = _land(node_a, d2, replace(m2, node_id="node-a"), node="node-a")
    summary, state = _run(store_block=ingest_block, bundle_keys=[k1, k2])
    assert state.is_completed() and summary["valid"] == 0
    assert {q["bundle_id"]: q["reason"] for q in summary["quarantined"]} == {m1.bundle_id: "wrong_node",
                                                                            m2.bundle_id: "wrong_node"}
    ingest_store = store_for(stack, "ingest")
    r1 = read_record(ingest_store, "node-a", m1.bundle_id)
    assert "landed under node-a/" in r1.error and "node-b" in r1.error
    assert "rows name nodes ['node-b']" in read_record(ingest_store, "node-a", m2.bundle_id).error
    # nothing was filed under the node the bundle claimed
    assert not _exists(ingest_store, "quarantine", f"node-b/{m1.bundle_id}/{quarantine.RECORD_NAME}")


@pytest.mark.integration
def test_size_limits_are_checked_before_downloading(stack: localstack.StackState, ingest_block: str) -> None:
    """main: a 180 MB manifest on a 45 kB bundle took core_ingest 2 minutes and 2 GB (here: just over the
    contract's 16 MiB limit, and a manifest claiming a bundle over the byte limit)."""
    node_a = store_for(stack, "node-a")
    d, m = bundle(10, "node-a", start_seq=_seq())
    doc = json.loads(m.to_json())
    doc["scorer_version"] = "x" * CONTRACT.max_manifest_bytes  # valid JSON, just too large
    big_key = _land(node_a, d, m, manifest=json.dumps(doc).encode())
    d2, m2 = bundle(10, "node-a", start_seq=_seq())
    claim_key = _land(node_a, d2, replace(m2, nbytes=CONTRACT.max_bundle_bytes + 1))

    ingest_store = store_for(stack, "ingest")
    t0 = time.perf_counter()
    scan = ingest.read_manifests(ingest_store, [ingest_store.key("landing", k) for k in (big_key, claim_key)])
    took = time.perf_counter() - t0
    print(f"read_manifests of a {len(json.dumps(doc)) / 2**20:.1f} MiB manifest: {took:.2f} s")
    assert {r for r, _ in scan.rejected.values()} == {"too_large"} and len(scan.rejected) == 2 and took < 10
    # a ranged read: at most limit + 1 bytes come down, however large the object
    with pytest.raises(landed.TooLarge):
        landed.read_limited(ingest_store.client(), ingest_store.bucket("landing"),
                            ingest_store.key("landing", big_key), 1000)

    summary, state = _run(store_block=ingest_block, bundle_keys=[big_key, claim_key])
    assert state.is_completed()
    q = {x["bundle_id"]: x for x in summary["quarantined"]}
    assert q[m.bundle_id]["reason"] == "too_large" and q[m2.bundle_id]["reason"] == "too_large"
    assert q[m.bundle_id]["samples"] == 10  # ids from the (small) bundle itself


@pytest.mark.integration
def test_validation_refuses_rows_that_break_training(stack: localstack.StackState, ingest_block: str) -> None:
    """main: 7-byte and 40 MiB pixels, NaN in value and a feature column, inf in a std column: committed."""
    node_a = store_for(stack, "node-a")
    bad: dict[str, tuple[str, str]] = {}
    for name, col, v, reason in (("px7", "pixels", b"1234567", "tensor_length"),
                                 ("px40m", "pixels", bytes(40 * 2**20), "too_large"),  # refused from its page headers
                                 ("nan-value", "value", math.nan, "non_finite"),
                                 ("nan-feature", "mean_b2_green", math.nan, "non_finite"),
                                 ("inf-std", "std_b5_swir1", math.inf, "non_finite")):
        t = _table(8)
        vals = t.column(col).to_pylist()
        t = _set(t, col, [*vals[:3], v, *vals[4:]], t.schema.field(col).type)
        d, m = write_bundle(t, CONTRACT, tier="normal")
        bad[m.bundle_id] = (_land(node_a, d, m), reason)
        assert name
    d_ok, m_ok = bundle(16, "node-a", start_seq=_seq())
    ok_key = _land(node_a, d_ok, m_ok)
    summary, state = _run(store_block=ingest_block, bundle_keys=[*(k for k, _ in bad.values()), ok_key])
    assert state.is_completed()
    assert {q["bundle_id"]: q["reason"] for q in summary["quarantined"]} == {b: r for b, (_, r) in bad.items()}
    assert summary["commits"][0]["bundles"] == [m_ok.bundle_id]
    rec = read_record(store_for(stack, "ingest"), "node-a", next(b for b, (_, r) in bad.items() if r == "non_finite"))
    assert "e.g. samples" in rec.error


@pytest.mark.integration
def test_a_resent_sample_id_is_a_recorded_duplicate_not_a_second_row(stack: localstack.StackState,
                                                                    ingest_block: str) -> None:
    """main: the same 30 sample ids in two bundles were two rows each in the latest version."""
    node_a = store_for(stack, "node-a")
    start = _seq()
    d1, m1 = write_bundle(_table(30, start=start), CONTRACT, tier="normal")
    first, _ = _run(store_block=ingest_block, bundle_keys=[_land(node_a, d1, m1)])
    assert first["commits"][0]["bundles"] == [m1.bundle_id]
    # the same 30 ids (other content: another bundle id) plus 10 new ones
    d2, m2 = write_bundle(_table(40, start=start), CONTRACT, tier="normal")
    assert m2.bundle_id != m1.bundle_id
    summary, state = _run(store_block=ingest_block, bundle_keys=[_land(node_a, d2, m2)])
    assert state.is_completed()
    c = summary["commits"][0]
    assert c["bundles"] == [m2.bundle_id] and c["rows"] == 10
    assert sorted(c["duplicates"][f"node-a/{m2.bundle_id}"]) == sorted(m1.sample_ids)
    pairs = _dataset_pairs(stack)
    assert len(pairs) == len(set(pairs)) and {("node-a", s) for s in m2.sample_ids} <= set(pairs)
    ingest_store = store_for(stack, "ingest")
    key = quarantine.duplicates_key(ingest_store, KIND, "node-a", m2.bundle_id)
    rec = json.loads(ingest_store.client().get_object(Bucket=ingest_store.bucket("quarantine"), Key=key)["Body"].read())
    assert sorted(rec["sample_ids"]) == sorted(m1.sample_ids) and rec["kept_rows"] == 10


@pytest.mark.integration
def test_concurrent_commits_keep_sample_ids_unique(stack: localstack.StackState,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """Three committers, each with its own open table (three identities, one table), commit overlapping
    bundles at once: every commit re-checks its ids when it loses the race for a version."""
    prefix = f"t-{uuid.uuid4().hex[:10]}"
    stores = [store_for(stack, role, prefix) for role in ("admin", "ingest", "lifecycle")]
    datasets.ensure_table(stores[0], CONTRACT)
    caplog.set_level("INFO", logger="edgehaul.core.datasets")
    all_bundles: list[ValidatedBundle] = []
    results: list[datasets.CommitResult] = []
    for _ in range(3):
        start = _seq()
        vbs = []
        for i in range(3):  # ids start+10i .. start+10i+29: each overlaps the next by 20
            d, m = write_bundle(_table(30, start=start + 10 * i), CONTRACT, tier="normal")
            table, res = validate_bundle(d, m)
            assert res.success and table is not None
            vbs.append(ValidatedBundle(m, table, res))
        all_bundles += vbs
        barrier = threading.Barrier(3)
        out: list[Any] = [None] * 3

        def commit(i: int, vbs: list[ValidatedBundle] = vbs, barrier: threading.Barrier = barrier,
                   out: list[Any] = out) -> None:
            barrier.wait()
            out[i] = commit_bundles(stores[i], CONTRACT, [vbs[i]], run_id=f"r{i}")

        threads = [threading.Thread(target=commit, args=(i,)) for i in range(3)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        results += out
    data = read_version(stores[0], KIND, columns=["sample_id", BUNDLE_ID_COLUMN])
    ids = data.column("sample_id").to_pylist()
    assert len(ids) == len(set(ids))  # unique across the whole dataset
    dups = {b: v for r in results for b, v in r.duplicates.items()}
    for vb in all_bundles:  # every sample id of every bundle: a row of its own, or named as a duplicate
        b = vb.manifest.bundle_id
        mine = data.filter(pc.equal(data.column(BUNDLE_ID_COLUMN), b)).column("sample_id").to_pylist()
        assert sorted(mine + dups.get(f"{vb.manifest.node_id}/{b}", [])) == sorted(vb.manifest.sample_ids)
    assert len(ids) == 3 * 50
    races = sum("lost the race" in r.getMessage() for r in caplog.records)
    print(f"concurrent commits: {sum(len(v) for v in dups.values())} duplicate ids dropped, {races} lost races "
          f"re-checked, versions {sorted(r.version for r in results if r.version is not None)}")


@pytest.mark.integration
def test_a_bundle_without_its_manifest_waits_then_is_quarantined_when_old(stack: localstack.StackState,
                                                                         ingest_block: str) -> None:
    """main: a hook for a Parquet object whose manifest was not written yet quarantined it and deleted it
    from landing; the manifest written next was orphaned."""
    node_a, ingest_store = store_for(stack, "node-a"), store_for(stack, "ingest")
    d, m = bundle(9, "node-a", start_seq=_seq())
    key = _land(node_a, d, m, with_manifest=False)  # the hook came before the manifest
    summary, state = _run(store_block=ingest_block, bundle_keys=[key])
    assert state.is_completed() and summary["waiting"] == [ingest_store.key("landing", key)]
    assert not summary["quarantined"] and _exists(ingest_store, "landing", key)
    _land(node_a, d, m)  # the manifest arrives
    summary, _ = _run(store_block=ingest_block, bundle_keys=[key])
    assert summary["commits"][0]["bundles"] == [m.bundle_id]

    d2, m2 = bundle(6, "node-a", start_seq=_seq())
    key2 = _land(node_a, d2, m2, with_manifest=False)  # an orphan, past the (here: zero) wait limit
    summary, _ = _run(store_block=ingest_block, bundle_keys=[key2], manifest_wait_s=0)
    assert [(q["bundle_id"], q["reason"], q["samples"]) for q in summary["quarantined"]] == [
        (m2.bundle_id, "manifest_missing", 6)]


@pytest.mark.integration
@pytest.mark.parametrize(("edit", "named"), [
    (lambda s: s.replace("kind: landsat_patch", "kind: [landsat_patch"), "landsat_patch.v1.yaml"),
    (lambda s: s.replace("expect_column_values_to_be_unique", "expect_column_values_to_be_purple"),
     "expectations[0] (expect_column_values_to_be_purple)"),
])
def test_a_broken_contract_fails_the_run_and_moves_nothing(stack: localstack.StackState, ingest_block: str,
                                                          tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          edit: Any, named: str) -> None:
    """main: a YAML error or an unknown expectation quarantined every good bundle; the run was Completed."""
    node_a, ingest_store = store_for(stack, "node-a"), store_for(stack, "ingest")
    d, m = bundle(11, "node-a", start_seq=_seq())
    key = _land(node_a, d, m)
    d_dir = tmp_path / "contracts"
    shutil.copytree(CONTRACT_FILE.parent, d_dir)
    (d_dir / CONTRACT_FILE.name).write_text(edit(CONTRACT_FILE.read_text()))
    with monkeypatch.context() as mp:
        mp.setenv("EDGEHAUL_CONTRACTS_DIR", str(d_dir))
        summary, state = _run(store_block=ingest_block, bundle_keys=[key])
    assert state.is_failed() and named in str(summary) and str(d_dir) in str(summary)
    assert _exists(ingest_store, "landing", key) and _exists(ingest_store, "landing", quarantine.manifest_key_for(key))
    assert not _exists(ingest_store, "quarantine", f"node-a/{m.bundle_id}/{quarantine.RECORD_NAME}")
    summary, state = _run(store_block=ingest_block, bundle_keys=[key])  # contract fixed: it commits
    assert state.is_completed() and summary["commits"][0]["bundles"] == [m.bundle_id]



@pytest.mark.integration
def test_a_manifest_rewritten_after_validation_is_not_committed(stack: localstack.StackState) -> None:
    """Same bytes, manifest now naming node-b between validation and commit: the commit leaves it in landing."""
    node_a, ingest_store = store_for(stack, "node-a"), store_for(stack, "ingest")
    d, m = bundle(8, "node-a", start_seq=_seq())
    key = ingest_store.key("landing", _land(node_a, d, m))
    result = ingest.validate_landed_many(ingest_store, list(ingest.read_manifests(ingest_store, [key]).manifests.items())
                                         ).passed[key]
    _land(node_a, d, m, node="node-a", manifest=replace(m, node_id="node-b").to_json())
    c = ingest.commit_validated(ingest_store, CONTRACT.id, [(key, result)], "run-rewrite", 60)
    assert c.version is None and not c.bundles and m.bundle_id not in c.already_committed
    assert _exists(ingest_store, "landing", key)


@pytest.mark.integration
def test_a_landed_bundle_rewritten_by_its_node_is_never_taken_twice(stack: localstack.StackState,
                                                                    ingest_block: str) -> None:
    """Landing is write-once, even where the store cannot refuse a rewrite (SeaweedFS 4.48 lets a node PUT over its
    own landed object): main raised DatasetError at commit, failing every bundle of the contract with it (here node-b's),
    and its quarantine deleted landing objects, which the ingest identity may no longer do."""
    node_a, node_b, ingest_store = store_for(stack, "node-a"), store_for(stack, "node-b"), store_for(stack, "ingest")
    d, m = bundle(8, "node-a", start_seq=_seq())
    key = ingest_store.key("landing", _land(node_a, d, m))
    d_b, m_b = bundle(5, "node-b", start_seq=_seq())
    key_b = ingest_store.key("landing", _land(node_b, d_b, m_b))
    scan = ingest.read_manifests(ingest_store, [key, key_b])
    passed = ingest.validate_landed_many(ingest_store, [(k, scan.manifests[k]) for k in (key, key_b)]).passed
    validated = [(k, passed[k]) for k in (key, key_b)]
    other, _ = bundle(8, "node-a", start_seq=_seq())
    s3a = node_a.client()
    s3a.put_object(Bucket=node_a.bucket("landing"), Key=key, Body=other)  # rewritten after validation

    c = ingest.commit_validated(ingest_store, CONTRACT.id, validated, "run-rewrite-data", 60)
    assert c.bundles == [m_b.bundle_id]  # node-b's bundle commits; node-a's changed one does not
    assert not set(m.sample_ids) & set(_dataset_ids(stack)) and set(m_b.sample_ids) <= set(_dataset_ids(stack))

    # the next run validates what is there now: the bytes do not match the manifest -> quarantined, accounted
    first, state = _run(store_block=ingest_block, bundle_keys=[key])
    assert state.is_completed(), state.message
    assert [(q["bundle_id"], q["reason"], q["samples"]) for q in first["quarantined"]] == [(m.bundle_id, "checksum", 8)]
    rec = read_record(ingest_store, "node-a", m.bundle_id)
    assert set(rec.landing_etags) == {f"{m.bundle_id}.parquet", f"{m.bundle_id}.manifest.json"}
    assert _exists(ingest_store, "landing", key.removeprefix(ingest_store.key("landing", "")))  # landing untouched

    second, _ = _run(store_block=ingest_block, bundle_keys=[key])  # done: not quarantined or validated again
    assert second["already_quarantined"] == [key] and not second["quarantined"] and second["valid"] == 0

    s3a.put_object(Bucket=node_a.bucket("landing"), Key=key, Body=d)  # the node puts the original bytes back
    third, _ = _run(store_block=ingest_block, bundle_keys=[key])
    assert "landing_changed" in third["skipped"][key] and m.bundle_id in third["skipped"][key]
    assert not third["quarantined"] and third["valid"] == 0 and not third["commits"]
    ids = _dataset_ids(stack)
    assert not set(m.sample_ids) & set(ids) and sorted(i for i in ids if i in set(m_b.sample_ids)) == sorted(m_b.sample_ids)
