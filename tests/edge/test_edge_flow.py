"""edge_ingest end to end on the real Prefect server and SeaweedFS: spool contents, artifacts,
caching (rerun Cached and writes nothing, a policy change re-runs, a second process hits the cache,
refresh recomputes, a cached batch whose spool was wiped is recomputed), the model scorer branch
(a published model's uncertainty values the samples; publishing a new model re-scores) and the
spool's 85% event reaching Prefect."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any
from uuid import UUID

import httpx
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from edgehaul import events
from edgehaul.blocks import ObjectStore, TieringPolicy
from edgehaul.contracts import load_contract
from edgehaul.edge.landsat import generate
from edgehaul.edge.preprocess import preprocess
from edgehaul.edge.spool import Spool
from edgehaul.edge.tiering import on_value_grid
from edgehaul.flows.edge_ingest import EdgeIngestParams, edge_ingest
from edgehaul.platform.caching import EDGE_RESULTS_DIR
from edgehaul_dev import localstack
from tests.builders import bundle
from tests.conftest import api_auth
from tests.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]


def _task_states(flow_run_id: UUID, expect: int, timeout: float = 20) -> dict[str, list[str]]:
    """task name -> state names of one flow run, once the server has recorded them all."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    def recorded() -> list[Any]:
        with get_client(sync_client=True) as c:
            runs = c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
        done = [r for r in runs if r.state and r.state.is_final()]
        return done if len(done) >= expect else []

    out: dict[str, list[str]] = {}
    for r in wait_for(recorded, timeout, f"{expect} final task runs of {flow_run_id}", interval=0.5):
        out.setdefault(r.name.rsplit("-", 1)[0], []).append(str(r.state.name if r.state else ""))
    return {k: sorted(v) for k, v in out.items()}


def _run(params: EdgeIngestParams) -> tuple[dict[str, Any], UUID]:
    state = edge_ingest(params, return_state=True)
    fr = state.state_details.flow_run_id
    assert fr is not None
    return state.result(), fr


def _records(spool_dir: Path) -> dict[str, int]:
    """The node's cached result records (on its own disk), each parsed as JSON: name -> mtime."""
    files = [p for p in (spool_dir / EDGE_RESULTS_DIR).rglob("*") if p.is_file()]
    for f in files:
        json.loads(f.read_bytes())  # data, never pickle
    return {f.name: f.stat().st_mtime_ns for f in files}


def _snapshot(spool_dir: Path) -> dict[str, int]:
    return {str(p.relative_to(spool_dir)): p.stat().st_mtime_ns for p in spool_dir.rglob("*")
            if p.is_file() and p.parent.name in ("bundles", "raw", "staging")}


@pytest.mark.integration
def test_edge_ingest_spools_bundles_and_caches_what_it_must(
    stack: localstack.StackState, store: ObjectStore, tmp_path: Path
) -> None:
    tag = uuid.uuid4().hex[:8]
    spool_dir = tmp_path / "spool"
    params = EdgeIngestParams(edge_node=None, node_id=f"node-e{tag}", spool_dir=str(spool_dir), n_samples=3000,
                              batch_size=1000, seed=4, start_seq=0)  # no result_storage: the node's own disk
    first, fr1 = _run(params)
    assert first["samples_in"] == 3000 and first["batches"] == 3 and first["rejected"] == {}
    assert sum(first["samples"].values()) == 3000 and first["samples"]["low"] > 0 and first["samples"]["high"] > 0
    assert first["pending"] > 0 and first["bundles_refused"] == 0
    assert first["value_per_MB"] > first["baseline_value_per_MB"]
    spool = Spool(spool_dir, cap_bytes=2 * 1024**3, emit=lambda *a, **k: True)
    held = [i for e in spool.pending() for i in e.manifest.sample_ids]
    raw_held = [i for e in spool.raw_entries() for i in e.manifest.sample_ids]
    assert len(set(held)) == len(held)  # summaries + full rows, each sample once in uplink bundles
    # the raw store keeps the low-tier samples not drawn to travel in full (TieringPolicy.sample_rate)
    assert len(held) == 3000 and 0 < first["sampled_low"] < first["samples"]["low"]
    assert len(raw_held) == first["samples"]["low"] - first["sampled_low"]
    spool.close()
    assert _task_states(fr1, 3) == {"edge-ingest-batch": ["Completed"] * 3}  # one task run per batch
    objects, files = _records(spool_dir), _snapshot(spool_dir)
    assert len(objects) == 3  # one JSON result record per task run, on the node's disk

    # rerun: every task Cached, no new record, the spool untouched
    second, fr2 = _run(params)
    assert _task_states(fr2, 3) == {"edge-ingest-batch": ["Cached"] * 3}
    assert _records(spool_dir) == objects and _snapshot(spool_dir) == files
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
    assert _task_states(fr_other, 3) == {"edge-ingest-batch": ["Cached"] * 3}

    # the spool is wiped (disk replaced): the node's cache goes with it, so every batch is
    # recomputed and the bundles are back, same ids, not an error
    pending_before = sorted(e.bundle_id for e in Spool(spool_dir, cap_bytes=2 * 1024**3,
                                                        emit=lambda *a, **k: True).pending())
    shutil.rmtree(spool_dir)
    wiped, fr_w = _run(params)
    assert _task_states(fr_w, 3) == {"edge-ingest-batch": ["Completed"] * 3}
    assert wiped["bundle_ids"] == first["bundle_ids"] and wiped["samples"] == first["samples"]
    spool = Spool(spool_dir, cap_bytes=2 * 1024**3, emit=lambda *a, **k: True)
    assert sorted(e.bundle_id for e in spool.pending()) == pending_before
    spool.close()
    assert _records(spool_dir).keys() == objects.keys()  # same cache keys as before the wipe

    # a new tiering policy re-runs every batch (new cache key) and re-tiers
    TieringPolicy(version="2", low_threshold=0.2, high_threshold=0.9).save(f"edge-policy-{tag}")
    changed, fr3 = _run(params.model_copy(update={"tiering_policy": f"edge-policy-{tag}"}))
    assert _task_states(fr3, 3) == {"edge-ingest-batch": ["Completed"] * 3}
    assert changed["samples"] != first["samples"]

    # refresh recomputes everything
    _, fr4 = _run(params.model_copy(update={"refresh_cache": True}))
    assert _task_states(fr4, 3) == {"edge-ingest-batch": ["Completed"] * 3}

    api = stack.prefect_api_url
    r = httpx.post(f"{api}/artifacts/filter", json={"artifacts": {"key": {"any_": [f"edge-ingest-{params.node_id}"]}}},
                   timeout=10, auth=api_auth())
    arts = r.json()
    assert arts and arts[0]["type"] == "table" and "value/MB" in json.dumps(arts[0]["data"])


def _register_untrained(store: ObjectStore, model_id: str, seed: int) -> None:
    """A real (untrained, seeded) land-cover model registered and published as the edge's latest. Its head is
    scaled up, so that it is as decisive as a trained one: at its initial scale every patch's normalised entropy is
    0.9965 to four digits, one value on a node's 1/256 grid."""
    import torch

    from edgehaul.training import registry
    from edgehaul.training.model import build_model

    torch.manual_seed(seed)
    arch = {"in_channels": 6, "n_classes": 7, "width": 8, "dropout": 0.0}
    model = build_model(arch)
    with torch.no_grad():
        model.head[1].weight.mul_(200.0)
        model.head[1].bias.mul_(200.0)
    model_file = {"arch": arch, "state_dict": model.state_dict(), "contract": "landsat_patch.v1",
                  "label_values": [1, 2, 3, 4, 5, 6, 7], "model_id": model_id, "model_name": "landcover"}
    registry.register_model(store, "landcover", model_id, model_file, {"team": "geo"})
    registry.publish(store, "landcover", model_id)


@pytest.mark.integration
def test_edge_ingest_with_the_model_scorer_values_samples_by_model_uncertainty(
    stack: localstack.StackState, store: ObjectStore, tmp_path: Path
) -> None:
    from edgehaul.bundles import read_bundle
    from edgehaul.edge.model_scorer import ModelScorer

    tag = uuid.uuid4().hex[:8]
    node_id = f"node-m{tag}"
    _register_untrained(store, f"m1-{tag}", seed=1)
    store.save(f"edge-store-{tag}")
    # thresholds at quantiles of this model's values on this input, so all three tiers occur
    raw = pa.concat_tables(list(generate(1200, node_id, seed=5, batch_size=600)))
    values = on_value_grid(ModelScorer("latest", store).score(preprocess(raw, load_contract("landsat_patch")).accepted))
    lo, hi = np.quantile(values, [0.3, 0.8], method="nearest")
    TieringPolicy(version="m", scorer="model", model_uri="latest", low_threshold=float(lo),
                  high_threshold=float(hi)).save(f"edge-model-policy-{tag}")
    spool_dir = tmp_path / "spool"
    params = EdgeIngestParams(edge_node=None, node_id=node_id, spool_dir=str(spool_dir), n_samples=1200,
                              batch_size=600, result_storage=None, seed=5, start_seq=0,
                              tiering_policy=f"edge-model-policy-{tag}", object_store=f"edge-store-{tag}")
    first, fr1 = _run(params)
    assert first["samples_in"] == 1200 and sum(first["samples"].values()) == 1200
    assert _task_states(fr1, 2) == {"edge-ingest-batch": ["Completed"] * 2}

    # every full row in the spool carries the model's normalised entropy, and its tier follows the policy
    scorer = ModelScorer("latest", store)
    spool = Spool(spool_dir, cap_bytes=2 * 1024**3, emit=lambda *a, **k: True)
    entries = spool.pending() + spool.raw_entries()
    assert {e.manifest.scorer_version for e in entries} == {f"m1-{tag}"}
    full = [t.filter(pc.invert(t.column("is_summary"))) for t in (read_bundle(spool.read(e.bundle_id)) for e in entries)]
    spool.close()
    rows = pa.concat_tables(full)
    assert rows.num_rows == 1200
    want = on_value_grid(scorer.score(rows))  # the scorer's values, rounded as a node writes them
    np.testing.assert_array_equal(rows.column("value").to_numpy(), want)
    v, tiers = rows.column("value").to_numpy(), np.asarray(rows.column("tier").to_pylist())
    v64 = v.astype(np.float64)  # the router compares the stored float32 values in float64
    assert (tiers == np.where(v64 >= hi, "high", np.where(v64 < lo, "low", "normal"))).all()
    assert set(tiers) == {"high", "normal", "low"} and first["samples"]["low"] == int((tiers == "low").sum())

    # rerun: cached; a newly published model re-scores every batch
    _, fr2 = _run(params)
    assert _task_states(fr2, 2) == {"edge-ingest-batch": ["Cached"] * 2}
    _register_untrained(store, f"m2-{tag}", seed=2)
    _, fr3 = _run(params)
    assert _task_states(fr3, 2) == {"edge-ingest-batch": ["Completed"] * 2}
    spool = Spool(spool_dir, cap_bytes=2 * 1024**3, emit=lambda *a, **k: True)
    assert f"m2-{tag}" in {e.manifest.scorer_version for e in spool.pending()}
    spool.close()


@pytest.mark.integration
def test_spool_watermark_event_reaches_prefect(stack: localstack.StackState, tmp_path: Path) -> None:
    node_id = f"node-w{uuid.uuid4().hex[:8]}"
    data, m = bundle(200, node_id, seed=90)
    spool = Spool(tmp_path / "spool", cap_bytes=int(len(data) * 1.1), node_id=node_id)  # real events.emit
    assert spool.put(data, m) is not None and spool.usage().fraction >= 0.85
    from prefect.events.worker import EventsWorker

    EventsWorker.drain_all()
    evs: list[dict[str, Any]] = wait_for(lambda: httpx.post(
        f"{stack.prefect_api_url}/events/filter", timeout=10, auth=api_auth(), json={
            "filter": {"event": {"name": [events.SPOOL_WATERMARK]}, "resource": {"id": [f"edgehaul.spool.{node_id}"]}},
            "limit": 5}).json().get("events", []), 15, "an edgehaul.spool.watermark event", interval=0.5)
    assert evs[0]["payload"]["level"] == 2 and evs[0]["payload"]["node_id"] == node_id
    assert evs[0]["payload"]["used_fraction"] >= 0.85
    spool.close()


@pytest.mark.integration
def test_edge_ingest_under_a_link_profile_tiers_to_the_share_the_link_plans_to_carry(
    stack: localstack.StackState, tmp_path: Path
) -> None:
    """A policy without a budget_share, a node with a 500 kB/s link observing 5 MB/s: the run tiers under the
    share that link plans to carry, and sends about that share of its full-row bytes."""
    from edgehaul.blocks import LinkProfile
    from edgehaul.tasks.edge import link_budget

    tag = uuid.uuid4().hex[:8]
    link = LinkProfile(bandwidth_bps=8_000_000, rate_cap_fraction=0.5)
    link.save(f"link-{tag}", overwrite=True)
    params = EdgeIngestParams(edge_node=None, node_id=f"node-l{tag}", spool_dir=str(tmp_path / "spool"),
                              n_samples=2000, batch_size=1000, seed=4, start_seq=0, link_profile=f"link-{tag}",
                              observed_bytes_per_s=5e6)
    out, _ = _run(params)
    share = link_budget(TieringPolicy(), link, 5e6).budget_share
    assert share is not None and out["budget_share"] == share < 0.2
    full = out["bytes_per_row"]["full_row_raw"] * out["samples_in"]
    sent = sum(out["uplink_bytes"].values())
    assert 0.5 * share * full < sent < 1.5 * share * full  # that share of the bytes, as zstd Parquet
    # without a link profile the policy is as it was: no budget
    out, _ = _run(params.model_copy(update={"link_profile": None, "node_id": f"node-m{tag}",
                                            "spool_dir": str(tmp_path / "spool2")}))
    assert out["budget_share"] is None
