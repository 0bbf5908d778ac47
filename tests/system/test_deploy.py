"""deployments/prefect.yaml: `prefect deploy --all` on the session's server, and a webhook-triggered
deployment run executed by a worker on the right pool."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest

from edgehaul.services.gateway import signed_headers
from edgehaul_dev import deploy, localstack
from tests.waiting import wait_for

FLOW_POOLS = {  # docs/ARCHITECTURE.md, "Flows"
    "edge_ingest": "edge-", "uplink_drain": "edge-", "core_ingest": "central", "compact_dataset": "central",
    "train_model": "central-gpu", "publish_model": "central", "lifecycle_moves": "ops", "cost_report": "ops",
    "fleet_report": "ops",
}


def test_spec_deploys_every_flow_to_its_pool_with_schedules_and_triggers() -> None:
    spec = deploy.load_spec()
    assert not deploy.missing_entrypoints(spec), "an entrypoint in deployments/prefect.yaml does not exist"
    by_flow: dict[str, list[dict[str, Any]]] = {}
    for d in spec["deployments"]:
        by_flow.setdefault(d["entrypoint"].rsplit(":", 1)[1], []).append(d)
    assert set(by_flow) == set(FLOW_POOLS)
    for flow, deps in by_flow.items():
        for d in deps:
            want, pool = FLOW_POOLS[flow], d["work_pool"]["name"]
            assert pool.startswith(want) if want.endswith("-") else pool == want, (flow, pool)
            assert Path(deploy.REPO, d["entrypoint"].split(":")[0]).name == f"{flow}.py"
    assert {d["name"] for d in by_flow["uplink_drain"]} == {"node-a", "node-b"}
    assert all("interval" in s for d in by_flow["uplink_drain"] for s in d["schedules"])
    assert by_flow["lifecycle_moves"][0]["schedules"][0]["cron"] == "0 3 * * *"
    assert by_flow["cost_report"][0]["schedules"][0]["cron"].endswith(" 1 * *")  # monthly
    assert by_flow["fleet_report"][0]["schedules"][0]["interval"] == 300
    expects = {flow: {e for d in deps for t in d.get("triggers", []) for e in t["expect"]} for flow, deps in by_flow.items()}
    assert expects["core_ingest"] == {"edgehaul.landing.batch"}
    assert expects["train_model"] == {"edgehaul.dataset.committed"}
    assert expects["publish_model"] == {"edgehaul.model.ready"}
    assert expects["uplink_drain"] == {"edgehaul.contact.opened"}
    text = (deploy.REPO / "deployments" / "prefect.yaml").read_text()
    assert "definitions:" in text and "*bundle_landed" in text and "&central" in text


def test_missing_entrypoint_is_named(tmp_path: Path) -> None:
    spec = {"deployments": [{"name": "x", "entrypoint": "flows/nope.py:nope", "work_pool": {"name": "ops"}}]}
    assert deploy.missing_entrypoints(spec) == ["flows/nope.py:nope"]
    bad = tmp_path / "prefect.yaml"
    bad.write_text(json.dumps(spec))
    with pytest.raises(FileNotFoundError, match=r"flows/nope\.py:nope"):
        deploy.prefect_deploy(bad)


@pytest.mark.integration
def test_prefect_deploy_all_and_a_webhook_runs_a_deployment_on_its_pool(stack: localstack.StackState) -> None:
    from prefect.client.orchestration import get_client

    from edgehaul_dev import configure

    spec = deploy.load_spec()
    configure.register_block_types()
    configure.save_blocks(stack)
    deploy.ensure_pools(deploy.pools_of(spec))
    assert deploy.ensure_pools(deploy.pools_of(spec)) == []  # idempotent
    out = deploy.prefect_deploy()
    assert "successfully created" in out

    ids = []
    try:
        with get_client(sync_client=True) as client:
            pools = {p.name: p.type for p in client.read_work_pools()}
            assert {pools[p] for p in deploy.pools_of(spec)} == {"process"}
            deps = {}
            for name in deploy.deployment_names(spec):
                d = client.read_deployment_by_name(name)
                deps[name] = d
                ids.append(d.id)
            assert deps["train_model/on-dataset-committed"].work_pool_name == "central-gpu"
            assert deps["uplink_drain/node-b"].work_queue_name == "node-b"
            assert deps["uplink_drain/node-a"].schedules[0].schedule.interval.total_seconds() == 600  # type: ignore[union-attr]
            assert deps["cost_report/monthly"].schedules[0].schedule.cron == "0 6 1 * *"  # type: ignore[union-attr]
            triggers = {
                name: client.read_resource_related_automations(f"prefect.deployment.{d.id}") for name, d in deps.items()
            }
            ingest = triggers["core_ingest/on-bundle-landed"]
            assert len(ingest) == 1 and ingest[0].trigger.expect == {"edgehaul.landing.batch"}  # type: ignore[union-attr]
            assert ingest[0].actions[0].parameters == {  # type: ignore[union-attr]
                "params": {"store_block": "ingest", "result_storage": "s3-bucket/edgehaul-core-results",
                           "bundle_keys": {"__prefect_kind": "json", "value": {
                               "__prefect_kind": "jinja", "template": "{{ event.payload.bundle_keys | tojson }}"}}}
            }
            assert len(triggers["publish_model/on-model-ready"]) == 1

        # A ground station's signed webhook -> contact.opened -> uplink_drain/node-a on edge-default,
        # executed by the pool's worker (an empty spool drains nothing and completes).
        gateway = localstack.start_gateway(stack)
        sender, secret = localstack.gateway_sender(stack)
        os.environ["PREFECT_WORKER_QUERY_SECONDS"] = "1"
        try:
            pid = deploy.start_workers(["edge-default"], Path(stack.root))
        finally:
            del os.environ["PREFECT_WORKER_QUERY_SECONDS"]
        try:
            body = json.dumps({"station_id": "gs-svalbard", "node_id": "node-a", "window_start": "2026-12-03T10:00:00Z",
                               "window_end": "2026-12-03T10:10:00Z"}).encode()
            r = httpx.post(f"{gateway}/hooks/{sender}/contact-window-opened", content=body,
                           headers=signed_headers(secret, body), timeout=60)  # a loaded machine
            assert r.status_code == 202, r.text
            dep_a = deps["uplink_drain/node-a"]

            def triggered() -> Any:
                from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

                with get_client(sync_client=True) as client:
                    runs = client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[dep_a.id])))
                return [fr for fr in runs if fr.created_by and fr.created_by.type == "AUTOMATION"]

            run = wait_for(triggered, 60, "the contact-window trigger to create a flow run")[0]

            def finished() -> Any:
                with get_client(sync_client=True) as client:
                    fr = client.read_flow_run(run.id)
                return fr if fr.state and fr.state.is_final() else None

            logs = Path(stack.root) / "logs" / "workers.log"
            fr = wait_for(finished, 240, f"the triggered run to finish; worker log: {logs}")
            assert fr.state.is_completed(), (fr.state, logs.read_text()[-3000:] if logs.exists() else "")
            assert fr.work_pool_name == "edge-default" and fr.work_queue_name == "node-a"
            assert fr.parameters["params"]["edge_node"] == "node-a"
        finally:
            os.killpg(pid, signal.SIGTERM)
            (Path(stack.root) / "pids" / "workers.pid").unlink(missing_ok=True)
    finally:
        # Leave no triggers behind for the rest of the session's tests (their events would start runs).
        with get_client(sync_client=True) as client:
            for i in ids:
                client.delete_deployment(i)
            for name in {t["name"] for ts in deploy.split_triggers(spec)[1].values() for t in ts}:
                for a in client.read_automations_by_name(name):  # not owned: they outlive their deployment
                    client.delete_automation(a.id)


@pytest.mark.integration
def test_redeploy_updates_triggers_in_place(stack: localstack.StackState) -> None:
    """A second deploy keeps each trigger's automation (same id: runs it started keep their 'Automation'),
    applies its new settings, and survives what `prefect deploy` does to the automations a deployment owns."""
    import uuid

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import DeploymentCreate

    tag = uuid.uuid4().hex[:8]
    with get_client(sync_client=True) as client:
        flow_id = client.create_flow_from_name(f"redeploy-{tag}")
        dep_id = client.create_deployment(**DeploymentCreate(flow_id=flow_id, name="d").model_dump(
            include={"flow_id", "name"}))
    trigger = {"name": f"edgehaul: test {tag} -> redeploy", "enabled": True, "expect": [f"edgehaul.test.{tag}"],
               "parameters": {"params": {"node": "{{ event.payload.node }}"}}}
    triggers = {f"redeploy-{tag}/d": [trigger]}
    try:
        first = deploy.apply_triggers(triggers)
        second = deploy.apply_triggers({f"redeploy-{tag}/d": [{**trigger, "expect": [f"edgehaul.test2.{tag}"]}]})
        assert [c for *_, c in first] == [True] and [c for *_, c in second] == [False]
        assert first[0][1] == second[0][1]
        with get_client(sync_client=True) as client:
            client.delete_resource_owned_automations(f"prefect.deployment.{dep_id}")  # what `prefect deploy` does
            (auto,) = client.read_automations_by_name(trigger["name"])
            related = client.read_resource_related_automations(f"prefect.deployment.{dep_id}")
        assert auto.id == first[0][1] and auto.trigger.expect == {f"edgehaul.test2.{tag}"}  # type: ignore[union-attr]
        assert [a.id for a in related] == [auto.id]
        assert auto.actions[0].deployment_id == dep_id  # type: ignore[union-attr]
    finally:
        with get_client(sync_client=True) as client:
            for a in client.read_automations_by_name(trigger["name"]):
                client.delete_automation(a.id)
            client.delete_deployment(dep_id)
