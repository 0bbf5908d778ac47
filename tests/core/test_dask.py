"""The Dask path: a data-parallel stage gives the same results under Dask as under threads.

The stage maps real domain functions (edgehaul.edge.preprocess.preprocess, edgehaul.bundles.write_bundle)
over a backlog of raw Landsat batches, one task per batch, and is run by a Prefect flow whose task
runner comes from edgehaul.platform.runners (EDGEHAUL_TASK_RUNNER).
"""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import given
from hypothesis import strategies as st
from prefect import flow, task
from prefect.task_runners import ThreadPoolTaskRunner
from prefect_dask import DaskTaskRunner

from edgehaul.bundles import read_bundle, write_bundle
from edgehaul.contracts import load_contract
from edgehaul.edge.landsat import generate
from edgehaul.edge.preprocess import preprocess
from edgehaul.platform.runners import RunnerConfig, RunnerConfigError, configured, task_runner
from edgehaul_dev import localstack


@task
def bundle_batch(raw: pa.Table) -> dict[str, object]:
    """One backlog batch -> one bundle (bytes + manifest) and the ids rejected on the way."""
    contract = load_contract("landsat_patch")
    res = preprocess(raw, contract)
    acc = res.accepted
    # Deterministic stand-in for scoring: the batch-normalised NIR mean (tiering is another stage).
    nir = pc.cast(acc.column("mean_b4_nir"), pa.float32())
    lo, hi = pc.min(nir).as_py(), pc.max(nir).as_py()
    value = pc.divide(pc.subtract(nir, lo), max(hi - lo, 1e-6))
    rows = acc.append_column("value", value).append_column("tier", pa.array(["normal"] * acc.num_rows))
    rows = rows.append_column("is_summary", pa.array([False] * acc.num_rows))
    data, manifest = write_bundle(rows, contract, tier="normal")
    return {"data": data, "manifest": manifest, "rejected": sorted(res.rejects.column("sample_id").to_pylist())}


@flow
def bundle_backlog(batches: list[pa.Table]) -> list[dict[str, object]]:
    futures = bundle_batch.map(batches)
    return [f.result() for f in futures]


def _backlog(n_batches: int = 4, rows: int = 300) -> list[pa.Table]:
    batches = []
    for i in range(n_batches):
        raw = next(generate(rows, "node-a", seed=i, start_seq=i * rows, batch_size=rows))
        # a duplicated sample id in every batch: preprocessing must reject it the same way everywhere
        batches.append(pa.concat_tables([raw, raw.slice(0, 1)]))
    return batches


def test_runner_defaults_to_threads_and_reads_dask_settings() -> None:
    assert isinstance(task_runner(RunnerConfig.from_env({})), ThreadPoolTaskRunner)
    cfg = RunnerConfig.from_env({"EDGEHAUL_TASK_RUNNER": "dask", "EDGEHAUL_DASK_ADDRESS": "tcp://sched:8786"})
    runner = task_runner(cfg)
    assert isinstance(runner, DaskTaskRunner) and runner.address == "tcp://sched:8786"
    local = task_runner(RunnerConfig.from_env({"EDGEHAUL_TASK_RUNNER": "Dask", "EDGEHAUL_DASK_WORKERS": "3"}))
    assert isinstance(local, DaskTaskRunner) and local.address is None
    assert local.cluster_kwargs["n_workers"] == 3 and local.cluster_kwargs["threads_per_worker"] == 1
    assert "local dask cluster (3 workers)" in RunnerConfig.from_env(
        {"EDGEHAUL_TASK_RUNNER": "dask", "EDGEHAUL_DASK_WORKERS": "3"}
    ).describe()


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({"EDGEHAUL_TASK_RUNNER": "ray"}, "EDGEHAUL_TASK_RUNNER"),
        ({"EDGEHAUL_TASK_RUNNER": "dask", "EDGEHAUL_DASK_ADDRESS": "sched:8786"}, "EDGEHAUL_DASK_ADDRESS"),
        ({"EDGEHAUL_DASK_WORKERS": "0"}, "EDGEHAUL_DASK_WORKERS"),
        ({"EDGEHAUL_THREADS": "two"}, "EDGEHAUL_THREADS"),
    ],
)
def test_bad_runner_settings_name_the_variable(env: dict[str, str], names: str) -> None:
    with pytest.raises(RunnerConfigError, match=names):
        RunnerConfig.from_env(env)


@given(workers=st.integers(min_value=1, max_value=512), threads=st.integers(min_value=1, max_value=512))
def test_any_positive_sizes_round_trip(workers: int, threads: int) -> None:
    cfg = RunnerConfig.from_env(
        {"EDGEHAUL_TASK_RUNNER": " dask ", "EDGEHAUL_DASK_WORKERS": str(workers), "EDGEHAUL_THREADS": str(threads)}
    )
    assert (cfg.kind, cfg.dask_workers, cfg.threads) == ("dask", workers, threads)


@pytest.mark.integration
def test_dask_and_thread_runs_give_identical_bundles(
    stack: localstack.StackState, monkeypatch: pytest.MonkeyPatch
) -> None:
    backlog = _backlog()
    results = {}
    for kind in ("thread", "dask"):
        monkeypatch.setenv("EDGEHAUL_TASK_RUNNER", kind)
        monkeypatch.setenv("EDGEHAUL_DASK_WORKERS", "2")
        f = configured(bundle_backlog)
        assert isinstance(f.task_runner, DaskTaskRunner if kind == "dask" else ThreadPoolTaskRunner)
        results[kind] = f(backlog)
    assert os.environ["EDGEHAUL_TASK_RUNNER"] == "dask"

    def summary(out: list[dict[str, object]]) -> list[tuple[object, ...]]:
        return [
            (r["manifest"].bundle_id, r["manifest"].sha256, tuple(r["manifest"].sample_ids), tuple(r["rejected"]))  # type: ignore[attr-defined]
            for r in out
        ]

    assert summary(results["dask"]) == summary(results["thread"])
    # Every input sample is accounted for: in its bundle, or rejected with the duplicate.
    for raw, r in zip(backlog, results["dask"], strict=True):
        table = read_bundle(r["data"], r["manifest"])  # type: ignore[arg-type]
        ids = table.column("sample_id").to_pylist()
        assert len(ids) + len(r["rejected"]) == raw.num_rows  # type: ignore[arg-type]
        assert set(ids) == set(raw.column("sample_id").to_pylist())
    assert len({r["manifest"].bundle_id for r in results["dask"]}) == len(backlog)  # type: ignore[attr-defined]


@pytest.mark.integration
def test_core_ingest_under_dask_commits_what_the_thread_run_commits(
    stack: localstack.StackState, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real core_ingest flow (per-bundle validation tasks) on both runners, each into its own prefix.

    The flow is called as it is declared: it picks its runner from EDGEHAUL_TASK_RUNNER when the run starts."""
    import uuid

    from edgehaul.core.datasets import open_table
    from edgehaul.flows.core_ingest import CoreIngestParams, core_ingest
    from tests.builders import bundle
    from tests.conftest import store_for

    bundles = [bundle(30, "node-a", seed=i, start_seq=i * 30) for i in range(3)]
    bad_data, bad_m = bundle(10, "node-b", seed=7)
    committed: dict[str, list[str]] = {}
    for kind in ("thread", "dask"):
        store = store_for(stack, prefix=f"dk-{kind}-{uuid.uuid4().hex[:8]}")
        s3 = store.client()
        for data, m in [*bundles, (bad_data[:-64], bad_m)]:
            s3.put_object(Bucket=store.bucket("landing"), Key=store.key("landing", m.object_key), Body=data)
            s3.put_object(Bucket=store.bucket("landing"), Key=store.key("landing", m.manifest_key), Body=m.to_json())
        block = f"dk-{uuid.uuid4().hex[:8]}"
        store.save(block, overwrite=True)
        monkeypatch.setenv("EDGEHAUL_TASK_RUNNER", kind)
        monkeypatch.setenv("EDGEHAUL_DASK_WORKERS", "2")
        state = core_ingest(CoreIngestParams(store_block=block), return_state=True)
        assert state.is_completed(), (kind, state)
        committed[kind] = sorted(open_table(store, "landsat_patch").to_pyarrow_table().column("sample_id").to_pylist())
    assert committed["dask"] == committed["thread"] == sorted(s for _, m in bundles for s in m.sample_ids)
