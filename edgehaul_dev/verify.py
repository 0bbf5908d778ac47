"""The operator's acceptance checklist against a RUNNING local stack: every item must pass before use.

    python -m edgehaul_dev.verify [--root .edgehaul-stack] [--only NAME ...]     # `make verify`

Prints PASS/FAIL per item and exits non-zero if any fails:
1. control_plane   Prefect API healthy; every work pool of the product (edge-*, central, central-gpu, ops:
                   deployments/prefect.yaml; other pools on the server are not judged) has a worker with a
                   recent heartbeat; recent edgehaul.link.stats and edgehaul.dataset.committed /
                   edgehaul.bundle.receipt events are visible (needs `make deploy` and a demo run);
2. high_value      a high-value sample, spooled and drained, lands in the object store within its
                   expected time (high tier is sent at once: transfer time at the rate cap + slack);
3. placement       train_model runs were executed by workers of the central-gpu pool, edge flows by workers
                   of edge-* pools (the workers' prefect.worker.executed-flow-run events, cross-checked
                   with each run's pool on the server), for runs of the product's deployments; needs runs
                   through deployments, e.g.
                   `python -m edgehaul_dev.demo --via-deployments` (`make verify-demo` does it all);
4. resume          a training process killed with kill -9 after a committed checkpoint resumes from
                   that checkpoint, and its loss curve equals an uninterrupted run's;
5. alert_l2        pushing an edge spool over its watermark fires the level-2 automation (its webhook
                   is pointed at a local receiver for the check, then restored);
6. quota           an over-quota training request is refused with a message naming team and limits
                   (submitted through the train_model deployment when deployed, else the quota step).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar

from prefect.blocks.core import Block

from edgehaul.blocks import LinkProfile, ObjectStore, TeamQuota
from edgehaul.blocks.object_store import Zone
from edgehaul.platform.block_loading import load_block
from edgehaul.platform.reporting import CHECK_TAG
from edgehaul.platform.roles import DEFAULT_POLICY, DEFAULT_TEAM
from edgehaul_dev import localstack

B = TypeVar("B", bound=Block)

EDGE_FLOWS = ("edge_ingest", "uplink_drain")
TRAINING_FLOWS = ("train_model",)
TRAINING_POOL = "central-gpu"  # deployments/prefect.yaml: training has its own (GPU) pool


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    seconds: float = 0.0


ZONES: tuple[Zone, ...] = ("landing", "curated", "cold", "checkpoints", "ops")


def remove_prefix(store: ObjectStore) -> int:
    """Delete every object under the store's (non-empty) prefix in each of the five buckets; returns how many."""
    if not store.prefix.strip("/"):
        raise ValueError("refusing to empty whole buckets: the store has no prefix")
    s3, n = store.client(), 0
    for bucket in sorted({store.bucket(z) for z in ZONES}):
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{store.prefix.strip('/')}/"):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                s3.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
                n += len(keys)
    return n


@contextlib.contextmanager
def scratch_store(state: localstack.StackState) -> Iterator[ObjectStore]:
    """An admin store under a fresh `verify-*` prefix, emptied in every bucket afterwards (also on failure):
    a check's bundle must not stay in the real landing bucket for every later core_ingest to skip."""
    store = state.store("admin", f"verify-{uuid.uuid4().hex[:8]}", inline_keys=True)
    try:
        yield store
    finally:
        remove_prefix(store)


def _load_block(cls: type[B], name: str) -> B | None:
    """The block, or None when it is missing or the server cannot say (a check then uses its own)."""
    try:
        return load_block(cls, name)
    except (ValueError, RuntimeError, OSError):
        return None


# ------------------------------------------------------------------------------------ 1 control plane


def _auth(auth: str | None) -> tuple[str, str] | None:
    if not auth:
        return None
    user, _, password = auth.partition(":")
    return user, password


def _events(api: str, names: list[str], since: datetime, auth: str | None, max_pages: int = 1) -> list[dict[str, Any]]:
    """Events named `names` since `since`, newest first: up to `max_pages` pages of 50."""
    import httpx

    body = {"filter": {"event": {"name": names}, "occurred": {"since": since.isoformat()}}, "limit": 50}
    with httpx.Client(timeout=30, auth=_auth(auth)) as h:
        r = h.post(f"{api}/events/filter", json=body)
        r.raise_for_status()
        page = r.json()
        out = list(page.get("events", []))
        for _ in range(max_pages - 1):
            if not page.get("next_page"):
                break
            r = h.get(page["next_page"])
            r.raise_for_status()
            page = r.json()
            out += page.get("events", [])
    return out


def product_pools(client: Any) -> list[str]:
    """The product's work pools (deployments/prefect.yaml) that exist on the server: a pool someone else
    made there (another stack's, a test's) is not this product's control plane, and its idle workers are
    no fault of this deployment."""
    from edgehaul_dev.deploy import load_spec, pools_of

    product = set(pools_of(load_spec()))
    return sorted(p.name for p in client.read_work_pools() if p.name in product)


def check_control_plane(state: localstack.StackState, window_h: float = 24.0) -> tuple[bool, str]:
    import httpx
    from prefect.client.orchestration import get_client

    h = httpx.get(f"{state.prefect_api_url}/health", timeout=5)
    problems: list[str] = []
    seen: list[str] = []
    if h.status_code != 200:
        problems.append(f"API health {h.status_code}")
    now = datetime.now(UTC)
    with get_client(sync_client=True) as c:
        pools = product_pools(c)
        edge = [p for p in pools if p.startswith("edge")]
        if not edge or not {"central", TRAINING_POOL, "ops"} <= set(pools):
            problems.append(f"pools {pools}: want edge-*, central, {TRAINING_POOL}, ops (run `make deploy`)")
        for pool in pools:
            beats = [w.last_heartbeat_time for w in c.read_workers_for_work_pool(pool) if w.last_heartbeat_time]
            fresh = [b for b in beats if now - b < timedelta(seconds=120)]
            (seen if fresh else problems).append(
                f"{pool}: {len(fresh)} live worker(s)" + ("" if fresh else " (start them with `make deploy`)")
            )
    since = now - timedelta(hours=window_h)
    for names in (["edgehaul.link.stats"], ["edgehaul.dataset.committed", "edgehaul.bundle.receipt"]):
        evs = _events(state.prefect_api_url, names, since, state.api_auth_string)
        (seen if evs else problems).append(f"{'/'.join(names)}: {len(evs)} event(s) in {window_h:g} h")
    return not problems, "; ".join(problems + seen)


# ------------------------------------------------------------------------------------ 2 high-value latency


def check_high_value(state: localstack.StackState, work: Path) -> tuple[bool, str]:

    with scratch_store(state) as store:
        return _high_value(store, work)


def _high_value(store: ObjectStore, work: Path) -> tuple[bool, str]:
    from edgehaul.bundles import write_bundle
    from edgehaul.contracts import load_contract
    from edgehaul.uplink.link import Link
    from edgehaul_dev.drills import KIND, _rows, drain, fast_profile, open_spool

    profile = _load_block(LinkProfile, DEFAULT_POLICY) or fast_profile()
    table = _rows(2, "node-a", int(time.time()) % 10_000, int(time.time() * 1000) % 10**9, "high", 0.97)
    data, m = write_bundle(table, load_contract(KIND), tier="high")
    sp = open_spool(work / "spool")
    t0 = time.monotonic()
    sp.put(data, m)  # what edge ingest does with a high-tier bundle: spooled, then sent at once
    rep = drain(store, sp, work / "uplink", link=Link(profile, emit_events=False), max_seconds=120)
    took = time.monotonic() - t0
    sp.close()
    expected = m.nbytes / profile.rate_cap_bytes_per_s + 2 * profile.latency_ms / 1000 * 6 + 5.0
    landed = [r for r in rep.landed if r.bundle_id == m.bundle_id]
    if not landed:
        return False, f"high-value bundle not landed: {rep.failed}"
    head = store.client().head_object(Bucket=landed[0].bucket, Key=landed[0].key)
    ok = took <= expected and head["Metadata"].get("sha256") == m.sha256
    rate = profile.rate_cap_bytes_per_s
    return ok, f"landed in {took:.2f} s (expected <= {expected:.1f} s: {m.nbytes} B at {rate:.0f} B/s + slack)"


# ------------------------------------------------------------------------------------ 3 placement


@dataclass(frozen=True)
class Execution:
    """A flow run a worker executed: from its `prefect.worker.executed-flow-run` event."""

    flow: str
    flow_run_id: str
    pool: str
    worker: str
    exit_code: str


def _related(event: dict[str, Any], role: str) -> dict[str, str]:
    return next((r for r in event.get("related", []) if r.get("prefect.resource.role") == role), {})


def executions(state: localstack.StackState, since: datetime) -> list[Execution]:
    """Every flow run a worker of any pool executed since `since` (newest first, at most 2,000)."""
    out = []
    for e in _events(state.prefect_api_url, ["prefect.worker.executed-flow-run"], since, state.api_auth_string, 40):
        run = _related(e, "flow-run")
        out.append(Execution(
            flow=_related(e, "flow").get("prefect.resource.name", ""),
            flow_run_id=run.get("prefect.resource.id", "").removeprefix("prefect.flow-run."),
            pool=_related(e, "work-pool").get("prefect.resource.name", ""),
            worker=e["resource"].get("prefect.resource.name", ""),
            exit_code=str(run.get("prefect.infrastructure.status-code", "")),
        ))
    return out


PLACEMENT: tuple[tuple[tuple[str, ...], str, Callable[[str], bool]], ...] = (
    (TRAINING_FLOWS, TRAINING_POOL, lambda pool: pool == TRAINING_POOL),
    (EDGE_FLOWS, "edge-*", lambda pool: pool.startswith("edge")),
)


def placement_verdict(execs: list[Execution], assigned: dict[str, str]) -> tuple[bool, str]:
    """PASS when, for training and for the edge flows, workers of the right pools executed at least one
    run that exited 0, no worker of another pool executed any, and the server assigned none elsewhere.
    `assigned`: flow run id -> work pool name the server recorded for runs of those flows."""
    problems: list[str] = []
    seen: list[str] = []
    for flows, want_name, want in PLACEMENT:
        mine = [x for x in execs if x.flow in flows]
        wrong = [f"{x.flow} run {x.flow_run_id[:8]} by worker {x.worker} of pool {x.pool}" for x in mine if not want(x.pool)]
        wrong += [f"run {i[:8]} assigned to pool {p}" for i, p in assigned.items()
                  if any(x.flow_run_id == i for x in mine) and not want(p)]
        good = [x for x in mine if want(x.pool) and x.exit_code == "0"]
        label = "/".join(flows)
        if wrong:
            problems.append(f"{label} ran outside {want_name}: {sorted(set(wrong))[:5]}")
        if not good:
            problems.append(f"no {label} run executed (exit 0) by a {want_name} worker yet (run it through its deployment)")
        if good:
            pools = sorted({x.pool for x in good})
            workers = sorted({x.worker for x in good})
            seen.append(f"{label}: {len(good)} run(s) executed by {workers} on {pools}")
    return not problems, "; ".join(problems + seen)


def check_placement(state: localstack.StackState, window_h: float = 24.0, since: datetime | None = None,
                    flow_run_ids: set[str] | None = None) -> tuple[bool, str]:
    """Placement from the workers' own execution events, cross-checked with the server's pool of each
    run; `flow_run_ids` limits the check to those runs (tests), else to runs of the product's deployments
    (prefect.yaml): another stack's or a test's deployment of the same flow on this server is not this
    product's placement."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from edgehaul_dev.deploy import deployment_names, load_spec

    execs = executions(state, since or datetime.now(UTC) - timedelta(hours=window_h))
    execs = [x for x in execs if x.flow in TRAINING_FLOWS + EDGE_FLOWS]
    if flow_run_ids is not None:
        execs = [x for x in execs if x.flow_run_id in flow_run_ids]
    ids = sorted({x.flow_run_id for x in execs})
    assigned: dict[str, str] = {}
    deployment_of: dict[str, str] = {}
    with get_client(sync_client=True) as c:
        for i in range(0, len(ids), 200):
            chunk = [uuid.UUID(x) for x in ids[i:i + 200]]
            for r in c.read_flow_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=chunk)), limit=200):
                assigned[str(r.id)] = r.work_pool_name or ""
                deployment_of[str(r.id)] = str(r.deployment_id or "")
        if flow_run_ids is None:
            ours = set()
            for name in deployment_names(load_spec()):
                try:
                    ours.add(str(c.read_deployment_by_name(name).id))
                except Exception:  # ObjectNotFound: not deployed (the verdict then finds no run of it)
                    continue
            execs = [x for x in execs if deployment_of.get(x.flow_run_id) in ours]
            assigned = {i: p for i, p in assigned.items() if deployment_of.get(i) in ours}
    return placement_verdict(execs, assigned)


# ------------------------------------------------------------------------------------ 4 resume


def _dataset(store: ObjectStore) -> str:
    from deltalake import write_deltalake

    from edgehaul_dev.drills import KIND, _rows

    uri = store.uri("curated", KIND)
    write_deltalake(uri, _rows(240, "node-a", 77, 0, "normal", None), storage_options=store.storage_options(), mode="append")
    return uri


def check_resume(state: localstack.StackState, work: Path) -> tuple[bool, str]:

    with scratch_store(state) as store:
        return _resume(store, work)


def _resume(store: ObjectStore, work: Path) -> tuple[bool, str]:
    from edgehaul.training.checkpoints import CheckpointStore
    from edgehaul.training.launch import child_env, store_to_public
    from edgehaul.training.trainer import TrainConfig, train

    uri = _dataset(store)
    # no events: a MODEL_READY of these made-up models would start production publish_model runs that fail
    base = dict(dataset_uri=uri, dataset_version=0, team="verify", model_name="verify-resume", seed=7, epochs=3,
                batch_size=16, width=8, num_threads=1, checkpoint_every_steps=5, val_fraction=0.15, emit_events=False,
                quality_gate=False, patience=0)  # resume is checked, not learning: every epoch runs, both register
    reference = train(TrainConfig.model_validate({**base, "run_id": "verify-uninterrupted"}), store)
    cfg = TrainConfig.model_validate({**base, "run_id": "verify-killed"})
    cfg_path, res_path = work / "run.json", work / "result.json"
    cfg_path.write_text(json.dumps({"config": cfg.model_dump(mode="json"), "store": store_to_public(store)}))
    cmd = [sys.executable, "-m", "edgehaul.training", "--config", str(cfg_path), "--result", str(res_path)]
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.Popen(cmd, cwd=root, env=child_env(store), stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            text=True)
    assert proc.stderr is not None
    killed_after = None
    for line in proc.stderr:
        if "checkpoint committed run=verify-killed step=" in line:
            killed_after = line.strip().rsplit("step=", 1)[-1].split()[0]
            os.kill(proc.pid, signal.SIGKILL)
            break
    proc.wait(60)
    if killed_after is None or proc.returncode != -signal.SIGKILL:
        return False, f"training was not killed after a checkpoint (exit {proc.returncode})"
    latest = CheckpointStore(store, "verify-killed").latest()
    proc2 = subprocess.run(cmd, cwd=root, env=child_env(store), capture_output=True, text=True, timeout=600)
    if proc2.returncode != 0:
        return False, f"resumed run failed: {proc2.stderr[-500:]}"
    res = json.loads(res_path.read_text())
    same = len(res["history"]) == len(reference.history) and all(
        math.isclose(a[k], b[k], rel_tol=1e-4, abs_tol=1e-6)
        for a, b in zip(reference.history, res["history"], strict=False) for k in ("train_loss", "val_loss"))
    ok = latest is not None and res["resumed_from_step"] == latest.step and res["steps"] == reference.steps and same
    curve = ", ".join(f"{h['train_loss']:.4f}" for h in res["history"])
    return ok, (f"killed after step {killed_after}, resumed from step {res['resumed_from_step']} "
                f"(latest committed {latest.step if latest else None}), {res['steps']}/{reference.steps} steps; "
                f"loss per epoch {curve} {'==' if same else '!='} uninterrupted")


# ------------------------------------------------------------------------------------ 5 level-2 alert


class _Receiver:
    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                n = int(self.headers.get("content-length", 0))
                doc = json.loads(self.rfile.read(n))
                outer.bodies.append(json.loads(doc["body"]) | {"subject": doc["subject"]})
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/alerts"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


def check_alert_l2(state: localstack.StackState, work: Path, timeout: float = 90.0) -> tuple[bool, str]:
    from prefect.blocks.notifications import CustomWebhookNotificationBlock
    from prefect.client.orchestration import get_client

    from edgehaul.edge.spool import Spool
    from edgehaul.services.automations import L2_NAME, NOTIFY_BLOCK, apply_automations
    from edgehaul_dev.drills import build_pool

    rx = _Receiver()
    with get_client(sync_client=True) as c:
        deployed = bool(c.read_automations_by_name(L2_NAME))
    previous = _load_block(CustomWebhookNotificationBlock, NOTIFY_BLOCK)
    try:
        if deployed and previous is not None:  # point the deployed automation's webhook at us, for now
            previous.model_copy(update={"url": rx.url, "headers": None, "secrets": {}}).save(NOTIFY_BLOCK, overwrite=True)
        else:
            apply_automations(webhook_url=rx.url)
        time.sleep(2.0)  # the server reloads automations every few seconds
        node = f"verify-{uuid.uuid4().hex[:6]}"
        (b,) = build_pool(work / "pool", [(60, "normal", 0.5)])
        size = b.path.stat().st_size + len(b.manifest.to_json())
        sp = Spool(work / "spool", cap_bytes=int(size / 0.9), node_id=node)  # one bundle fills it to ~90%
        sp.put(b.data(), b.manifest)
        fill = sp.usage().fraction
        sp.close()
        deadline = time.monotonic() + timeout
        hit = None
        while time.monotonic() < deadline and hit is None:
            hit = next((x for x in rx.bodies if x.get("level") == 2 and node in json.dumps(x)), None)
            time.sleep(0.3)
    finally:
        if deployed and previous is not None:
            previous.save(NOTIFY_BLOCK, overwrite=True)
        rx.close()
    if hit is None:
        return False, f"spool {node} at {fill:.0%}: no level-2 notification within {timeout:.0f} s"
    return True, f"spool {node} at {fill:.0%}: level-2 alert '{hit.get('subject')}'"


# ------------------------------------------------------------------------------------ 6 quota


TRAIN_DEPLOYMENT = "train_model/on-dataset-committed"


def _live_workers(pool: str) -> int:
    from prefect.client.orchestration import get_client

    now = datetime.now(UTC)
    with get_client(sync_client=True) as c:
        try:
            workers = c.read_workers_for_work_pool(pool)
        except Exception:  # no such pool
            return 0
    return sum(1 for w in workers if w.last_heartbeat_time and now - w.last_heartbeat_time < timedelta(seconds=120))


def _submit_over_quota(team: str, hours: float, timeout: float) -> tuple[str, str, str]:
    """Submit a training run over the quota through the deployment; (run name, final state, message).
    A run cancelled by the deployment's CANCEL_NEW limit (a training is active) is submitted again.
    Its runs are tagged CHECK_TAG (named 'check: ...', no alert) and deleted once read: a refusal the
    check asked for is not a failure of production, and must not sit in the UI's failed runs."""
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    fr: Any = None
    for _ in range(10):
        fr = run_deployment(TRAIN_DEPLOYMENT, parameters={"params": {"team": team, "max_hours": hours}},
                            timeout=0, as_subflow=False, tags=[CHECK_TAG])
        deadline = time.monotonic() + timeout
        with get_client(sync_client=True) as c:
            while not (fr.state and fr.state.is_final()) and time.monotonic() < deadline:
                time.sleep(2)
                fr = c.read_flow_run(fr.id)
            if fr.state and fr.state.is_final():
                c.delete_flow_run(fr.id)
        if not (fr.state and fr.state.is_cancelled() and "concurrency" in (fr.state.message or "")):
            break
        print("  quota: a training is running (the deployment takes one at a time); submitting again in 15 s")
        time.sleep(15)
    return fr.name, fr.state_name or "", (fr.state.message or "") if fr.state else ""


def check_quota(state: localstack.StackState, timeout: float = 300.0) -> tuple[bool, str]:
    """Over-quota training is refused with a message naming team and limit: submitted through the
    training deployment when it is deployed with a live training worker, else the quota step itself."""
    from prefect.client.orchestration import get_client

    from edgehaul.tasks.train import check_team_quota
    from edgehaul.training.quota import QuotaExceeded

    quota = _load_block(TeamQuota, DEFAULT_TEAM) or TeamQuota(team=DEFAULT_TEAM, accelerator_hours_per_month=10,
                                                          storage_bytes=1024**4)
    hours = min(quota.accelerator_hours_per_month + 1, 720.0)  # the flow's max_hours bound

    def clear(msg: str) -> bool:
        return quota.team in msg and "accelerator_hours_per_month" in msg and "refused" in msg

    with get_client(sync_client=True) as c:
        try:
            deployed = c.read_deployment_by_name(TRAIN_DEPLOYMENT) is not None
        except Exception:  # ObjectNotFound
            deployed = False
    if deployed and _live_workers(TRAINING_POOL):
        name, final, msg = _submit_over_quota(quota.team, hours, timeout)
        ok = final == "Failed" and "QuotaExceeded" in msg and clear(msg)
        return ok, f"{TRAIN_DEPLOYMENT} run {name} ({hours:g} h for team {quota.team!r}): {final}: {msg[:400]}"
    try:
        check_team_quota.fn(state.store(inline_keys=True), quota, 1, hours, 0)
    except QuotaExceeded as e:
        return clear(str(e)), f"refused (quota step; no {TRAIN_DEPLOYMENT} with a live worker): {e}"
    return False, f"a {hours:g} h request over a {quota.accelerator_hours_per_month:g} h quota was accepted"


# ------------------------------------------------------------------------------------ runner


def prerequisites(state: localstack.StackState, window_h: float = 24.0) -> list[str]:
    """What the checks need that the stack does not have yet, each with the command that provides it
    (printed before the checks: a FAIL for a missing step is then no surprise)."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as c:
        try:
            deployed = c.read_deployment_by_name(TRAIN_DEPLOYMENT) is not None
        except Exception:  # ObjectNotFound
            deployed = False
        pools = product_pools(c)
    if not deployed:
        return ["nothing deployed: run `make deploy` first (control_plane and placement need its workers; "
                "quota then runs through the training deployment), then `python -m edgehaul_dev.demo --via-deployments` "
                "(placement needs runs executed by workers); `make verify-demo` does all of it"]
    out = []
    if idle := [p for p in pools if not _live_workers(p)]:
        out.append(f"no live worker yet on {', '.join(idle)}: workers register about 30 s after `make deploy` "
                   "(restart them with `make deploy`)")
    execs = [x for x in executions(state, datetime.now(UTC) - timedelta(hours=window_h))
             if x.flow in TRAINING_FLOWS + EDGE_FLOWS]
    if not {x.flow for x in execs} & set(TRAINING_FLOWS) or not {x.flow for x in execs} & set(EDGE_FLOWS):
        out.append("no training or edge run executed by a worker yet: run `python -m edgehaul_dev.demo "
                   "--via-deployments` (placement checks those runs' pools)")
    return out


CHECKS = ("control_plane", "high_value", "placement", "resume", "alert_l2", "quota")


def run_checks(state: localstack.StackState, only: tuple[str, ...] = (), say: Callable[[str], None] = print) -> list[Check]:
    work = Path(tempfile.mkdtemp(prefix="edgehaul-verify-"))
    fns: dict[str, Callable[[], tuple[bool, str]]] = {
        "control_plane": lambda: check_control_plane(state),
        "high_value": lambda: check_high_value(state, work / "hv"),
        "placement": lambda: check_placement(state),
        "resume": lambda: check_resume(state, _mk(work / "resume")),
        "alert_l2": lambda: check_alert_l2(state, _mk(work / "alert")),
        "quota": lambda: check_quota(state),
    }
    out = []
    for name in CHECKS:
        if only and name not in only:
            continue
        t0 = time.monotonic()
        try:
            ok, detail = fns[name]()
        except Exception as e:  # a check that cannot run is a failed check, with the reason
            ok, detail = False, f"{type(e).__name__}: {str(e)[:400]}"
        c = Check(name, ok, detail, time.monotonic() - t0)
        say(f"{'PASS' if ok else 'FAIL'}  {name:<14} {detail}  ({c.seconds:.1f} s)")
        out.append(c)
    shutil.rmtree(work, ignore_errors=True)  # spools, uplink state, the training's files
    return out


def _mk(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="edgehaul_dev.verify", description="operator acceptance checklist")
    ap.add_argument("--root", type=Path, default=localstack.DEFAULT_ROOT)
    ap.add_argument("--only", nargs="*", default=[], choices=CHECKS)
    args = ap.parse_args(argv)
    state = localstack.StackState.load(args.root)
    if state is None or not all(localstack.health(args.root).values()):
        print(f"FAIL  no running stack at {args.root}: run `make up` (and `make deploy`) first")
        return 2
    os.environ.update(state.env())
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    # Settings were read when prefect was imported: set the stack's API (and its auth, if on) here.
    with temporary_settings(updates={PREFECT_API_URL: state.prefect_api_url,
                                     PREFECT_API_AUTH_STRING: state.api_auth_string}):
        for need in prerequisites(state):
            print(f"NEEDS {need}")
        checks = run_checks(state, tuple(args.only))
    failed = [c.name for c in checks if not c.ok]
    print(f"{len(checks) - len(failed)}/{len(checks)} checks passed" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
