"""train_model as a deployment: launched on a central `process` pool by a real worker, refused on
an edge pool, refused over quota and outside a pool without the flag; publish_model swaps the
edge model pointer."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import cast

import pytest

from edgehaul.blocks import ObjectStore, TeamQuota
from edgehaul.flows.train_model import TrainModelParams, train_model
from edgehaul.training import registry
from edgehaul.training.placement import PlacementError
from edgehaul.training.quota import QuotaExceeded
from edgehaul_dev import localstack
from tests.train_support import make_dataset

ROOT = Path(__file__).resolve().parents[2]


GOOD = {"val_acc": 0.9, "val_macro_f1": 0.8, "val_chance_macro_f1": 0.2}
WEAK = {"val_acc": 0.6, "val_macro_f1": 0.22, "val_chance_macro_f1": 0.2}


def _small(store_block: str, quota_block: str, **kw: object) -> dict[str, object]:
    p: dict[str, object] = dict(
        team="geo", store_block=store_block, quota_block=quota_block, epochs=1, batch_size=32, width=8,
        num_threads=1, checkpoint_every_steps=10, max_hours=0.5, quality_gate=False,  # plumbing, not learning
    )
    p.update(kw)
    return p


def _blocks(store: ObjectStore, hours: float = 100.0) -> tuple[str, str]:
    tag = uuid.uuid4().hex[:8]
    store.save(f"store-{tag}", overwrite=True)
    TeamQuota(team="geo", accelerator_hours_per_month=hours, max_accelerators_per_run=4,
              storage_bytes=10**9).save(f"quota-{tag}", overwrite=True)
    return f"store-{tag}", f"quota-{tag}"


@pytest.mark.integration
def test_train_model_runs_on_central_pool_and_is_refused_on_edge_pool(stack: localstack.StackState,
                                                                      store: ObjectStore) -> None:
    from prefect import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.client.schemas.objects import FlowRun
    from prefect.deployments import run_deployment
    from prefect.flows import Flow

    make_dataset(store, [300])
    store_block, quota_block = _blocks(store)
    tag = uuid.uuid4().hex[:8]
    pools = {"central": f"central-test-{tag}", "edge": f"edge-test-{tag}"}
    with get_client(sync_client=True) as client:
        for pool in pools.values():
            client.create_work_pool(WorkPoolCreate(name=pool, type="process"))
    runs: dict[str, FlowRun] = {}
    for kind, pool in pools.items():
        flow = Flow.from_source(source=str(ROOT), entrypoint="flows/train_model.py:train_model")
        flow.deploy(  # type: ignore[union-attr]
            name=f"train-{kind}-{tag}", work_pool_name=pool, build=False, push=False, print_next_steps=False,
            parameters={"params": _small(store_block, quota_block, run_id=f"flow-{kind}-{tag}")},
        )
        runs[kind] = cast(FlowRun, run_deployment(name=f"train_model/train-{kind}-{tag}", timeout=0))
    env = {**os.environ, "PREFECT_API_URL": stack.prefect_api_url, "PREFECT_WORKER_QUERY_SECONDS": "1",
           "PREFECT_LOGGING_LEVEL": "WARNING"}
    workers = {
        kind: subprocess.Popen(
            [str(Path(sys.executable).parent / "prefect"), "worker", "start", "--pool", pool, "--run-once",
             "--type", "process"],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for kind, pool in pools.items()
    }
    outs = {kind: w.communicate(timeout=400)[0] for kind, w in workers.items()}
    with get_client(sync_client=True) as client:
        central = client.read_flow_run(runs["central"].id)
        edge = client.read_flow_run(runs["edge"].id)
        assert central.state is not None and central.state.is_completed(), outs["central"][-3000:]
        assert central.work_pool_name == pools["central"]
        assert edge.state is not None and edge.state.is_failed(), outs["edge"][-3000:]
        assert edge.work_pool_name == pools["edge"]
        assert "edge pool" in str(edge.state.message)
        arts = client.read_artifacts(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[central.id])))
        kinds = {a.key: a.type for a in arts}
        assert kinds.get("train-landcover-metrics") == "table" and kinds.get("train-landcover-plot") == "image"
        assert kinds.get("train-landcover-plot-inline") == "markdown"
    lin = registry.read_lineage(store, "landcover", f"flow-central-{tag}")
    assert lin is not None and lin["flow_run_id"] == str(central.id) and lin["team"] == "geo"
    assert registry.read_lineage(store, "landcover", f"flow-edge-{tag}") is None


@pytest.mark.integration
def test_train_model_refuses_over_quota_and_outside_a_pool(store: ObjectStore) -> None:
    make_dataset(store, [50])
    store_block, quota_block = _blocks(store, hours=1.0)
    with pytest.raises(PlacementError, match="allow_local"):
        train_model(TrainModelParams.model_validate(_small(store_block, quota_block)))
    # 2 processes x 0.75 h = 1.5 h > the 1 h monthly quota
    over = _small(store_block, quota_block, allow_local=True, nproc_per_node=2, max_hours=0.75)
    with pytest.raises(QuotaExceeded, match=r"team 'geo' quota exceeded.*2 x 0.75 h = 1.5 h"):
        train_model(TrainModelParams.model_validate(over))


@pytest.mark.integration
def test_local_run_trains_and_publish_model_swaps_the_edge_pointer(store: ObjectStore) -> None:
    from edgehaul.flows.publish_model import PublishModelParams, QualityGateFailed, publish_model

    make_dataset(store, [200])
    store_block, quota_block = _blocks(store)
    out = train_model(TrainModelParams.model_validate(_small(store_block, quota_block, allow_local=True, run_id="a1")))
    assert out["work_pool"] == "local" and out["dataset_version"] == 0 and out["model_id"] == "a1"
    # a retried run with the same run_id does not train again
    again = train_model(TrainModelParams.model_validate(_small(store_block, quota_block, allow_local=True,
                                                               run_id="a1")))
    assert again["history"] == out["history"]
    with pytest.raises(QualityGateFailed, match="below the publish gate"):
        publish_model(PublishModelParams(model_id="a1", store_block=store_block, min_val_acc=1.0))
    with pytest.raises(QualityGateFailed, match=r"macro-F1 .* below the publish gate"):
        publish_model(PublishModelParams(model_id="a1", store_block=store_block, min_macro_f1_over_chance=1.0))
    registry.register_model(store, "landcover", "a0", {"x": 1}, {"team": "geo", "final": GOOD})
    first = publish_model(PublishModelParams(model_id="a0", store_block=store_block))
    assert first["model_id"] == "a0" and first["previous"] is None
    # the gate is on by default: a model at chance, or one never validated, is refused
    registry.register_model(store, "landcover", "weak", {"x": 1}, {"team": "geo", "final": WEAK})
    registry.register_model(store, "landcover", "unmeasured", {"x": 1}, {"team": "geo", "final": {"val_acc": 0.9}})
    for mid in ("weak", "unmeasured"):
        with pytest.raises(QualityGateFailed, match="below the publish gate"):
            publish_model(PublishModelParams(model_id=mid, store_block=store_block))
    registry.register_model(store, "landcover", "a2", {"x": 1}, {"team": "geo", "final": GOOD})
    second = publish_model(PublishModelParams(model_id="a2", store_block=store_block))
    assert second["previous"] == "a0"
    pointer, _ = registry.read_json(store, registry.latest_uri(store))
    assert pointer["model_id"] == "a2"


@pytest.mark.integration
def test_a_model_of_an_older_dataset_version_does_not_replace_a_newer_one(store: ObjectStore) -> None:
    from edgehaul.flows.publish_model import PublishModelParams, publish_model

    store_block, _ = _blocks(store)
    name, uri = "stale-check", "s3://curated/tables/stale-check"
    for model_id, version in (("v5", 5), ("v3", 3), ("v7", 7), ("other", 1)):
        registry.register_model(store, name, model_id, {"x": 1}, {"dataset_uri": uri if model_id != "other" else
                                                                  uri + "-b", "dataset_version": version,
                                                                  "final": GOOD})
    assert publish_model(PublishModelParams(model_id="v5", model_name=name, store_block=store_block))["model_id"] == "v5"
    late = publish_model(PublishModelParams(model_id="v3", model_name=name, store_block=store_block))
    assert late["published"] is False and "version 3" in late["reason"] and "v5 (version 5)" in late["reason"]
    assert registry.read_json(store, registry.latest_uri(store, name))[0]["model_id"] == "v5"
    with pytest.raises(registry.StaleModel, match="older than the published model v5"):
        registry.publish(store, name, "v3")
    # newer versions, another dataset and an operator's rollback all go through
    assert registry.publish(store, name, "v7")["previous"] == "v5"
    assert registry.publish(store, name, "v3", allow_older=True)["previous"] == "v7"
    assert registry.publish(store, name, "other")["dataset_version"] == 1
