"""Warm serving: a deployment's flow runs executed inside one long-lived process.

Prefect's runner (`flow.serve`, a process worker) starts every flow run in a fresh Python process, which
pays the interpreter, Prefect, Great Expectations and deltalake imports and the first table open before
the run does anything: ~30-45 s per run on a loaded 2-core machine, most of a short core_ingest run.
`serve_warm` instead polls the deployment's due runs, takes each one as a runner does (proposes Pending:
the server refuses it when another runner took the run first, or a run that another run completed), and
runs it with Prefect's own engine (`run_flow`) in a thread of this process, at most `limit` at once. The
process keeps what its runs have loaded (modules, the open Delta table handles, GE's context), so a run
costs its own work. What is given up: a run cannot be killed apart from the process (cancelling one
marks it, the thread finishes), and a crash of the process ends all its runs at once (their claims
expire after the lease; core_ingest's commits are atomic). Run several warm processes for more slots.
"""

from __future__ import annotations

import contextvars
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

from prefect.logging import get_logger

log = get_logger("edgehaul.services.warm")


def serve_warm(flow: Any, deployment_id: str, *, limit: int = 4, poll_s: float = 0.5,
               stop: threading.Event | None = None, grace_s: float = 120.0) -> int:
    """Run `deployment_id`'s due flow runs in this process until `stop` is set; returns how many ran.
    On stop, runs already taken finish (up to `grace_s`); no new one is taken."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.responses import OrchestrationResult, SetStateStatus
    from prefect.flow_engine import run_flow
    from prefect.states import Pending

    stop = stop or threading.Event()
    dep = uuid.UUID(deployment_id)
    pool = ThreadPoolExecutor(max_workers=limit, thread_name_prefix="warm-run")
    running: set[Future[Any]] = set()
    started = 0

    def one(fr: Any) -> None:
        try:
            run_flow(flow, flow_run=fr, return_type="state")  # the engine records every state and error
        except BaseException as e:  # the engine failed outside the run: say so, keep serving
            log.error("warm run %s of deployment %s ended outside its state: %s", fr.id, deployment_id, e)

    with get_client(sync_client=True) as client:
        while not stop.is_set():
            running = {f for f in running if not f.done()}
            free = limit - len(running)
            if free > 0:
                try:
                    due = client.get_scheduled_flow_runs_for_deployments(
                        deployment_ids=[dep], scheduled_before=datetime.now(UTC), limit=free)
                except Exception as e:  # the API is busy or restarting: try again next poll
                    log.warning("warm serve of %s: runs not read (%s)", deployment_id, e)
                    due = []
                for fr in due[:free]:
                    try:
                        res: OrchestrationResult[Any] = client.set_flow_run_state(fr.id, Pending())
                    except Exception as e:  # another poll takes it
                        log.warning("warm serve of %s: run %s not taken (%s)", deployment_id, fr.id, e)
                        continue
                    if res.status != SetStateStatus.ACCEPT:
                        continue  # another runner took it, or it was completed by a run that covered it
                    running.add(pool.submit(contextvars.copy_context().run, one, client.read_flow_run(fr.id)))
                    started += 1
            stop.wait(poll_s)
    deadline = time.monotonic() + grace_s
    for f in running:
        try:
            f.result(timeout=max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            log.warning("warm serve of %s: stopped with a run still going after %.0f s", deployment_id, grace_s)
    pool.shutdown(wait=False)
    return started


def main(argv: list[str] | None = None) -> int:
    """`python -m edgehaul.services.warm core_ingest/on-bundle-landed --limit 4`: serve a deployment made by
    `prefect deploy` warm, from the code folder its entrypoint is relative to (the images' /opt/edgehaul).
    Beside the pool's process worker it is safe: each run is taken once (Pending), by whichever polls first."""
    import argparse
    import signal

    from prefect.client.orchestration import get_client
    from prefect.flows import load_flow_from_entrypoint

    ap = argparse.ArgumentParser(prog="python -m edgehaul.services.warm", description=main.__doc__)
    ap.add_argument("deployment", help="<flow>/<deployment>, e.g. core_ingest/on-bundle-landed")
    ap.add_argument("--limit", type=int, default=4, help="runs at once in this process (default 4)")
    ap.add_argument("--poll", type=float, default=0.5, help="seconds between polls (default 0.5)")
    args = ap.parse_args(argv)
    with get_client(sync_client=True) as client:
        dep = client.read_deployment_by_name(args.deployment)
    if not dep.entrypoint:
        raise SystemExit(f"deployment {args.deployment} has no entrypoint to load its flow from")
    flow: Any = load_flow_from_entrypoint(dep.entrypoint)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    log.info("serving %s warm (%s), %d at once", args.deployment, dep.entrypoint, args.limit)
    try:
        n = serve_warm(flow, str(dep.id), limit=args.limit, poll_s=args.poll, stop=stop)
    except KeyboardInterrupt:
        return 130
    log.info("stopped after %d runs", n)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
