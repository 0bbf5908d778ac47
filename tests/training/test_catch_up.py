"""Training always catches up: runs queue behind a busy training (never cancelled), the
next one trains the newest committed version, and runs covered by it end at once."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from edgehaul.blocks import ObjectStore, TeamQuota
from edgehaul.flows.train_model import TrainModelParams, train_model
from edgehaul.training import registry
from edgehaul.training.catch_up import plan_version
from edgehaul.training.checkpoints import CheckpointStore
from edgehaul_dev import localstack
from tests.train_support import make_dataset
from tests.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]


@given(latest=st.integers(0, 50), data=st.data(), catch_up=st.booleans())
def test_plan_trains_the_newest_once_or_exactly_what_was_asked(latest: int, data: st.DataObject,
                                                               catch_up: bool) -> None:
    requested = data.draw(st.none() | st.integers(0, latest))
    trained = {v: f"m{v}" for v in data.draw(st.sets(st.integers(0, latest)))}
    plan = plan_version(requested, latest, trained, catch_up=catch_up)
    assert plan.latest == latest and plan.requested == requested
    if catch_up:  # the newest, unless a registered model already covers it
        assert plan.version == (None if latest in trained else latest)
        assert plan.covered_by == trained.get(latest)
        assert plan.superseded == (plan.version is not None and requested is not None and requested < latest)
    else:
        assert plan.version == (latest if requested is None else requested)
    assert str(plan.version if plan.version is not None else latest) in plan.reason


def test_a_version_outside_the_dataset_is_refused() -> None:
    with pytest.raises(ValueError, match=r"versions 0\.\.3"):
        plan_version(4, 3, {}, catch_up=True)


def _blocks(store: ObjectStore) -> tuple[str, str]:
    tag = uuid.uuid4().hex[:8]
    store.save(f"store-{tag}", overwrite=True)
    TeamQuota(team="geo", accelerator_hours_per_month=100, max_accelerators_per_run=4,
              storage_bytes=10**9).save(f"quota-{tag}", overwrite=True)
    return f"store-{tag}", f"quota-{tag}"


@pytest.mark.integration
def test_three_commits_during_a_busy_training_the_next_run_trains_the_newest(stack: localstack.StackState,
                                                                              store: ObjectStore) -> None:
    from prefect import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.client.schemas.objects import ConcurrencyLimitConfig, FlowRun, State
    from prefect.deployments import run_deployment
    from prefect.flows import Flow

    make_dataset(store, [1500])  # v0: big enough that the first run is still training while we commit
    store_block, quota_block = _blocks(store)
    tag = uuid.uuid4().hex[:8]
    pool = f"central-gpu-test-{tag}"
    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name=pool, type="process"))
    flow = Flow.from_source(source=str(ROOT), entrypoint="flows/train_model.py:train_model")
    flow.deploy(  # type: ignore[union-attr]
        name=f"train-{tag}", work_pool_name=pool, build=False, push=False, print_next_steps=False,
        concurrency_limit=ConcurrencyLimitConfig(limit=1, collision_strategy="ENQUEUE"),
    )
    params = dict(team="geo", store_block=store_block, quota_block=quota_block, epochs=3, batch_size=32, width=8,
                  num_threads=1, checkpoint_every_steps=20, max_hours=0.5)
    env = {**os.environ, "PREFECT_API_URL": stack.prefect_api_url, "PREFECT_WORKER_QUERY_SECONDS": "1"}
    worker = subprocess.Popen([str(Path(sys.executable).parent / "prefect"), "worker", "start", "--pool", pool,
                               "--type", "process"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)

    def submit(version: int, **over: object) -> FlowRun:
        fr = run_deployment(name=f"train_model/train-{tag}", timeout=0,  # the parameters replace them all
                            parameters={"params": {**params, "dataset_version": version, **over}})
        assert isinstance(fr, FlowRun)
        return fr

    try:
        # 100 epochs, no early stop: ~35 s on these machines (an epoch of 1,000 rows takes ~0.35 s), where the
        # three commits and submissions below take ~8 s; 12 epochs once ended before the third submission
        first = submit(0, epochs=100, patience=0)
        with get_client(sync_client=True) as client:
            def started() -> State | None:
                s = client.read_flow_run(first.id).state
                return s if s is not None and (s.is_running() or s.is_final()) else None

            state = wait_for(started, 240, f"run {first.id} to start", interval=0.5)
            assert state is not None and state.is_running(), state
            # busy training v0 once its first checkpoint is committed (step 20 of ~3,300): the object store says
            # so at once, where its log lines reach the API seconds later
            ckpt = CheckpointStore(store, f"train-{first.id}", emit_events=False)
            wait_for(ckpt.latest, 240, f"a committed checkpoint of run train-{first.id}")
            later = []
            for v in (1, 2, 3):  # three commits while it trains, each triggering its own run
                make_dataset_version(store, v)
                later.append(submit(v))
            assert not client.read_flow_run(first.id).state.is_final()  # type: ignore[union-attr]
            runs = [first, *later]

            def finished() -> list[FlowRun]:
                done = [client.read_flow_run(r.id) for r in runs]
                return done if all(r.state is not None and r.state.is_final() for r in done) else []

            done = wait_for(finished, 400, "every training run to finish")
    finally:
        worker.terminate()
        worker.wait(30)
        with get_client(sync_client=True) as client, contextlib.suppress(Exception):
            client.delete_work_pool(pool)  # no idle test pool left for `make verify` to count
    states = [r.state for r in done]
    assert all(s is not None and s.is_completed() for s in states), [(s.type, s.message) for s in states if s]
    # no result persistence on this deployment: the registry and the runs' final states say what each did
    uri = store.uri("curated", "landsat_patch")
    trained = registry.trained_versions(store, "landcover", uri)
    assert trained[0] == f"train-{first.id}" and set(trained) == {0, 3}  # nothing trained v1 or v2
    # the first queued run trains the newest (v3), whichever commit started it; the other two are covered
    by_id = {f"train-{r.id}": r for r in later}
    newest = by_id[trained[3]]
    # queued runs start in no fixed order: the one that trains may have asked for v1, v2 or v3
    assert newest.parameters["params"]["dataset_version"] in (1, 2, 3)
    final = {r.id: r.state for r in done}
    for r in later:  # the covered runs say why they did nothing, in their final state (shown in the runs list)
        message = final[r.id].message or ""  # type: ignore[union-attr]
        if r.id == newest.id:
            assert "nothing to train" not in message, message
        else:
            assert f"nothing to train: v3 (the newest) is already trained by model {trained[3]}" in message, message


def make_dataset_version(store: ObjectStore, v: int) -> None:
    from deltalake import write_deltalake

    from tests.train_support import processed_rows, with_unusable_rows

    rows = with_unusable_rows(processed_rows(100, "node-a", seed=200 + v, start_seq=10_000 * v))
    write_deltalake(store.uri("curated", "landsat_patch"), rows, storage_options=store.storage_options(), mode="append")


@pytest.mark.integration
def test_catch_up_off_trains_exactly_the_requested_version(store: ObjectStore) -> None:
    make_dataset(store, [120, 120])
    store_block, quota_block = _blocks(store)
    base = dict(team="geo", store_block=store_block, quota_block=quota_block, epochs=1, batch_size=32, width=8,
                num_threads=1, max_hours=0.5, allow_local=True,
                quality_gate=False)  # which version is trained, not how well: 1 epoch on 240 rows
    newest = train_model(TrainModelParams.model_validate({**base, "dataset_version": 0, "run_id": "c1"}))
    assert newest["dataset_version"] == 1 and newest["requested_version"] == 0
    again = train_model(TrainModelParams.model_validate({**base, "run_id": "c2"}))
    assert again["skipped"] and again["model_id"] == "c1" and "already trained by model c1" in again["reason"]
    old = train_model(TrainModelParams.model_validate({**base, "dataset_version": 0, "run_id": "c3",
                                                       "catch_up": False}))
    assert old["dataset_version"] == 0 and not old.get("skipped")
