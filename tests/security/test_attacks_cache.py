"""No shared writable state across the edge/core boundary, attacked on the real stack.

On main at 8a307c0 each of these fails: every node held the shared `results` identity, which could write
the ops bucket's `prefect-results/` where core_ingest read cloudpickle records (a forged record ran code
in the core and committed a bad bundle as "Cached"); core_ingest and compact_dataset re-saved the shared
`edgehaul-ops-results` block with their own keys on every run; records were pickle.
"""

from __future__ import annotations

import json
import pickle
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from botocore.exceptions import ClientError
from hypothesis import given, settings
from hypothesis import strategies as st
from prefect._internal.result_records import ResultRecord, ResultRecordMetadata
from prefect.serializers import JSONSerializer, PickleSerializer

from edgehaul.blocks import ObjectStore
from edgehaul.bundles import BundleManifest, write_bundle
from edgehaul.contracts import load_contract
from edgehaul.core.validation import ExpectationRow, ValidationResult
from edgehaul.core.validation_cache import landed_etag, validation_key
from edgehaul.flows.compact_dataset import CompactDatasetParams, compact_dataset
from edgehaul.flows.core_ingest import CoreIngestParams, core_ingest
from edgehaul.flows.edge_ingest import EdgeIngestParams, edge_ingest
from edgehaul.platform.caching import CORE_RESULTS_FOLDER, EDGE_RESULTS_DIR, core_result_storage_block
from edgehaul_dev import localstack
from tests.builders import bundle, land, processed_rows
from tests.conftest import api_auth, store_for

CONTRACT = load_contract("landsat_patch")


def _nodes(stack: localstack.StackState) -> list[str]:
    return sorted(n for n in stack.identities if n not in localstack.ROLES)


def _denied(call: Any, **kw: Any) -> None:
    with pytest.raises(ClientError) as e:
        call(**kw)
    assert e.value.response["Error"]["Code"] in ("AccessDenied", "403"), e.value.response["Error"]


class _Marker:
    """Unpickling this creates a file: the stand-in for attacker code."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.path), "w"))


def _forged_record(marker: Path, key: str) -> bytes:
    """A Prefect result record as a node would forge it: pickle that runs code when the core reads it."""
    meta = ResultRecordMetadata(storage_key=key, serializer=PickleSerializer(picklelib="pickle"), expiration=None)
    return ResultRecord(metadata=meta, result=_Marker(marker)).serialize()


def _scaled_bundle(node: str, seed: int) -> tuple[bytes, BundleManifest]:
    """A bundle validation rejects (features at x255), which a forged 'success' would let through."""
    t = processed_rows(25, node, seed=seed, start_seq=7000)
    for name in CONTRACT.feature_columns:
        t = t.set_column(t.schema.get_field_index(name), name, pc.multiply(t.column(name), pa.scalar(255.0, pa.float32())))
    return write_bundle(t, CONTRACT, tier="normal")


def _hold_claim(store: ObjectStore, node_id: str, bundle_id: str) -> None:
    """Another live run's claim on a bundle: core_ingest validates it and defers its commit, so the bundle
    stays uncommitted and the next run validates it again (a committed bundle is never validated again)."""
    store.client().put_object(Bucket=store.bucket("curated"),
                              Key=store.key("curated", f"_claims/{CONTRACT.kind}/{node_id}/{bundle_id}.json"),
                              Body=json.dumps({"run": "another-live-run", "at": time.time()}).encode())


def _central(stack: localstack.StackState, tag: str) -> tuple[ObjectStore, str, str]:
    """The ingest identity under a fresh prefix, its block, and the central results block as
    `edgehaul blocks apply` saves it (deploy time, not a flow)."""
    ingest = store_for(stack, "ingest", prefix=f"t-{tag}")
    ingest.save(f"ingest-{tag}", overwrite=True)
    core_result_storage_block(ingest).save(f"core-results-{tag}", overwrite=True)
    return ingest, f"ingest-{tag}", f"s3-bucket/core-results-{tag}"


def _block_documents(api: str) -> dict[str, tuple[Any, ...]]:
    """Every block document on the server (named and anonymous): id -> (name, updated, data)."""
    out: dict[str, tuple[Any, ...]] = {}
    for anonymous in (False, True):
        offset = 0
        while True:
            r = httpx.post(f"{api}/block_documents/filter", timeout=30, auth=api_auth(), json={
                "block_documents": {"is_anonymous": {"eq_": anonymous}}, "offset": offset, "limit": 200})
            r.raise_for_status()
            page = r.json()
            out.update({d["id"]: (d["name"], d["updated"], json.dumps(d["data"], sort_keys=True)) for d in page})
            if len(page) < 200:
                break
            offset += 200
    return out


# ---- the boundary in the store ------------------------------------------------------------------

@pytest.mark.integration
def test_no_edge_identity_can_write_or_read_central_results(stack: localstack.StackState) -> None:
    tag = uuid.uuid4().hex[:8]
    assert "results" not in stack.identities  # no identity shared by the nodes any more
    ops = "edgehaul-ops"
    central_key = f"{CORE_RESULTS_FOLDER}/{tag}-probe"
    store_for(stack, "ingest").client().put_object(Bucket=ops, Key=central_key, Body=b"{}")  # the writer it has
    for node in _nodes(stack):
        s3 = store_for(stack, node).client()
        for key in (f"{CORE_RESULTS_FOLDER}/{tag}-{node}", f"prefect-results/{tag}-{node}", central_key):
            _denied(s3.put_object, Bucket=ops, Key=key, Body=b"forged")
        _denied(s3.get_object, Bucket=ops, Key=central_key)
        _denied(s3.delete_object, Bucket=ops, Key=central_key)
    assert store_for(stack).client().get_object(Bucket=ops, Key=central_key)["Body"].read() == b"{}"


def test_a_node_writes_nothing_in_the_ops_bucket_and_reads_only_its_downlink() -> None:
    cfg = localstack.identities_config(
        {r: localstack.Credentials("k", "s") for r in [*localstack.ROLES, "node-a", "node-b"]}, ["node-a", "node-b"])
    grants = {i["name"]: i["actions"] for i in cfg["identities"]}  # type: ignore[index]
    assert set(grants) == {*localstack.ROLES, "node-a", "node-b"}
    for node in ("node-a", "node-b"):
        assert grants[node]
        for a in grants[node]:
            verb, target = a.split(":", 1)
            assert target.startswith(f"edgehaul-landing/{node}/") or (
                verb in ("Read", "List") and target == f"edgehaul-ops/downlink/{node}/*"), (node, a)
    iam = Path(__file__).resolve().parents[2] / "infra" / "iam"
    assert not (iam / "results.json").exists()
    for stmt in json.loads((iam / "edge-node.json").read_text())["Statement"]:
        if "edgehaul-ops" in json.dumps(stmt):
            assert stmt["Effect"] == "Allow" and set(stmt["Action"]) <= {"s3:GetObject", "s3:ListBucket"}, stmt
            assert "downlink/${aws:username}/" in json.dumps(stmt), stmt


# ---- a forged record changes nothing --------------------------------------------------------------

@pytest.mark.integration
def test_forged_cache_record_runs_no_code_and_the_bundle_is_validated_for_real(
    stack: localstack.StackState, tmp_path: Path
) -> None:
    tag = uuid.uuid4().hex[:8]
    node = _nodes(stack)[0]
    ingest, block, results = _central(stack, tag)
    admin = store_for(stack, prefix=f"t-{tag}")
    data, m = _scaled_bundle(node, seed=31)
    key = land(admin, data, m)  # the node's upload (under the test's prefix, so the admin puts it)

    # The attacker computes the entry core_ingest will look up (public inputs + the ETag it can HEAD too).
    entry = validation_key(m.sha256, f"edgehaul-landing/{key}", landed_etag(ingest, key), CONTRACT.sha256)
    marker = tmp_path / "attacker-code-ran"
    forged = _forged_record(marker, entry)
    ResultRecord.deserialize(forged)  # live ammunition: reading this record runs the code
    assert marker.exists()
    marker.unlink()

    # ... and writes it wherever a node identity can: the central folder (denied) or its own landing prefix.
    s3 = store_for(stack, node).client()
    central = f"{ingest.key('ops', CORE_RESULTS_FOLDER)}/{entry}"
    _denied(s3.put_object, Bucket="edgehaul-ops", Key=central, Body=forged)
    _denied(s3.put_object, Bucket="edgehaul-ops", Key=f"prefect-results/{entry}", Body=forged)
    for k in (f"{node}/{entry}", f"{node}/prefect-results/{entry}", f"{node}/{CORE_RESULTS_FOLDER}/{entry}"):
        s3.put_object(Bucket="edgehaul-landing", Key=k, Body=forged)

    state = core_ingest(CoreIngestParams(store_block=block, bundle_keys=[key], result_storage=results),
                        return_state=True)
    summary = state.result()
    assert not marker.exists()
    assert summary["valid"] == 0 and [q["bundle_id"] for q in summary["quarantined"]] == [m.bundle_id]
    assert summary["quarantined"][0]["reason"] == "expectations" and summary["versions"] == {}
    curated = admin.client().list_objects_v2(Bucket="edgehaul-curated", Prefix=admin.key("curated", ""))
    assert curated.get("KeyCount", 0) == 0  # nothing committed: no dataset under this prefix at all
    # the rejection was not cached: no record under the entry the attacker aimed at
    with pytest.raises(ClientError):
        ingest.client().head_object(Bucket="edgehaul-ops", Key=central)


@pytest.mark.integration
def test_a_cached_validation_is_bound_to_the_landed_bytes_not_to_the_manifest(stack: localstack.StackState) -> None:
    """Bytes swapped under an unchanged manifest miss the cache and are validated again (on main the entry
    was keyed on the manifest's checksum alone: the swap was served 'Cached' and failed the run at commit)."""
    tag = uuid.uuid4().hex[:8]
    _, block, results = _central(stack, tag)
    admin = store_for(stack, prefix=f"t-{tag}")
    data, m = bundle(30, _nodes(stack)[0], seed=21)
    key = land(admin, data, m)
    _hold_claim(admin, m.node_id, m.bundle_id)  # validated (and cached), not committed: the next run validates it again
    first = core_ingest(CoreIngestParams(store_block=block, bundle_keys=[key], result_storage=results))
    assert first["valid"] == 1 and first["deferred"] == [m.bundle_id]
    swapped = data[:100] + bytes(b ^ 0xFF for b in data[100:200]) + data[200:]
    admin.client().put_object(Bucket="edgehaul-landing", Key=key, Body=swapped)  # same size, same manifest
    state = core_ingest(CoreIngestParams(store_block=block, bundle_keys=[key], result_storage=results),
                        return_state=True)
    assert state.is_completed()
    second = state.result()
    assert second["valid"] == 0 and [(q["bundle_id"], q["reason"]) for q in second["quarantined"]] == \
        [(m.bundle_id, "checksum")]


# ---- flows save no block; records are JSON -------------------------------------------------------

@pytest.mark.integration
def test_flows_save_no_block_and_cached_results_are_json(stack: localstack.StackState, tmp_path: Path) -> None:
    tag = uuid.uuid4().hex[:8]
    ingest, block, results = _central(stack, tag)
    admin = store_for(stack, prefix=f"t-{tag}")
    node = _nodes(stack)[0]
    good = [bundle(30, node, seed=41), bundle(20, node, seed=42, start_seq=100)]
    keys = [land(admin, d, m) for d, m in good]
    before = _block_documents(stack.prefect_api_url)

    summary = core_ingest(CoreIngestParams(store_block=block, bundle_keys=keys, result_storage=results))
    assert summary["valid"] == 2 and summary["versions"] == {CONTRACT.kind: 1}
    d, m = bundle(10, node, seed=43, start_seq=200)
    core_ingest(CoreIngestParams(store_block=block, bundle_keys=[land(admin, d, m)], result_storage=results))
    compacted = compact_dataset(CompactDatasetParams(store_block=block, kind=CONTRACT.kind, result_storage=results))
    assert compacted["files_removed"] >= 2
    # and with no result storage named (on main this path saved the shared results block with ingest's keys)
    core_ingest(CoreIngestParams(store_block=block, bundle_keys=keys[:1]))
    compact_dataset(CompactDatasetParams(store_block=block, kind=CONTRACT.kind))
    spool = tmp_path / "spool"
    edge_ingest(EdgeIngestParams(edge_node=None, node_id=f"node-x{tag}", spool_dir=str(spool), n_samples=300,
                                 batch_size=300))
    assert _block_documents(stack.prefect_api_url) == before  # not one block saved, updated or created

    # central records: JSON with the json serializer, holding the ValidationResult / compaction dict as data
    s3 = ingest.client()
    folder = ingest.key("ops", CORE_RESULTS_FOLDER)
    objs = [o["Key"] for p in s3.get_paginator("list_objects_v2").paginate(Bucket="edgehaul-ops", Prefix=folder + "/")
            for o in p.get("Contents", [])]
    assert len(objs) == 4  # 3 validations + 1 compaction
    seen: list[Any] = []
    for k in objs:
        rec = json.loads(s3.get_object(Bucket="edgehaul-ops", Key=k)["Body"].read())
        assert rec["metadata"]["serializer"]["type"] == "json"
        seen.append(JSONSerializer().loads(rec["result"].encode()))
    validated = [r for r in seen if isinstance(r, ValidationResult)]
    assert sorted(r.bundle_id for r in validated) == sorted([*(g[1].bundle_id for g in good), m.bundle_id])
    assert all(r.success and r.expectations for r in validated)
    assert [r["version"] for r in seen if isinstance(r, dict)] == [compacted["version"]]
    # the edge's record lives on the node's disk, also JSON
    edge_records = [p for p in (spool / EDGE_RESULTS_DIR).rglob("*") if p.is_file()]
    assert len(edge_records) == 1
    assert json.loads(edge_records[0].read_bytes())["metadata"]["serializer"]["type"] == "json"

    # a rerun over committed bundles validates nothing; a deferred bundle's rerun is served from its JSON record
    again = core_ingest(CoreIngestParams(store_block=block, bundle_keys=keys, result_storage=results))
    assert again["already_committed"] == sorted(g[1].bundle_id for g in good) and again["valid"] == 0
    d, late = bundle(10, node, seed=44, start_seq=300)
    late_key = land(admin, d, late)
    _hold_claim(admin, late.node_id, late.bundle_id)
    for _ in range(2):
        rerun = core_ingest(CoreIngestParams(store_block=block, bundle_keys=[late_key], result_storage=results))
        assert rerun["valid"] == 1 and rerun["deferred"] == [late.bundle_id]
    assert len([o for p in s3.get_paginator("list_objects_v2").paginate(Bucket="edgehaul-ops", Prefix=folder + "/")
                for o in p.get("Contents", [])]) == 5  # one record more, not two: the second run read it


# ---- the cached values round-trip as data --------------------------------------------------------

_text = st.text(max_size=20)
_rows = st.builds(ExpectationRow, expectation=_text, column=st.none() | _text, success=st.booleans(),
                  observed_value=st.none() | _text | st.floats(allow_nan=False), unexpected_count=st.none() | st.integers(),
                  details=_text)


@settings(max_examples=200, deadline=None)
@given(st.builds(ValidationResult, bundle_id=_text, node_id=_text, contract=_text, contract_sha256=_text,
                 bundle_sha256=_text, rows=st.integers(min_value=0), success=st.booleans(), reason=_text, error=_text,
                 expectations=st.lists(_rows, max_size=4).map(tuple)))
def test_validation_results_round_trip_through_the_json_serializer(v: ValidationResult) -> None:
    s = JSONSerializer()
    blob = s.dumps(v)
    assert json.loads(blob)["__class__"] == "edgehaul.core.validation.ValidationResult"  # JSON, not pickle
    assert s.loads(blob) == v
    assert pickle.loads(pickle.dumps(v)) == v  # (the dataclass itself stays picklable for in-process futures)



# ---- the result storage is pinned, not whatever a block says ---------------------------------------

@pytest.mark.integration
def test_a_results_block_repointed_into_a_landing_prefix_is_refused_and_the_bundle_validated(
    stack: localstack.StackState,
) -> None:
    """An API-string holder re-points the central results block into a node's landing prefix and writes a
    JSON 'success' for its bad bundle there (on main: committed, 12 of 12 NaN rows). The core pins its
    storage (EDGEHAUL_CORE_RESULTS_URI, default its own ops folder): the block is refused, the bundle validated."""
    from edgehaul.core.validation_cache import ValidationCache, refusal

    tag = uuid.uuid4().hex[:8]
    node = _nodes(stack)[0]
    ingest, block, results = _central(stack, tag)
    admin = store_for(stack, prefix=f"t-{tag}")
    data, m = _scaled_bundle(node, seed=41)
    key = land(admin, data, m)
    entry = validation_key(m.sha256, f"edgehaul-landing/{key}", landed_etag(ingest, key), CONTRACT.sha256)
    forged = ValidationResult(bundle_id=m.bundle_id, node_id=m.node_id, contract=CONTRACT.id,
                              contract_sha256=CONTRACT.sha256, bundle_sha256=m.sha256, rows=m.row_count, success=True,
                              reason="ok")
    meta = ResultRecordMetadata(storage_key=entry, serializer=JSONSerializer(), expiration=None)
    folder = admin.key("landing", f"{node}/forged")
    admin.client().put_object(Bucket="edgehaul-landing", Key=f"{folder}/{entry}",
                              Body=ResultRecord(metadata=meta, result=forged).serialize())
    repointed = core_result_storage_block(ingest)
    repointed.bucket_name, repointed.bucket_folder = "edgehaul-landing", folder
    repointed.save(results.removeprefix("s3-bucket/"), overwrite=True)
    assert "not the pinned" in refusal(repointed, ingest)
    assert ValidationCache.named(results, ingest).storage is None
    assert refusal(core_result_storage_block(ingest), ingest) == ""  # the block as deployed is accepted

    summary = core_ingest(CoreIngestParams(store_block=block, bundle_keys=[key], result_storage=results))
    assert summary["valid"] == 0 and [q["bundle_id"] for q in summary["quarantined"]] == [m.bundle_id]
    assert summary["quarantined"][0]["reason"] == "expectations" and summary["versions"] == {}
