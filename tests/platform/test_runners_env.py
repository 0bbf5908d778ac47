"""Deployable flows pick their task runner from the environment of the process that runs them.

A worker starts each flow run as `python -m prefect.engine <flow run id>` with its job environment;
the integration test does exactly that for a real core_ingest deployment run, with
EDGEHAUL_TASK_RUNNER=dask and EDGEHAUL_DASK_ADDRESS pointing at a dask.distributed cluster owned by
the test, and reads the scheduler's task stream to see the flow's task runs executed by its workers.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import cast
from uuid import UUID

import pytest
from prefect.task_runners import ThreadPoolTaskRunner
from prefect_dask import DaskTaskRunner

from edgehaul.platform.runners import EnvironmentTaskRunner, RunnerConfigError, from_environment
from edgehaul_dev import localstack

REPO = Path(__file__).resolve().parents[2]


def test_deployable_data_parallel_flows_declare_the_environment_runner() -> None:
    from edgehaul.flows.compact_dataset import compact_dataset
    from edgehaul.flows.core_ingest import core_ingest
    from edgehaul.flows.edge_ingest import edge_ingest

    for f in (core_ingest, compact_dataset, edge_ingest):
        assert isinstance(f.task_runner, EnvironmentTaskRunner), f.name
        # with_options keeps it unless a runner is given (what runners.configured does)
        assert isinstance(f.with_options(retries=1).task_runner, EnvironmentTaskRunner), f.name


def test_runner_is_resolved_when_a_run_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    placeholder = from_environment()  # as at import time, before the job's variables are known
    for name in ("EDGEHAUL_TASK_RUNNER", "EDGEHAUL_DASK_ADDRESS", "EDGEHAUL_DASK_WORKERS", "EDGEHAUL_THREADS"):
        monkeypatch.delenv(name, raising=False)
    default = placeholder.duplicate()
    assert type(default) is ThreadPoolTaskRunner and default == ThreadPoolTaskRunner()  # Prefect's default, unchanged
    monkeypatch.setenv("EDGEHAUL_TASK_RUNNER", "dask")
    monkeypatch.setenv("EDGEHAUL_DASK_ADDRESS", "tcp://dask-scheduler:8786")
    runner = placeholder.duplicate()
    assert isinstance(runner, DaskTaskRunner) and runner.address == "tcp://dask-scheduler:8786"
    assert placeholder.duplicate() is not runner  # a fresh runner per run
    monkeypatch.setenv("EDGEHAUL_TASK_RUNNER", "spark")
    with pytest.raises(RunnerConfigError, match="EDGEHAUL_TASK_RUNNER"):
        placeholder.duplicate()
    with pytest.raises(RuntimeError, match="resolved per flow run"):
        placeholder.submit(None, {})


def test_a_flow_loaded_from_its_file_is_shipped_by_value() -> None:
    from prefect.utilities.importtools import load_script_as_module

    from edgehaul.flows.core_ingest import core_ingest
    from edgehaul.platform.runners_dask import ship_flow_module_by_value

    assert ship_flow_module_by_value(core_ingest) is None  # flows.core_ingest: workers import it themselves
    loaded = load_script_as_module(str(REPO / "flows" / "core_ingest.py"))  # what a deployment run does
    assert "." not in loaded.__name__
    assert ship_flow_module_by_value(loaded.core_ingest) == loaded.__name__


@pytest.mark.integration
def test_deployed_core_ingest_run_with_dask_env_runs_its_tasks_on_the_cluster(stack: localstack.StackState) -> None:
    from distributed import Client, LocalCluster, get_task_stream
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.deployments.runner import RunnerDeployment

    from edgehaul.core.datasets import open_table
    from edgehaul.flows.core_ingest import core_ingest
    from tests.builders import bundle
    from tests.conftest import store_for

    store = store_for(stack, prefix=f"rt-{uuid.uuid4().hex[:8]}")
    s3 = store.client()
    good = [bundle(25, "node-a", seed=40)]
    bad_data, bad_m = bundle(10, "node-b", seed=47)
    for data, m in [*good, (bad_data[:-64], bad_m)]:
        s3.put_object(Bucket=store.bucket("landing"), Key=store.key("landing", m.object_key), Body=data)
        s3.put_object(Bucket=store.bucket("landing"), Key=store.key("landing", m.manifest_key), Body=m.to_json())
    block = f"rt-{uuid.uuid4().hex[:8]}"
    store.save(block, overwrite=True)

    # both calls are sync in a sync context (Prefect's async_dispatch)
    deployment = cast(RunnerDeployment, core_ingest.to_deployment(name=f"dask-env-{block}"))
    deployment_id = cast(UUID, deployment.apply())
    with get_client(sync_client=True) as client:
        run = client.create_flow_run_from_deployment(
            deployment_id, parameters={"params": {"store_block": block, "refresh_cache": True, "validate_batch": 1}}
        )

    # one worker process: every worker pays the imports and Great Expectations' start-up, and CI has 2 cores
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \
            Client(cluster) as dask_client, get_task_stream(client=dask_client) as stream:
        env = {**os.environ, "EDGEHAUL_TASK_RUNNER": "dask", "EDGEHAUL_DASK_ADDRESS": cluster.scheduler_address}
        # what a process worker runs for a flow run (its job env on top of its own)
        proc = subprocess.run([sys.executable, "-m", "prefect.engine", str(run.id)], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=420)
        workers = set(dask_client.scheduler_info()["workers"])
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert f"task runner: dask cluster at {cluster.scheduler_address}" in out

    with get_client(sync_client=True) as client:
        state = client.read_flow_run(run.id).state
        task_runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])))
    assert state is not None and state.is_completed(), state
    # submitted task runs (a validation chunk per bundle at validate_batch=1, one quarantine) went to Dask;
    # the rest ran inline
    submitted = [t for t in task_runs if t.task_key.startswith(("validate_bundles_task", "quarantine_task"))]
    assert len(submitted) == 3, sorted(t.name for t in task_runs)
    assert len(task_runs) > len(submitted)  # discover / read manifests / commit ran in the flow's process
    assert len(stream.data) == len(submitted), [r["key"] for r in stream.data]
    assert {r["worker"] for r in stream.data} <= workers
    assert all(r["status"] == "OK" for r in stream.data)
    committed = open_table(store, "landsat_patch").to_pyarrow_table().column("sample_id").to_pylist()
    assert sorted(committed) == sorted(s for _, m in good for s in m.sample_ids)
