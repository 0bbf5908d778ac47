"""`make demo`: the end-to-end pipeline on the local stack, on real Landsat patches.

edge_ingest (two nodes) -> uplink_drain (simulated link) -> core_ingest (GE validation, Delta
commit) -> train_model (checkpoints) -> publish_model -> lifecycle_moves (dry run) -> cost_report (the
current month to date, so the demo's own uplink, storage and training show). Every step is a Prefect
flow run visible in the UI; the summary printed at the end has samples per tier, bytes uplinked, the
dataset version, model metrics and the UI address.

With --via-deployments (after `make deploy`) the same pipeline runs through the deployments, so the
workers of the right pools execute it: edge_ingest and uplink_drain per node on `edge-default` (queue
per node), then the event chain bundle landed -> core_ingest -> dataset committed -> train_model (on
`central-gpu`) -> model ready -> publish_model (core_ingest and publish_model on `central`), and
lifecycle_moves (dry run) / cost_report on `ops`. The summary then lists every flow run with its pool
and final state; any run not Completed fails the demo.

    python -m edgehaul_dev.demo [--samples N] [--epochs E] [--via-deployments [--timeout S]]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, cast
from uuid import UUID

from edgehaul import events
from edgehaul.platform.roles import DEFAULT_POLICY, StoreBlock, node_store
from edgehaul.training.catch_up import NOTHING_TO_TRAIN
from edgehaul_dev import configure, localstack
from edgehaul_dev.settings import dev_settings

if TYPE_CHECKING:
    from prefect.client.schemas.objects import FlowRun

log = logging.getLogger("edgehaul_dev.demo")


def this_month() -> str:
    """The cost report's month for the demo: the current one (to date); the scheduled report prices the last."""
    return f"{datetime.now(UTC):%Y-%m}"


class _HideCompleted(logging.Filter):
    """Drops Prefect's "Finished in state Completed()" console lines (one per task and flow run: 34 in a demo).
    The summary lists every run's final state; other final states still print, and the API keeps every line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Finished in state Completed(")


def quiet_prefect_console() -> None:
    """Filter Prefect's console handlers (on the root logger in Prefect 3's logging.yml); API handlers keep all."""
    for name in ("", "prefect", "prefect.flow_runs", "prefect.task_runs"):
        for handler in logging.getLogger(name).handlers:
            if type(handler).__name__ == "PrefectConsoleHandler":
                handler.addFilter(_HideCompleted())


def run(samples: int, epochs: int, nodes: list[str]) -> dict[str, Any]:
    from edgehaul.flows.core_ingest import CoreIngestParams, core_ingest
    from edgehaul.flows.cost_report import CostReportParams, cost_report
    from edgehaul.flows.edge_ingest import EdgeIngestParams, edge_ingest
    from edgehaul.flows.lifecycle_moves import LifecycleParams, lifecycle_moves
    from edgehaul.flows.publish_model import PublishModelParams, publish_model
    from edgehaul.flows.train_model import TrainModelParams, train_model
    from edgehaul.flows.uplink_drain import UplinkDrainParams, uplink_drain

    t0 = time.perf_counter()
    out: dict[str, Any] = {"edge": {}, "uplink": {}}
    # Rare land-cover classes are over-represented on node-b, as a site seeing something unusual would.
    mixes: list[dict[int, float] | None] = [None, {2: 3.0, 4: 3.0, 6: 3.0, 1: 1.0, 3: 1.0, 5: 1.0}]
    for i, node in enumerate(nodes):
        out["edge"][node] = edge_ingest(EdgeIngestParams(
            edge_node=node, object_store=node_store(node), tiering_policy=DEFAULT_POLICY, n_samples=samples,
            batch_size=min(20_000, samples),
            seed=i, class_weights=mixes[i % len(mixes)],
        ))
    for i, node in enumerate(nodes):
        out["uplink"][node] = uplink_drain(UplinkDrainParams(
            edge_node=node, link_profile=DEFAULT_POLICY, object_store=node_store(node), simulate=True, seed=i,
            max_seconds=600,
        ))
    out["core"] = core_ingest(CoreIngestParams(store_block=StoreBlock.INGEST))
    version = out["core"]["versions"].get("landsat_patch")
    out["train"] = train_model(TrainModelParams(
        team="geo", store_block=StoreBlock.TRAINER, dataset_version=version, epochs=epochs, allow_local=True, max_hours=0.5,
    ))
    model_id = out["train"].get("model_id")
    if model_id:
        out["publish"] = publish_model(PublishModelParams(model_id=model_id, store_block=StoreBlock.TRAINER))
    out["lifecycle"] = lifecycle_moves(LifecycleParams(store_block=StoreBlock.LIFECYCLE, dry_run=True))
    out["cost"] = cost_report(CostReportParams(store_block=StoreBlock.LIFECYCLE, month=this_month()))
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    return out


# ------------------------------------------------------------------------------------ via deployments

# Flows started by the event chain rather than by this script (deployment names in deployments/prefect.yaml).
CHAIN = ("core_ingest/on-bundle-landed", "train_model/on-dataset-committed", "publish_model/on-model-ready")


def _count_events(api: str, name: str, since: datetime, auth: str | None) -> int:
    import httpx

    body = {"filter": {"event": {"name": [name]}, "occurred": {"since": since.isoformat()}}, "limit": 1}
    r = httpx.post(f"{api}/events/filter", json=body, timeout=30, auth=tuple(auth.split(":", 1)) if auth else None)  # type: ignore[arg-type]
    r.raise_for_status()
    return int(r.json().get("total", 0))


def _await_runs(ids: list[UUID], timeout: float, what: str) -> list[Any]:
    from prefect.client.orchestration import get_client

    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as c:
        while True:
            runs = [c.read_flow_run(i) for i in ids]
            if all(r.state and r.state.is_final() for r in runs):
                return runs
            if time.monotonic() > deadline:
                left = [f"{r.name}:{r.state_name}" for r in runs if not (r.state and r.state.is_final())]
                raise TimeoutError(f"{what}: runs not finished after {timeout:.0f} s: {left}")
            time.sleep(2)


def _start(name: str, params: dict[str, Any]) -> UUID:
    from prefect.deployments import run_deployment

    fr = run_deployment(name, parameters={"params": params}, timeout=0, as_subflow=False, tags=["edgehaul-demo"])
    return cast("FlowRun", fr).id


def _run_all(starts: dict[str, tuple[str, dict[str, Any]]], timeout: float, say: Callable[[str], None]) -> dict[str, Any]:
    """Start deployment runs at once and wait for all; a run cancelled by the deployment's CANCEL_NEW
    concurrency limit (a scheduled run of the same deployment was active) is started again."""
    ids = {key: _start(dep, params) for key, (dep, params) in starts.items()}
    deadline = time.monotonic() + timeout
    for _attempt in range(5):
        runs = dict(zip(ids, _await_runs(list(ids.values()), max(1.0, deadline - time.monotonic()), "demo"), strict=True))
        again = {k for k, r in runs.items() if r.state and r.state.is_cancelled()}
        if not again:
            return runs
        say(f"{len(again)} run(s) cancelled by a concurrency limit, starting them again: {sorted(again)}")
        time.sleep(3)
        ids.update({k: _start(*starts[k]) for k in again})
    return runs


def _chain_runs(since: datetime) -> list[tuple[str, Any]]:
    """(deployment name, flow run) of the chain's runs expected to start after `since`."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        DeploymentFilter,
        DeploymentFilterId,
        FlowRunFilter,
        FlowRunFilterExpectedStartTime,
    )

    with get_client(sync_client=True) as c:
        dep = {c.read_deployment_by_name(n).id: n for n in CHAIN}
        runs = c.read_flow_runs(
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=list(dep))),
            flow_run_filter=FlowRunFilter(expected_start_time=FlowRunFilterExpectedStartTime(after_=since)),  # type: ignore[arg-type]
            limit=200,
        )
        return [(dep[r.deployment_id], r) for r in runs if r.deployment_id in dep]


def _flow_of(c: Any, run: Any, names: dict[UUID, str]) -> str:
    if run.flow_id not in names:
        names[run.flow_id] = c.read_flow(run.flow_id).name
    return names[run.flow_id]


def run_via_deployments(samples: int, epochs: int, nodes: list[str], state: localstack.StackState,
                        timeout: float = 1800.0, say: Callable[[str], None] = log.info,
                        start_seq: int | None = None) -> dict[str, Any]:
    """The pipeline through the deployments of `make deploy`; returns the flow runs and what they made.
    `start_seq`: the nodes' first sample number (sample ids are node + number); None: past every number the
    node's spool handed out before."""
    from prefect.client.orchestration import get_client

    t0, since = time.monotonic(), datetime.now(UTC) - timedelta(seconds=5)
    deadline = t0 + timeout
    mixes: list[dict[int, float] | None] = [None, {2: 3.0, 4: 3.0, 6: 3.0, 1: 1.0, 3: 1.0, 5: 1.0}]
    runs: list[Any] = []
    edge = _run_all({f"edge_ingest/{n}": (f"edge_ingest/{n}", {
        "edge_node": n, "object_store": node_store(n), "tiering_policy": DEFAULT_POLICY, "n_samples": samples,
        "batch_size": max(100, min(20_000, samples)),
        "seed": i, "class_weights": mixes[i % len(mixes)], **({} if start_seq is None else {"start_seq": start_seq})})
        for i, n in enumerate(nodes)}, timeout, say)
    runs += edge.values()
    say(f"edge_ingest: {[f'{k} {r.state_name}' for k, r in edge.items()]}")
    up = _run_all({f"uplink_drain/{n}": (f"uplink_drain/{n}", {
        "edge_node": n, "object_store": node_store(n), "link_profile": DEFAULT_POLICY, "simulate": True, "seed": i,
        "max_seconds": 600})
        for i, n in enumerate(nodes)}, max(1.0, deadline - time.monotonic()), say)
    runs += up.values()
    say(f"uplink_drain: {[f'{k} {r.state_name}' for k, r in up.items()]}")
    # The event chain: one core_ingest run per landing batch (a drain's landed bundles); each commit triggers
    # training (queued; a run covered by a newer model ends at once, announcing nothing), each model ready
    # triggers publishing.
    chain: list[Any] = []
    landed = batches = committed = ready = 0
    for _ in range(10):  # the landed events reach the server a moment after the drains end
        landed = _count_events(state.prefect_api_url, events.BUNDLE_LANDED, since, state.api_auth_string)
        if landed:
            break
        time.sleep(1)
    if landed:
        say(f"{landed} bundles landed; waiting up to {deadline - time.monotonic():.0f} s for the event chain "
            "core_ingest -> train_model -> publish_model that they start (done when every run has ended for 10 s)")
    else:
        say("0 bundles landed: the edge runs spooled nothing new (their batches were cached by an earlier demo "
            "with the same seeds) or the spools were already drained; nothing starts the event chain, so no wait")
    quiet_since: tuple[float, int] | None = None  # (when the chain was last seen done, its run count then)
    told = time.monotonic()
    while landed and time.monotonic() < deadline:
        # Events reach the server asynchronously and triggers fire a moment later: count what starts each
        # step every time, and call the chain done only when it has stayed done for 10 s.
        batches = _count_events(state.prefect_api_url, events.LANDING_BATCH, since, state.api_auth_string)
        ready = _count_events(state.prefect_api_url, events.MODEL_READY, since, state.api_auth_string)
        # a batch whose samples were all committed before (an earlier run with the same seeds) commits no
        # version, so it starts no training: wait for a training run only when a commit announced one
        committed = _count_events(state.prefect_api_url, events.DATASET_COMMITTED, since, state.api_auth_string)
        named = _chain_runs(since)
        chain = [r for _, r in named]
        ok = {n: [r for d, r in named if d == n and r.state and r.state.is_completed()] for n in CHAIN}
        ingests = [r for d, r in named if d == CHAIN[0]]
        publishes = [r for d, r in named if d == CHAIN[2]]
        settled = all(r.state and r.state.is_final() for r in chain)
        trained = bool(ok[CHAIN[1]]) or not committed
        if settled and batches and len(ingests) >= batches and trained and len(publishes) >= ready:
            if quiet_since is None or quiet_since[1] != len(chain):
                quiet_since = (time.monotonic(), len(chain))
            elif time.monotonic() - quiet_since[0] >= 10:
                break
        else:
            quiet_since = None
        if time.monotonic() - told >= 30:
            told = time.monotonic()
            active = [f"{r.name} {r.state_name}" for r in chain if not (r.state and r.state.is_final())]
            say(f"event chain: {len(chain)} runs so far, {len(ingests)}/{batches} ingests (one per landing batch), "
                f"{len(publishes)}/{ready} publishes; still running: {active}")
        time.sleep(3)
    if landed and time.monotonic() >= deadline:
        pending = [f"{r.name}:{r.state_name}" for r in chain if not (r.state and r.state.is_final())]
        ended = [f"{r.name}:{r.state_name}:{((r.state.message or '') if r.state else '')[:200]}" for r in chain
                 if r.state and r.state.is_final()]
        raise TimeoutError(f"event chain not finished after {timeout:.0f} s ({len(chain)} runs; pending {pending}; "
                           f"ended {ended}; events: {batches} landing batches, {committed} commits, {ready} models "
                           f"ready)")
    if landed:  # the count of the summary: events that arrived during the wait too
        landed = _count_events(state.prefect_api_url, events.BUNDLE_LANDED, since, state.api_auth_string)
    runs += chain
    ops_store = StoreBlock.LIFECYCLE.value
    ops = _run_all({"lifecycle_moves/daily": ("lifecycle_moves/daily", {"store_block": ops_store, "dry_run": True}),
                    "cost_report/monthly": ("cost_report/monthly", {"store_block": ops_store, "month": this_month()})},
                   max(1.0, deadline - time.monotonic()), say)
    runs += ops.values()
    names: dict[UUID, str] = {}
    with get_client(sync_client=True) as c:
        rows = [{"flow": _flow_of(c, r, names), "run": r.name, "pool": r.work_pool_name, "queue": r.work_queue_name,
                 "state": r.state_name, "seconds": round(r.total_run_time.total_seconds(), 1),
                 "by": r.created_by.type if r.created_by else "", "parameters": r.parameters.get("params", {}),
                 "message": (r.state.message or "") if r.state else ""}
                for r in runs]
    return {"runs": rows, "bundles_landed": landed, "versions_committed": committed,
            "wall_s": round(time.monotonic() - t0, 1)}


def run_ok(row: dict[str, Any]) -> bool:
    """Completed, or cancelled on purpose by a deployment's CANCEL_NEW concurrency limit (training: a
    commit during a run is covered by a later commit's run)."""
    return row["state"] == "Completed" or (row["state"] == "Cancelled" and "concurrency limit" in row["message"])


def deployment_summary_lines(out: dict[str, Any], ui_url: str) -> list[str]:
    lines = ["", "edgehaul demo through deployments — flow runs", "=" * 60]
    for r in out["runs"]:
        p = r["parameters"]
        what = p.get("edge_node") or p.get("dataset_version") or p.get("model_id") or p.get("bundle_keys") or ""
        lines.append(f"{r['state']:<10} {r['flow']:<16} {r['pool'] or '-':<13} {r['queue'] or '':<8} "
                     f"{r['seconds']:>6.1f} s  {r['by'] or 'API':<10} {what}")
    bad = [r for r in out["runs"] if not run_ok(r)]
    skipped = sum(1 for r in out["runs"] if r["state"] == "Cancelled" and run_ok(r))
    covered = sum(1 for r in out["runs"] if r["state"] == "Completed" and r["message"].startswith(NOTHING_TO_TRAIN))
    lines.append(f"{len(out['runs'])} flow runs, {len(bad)} failed, {covered} with nothing left to do (a run before "
                 f"them covered it), {skipped} skipped by a concurrency limit; "
                 f"{out['bundles_landed']} bundles landed; "
                 f"wall time {out['wall_s']} s")
    lines.append(f"Prefect UI: {ui_url}  (flow runs, artifacts, events)")
    return lines


def summary_lines(out: dict[str, Any], ui_url: str) -> list[str]:
    lines = ["", "edgehaul demo — summary", "=" * 60]
    for node, e in out["edge"].items():
        tiers = e.get("samples", {})
        kept = e.get("bundles_by_reason", {}).get("raw", 0)
        lines.append(
            f"{node}: {e.get('samples_in', 0)} samples in, {sum(e.get('rejected', {}).values())} rejected; "
            f"tiers {json.dumps(tiers)}; {e.get('bundles', 0)} bundles"
            + (f" ({kept} low-tier, kept in the node's raw store: never uplinked)" if kept else "")
        )
    for node, u in out["uplink"].items():
        lines.append(
            f"{node} uplink: {u.get('bundles_landed', 0)} bundles, {u.get('bytes_landed', 0) / 1e6:.1f} MB, "
            f"goodput {u.get('goodput_bps', 0) / 1e6:.1f} Mbit/s ({100 * u.get('rate_cap_use', 0):.0f}% of cap)"
        )
    core = out.get("core", {})
    lines.append(
        f"dataset: versions {json.dumps(core.get('versions', {}))} ({core.get('valid', 0)} bundles valid, "
        f"{len(core.get('quarantined', []))} quarantined, {len(core.get('errors', []))} errors)"
    )
    tr = out.get("train", {})
    hist = tr.get("history") or [{}]
    best = max(hist, key=lambda h: h.get("val_macro_f1", float("-inf")) if h.get("val_macro_f1") == h.get(
        "val_macro_f1") else float("-inf"))  # the epoch the trainer registers (NaN never the best)
    shown = {k: round(v, 4) if isinstance(v, float) else v for k, v in best.items()
             if not k.startswith(("val_support_", "val_f1_"))}
    lines.append(f"model: {tr.get('model_id')} on dataset v{tr.get('dataset_version')}, validation macro-F1 "
                 f"{best.get('val_macro_f1', float('nan')):.3f} against {best.get('val_chance_macro_f1', float('nan')):.3f} "
                 f"for a label-blind guesser (epoch {best.get('epoch')} of {len(hist)}); {json.dumps(shown)}")
    unseen = [k.removeprefix("val_recall_") for k, v in best.items() if k.startswith("val_recall_") and v == 0]
    if unseen:
        lines.append(f"model: never right on classes {', '.join(unseen)} (each has validation support)")
    cost = out.get("cost", {})
    lines.append(f"cost report {cost.get('month', '')} (month to date): total {cost.get('total')} "
                 f"{cost.get('currency', '')}".rstrip())
    lines.append(f"wall time {out.get('wall_s')} s")
    lines.append(f"Prefect UI: {ui_url}  (flow runs, artifacts, events)")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="edgehaul_dev.demo")
    ap.add_argument("--samples", type=int, default=dev_settings().demo_samples, help="default: EDGEHAUL_DEMO_SAMPLES")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--nodes", nargs="+", default=["node-a", "node-b"])
    ap.add_argument("--via-deployments", action="store_true", help="run through the deployments (after make deploy)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="(--via-deployments) give up after this many seconds")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # quiet by default: the libraries' INFO chatter (Great Expectations alone says "Skipping registering"
    # 214 times on import) would bury the demo's summary
    for noisy in ("httpx", "great_expectations"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    state = localstack.StackState.load(localstack.DEFAULT_ROOT)
    if state is None:
        print("no local stack; run 'make up' (make demo does it)", file=sys.stderr)
        return 1
    os.environ.update(state.env())
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    # Settings were read when prefect was imported: set the stack's API (and its auth, if on) here.
    with temporary_settings(updates={PREFECT_API_URL: state.prefect_api_url,
                                     PREFECT_API_AUTH_STRING: state.api_auth_string}):
        return _main(args, state)


def _main(args: argparse.Namespace, state: localstack.StackState) -> int:
    if args.via_deployments:
        out = run_via_deployments(args.samples, args.epochs, args.nodes, state, args.timeout, say=log.info)
        print("\n".join(deployment_summary_lines(out, state.prefect_ui_url)))
        return 0 if all(run_ok(r) for r in out["runs"]) else 1
    configure.register_block_types()
    configure.save_blocks(state)
    quiet_prefect_console()
    out = run(args.samples, args.epochs, args.nodes)
    print("\n".join(summary_lines(out, state.prefect_ui_url)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
