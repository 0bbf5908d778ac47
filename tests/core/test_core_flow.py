"""core_ingest and compact_dataset flows on the real Prefect server and S3: bad bundles quarantined with
their reason and every sample id, good ones committed as one version, validation cached on content
(rerun, another process, refresh), and compaction cached on its input file set."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, FlowRunFilter, FlowRunFilterId

from edgehaul.blocks import ObjectStore
from edgehaul.bundles import write_bundle
from edgehaul.contracts import load_contract
from edgehaul.core.datasets import content_sha256, lineage, open_table, read_version
from edgehaul.core.quarantine import read_record
from edgehaul.flows.compact_dataset import CompactDatasetParams, compact_dataset
from edgehaul.flows.core_ingest import CoreIngestParams, core_ingest
from tests.builders import bundle, land, processed_rows
from tests.waiting import wait_for

CONTRACT = load_contract("landsat_patch")
pytestmark = pytest.mark.integration


def _keys(store: ObjectStore, zone: Any) -> set[str]:
    s3 = store.client()
    out = set()
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=store.bucket(zone), Prefix=store.key(zone, "")):
        out.update(o["Key"] for o in page.get("Contents", []))
    return out


def _all_objects(store: ObjectStore) -> set[tuple[str, str]]:
    return {(z, k) for z in ("landing", "curated", "ops") for k in _keys(store, z)}


def _task_states(flow_run_id: Any, name_prefix: str, expected: int) -> list[str]:
    """State names of a flow run's tasks, waiting for the server to record them all."""
    def recorded() -> tuple[list[str]] | None:  # a tuple: truthy even when no task is expected
        with get_client(sync_client=True) as client:
            runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
        names = [r.state_name or "" for r in runs if r.name.startswith(name_prefix) and r.state and r.state.is_final()]
        return (sorted(names),) if len(names) >= expected else None

    return wait_for(recorded, 30, f"{expected} final {name_prefix}* task runs of {flow_run_id}", interval=0.5)[0]


@pytest.fixture
def block(store: ObjectStore) -> str:
    name = f"core-{uuid.uuid4().hex[:10]}"
    store.save(name, overwrite=True)
    return name


def _run(params: Any, flow: Any) -> tuple[dict[str, Any], Any]:
    state = flow(params, return_state=True)
    return state.result(), state.state_details.flow_run_id


def test_core_ingest_quarantines_bad_bundles_commits_good_ones_and_caches(store: ObjectStore, block: str) -> None:
    good = [bundle(40, "node-a", seed=1), bundle(30, "node-a", seed=2, start_seq=100), bundle(20, "node-b", seed=3)]
    good_keys = [land(store, d, m) for d, m in good]
    # wrong scale: features computed from raw counts (x255)
    t = processed_rows(25, "node-b", seed=4, start_seq=200)
    for name in CONTRACT.feature_columns:
        t = t.set_column(t.schema.get_field_index(name), name, pc.multiply(t.column(name), pa.scalar(255.0, pa.float32())))
    scaled, scaled_m = write_bundle(t, CONTRACT, tier="normal")
    land(store, scaled, scaled_m)
    # corrupted in flight / at rest
    d, corrupt_m = bundle(15, "node-a", seed=5, start_seq=300)
    land(store, d[:100] + bytes(b ^ 0xFF for b in d[100:200]) + d[200:], corrupt_m)
    # unknown contract version
    d, unknown_m = bundle(10, "node-b", seed=6, start_seq=400)
    land(store, d, replace(unknown_m, contract="landsat_patch.v7"))
    # still uploading: data without a manifest is not a bundle yet
    d, partial_m = bundle(10, "node-a", seed=7, start_seq=500)
    store.client().put_object(Bucket=store.bucket("landing"), Key=store.key("landing", partial_m.object_key), Body=d)

    summary, run1 = _run(CoreIngestParams(store_block=block, validate_batch=4), core_ingest)
    assert summary["bundles"] == 7 and summary["valid"] == 3 and not summary["errors"]
    # the data without its manifest is reported as waiting, and left in landing (see below)
    assert summary["waiting"] == [store.key("landing", partial_m.object_key)]
    # the 6 bundles with a manifest were validated in chunks of 4: two task runs, not one per bundle
    assert summary["validation_tasks"] == 2 and summary["cached"] == 0
    reasons = {q["bundle_id"]: q["reason"] for q in summary["quarantined"]}
    assert reasons == {scaled_m.bundle_id: "expectations", corrupt_m.bundle_id: "checksum",
                       unknown_m.bundle_id: "unknown_contract"}
    assert summary["versions"] == {"landsat_patch": 1}

    # quarantine: record with the reason, the failed checks and every sample id; landing is write-once, so
    # the bundles stay there, and the record (with their landing ETags) keeps the next run from taking them
    rec = read_record(store, "node-b", scaled_m.bundle_id)
    assert rec.reason == "expectations" and sorted(rec.sample_ids) == sorted(scaled_m.sample_ids)
    failed = {(e["expectation"], e["column"]) for e in rec.validation["expectations"] if not e["success"]}
    assert ("expect_column_mean_to_be_between", "mean_b4_nir") in failed
    assert {o.rsplit("/", 1)[-1] for o in rec.objects} == {f"{scaled_m.bundle_id}.parquet",
                                                           f"{scaled_m.bundle_id}.manifest.json"}
    corrupt = read_record(store, "node-a", corrupt_m.bundle_id)
    assert "checksum mismatch" in corrupt.error and sorted(corrupt.sample_ids) == sorted(corrupt_m.sample_ids)
    landing = _keys(store, "landing")
    for m in (scaled_m, corrupt_m, unknown_m):
        assert store.key("landing", m.object_key) in landing
        assert read_record(store, m.node_id, m.bundle_id).landing_etags
    assert store.key("landing", partial_m.object_key) in landing

    # the version holds exactly the good samples; lineage back to nodes and bundles
    ids = read_version(store, "landsat_patch", 1, columns=["sample_id"]).column("sample_id").to_pylist()
    assert sorted(ids) == sorted(i for _, m in good for i in m.sample_ids)
    lin = lineage(store, "landsat_patch", 1)
    assert lin.nodes == ["node-a", "node-b"] and {b["bundle_id"] for b in lin.bundles} == {m.bundle_id for _, m in good}

    with get_client(sync_client=True) as client:
        arts = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["core-ingest-validation"])),
                                     flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run1])))
    assert len(arts) == 1 and arts[0].type == "table"
    rows = json.loads(arts[0].data) if isinstance(arts[0].data, str) else arts[0].data
    assert sorted(r["reason"] for r in rows) == ["checksum", "expectations", "ok", "ok", "ok", "unknown_contract"]
    assert _task_states(run1, "validate-", 2) == ["Completed", "Completed"]  # rejections are results, not failures

    # rerun on the same bundles: they are in the dataset, so nothing is validated again (a run
    # behind one that caught up ends at once), no new version, no new object anywhere
    before = _all_objects(store)
    summary2, run2 = _run(CoreIngestParams(store_block=block, bundle_keys=good_keys), core_ingest)
    assert summary2["already_committed"] == sorted(m.bundle_id for _, m in good)
    assert summary2["valid"] == 0 and summary2["versions"] == {} and summary2["commits"] == []
    assert _task_states(run2, "validate-", 0) == []
    assert _all_objects(store) == before and open_table(store, "landsat_patch").version() == 1

    # validation is cached on content: a bundle validated but deferred (another live run holds its claim)
    # is validated again by the next run from the cache, in this process and in another worker process
    d, late_m = bundle(20, "node-b", seed=8, start_seq=600)
    late_key = land(store, d, late_m)
    store.client().put_object(Bucket=store.bucket("curated"),
                              Key=store.key("curated", f"_claims/landsat_patch/node-b/{late_m.bundle_id}.json"),
                              Body=json.dumps({"run": "another-live-run", "at": time.time()}).encode())
    summary3, _ = _run(CoreIngestParams(store_block=block, bundle_keys=[late_key]), core_ingest)
    assert summary3["deferred"] == [late_m.bundle_id] and summary3["cached"] == 0
    summary3, _ = _run(CoreIngestParams(store_block=block, bundle_keys=[late_key]), core_ingest)
    assert summary3["deferred"] == [late_m.bundle_id] and summary3["cached"] == 1

    # another worker process hits the cache this one wrote
    code = ("import json,sys; from flows.core_ingest import core_ingest, CoreIngestParams; "
            "s = core_ingest(CoreIngestParams(**json.loads(sys.argv[1])), return_state=True); "
            "print('CACHED', s.result()['cached'])")
    out = subprocess.run([sys.executable, "-c", code, json.dumps({"store_block": block, "bundle_keys": [late_key]})],
                         cwd=Path(__file__).parents[2], env=os.environ.copy(), capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("CACHED", 1)[1].split()[0] == "1"

    # refresh recomputes
    summary5, _ = _run(CoreIngestParams(store_block=block, bundle_keys=[late_key], refresh_cache=True), core_ingest)
    assert summary5["cached"] == 0 and summary5["deferred"] == [late_m.bundle_id]


def test_compact_dataset_flow_keeps_versions_and_caches_on_its_file_set(store: ObjectStore, block: str) -> None:
    for seed in range(3):
        d, m = bundle(20, "node-a", seed=10 + seed, start_seq=seed * 100)
        core_ingest(CoreIngestParams(store_block=block, bundle_keys=[land(store, d, m)]))
    versions = {v: content_sha256(read_version(store, "landsat_patch", v)) for v in (1, 2, 3)}
    params = CompactDatasetParams(store_block=block, target_size_mb=32)
    r1, _ = _run(params, compact_dataset)
    assert r1["version"] == 4 and r1["files_removed"] == 3 and r1["files_added"] == 1
    for v, digest in versions.items():
        assert content_sha256(read_version(store, "landsat_patch", v)) == digest
    assert content_sha256(read_version(store, "landsat_patch", 4)) == versions[3]
    r2, _ = _run(params, compact_dataset)  # a new file set (one file): nothing to merge
    assert r2["version"] is None
    r3, run3 = _run(params, compact_dataset)  # the same file set again: Cached, no work
    assert r3 == r2 and _task_states(run3, "core-compact", 1) == ["Cached"]
    assert open_table(store, "landsat_patch").version() == 4
