"""`make verify` checks (edgehaul_dev.verify) against the session stack.

high_value, resume, alert_l2 and quota must PASS here. control_plane needs a worker on every pool
(`make deploy`), so on the session stack it is exercised for its FAIL path. placement is checked on
real flow runs executed by real process workers of the session's `central-gpu` and `edge-default` pools
(deployments of the real flows on a private work queue): training and an edge flow on their pools
pass, a training deployment put on an edge pool fails the check. The whole chain on a deployed stack
(`make verify-demo`) is recorded in docs/VERIFY.md.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from edgehaul.blocks import EdgeNode, LinkProfile, TeamQuota
from edgehaul_dev import deploy, localstack, verify
from tests.conftest import store_for
from tests.waiting import wait_for


@pytest.mark.integration
def test_checks_that_run_on_the_session_stack_pass(stack: localstack.StackState) -> None:
    lines: list[str] = []
    since = datetime.now(UTC)
    checks = verify.run_checks(stack, ("high_value", "resume", "alert_l2", "quota"), say=lines.append)
    print("\n".join(lines))
    assert [c.name for c in checks] == ["high_value", "resume", "alert_l2", "quota"]
    for c in checks:
        assert c.ok, (c.name, c.detail)
    by = {c.name: c.detail for c in checks}
    assert "resumed from step" in by["resume"] and "== uninterrupted" in by["resume"]
    assert "refused" in by["quota"] and "'default'" in by["quota"]
    assert "level-2 alert" in by["alert_l2"]
    # nothing stays in the buckets: a verify-* bundle left in landing is skipped by every later core_ingest
    s3 = store_for(stack).client()
    for bucket in sorted(set(localstack.BUCKETS)):
        left = s3.list_objects_v2(Bucket=bucket, Prefix="verify-").get("Contents", [])
        assert not left, (bucket, [o["Key"] for o in left][:5])
    # the resume check's made-up models announce nothing (a model.ready would start a production publish_model)
    time.sleep(3)
    ready = verify._events(stack.prefect_api_url, ["edgehaul.model.ready"], since, stack.api_auth_string)
    assert not [e for e in ready if "verify" in e["resource"]["prefect.resource.id"]], ready


@pytest.mark.integration
def test_deployment_checks_fail_clearly_without_deployments(stack: localstack.StackState) -> None:
    """Without live workers on every pool, and with no runs executed by workers since now, both fail
    and say what is missing."""
    checks = {c.name: c for c in verify.run_checks(stack, ("control_plane",), say=lambda s: None)}
    assert not checks["control_plane"].ok and "make deploy" in checks["control_plane"].detail
    (need,) = verify.prerequisites(stack)  # said before the checks run, with the commands that provide it
    assert need.startswith("nothing deployed: run `make deploy` first") and "--via-deployments" in need
    ok, detail = verify.check_placement(stack, since=datetime.now(UTC))
    assert not ok
    assert "no train_model run executed" in detail and "no edge_ingest/uplink_drain run executed" in detail


def _x(flow: str, pool: str, code: str = "0", run: str | None = None) -> verify.Execution:
    return verify.Execution(flow, run or uuid.uuid4().hex, pool, f"{pool}-worker", code)


def test_placement_verdict_rules() -> None:
    good = [_x("train_model", "central-gpu"), _x("edge_ingest", "edge-default"), _x("uplink_drain", "edge-north")]
    ok, detail = verify.placement_verdict(good, {})
    assert ok, detail
    assert "train_model: 1 run(s)" in detail and "edge_ingest/uplink_drain: 2 run(s)" in detail
    # training executed by an edge or a CPU central worker, or an edge flow by the training worker: FAIL, naming the run
    for bad in (_x("train_model", "edge-default", "1", "aaaa1111"), _x("train_model", "central", "0", "aaaa1111"),
                _x("edge_ingest", "central-gpu", "0", "aaaa1111")):
        ok, detail = verify.placement_verdict([*good, bad], {})
        assert not ok and "aaaa1111" in detail and bad.pool in detail
    # only failed executions on the right pool: not evidence of placement
    ok, detail = verify.placement_verdict([_x("train_model", "central-gpu", "1"), good[1]], {})
    assert not ok and "no train_model run executed (exit 0)" in detail
    # the server's pool of an executed run disagrees with the worker's
    ok, detail = verify.placement_verdict(good, {good[0].flow_run_id: "edge-default"})
    assert not ok and "assigned to pool edge-default" in detail


@pytest.mark.integration
def test_placement_on_runs_executed_by_real_workers(stack: localstack.StackState, tmp_path: Path) -> None:
    from prefect.client.orchestration import get_client

    tag = uuid.uuid4().hex[:8]
    queue, team = f"verify-{tag}", f"verify-{tag}"
    store = store_for(stack, "admin", f"t-verify-{tag}")
    verify._dataset(store)  # a small curated landsat_patch table to train on
    store.save(f"verify-{tag}", overwrite=True)
    TeamQuota(team=team, accelerator_hours_per_month=10, storage_bytes=1024**3).save(team, overwrite=True)
    EdgeNode(node_id=f"verify-{tag}", spool_dir=str(tmp_path / "spool")).save(f"verify-{tag}", overwrite=True)
    LinkProfile(bandwidth_bps=100e6, latency_ms=5, loss_rate=0.0).save(f"verify-{tag}", overwrite=True)
    deploy.ensure_pools(["central-gpu", "edge-default"])
    train = {"team": team, "store_block": f"verify-{tag}", "epochs": 1, "width": 4, "batch_size": 64,
             "num_threads": 1, "max_hours": 0.1, "quality_gate": False}  # placement, not learning
    uplink = {"edge_node": f"verify-{tag}", "object_store": f"verify-{tag}", "link_profile": f"verify-{tag}",
              "simulate": True, "max_seconds": 30}
    # The real flows, deployed the way `prefect deploy` does (code in the repository, no download).
    pull = [{"prefect.deployments.steps.set_working_directory": {"directory": str(deploy.REPO)}}]
    specs = {  # run key -> (flow, entrypoint, pool, parameters)
        "train": ("train_model", "flows/train_model.py:train_model", "central-gpu", train),
        "uplink": ("uplink_drain", "flows/uplink_drain.py:uplink_drain", "edge-default", uplink),
        "misplaced": ("train_model", "flows/train_model.py:train_model", "edge-default", train),
    }
    env = {**os.environ, "PREFECT_WORKER_QUERY_SECONDS": "1", "PYTHONPATH": str(deploy.REPO)}
    workers: list[subprocess.Popen[bytes]] = []
    dep_ids = []
    t0 = datetime.now(UTC) - timedelta(seconds=2)
    try:
        with get_client(sync_client=True) as c:
            runs = {}
            for key, (flow, entry, pool, params) in specs.items():
                dep_id = c.create_deployment(
                    flow_id=c.create_flow_from_name(flow), name=f"verify-{key}-{tag}", entrypoint=entry,
                    work_pool_name=pool, work_queue_name=queue, pull_steps=pull, parameters={"params": params},
                )
                dep_ids.append(dep_id)
                runs[key] = c.create_flow_run_from_deployment(dep_id).id
        for pool in ("central-gpu", "edge-default"):
            workers.append(subprocess.Popen(
                [deploy.prefect_exe(), "worker", "start", "--pool", pool, "--work-queue", queue, "--type", "process",
                 "--name", f"verify-{pool}-{tag}"],
                cwd=deploy.REPO, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            ))

        def executed() -> list[verify.Execution]:
            got = [x for x in verify.executions(stack, t0) if x.flow_run_id in {str(i) for i in runs.values()}]
            return got if len(got) == len(runs) else []

        execs = {x.flow_run_id: x for x in wait_for(executed, 240, "three worker-executed flow runs")}
        with get_client(sync_client=True) as c:
            final = {k: c.read_flow_run(i) for k, i in runs.items()}
        assert final["train"].state.is_completed(), final["train"].state  # type: ignore[union-attr]
        assert final["uplink"].state.is_completed(), final["uplink"].state  # type: ignore[union-attr]
        # The flow itself refuses to train on an edge pool; the check must catch the misplacement too.
        assert final["misplaced"].state.is_failed(), final["misplaced"].state  # type: ignore[union-attr]
        assert execs[str(runs["train"])].worker == f"verify-central-gpu-{tag}"
        assert execs[str(runs["misplaced"])].pool == "edge-default"

        good = {str(runs["train"]), str(runs["uplink"])}
        ok, detail = verify.check_placement(stack, since=t0, flow_run_ids=good)
        assert ok, detail
        assert f"verify-central-gpu-{tag}" in detail and f"verify-edge-default-{tag}" in detail
        ok, detail = verify.check_placement(stack, since=t0, flow_run_ids={str(i) for i in runs.values()})
        assert not ok
        assert "train_model ran outside central-gpu" in detail and str(runs["misplaced"])[:8] in detail
    finally:
        for w in workers:
            os.killpg(w.pid, signal.SIGTERM)
        for w in workers:
            try:
                w.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(w.pid, signal.SIGKILL)
        with get_client(sync_client=True) as c:
            for d in dep_ids:
                c.delete_deployment(d)
