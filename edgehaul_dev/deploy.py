"""`make deploy`: put the whole product on a Prefect server and start its workers.

Against $PREFECT_API_URL (the local stack of $EDGEHAUL_STACK_DIR by default), in order:
1. `prefect block register -m edgehaul.blocks`, and the stack's block documents (`edgehaul_dev.configure`);
2. the work pools named in deployments/prefect.yaml (`edge-<group>`, `central`, `ops`), type `process`;
3. `prefect deploy --all --prefect-file deployments/prefect.yaml` (CI=true: no prompts) from the
   repository root: deployments, schedules and event triggers;
4. the alert automations (`edgehaul.platform.automations`), notifying the gateway's /alerts sink of the
   local stack, or $EDGEHAUL_ALERT_WEBHOOK_URL;
5. one `prefect worker start` per pool, under one supervisor process recorded as the stack's
   `workers` PID (`make down` stops them with the rest of the stack).

    python -m edgehaul_dev.deploy [--no-workers] [--no-automations]
    python -m edgehaul_dev.deploy workers --pool central --pool ops     # the supervisor itself
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

log = logging.getLogger("edgehaul_dev.deploy")

REPO = Path(__file__).resolve().parent.parent
PREFECT_FILE = REPO / "deployments" / "prefect.yaml"


def load_spec(path: Path = PREFECT_FILE) -> dict[str, Any]:
    spec = yaml.safe_load(path.read_text())
    if not isinstance(spec, dict) or not isinstance(spec.get("deployments"), list):
        raise ValueError(f"{path}: no 'deployments' list")
    return spec


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
    from edgehaul_dev import configure, localstack

    configure.register_block_types()
    state = localstack.StackState.load(localstack.DEFAULT_ROOT)
    if state is not None and os.environ.get("PREFECT_API_URL", "").rstrip("/") == state.prefect_api_url:
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


def prefect_deploy(prefect_file: Path = PREFECT_FILE, timeout: float = 900) -> str:
    """`prefect deploy --all` from the repository root, without prompts; returns its output."""
    spec = load_spec(prefect_file)
    if missing := missing_entrypoints(spec):
        raise FileNotFoundError(f"{prefect_file}: entrypoints not found: {', '.join(missing)}")
    env = {**os.environ, "CI": "true", "PREFECT_CLI_PROMPT": "false", "PYTHONPATH": str(REPO)}
    cmd = [prefect_exe(), "--no-prompt", "deploy", "--all", "--prefect-file", str(prefect_file)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"prefect deploy failed (exit {proc.returncode}):\n{out[-4000:]}")
    log.info("deployed %d deployments from %s", len(spec["deployments"]), prefect_file.relative_to(REPO))
    return out


def default_alert_target() -> tuple[str, str | None]:
    """(webhook URL, bearer token): $EDGEHAUL_ALERT_WEBHOOK_URL, else the local gateway's /alerts sink."""
    url = os.environ.get("EDGEHAUL_ALERT_WEBHOOK_URL")
    if url:
        return url, os.environ.get("EDGEHAUL_ALERT_WEBHOOK_TOKEN")
    from edgehaul.platform import gateway
    from edgehaul_dev import localstack

    state = localstack.StackState.load(localstack.DEFAULT_ROOT)
    if state is None:
        raise RuntimeError("no alert receiver: set EDGEHAUL_ALERT_WEBHOOK_URL or run 'make up' first")
    base = localstack.start_gateway(state)
    return f"{base}/alerts", gateway.alert_token(gateway.load_secret())


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


def deploy(*, workers: bool = True, automations: bool = True, prefect_file: Path = PREFECT_FILE) -> dict[str, Any]:
    spec = load_spec(prefect_file)
    register_blocks()
    pools = pools_of(spec)
    ensure_pools(pools)
    prefect_deploy(prefect_file)
    out: dict[str, Any] = {"pools": pools, "deployments": deployment_names(spec)}
    if automations:
        from edgehaul.platform.automations import apply_automations

        url, token = default_alert_target()
        out["automations"] = [a.name for a in apply_automations(webhook_url=url, token=token)]
    if workers:
        out["workers_pid"] = start_workers(pools)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="edgehaul_dev.deploy", description="deploy edgehaul to a Prefect server")
    ap.add_argument("command", nargs="?", default="deploy", choices=["deploy", "workers"])
    ap.add_argument("--pool", action="append", default=[], help="(workers) pool to serve; repeatable")
    ap.add_argument("--no-workers", action="store_true")
    ap.add_argument("--no-automations", action="store_true")
    ap.add_argument("--prefect-file", type=Path, default=PREFECT_FILE)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.command == "workers":
        return supervise(args.pool or pools_of(load_spec(args.prefect_file)))
    out = deploy(workers=not args.no_workers, automations=not args.no_automations,
                 prefect_file=args.prefect_file.resolve())
    print(f"pools: {', '.join(out['pools'])}")
    print(f"deployments ({len(out['deployments'])}): {', '.join(out['deployments'])}")
    if "automations" in out:
        print(f"alert automations: {', '.join(out['automations'])}")
    if "workers_pid" in out:
        print(f"workers: supervisor pid {out['workers_pid']} (stopped by 'make down')")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
