"""edge_ingest end to end on the real Prefect server and SeaweedFS: spool contents, artifacts,
caching (rerun Cached and writes nothing, policy change rescoring only, a second process hits the
cache, refresh recomputes) and the spool's 85% event reaching Prefect."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any
from uuid import UUID

import httpx
import pytest

from blocks import ObjectStore, TieringPolicy
from edgehaul import events, localstack
from edgehaul.caching import RESULTS_FOLDER, ensure_result_storage
from edgehaul.spool import Spool
from flows.edge_ingest import EdgeIngestParams, edge_ingest
from tests.builders import bundle

ROOT = Path(__file__).resolve().parent.parent


def _task_states(flow_run_id: UUID, expect: int, timeout: float = 20) -> dict[str, list[str]]:
    """task name -> state names of one flow run, once the server has recorded them all."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    deadline = time.monotonic() + timeout
    while True:
        with get_client(sync_client=True) as c:
            runs = c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
        done = [r for r in runs if r.state and r.state.is_final()]
        if len(done) >= expect or time.monotonic() > deadline:
            out: dict[str, list[str]] = {}
            for r in done:
                out.setdefault(r.name.rsplit("-", 1)[0], []).append(str(r.state.name if r.state else ""))
            return out
        time.sleep(0.5)


def _run(params: EdgeIngestParams) -> tuple[dict[str, Any], UUID]:
    state = edge_ingest(params, return_state=True)
    return state.result(), state.state_details.flow_run_id


def _ops_objects(store: ObjectStore) -> set[str]:
    s3 = store.client()
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=store.bucket("ops"), Prefix=store.key("ops", RESULTS_FOLDER))
    return {o["Key"] for p in pages for o in p.get("Contents", [])}


def _snapshot(spool_dir: Path) -> dict[str, int]:
    return {str(p.relative_to(spool_dir)): p.stat().st_mtime_ns for p in spool_dir.rglob("*")
            if p.is_file() and p.parent.name in ("bundles", "raw", "staging")}


@pytest.mark.integration
def test_edge_ingest_spools_bundles_and_caches_what_it_must(
    stack: localstack.StackState, store: ObjectStore, tmp_path: Path
) -> None:
    tag = uuid.uuid4().hex[:8]
    slug = ensure_result_storage(store, name=f"edge-results-{tag}")
    spool_dir = tmp_path / "spool"
    params = EdgeIngestParams(edge_node=None, node_id=f"node-e{tag}", spool_dir=str(spool_dir), n_samples=3000,
                              batch_size=1000, result_storage=slug, seed=4)
    first, fr1 = _run(params)
    assert first["samples_in"] == 3000 and first["batches"] == 3 and first["rejected"] == {}
    assert sum(first["samples"].values()) == 3000 and first["samples"]["low"] > 0 and first["samples"]["high"] > 0
    assert first["pending"] > 0 and first["bundles_refused"] == 0
    assert first["value_per_MB"] > first["baseline_value_per_MB"]
    spool = Spool(spool_dir, cap_bytes=2 * 1024**3, emit=lambda *a, **k: True)
    held = [i for e in spool.pending() for i in e.manifest.sample_ids]
    raw_held = [i for e in spool.raw_entries() for i in e.manifest.sample_ids]
    assert len(set(held)) == len(held)  # summaries + full rows, each sample once in uplink bundles
    assert len(held) == 3000 and len(raw_held) == first["samples"]["low"]
    spool.close()
    assert _task_states(fr1, 6) == {"edge-preprocess": ["Completed"] * 3, "edge-tier-and-spool": ["Completed"] * 3}
    objects, files = _ops_objects(store), _snapshot(spool_dir)
    assert len(objects) == 6  # one result record per task run, in the ops bucket

    # rerun: every task Cached, nothing new in the ops bucket, the spool untouched
    second, fr2 = _run(params)
    assert _task_states(fr2, 6) == {"edge-preprocess": ["Cached"] * 3, "edge-tier-and-spool": ["Cached"] * 3}
    assert _ops_objects(store) == objects and _snapshot(spool_dir) == files
    assert second["bundle_ids"] == first["bundle_ids"]

    # a second worker process hits the cache the first one wrote
    code = (
        "import json, sys\n"
        "from flows.edge_ingest import EdgeIngestParams, edge_ingest\n"
        "s = edge_ingest(EdgeIngestParams.model_validate_json(sys.argv[1]), return_state=True)\n"
        "print(json.dumps({'id': str(s.state_details.flow_run_id)}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, params.model_dump_json()], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300, check=True)
    fr_other = UUID(json.loads(proc.stdout.strip().splitlines()[-1])["id"])
    assert _task_states(fr_other, 6) == {"edge-preprocess": ["Cached"] * 3, "edge-tier-and-spool": ["Cached"] * 3}

    # a new tiering policy rescores and re-tiers, preprocessing stays cached
    TieringPolicy(version="2", low_threshold=0.2, high_threshold=0.9).save(f"edge-policy-{tag}")
    changed, fr3 = _run(params.model_copy(update={"tiering_policy": f"edge-policy-{tag}"}))
    assert _task_states(fr3, 6) == {"edge-preprocess": ["Cached"] * 3, "edge-tier-and-spool": ["Completed"] * 3}
    assert changed["samples"] != first["samples"]

    # refresh recomputes everything
    _, fr4 = _run(params.model_copy(update={"refresh_cache": True}))
    assert _task_states(fr4, 6) == {"edge-preprocess": ["Completed"] * 3, "edge-tier-and-spool": ["Completed"] * 3}

    api = stack.prefect_api_url
    r = httpx.post(f"{api}/artifacts/filter", json={"artifacts": {"key": {"any_": [f"edge-ingest-{params.node_id}"]}}},
                   timeout=10)
    arts = r.json()
    assert arts and arts[0]["type"] == "table" and "value/MB" in json.dumps(arts[0]["data"])


@pytest.mark.integration
def test_spool_watermark_event_reaches_prefect(stack: localstack.StackState, tmp_path: Path) -> None:
    node_id = f"node-w{uuid.uuid4().hex[:8]}"
    data, m = bundle(200, node_id, seed=90)
    spool = Spool(tmp_path / "spool", cap_bytes=int(len(data) * 1.1), node_id=node_id)  # real events.emit
    assert spool.put(data, m) is not None and spool.usage().fraction >= 0.85
    from prefect.events.worker import EventsWorker

    EventsWorker.drain_all()
    deadline = time.monotonic() + 15
    evs: list[dict[str, Any]] = []
    while not evs and time.monotonic() < deadline:
        r = httpx.post(f"{stack.prefect_api_url}/events/filter", timeout=10, json={
            "filter": {"event": {"name": [events.SPOOL_WATERMARK]}, "resource": {"id": [f"edgehaul.spool.{node_id}"]}},
            "limit": 5})
        evs = r.json().get("events", [])
        time.sleep(0.5)
    assert evs, "no edgehaul.spool.watermark event recorded"
    assert evs[0]["payload"]["level"] == 2 and evs[0]["payload"]["node_id"] == node_id
    assert evs[0]["payload"]["used_fraction"] >= 0.85
    spool.close()
