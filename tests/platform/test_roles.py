"""Role block names are defined once (edgehaul.platform.roles) and the deployment files follow them:
every deployment names its role's store block and none runs as admin; the production prefect.yaml
holds no demo settings and pulls the code from the image; the demo overlay only adds demo settings.
And `load_block`: typed, with an error that names the block and what to do."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from edgehaul.platform.block_loading import BlockNotFoundError, aload_block, load_block
from edgehaul.platform.caching import CORE_RESULTS_BLOCK
from edgehaul.platform.roles import FLOW_STORES, StoreBlock, node_store
from edgehaul_dev import configure, deploy, localstack

PRODUCTION = deploy.load_spec()
DEMO = deploy.load_spec(overlay=deploy.DEMO_OVERLAY)
IMAGE_DIR = "/opt/edgehaul"


def _flow(d: dict[str, Any]) -> str:
    return str(d["entrypoint"].rsplit(":", 1)[1])


def _params(d: dict[str, Any]) -> dict[str, Any]:
    return dict((d.get("parameters") or {}).get("params") or {})


def _store_problems(spec: dict[str, Any]) -> list[str]:
    """Every way a deployment (or a trigger's run of it) would not run as its role's own store."""
    problems = []
    for d in spec["deployments"]:
        flow, where = _flow(d), f"{_flow(d)}/{d['name']}"
        if flow not in FLOW_STORES:
            problems.append(f"{where}: flow has no role in edgehaul.platform.roles.FLOW_STORES")
            continue
        param, role = FLOW_STORES[flow]
        params = _params(d)
        want = node_store(params.get("edge_node", "")) if role is None else role.value
        # A trigger's params replace the deployment's as a whole: each must name the store again.
        runs = [("deployment", params)] + [(f"trigger {t.get('name')!r}", (t.get("parameters") or {}).get("params"))
                                           for t in d.get("triggers") or [] if t.get("parameters")]
        for what, p in runs:
            got = (p or {}).get(param)
            if got is None:
                problems.append(f"{where} ({what}): no {param} (the flow's default would decide who it runs as)")
            elif got == StoreBlock.ADMIN.value:
                problems.append(f"{where} ({what}): {param}={got!r} runs as admin")
            elif got != want:
                problems.append(f"{where} ({what}): {param}={got!r}, its role's block is {want!r}")
    return problems


@pytest.mark.parametrize("spec", [PRODUCTION, DEMO], ids=["production", "demo overlay"])
def test_every_deployment_runs_as_its_roles_store_never_admin(spec: dict[str, Any]) -> None:
    assert not _store_problems(spec)
    assert {_flow(d) for d in spec["deployments"]} == set(FLOW_STORES)


def test_the_store_check_fails_on_admin_a_missing_block_and_another_nodes_store() -> None:
    spec: dict[str, Any] = yaml.safe_load(yaml.safe_dump(PRODUCTION))
    by = {f"{_flow(d)}/{d['name']}": d for d in spec["deployments"]}
    by["train_model/on-dataset-committed"]["parameters"]["params"]["store_block"] = "central"
    del by["cost_report/monthly"]["parameters"]
    by["uplink_drain/node-b"]["parameters"]["params"]["object_store"] = "node-a"
    by["core_ingest/on-bundle-landed"]["triggers"][0]["parameters"]["params"].pop("store_block")
    problems = "\n".join(_store_problems(spec))
    assert "train_model/on-dataset-committed (deployment): store_block='central' runs as admin" in problems
    assert "cost_report/monthly (deployment): no store_block" in problems
    assert "uplink_drain/node-b (deployment): object_store='node-a', its role's block is 'node-b'" in problems
    assert "core_ingest/on-bundle-landed (trigger" in problems and len(problems.splitlines()) == 4


@pytest.mark.parametrize("spec", [PRODUCTION, DEMO], ids=["production", "demo overlay"])
def test_no_deployment_rewrites_the_shared_results_block(spec: dict[str, Any]) -> None:
    """core_ingest and compact_dataset cache through the central results block saved at deploy time (ingest's
    keys); their deployments and triggers name it (left empty, a run would cache on the worker's disk only)."""
    from edgehaul.flows.compact_dataset import CompactDatasetParams
    from edgehaul.flows.core_ingest import CoreIngestParams

    saving: dict[str, type[BaseModel]] = {"core_ingest": CoreIngestParams, "compact_dataset": CompactDatasetParams}
    assert all(m.model_fields["result_storage"].default == "" for m in saving.values())
    slug = f"s3-bucket/{CORE_RESULTS_BLOCK}"
    wrong = [f"{_flow(d)}/{d['name']} {what}" for d in spec["deployments"] if _flow(d) in saving
             for what, p in [("deployment", _params(d)),
                             *((f"trigger {t.get('name')!r}", t["parameters"].get("params") or {})
                               for t in d.get("triggers") or [] if t.get("parameters"))]
             if p.get("result_storage") != slug]
    assert not wrong


def test_production_file_has_no_demo_settings_and_pulls_the_code_from_the_image() -> None:
    assert PRODUCTION["pull"] == [{"prefect.deployments.steps.set_working_directory": {"directory": IMAGE_DIR}}]
    dockerfile = (deploy.REPO / "infra" / "images" / "Dockerfile").read_text()
    assert f"WORKDIR {IMAGE_DIR}" in dockerfile and f"ln -s edgehaul/$d {IMAGE_DIR}/$d" in dockerfile
    assert not [f"{_flow(d)}/{d['name']}" for d in PRODUCTION["deployments"] if _params(d).get("simulate")]
    # Whatever the overlay sets must not be in the production file already (a demo setting leaked back).
    overlay = yaml.safe_load(deploy.DEMO_OVERLAY.read_text())
    prod = {(d["entrypoint"], d["name"]): d for d in PRODUCTION["deployments"]}

    def leaked(over: Any, base: Any, path: str) -> list[str]:
        if isinstance(over, dict) and isinstance(base, dict):
            return [x for k, v in over.items() for x in leaked(v, base.get(k), f"{path}.{k}")]
        return [path] if over == base else []

    found = [x for o in overlay["deployments"] for x in leaked(
        {k: v for k, v in o.items() if k not in ("entrypoint", "name")}, prod[(o["entrypoint"], o["name"])], o["name"])]
    assert not found, f"demo settings in the production prefect.yaml: {found}"


def test_demo_overlay_simulates_the_link_runs_from_the_checkout_and_changes_no_store() -> None:
    uplinks = [d for d in DEMO["deployments"] if _flow(d) == "uplink_drain"]
    assert len(uplinks) == 2 and all(_params(d)["simulate"] is True for d in uplinks)
    assert "pull" not in DEMO  # Prefect's default pull step: the folder `prefect deploy` runs from
    for prod, demo in zip(PRODUCTION["deployments"], DEMO["deployments"], strict=True):
        param = FLOW_STORES[_flow(prod)].param
        assert _params(demo)[param] == _params(prod)[param]
        assert demo["work_pool"] == prod["work_pool"] and demo.get("triggers") == prod.get("triggers")


def test_overlay_merge_rules(tmp_path: Path) -> None:
    spec: dict[str, Any] = {"pull": [1], "deployments": [
        {"name": "a", "entrypoint": "f.py:f", "parameters": {"params": {"x": 1, "y": 2}}}]}
    out = deploy.apply_overlay(spec, {"pull": None, "deployments": [
        {"name": "a", "entrypoint": "f.py:f", "parameters": {"params": {"y": None, "z": 3}}}]})
    assert out == {"deployments": [{"name": "a", "entrypoint": "f.py:f", "parameters": {"params": {"x": 1, "z": 3}}}]}
    assert spec["deployments"][0]["parameters"]["params"] == {"x": 1, "y": 2}  # the input is left alone
    bad = tmp_path / "overlay.yaml"
    bad.write_text(yaml.safe_dump({"deployments": [{"name": "renamed", "entrypoint": "flows/core_ingest.py:core_ingest"}]}))
    with pytest.raises(ValueError, match=r"overlay\.yaml: overlay deployment 'renamed' .* matches no deployment"):
        deploy.load_spec(overlay=bad)


def test_flow_defaults_and_the_local_stack_use_the_role_blocks() -> None:
    from edgehaul.flows.compact_dataset import CompactDatasetParams
    from edgehaul.flows.core_ingest import CoreIngestParams
    from edgehaul.flows.cost_report import CostReportParams
    from edgehaul.flows.lifecycle_moves import LifecycleParams
    from edgehaul.flows.publish_model import PublishModelParams
    from edgehaul.flows.train_model import TrainModelParams

    models: dict[str, type[BaseModel]] = {
        "core_ingest": CoreIngestParams, "compact_dataset": CompactDatasetParams, "train_model": TrainModelParams,
        "publish_model": PublishModelParams, "lifecycle_moves": LifecycleParams, "cost_report": CostReportParams}
    for flow, model in models.items():
        param, role = FLOW_STORES[flow]
        assert model.model_fields[param].default == role, flow
    # configure saves one block per role, with the identity of the same name (and admin for `central`)
    assert configure.STORE_BLOCKS == {"central": "admin", "ingest": "ingest", "trainer": "trainer",
                                      "lifecycle": "lifecycle"}
    assert set(configure.STORE_BLOCKS.values()) <= set(localstack.ROLES)
    iam = deploy.REPO / "infra" / "iam"
    assert all((iam / f"{b.identity}.json").exists() for b in StoreBlock if b is not StoreBlock.ADMIN)


@pytest.mark.integration
def test_load_block_is_typed_and_a_missing_block_says_what_to_do(stack: localstack.StackState) -> None:
    import asyncio

    from edgehaul.blocks import LinkProfile, ObjectStore

    name = f"t-{uuid.uuid4().hex[:10]}"
    LinkProfile(bandwidth_bps=1e6).save(name)
    profile = load_block(LinkProfile, name)
    assert type(profile) is LinkProfile and profile.bandwidth_bps == 1e6
    assert asyncio.run(aload_block(LinkProfile, name)).bandwidth_bps == 1e6
    with pytest.raises(BlockNotFoundError) as e:
        load_block(ObjectStore, name, param="store_block")  # a LinkProfile of that name is not an ObjectStore
    msg = str(e.value)
    assert f"ObjectStore block '{name}' (type 'edgehaul-object-store') not found on {stack.prefect_api_url}" in msg
    assert "infra/README.md#blocks" in msg and "pass store_block=" in msg
    assert isinstance(e.value, ValueError)  # callers that caught Prefect's ValueError still do
    with pytest.raises(BlockNotFoundError, match="pass object_store="):
        asyncio.run(aload_block(ObjectStore, name, param="object_store"))
