"""core_ingest catches up: a run takes the bundle keys of its deployment's runs still queued,
commits them, and completes those runs so they never start; bundles already committed are skipped before
validation. Two runs racing over the same queue commit each bundle exactly once."""

from __future__ import annotations

import contextvars
import json
import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, TaskRunFilter, TaskRunFilterName
from prefect.states import Pending, Scheduled

from edgehaul.blocks import ObjectStore
from edgehaul.core.datasets import lineage, open_table
from edgehaul.core.ingest import QueuedBatch, settled_batches, take_queued
from edgehaul.flows.core_ingest import CoreIngestParams, core_ingest
from tests.builders import bundle, land
from tests.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]
KIND = "landsat_patch"

keys_st = st.lists(st.sampled_from([f"k{i}" for i in range(30)]), max_size=8)


@given(own=keys_st, batches=st.lists(keys_st, max_size=8), bound=st.integers(1, 40), open_keys=st.sets(
    st.sampled_from([f"k{i}" for i in range(30)]), max_size=5))
def test_taking_queued_batches_keeps_the_bound_and_whole_batches(own: list[str], batches: list[list[str]], bound: int,
                                                                 open_keys: set[str]) -> None:
    own = list(dict.fromkeys(own))[:bound]  # the flow cuts its own keys to the bound first
    queued = [QueuedBatch(f"r{i}", tuple(b)) for i, b in enumerate(batches)]
    keys, taken = take_queued(own, queued, bound)
    assert keys[: len(own)] == own and len(keys) == len(set(keys)) <= bound
    for b in queued:  # taken whole, or it would not have fitted
        assert set(b.keys) <= set(keys) if b in taken else len(set(keys) | set(b.keys)) > bound
    settled = settled_batches(taken, open_keys)
    assert all(b in taken and not open_keys & set(b.keys) for b in settled)
    assert all(b in settled for b in taken if not open_keys & set(b.keys))


def _deployment(name: str) -> str:
    with get_client(sync_client=True) as client:
        flow_id = client.create_flow(core_ingest)
        return str(client.create_deployment(flow_id=flow_id, name=name, entrypoint="flows/core_ingest.py:core_ingest"))


def _queue(dep: str, params: CoreIngestParams) -> str:
    with get_client(sync_client=True) as client:
        fr = client.create_flow_run_from_deployment(uuid.UUID(dep), parameters={"params": params.model_dump()},
                                                    state=Scheduled())
        return str(fr.id)


def run_worker(flow_run_id: str, out: str) -> None:
    """A flow run of the deployment, run the way a runner's child process runs it."""
    from prefect.flow_engine import run_flow

    with get_client(sync_client=True) as client:
        fr = client.read_flow_run(uuid.UUID(flow_run_id))
    state = run_flow(core_ingest, flow_run=fr, parameters=fr.parameters, return_type="state")
    Path(out).write_text(json.dumps(state.result()))  # type: ignore[union-attr]


@pytest.mark.integration
def test_two_runs_racing_over_a_queue_commit_each_bundle_once_and_complete_the_covered_runs(
        store: ObjectStore, tmp_path: Path) -> None:
    block = f"core-{uuid.uuid4().hex[:10]}"
    store.save(block, overwrite=True)
    made = [bundle(12, node, seed=s, start_seq=s * 100) for s, node in
            ((1, "node-a"), (2, "node-a"), (3, "node-b"), (4, "node-b"), (5, "node-a"), (6, "node-b"), (7, "node-a"))]
    keys = [land(store, d, m).removeprefix(store.key("landing", "")) for d, m in made]  # relative, as events carry
    ids = [m.bundle_id for _, m in made]
    dep = _deployment(f"catch-up-{uuid.uuid4().hex[:8]}")

    def params(ks: list[str], **kw: Any) -> CoreIngestParams:
        return CoreIngestParams(**{"store_block": block, "bundle_keys": ks, **kw})

    first, second = _queue(dep, params(keys[0:2])), _queue(dep, params(keys[2:4]))
    covered = [_queue(dep, params(keys[4:6])), _queue(dep, params([keys[6], keys[0]]))]  # one overlaps a runner's
    other = _queue(dep, params(keys[4:5], store_block="someone-else"))  # other work: never taken
    with get_client(sync_client=True) as client:  # as a runner does before it starts a run's process
        for run in (first, second):
            client.set_flow_run_state(uuid.UUID(run), Pending())
    procs, outs = [], []
    for i, run in enumerate((first, second)):
        out = tmp_path / f"out{i}.json"
        outs.append(out)
        code = f"from tests.core.test_core_catch_up import run_worker; run_worker({run!r}, {str(out)!r})"
        procs.append(subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=os.environ.copy(),
                                      stderr=subprocess.PIPE, text=True))
    for p in procs:
        _, err = p.communicate(timeout=400)
        assert p.returncode == 0, err[-4000:]
    results = [json.loads(o.read_text()) for o in outs]

    # every bundle in the dataset exactly once, each in one commit
    table = open_table(store, KIND).to_pyarrow_table(columns=["bundle_id", "sample_id"])
    got = table.column("bundle_id").to_pylist()
    assert sorted(set(got)) == sorted(ids) and all(got.count(b) == 12 for b in ids)
    assert table.num_rows == len(set(table.column("sample_id").to_pylist()))
    in_commits = [b for r in results for c in r["commits"] for b in c["bundles"]]
    assert sorted(in_commits) == sorted(ids)  # each bundle committed by one of the two runs, once
    versions = [c["version"] for r in results for c in r["commits"] if c["version"] is not None]
    assert sorted(b["bundle_id"] for b in lineage(store, KIND, max(versions)).bundles) == sorted(ids)
    # the queued runs were taken: completed without ever starting (no task runs), naming the run that did it
    # each queued batch taken by one of the two runs (claimed), never both; every claim dropped at the end
    taken = [set(r["taken_runs"]) for r in results]
    assert not taken[0] & taken[1] and taken[0] | taken[1] == set(covered)
    assert "Contents" not in store.client().list_objects_v2(Bucket=store.bucket("curated"),
                                                            Prefix=store.key("curated", "_claims/_batches/"))
    with get_client(sync_client=True) as client:
        runs = {str(r.id): r for r in client.read_flow_runs(flow_run_filter=FlowRunFilter(
            id=FlowRunFilterId(any_=[uuid.UUID(x) for x in (first, second, *covered, other)])))}
        st_of = {r: runs[r].state for r in runs}
        taker = {run: r for r in results for run in r["taken_runs"]}
        for i, run in enumerate(covered):
            s = st_of[run]
            assert s is not None
            if i == 1 and s.is_scheduled():
                # its batch shares a bundle with the first runner's own: when the taker met that bundle
                # claimed by the live first runner (deferred there), the batch is not settled and stays its
                # own run's, which would find both bundles committed
                assert ids[0] in taker[run]["deferred"], (taker[run], s)
                client.delete_flow_run(uuid.UUID(run))
                continue
            assert s.is_completed() and "covered by core_ingest run" in (s.message or ""), s
            assert not client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[uuid.UUID(run)])))
        ends = [st_of[r] for r in (first, second, other)]
        assert all(e is not None and e.is_completed() for e in ends[:2]), ends
        assert ends[2] is not None and ends[2].is_scheduled(), ends[2]
        client.delete_flow_run(uuid.UUID(other))

    # a run started after all that finds its bundles committed: no validation, no commit
    state = core_ingest(params(keys), return_state=True)
    late = state.result()
    assert late["already_committed"] == sorted(ids) and late["valid"] == 0 and late["versions"] == {}
    with get_client(sync_client=True) as client:
        validated = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id or uuid.uuid4()])),
            task_run_filter=TaskRunFilter(name=TaskRunFilterName(like_="validate-")))
    assert validated == []


@pytest.mark.integration
def test_a_warm_process_runs_the_deployment_and_its_first_run_covers_the_queue(store: ObjectStore) -> None:
    from edgehaul.services.warm import serve_warm

    block = f"core-{uuid.uuid4().hex[:10]}"
    store.save(block, overwrite=True)
    made = [bundle(10, "node-a", seed=s, start_seq=s * 100) for s in (21, 22, 23)]
    keys = [land(store, d, m).removeprefix(store.key("landing", "")) for d, m in made]
    dep = _deployment(f"warm-{uuid.uuid4().hex[:8]}")
    runs = [_queue(dep, CoreIngestParams(store_block=block, bundle_keys=ks)) for ks in (keys[:1], keys[1:])]
    stop = threading.Event()
    out: list[int] = []
    server = threading.Thread(target=contextvars.copy_context().run,
                              args=(lambda: out.append(serve_warm(core_ingest, dep, limit=1, poll_s=0.5, stop=stop)),))
    server.start()
    try:
        with get_client(sync_client=True) as client:
            def final() -> list[Any]:
                states = [client.read_flow_run(uuid.UUID(r)).state for r in runs]
                return states if all(s is not None and s.is_final() for s in states) else []

            states = wait_for(final, 120, "both core_ingest runs to finish", interval=0.5)
    finally:
        stop.set()
        server.join(timeout=120)
    assert all(s is not None and s.is_completed() for s in states), states
    # one slot: the first run took the second's batch, so the second never ran
    assert out == [1] and "covered by core_ingest run" in (states[1].message or "")  # type: ignore[union-attr]
    got = open_table(store, KIND).to_pyarrow_table(columns=["bundle_id"]).column("bundle_id").to_pylist()
    assert sorted(set(got)) == sorted(m.bundle_id for _, m in made) and len(got) == 30
    # the warm run's task runs are recorded like any run's (one validation chunk of its 3 bundles)
    with get_client(sync_client=True) as client:
        def validated() -> list[str]:
            names = [t.name for t in client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[uuid.UUID(runs[0])])))]
            return names if any(n.startswith("validate-") for n in names) else []

        names = wait_for(validated, 30, "the warm run's validation task run", interval=0.5)
    assert [n for n in names if n.startswith("validate-")] == ["validate-3-bundles-1-of-1"], names
