"""`make deploy`: put the whole product on a Prefect server and start its workers.

Against $PREFECT_API_URL (the local stack of $EDGEHAUL_STACK_DIR by default), in order:
1. `prefect block register -m edgehaul.blocks`, and the stack's block documents (`edgehaul_dev.configure`);
2. the work pools named in deployments/prefect.yaml (`edge-<group>`, `central`, `ops`), type `process`;
3. `prefect deploy --all` (CI=true: no prompts) from the repository root, of deployments/prefect.yaml
   (production) with the local stack's overlay edgehaul_dev/demo_overlay.yaml merged in (`apply_overlay`):
   deployments and schedules; then the event triggers as automations updated in place by name
   (`apply_triggers`: `prefect deploy` would recreate them, blanking the trigger of past runs);
4. the alert automations (`edgehaul.services.automations`), notifying the gateway's /alerts sink of the
   local stack, or $EDGEHAUL_ALERT_WEBHOOK_URL;
5. one `prefect worker start` per central pool, under one supervisor process recorded as the stack's
   `workers` PID (`make down` stops them with the rest of the stack). No edge pool's worker: it would
   hold the central API string; nodes run node-local (`edgehaul node run`). `--edge-workers` adds them
   as simulated nodes on this host, for the deployment-path demo (`make verify-demo`) only.

    python -m edgehaul_dev.deploy [--no-workers] [--edge-workers] [--no-automations] [--overlay FILE | --no-overlay]
    python -m edgehaul_dev.deploy workers --pool central --pool ops     # the supervisor itself
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from edgehaul.platform.settings import get_settings

log = logging.getLogger("edgehaul_dev.deploy")

REPO = Path(__file__).resolve().parent.parent
PREFECT_FILE = REPO / "deployments" / "prefect.yaml"  # production: what an operator deploys
DEMO_OVERLAY = Path(__file__).with_name("demo_overlay.yaml")  # the local stack's settings over it (not shipped)


def load_spec(path: Path = PREFECT_FILE, overlay: Path | None = None) -> dict[str, Any]:
    """The deployment file, with `overlay` merged in (`apply_overlay`) when given."""
    spec = yaml.safe_load(path.read_text())
    if not isinstance(spec, dict) or not isinstance(spec.get("deployments"), list):
        raise ValueError(f"{path}: no 'deployments' list")
    if overlay is None:
        return spec
    extra = yaml.safe_load(overlay.read_text())
    if not isinstance(extra, dict):
        raise ValueError(f"{overlay}: not a mapping")
    try:
        return apply_overlay(spec, extra)
    except ValueError as e:
        raise ValueError(f"{overlay}: {e}") from None


def _merge(base: Any, over: Any) -> Any:
    if isinstance(base, dict) and isinstance(over, dict):
        out = dict(base)
        for k, v in over.items():
            if v is None:
                out.pop(k, None)
            else:
                out[k] = _merge(base.get(k), v)
        return out
    return over


def apply_overlay(spec: dict[str, Any], overlay: dict[str, Any]) -> dict[str, Any]:
    """prefect.yaml with an overlay's settings: top-level keys replace the file's (null removes one);
    each overlay deployment, matched by entrypoint and name, is merged into that deployment
    (mappings key by key, null removes a key, anything else replaces). An overlay deployment that
    matches none is an error, so an overlay cannot silently outlive a renamed deployment."""
    out: dict[str, Any] = _merge(spec, {k: v for k, v in overlay.items() if k != "deployments"})
    deployments = [dict(d) for d in spec["deployments"]]
    index = {(d["entrypoint"], d["name"]): i for i, d in enumerate(deployments)}
    for d in overlay.get("deployments") or []:
        key = (d.get("entrypoint"), d.get("name"))
        if key not in index:
            raise ValueError(f"overlay deployment {key[1]!r} ({key[0]}) matches no deployment of the file")
        i = index[key]
        deployments[i] = _merge(deployments[i], {k: v for k, v in d.items() if k not in ("entrypoint", "name")})
    out["deployments"] = deployments
    return out


def deployment_names(spec: dict[str, Any]) -> list[str]:
    """'<flow function>/<deployment>' names; the flow name equals the function name in this project."""
    return [f"{d['entrypoint'].rsplit(':', 1)[1]}/{d['name']}" for d in spec["deployments"]]


def pools_of(spec: dict[str, Any]) -> list[str]:
    return sorted({d["work_pool"]["name"] for d in spec["deployments"]})


def missing_entrypoints(spec: dict[str, Any], root: Path = REPO) -> list[str]:
    """Entrypoints whose file or function is absent (checked without importing the flows)."""
    out = []
    for d in spec["deployments"]:
        path, func = d["entrypoint"].rsplit(":", 1)
        f = root / path
        if not f.exists() or f"def {func}(" not in f.read_text():
            out.append(d["entrypoint"])
    return out


def prefect_exe() -> str:
    return str(Path(sys.executable).parent / "prefect")


def register_blocks() -> None:
    from prefect.settings import get_current_settings

    from edgehaul_dev import configure, localstack

    configure.register_block_types()
    state = localstack.StackState.load(localstack.DEFAULT_ROOT)
    # Prefect's own settings: the API this process talks to (environment, profile or temporary_settings)
    api_url = (get_current_settings().api.url or "").rstrip("/")
    if state is not None and api_url == state.prefect_api_url:
        saved = configure.save_blocks(state)
        log.info("blocks saved: %d documents", sum(len(v) for v in saved.values()))


def ensure_pools(names: list[str]) -> list[str]:
    """Create missing `process` work pools; returns the ones created."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists
    from prefect.workers.process import ProcessWorker

    template = ProcessWorker.get_default_base_job_template()
    created = []
    with get_client(sync_client=True) as client:
        for name in names:
            try:
                client.create_work_pool(WorkPoolCreate(name=name, type="process", base_job_template=template))
                created.append(name)
            except ObjectAlreadyExists:
                pass
    log.info("work pools: %s (%d new)", ", ".join(names), len(created))
    return created


def prefect_deploy(prefect_file: Path = PREFECT_FILE, overlay: Path | None = DEMO_OVERLAY, timeout: float = 900) -> str:
    """`prefect deploy --all` from the repository root, without prompts; returns its output. With an
    overlay, the merged file is written to a temporary folder and deployed from there (entrypoints and
    Prefect's default pull step are relative to the working directory, the repository root)."""
    if missing := missing_entrypoints(load_spec(prefect_file)):
        raise FileNotFoundError(f"{prefect_file}: entrypoints not found: {', '.join(missing)}")
    spec = load_spec(prefect_file, overlay)
    bare, triggers = split_triggers(spec)
    env = {**os.environ, "CI": "true", "PREFECT_CLI_PROMPT": "false", "PYTHONPATH": str(REPO)}
    with tempfile.TemporaryDirectory(prefix="edgehaul-deploy-") as tmp:
        target = Path(tmp, "prefect.yaml")
        target.write_text(yaml.safe_dump(bare, sort_keys=False))
        cmd = [prefect_exe(), "--no-prompt", "deploy", "--all", "--prefect-file", str(target)]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"prefect deploy failed (exit {proc.returncode}):\n{out[-4000:]}")
    log.info("deployed %d deployments from %s%s", len(spec["deployments"]), prefect_file.name,
             f" + {overlay.name}" if overlay else "")
    applied = apply_triggers(triggers)
    return out + "".join(f"trigger {'created' if new else 'updated'}: {name} ({i})\n" for name, i, new in applied)


def split_triggers(spec: dict[str, Any]) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    """(the spec without triggers, '<flow>/<deployment>' -> its trigger specs). `prefect deploy` deletes
    and recreates a deployment's triggers on every run, which gives them new ids and blanks the
    'Automation' label of the runs they started; `apply_triggers` updates them in place instead."""
    bare = {**spec, "deployments": [{k: v for k, v in d.items() if k != "triggers"} for d in spec["deployments"]]}
    names = deployment_names(spec)
    return bare, {n: list(d["triggers"]) for n, d in zip(names, spec["deployments"], strict=True) if d.get("triggers")}


def apply_triggers(triggers: dict[str, list[dict[str, Any]]]) -> list[tuple[str, Any, bool]]:
    """Each deployment trigger as an automation, created or updated by name (the id stays, so do the
    labels of past runs); (name, automation id, created). Not owned by the deployment, so `prefect
    deploy` leaves them alone; they are still related to it (its Triggers tab lists them)."""
    from prefect.automations import AutomationCore
    from prefect.client.orchestration import get_client
    from prefect.events import DeploymentTriggerTypes
    from pydantic import TypeAdapter

    adapter: TypeAdapter[DeploymentTriggerTypes] = TypeAdapter(DeploymentTriggerTypes)
    out: list[tuple[str, Any, bool]] = []
    with get_client(sync_client=True) as client:
        for deployment, specs in triggers.items():
            dep_id = client.read_deployment_by_name(deployment).id
            for i, raw in enumerate(specs, start=1):
                trigger = adapter.validate_python({"name": f"{deployment}__automation_{i}", **raw})
                trigger.set_deployment_id(dep_id)
                owned = trigger.as_automation()
                # without the owner: an update may not name one, and `prefect deploy` deletes what is owned
                auto = AutomationCore.model_validate(
                    {k: getattr(owned, k) for k in owned.model_fields_set - {"owner_resource"}})
                existing = client.read_automations_by_name(auto.name)
                if existing:
                    client.update_automation(existing[0].id, auto)
                    for extra in existing[1:]:  # a duplicate from an older deploy or a concurrent one
                        client.delete_automation(extra.id)
                    out.append((auto.name, existing[0].id, False))
                else:
                    out.append((auto.name, client.create_automation(auto), True))
    log.info("triggers: %d created, %d updated in place", sum(c for *_, c in out), sum(not c for *_, c in out))
    return out


def default_alert_target() -> tuple[str, str | None]:
    """(webhook URL, bearer token): $EDGEHAUL_ALERT_WEBHOOK_URL, else the local gateway's /alerts sink."""
    settings = get_settings()
    if settings.alert_webhook_url:
        token = settings.alert_webhook_token
        return settings.alert_webhook_url, token.get_secret_value() if token else None
    from edgehaul.services import gateway
    from edgehaul_dev import localstack

    state = localstack.StackState.load(localstack.DEFAULT_ROOT)
    if state is None:
        raise RuntimeError("no alert receiver: set EDGEHAUL_ALERT_WEBHOOK_URL or run 'make up' first")
    base = localstack.start_gateway(state)
    return f"{base}/alerts", gateway.alert_token(gateway.load_secret(Path(state.root) / "gateway"))


def start_workers(pools: list[str], root: Path | None = None) -> int:
    """The worker supervisor, as a recorded background process of the local stack."""
    from edgehaul_dev import localstack

    root = root or localstack.DEFAULT_ROOT
    pid = localstack._read_pid(root, "workers")
    if pid:
        log.info("workers already running (pid %d)", pid)
        return pid
    cmd = [sys.executable, "-m", "edgehaul_dev.deploy", "workers", *[a for p in pools for a in ("--pool", p)]]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.setdefault("PREFECT_WORKER_QUERY_SECONDS", "5")
    pid = localstack._spawn(root, "workers", cmd, env)
    log.info("workers for %s started (supervisor pid %d, logs %s)", ", ".join(pools), pid, root / "logs")
    return pid


def supervise(pools: list[str]) -> int:
    """Run one process worker per pool; restart one that exits; stop all on SIGTERM/SIGINT."""
    stopping = False

    def stop(*_: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)

    def launch(pool: str) -> subprocess.Popen[bytes]:
        return subprocess.Popen([prefect_exe(), "worker", "start", "--pool", pool, "--type", "process",
                                 "--name", f"{pool}-{os.uname().nodename}"], cwd=REPO)

    procs = {p: launch(p) for p in pools}
    backoff = dict.fromkeys(pools, 1.0)
    while not stopping:
        time.sleep(0.5)
        for pool, proc in list(procs.items()):
            if proc.poll() is not None and not stopping:
                log.warning("worker for %s exited (%s); restarting in %.0f s", pool, proc.returncode, backoff[pool])
                time.sleep(backoff[pool])
                backoff[pool] = min(backoff[pool] * 2, 60)
                procs[pool] = launch(pool)
    for proc in procs.values():
        proc.terminate()
    for proc in procs.values():
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
    return 0


def worker_pools(pools: list[str], *, edge_workers: bool = False) -> list[str]:
    """The pools this host runs workers for: the central ones. An edge pool's worker would hold the central
    API string (which lets its holder change any block, deployment or automation): nodes run node-local
    (`edgehaul node run`). `edge_workers` runs them here anyway: simulated nodes on the operator's own
    machine, for the deployment-path demo (`make verify-demo`) only, never on an edge host."""
    return [p for p in pools if edge_workers or not p.startswith("edge-")]


def deploy(*, workers: bool = True, automations: bool = True, prefect_file: Path = PREFECT_FILE,
           overlay: Path | None = DEMO_OVERLAY, edge_workers: bool = False) -> dict[str, Any]:
    spec = load_spec(prefect_file, overlay)
    register_blocks()
    pools = pools_of(spec)
    ensure_pools(pools)
    prefect_deploy(prefect_file, overlay)
    out: dict[str, Any] = {"pools": pools, "deployments": deployment_names(spec)}
    if automations:
        from edgehaul.services.automations import apply_automations

        url, token = default_alert_target()
        out["automations"] = [a.name for a in apply_automations(webhook_url=url, token=token)]
    if workers:
        out["workers_pid"] = start_workers(worker_pools(pools, edge_workers=edge_workers))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="edgehaul_dev.deploy", description="deploy edgehaul to a Prefect server")
    ap.add_argument("command", nargs="?", default="deploy", choices=["deploy", "workers"])
    ap.add_argument("--pool", action="append", default=[], help="(workers) pool to serve; repeatable")
    ap.add_argument("--no-workers", action="store_true")
    ap.add_argument("--edge-workers", action="store_true",
                    help="also run the edge pools' workers on this host (simulated nodes, demo of the deployment "
                         "path): they hold the central API string, so never on an edge host")
    ap.add_argument("--no-automations", action="store_true")
    ap.add_argument("--prefect-file", type=Path, default=PREFECT_FILE)
    ap.add_argument("--overlay", type=Path, default=DEMO_OVERLAY, help="settings merged over the file (the demo's)")
    ap.add_argument("--no-overlay", action="store_true", help="deploy the file as it is (production settings)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.command == "workers":
        return supervise(args.pool or pools_of(load_spec(args.prefect_file)))
    out = deploy(workers=not args.no_workers, automations=not args.no_automations, edge_workers=args.edge_workers,
                 prefect_file=args.prefect_file.resolve(), overlay=None if args.no_overlay else args.overlay.resolve())
    print(f"pools: {', '.join(out['pools'])}")
    print(f"deployments ({len(out['deployments'])}): {', '.join(out['deployments'])}")
    if "automations" in out:
        print(f"alert automations: {', '.join(out['automations'])}")
    if "workers_pid" in out:
        print(f"workers: supervisor pid {out['workers_pid']} (stopped by 'make down')")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
