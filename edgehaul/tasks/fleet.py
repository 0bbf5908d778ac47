"""Tasks of the fleet view: gather what the Prefect API and the store hold, build the view, publish it.

Reads are retried on transport errors only (S3 by `edgehaul.platform.s3_errors`, the Prefect API by
its own client); nothing is cached: the view is of now.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from edgehaul import events
from edgehaul.blocks import ObjectStore
from edgehaul.ops import fleet
from edgehaul.platform.s3_errors import IO_RETRY
from edgehaul.uplink.pass_plan import Pass, PassScheduleError, load_passes

log = logging.getLogger(__name__)

EDGE_NODE_SLUG = "edgehaul-edge-node"
PAGE_LIMIT = 50  # events per page (the server's maximum); pages are followed up to MAX_EVENTS
MAX_EVENTS = 20_000
MAX_RUNS = 200  # the latest core_ingest runs of the window (the server's page maximum)


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    pass_schedule: str | None


def _node_of(resource: dict[str, str], prefix: str) -> str | None:
    node = resource.get("edgehaul.node") or resource.get("edgehaul.node.id")
    rid = resource.get("prefect.resource.id", "")
    return node or (rid[len(prefix):] if rid.startswith(prefix) else None)


def latest_events(names: list[str], since: datetime, until: datetime) -> list[tuple[str, datetime, dict[str, Any],
                                                                                    dict[str, str]]]:
    """(event name, occurred, payload, resource labels) of every event named `names` in [since, until]."""
    from prefect.client.orchestration import get_client
    from prefect.events.filters import EventFilter, EventNameFilter, EventOccurredFilter

    out: list[tuple[str, datetime, dict[str, Any], dict[str, str]]] = []
    flt = EventFilter(occurred=EventOccurredFilter(since=since, until=until),  # type: ignore[arg-type]  # DateTime
                      event=EventNameFilter(name=names))
    with get_client(sync_client=True) as client:
        page = client.read_events(flt, limit=PAGE_LIMIT)
        while True:
            out += [(e.event, e.occurred, dict(e.payload), dict(e.resource.root)) for e in page.events]
            if not page.next_page or len(out) >= MAX_EVENTS:
                break
            page = client.read_events_page(str(page.next_page))
    return out


@task(name="read-fleet-facts", retries=2, retry_delay_seconds=[5, 30], cache_policy=NO_CACHE)
def read_facts(since: datetime, now: datetime) -> dict[str, Any]:
    """Edge nodes (blocks), their latest link stats and spool alerts, checkpoint failures and core_ingest
    run timings since `since`, from the Prefect API."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName, FlowRunFilter, FlowRunFilterStartTime
    from prefect.client.schemas.sorting import FlowRunSort

    with get_client(sync_client=True) as client:
        docs = client.read_block_documents_by_type(EDGE_NODE_SLUG, include_secrets=False)
        nodes = {str(d.data["node_id"]): NodeInfo(str(d.data["node_id"]), d.data.get("pass_schedule")) for d in docs
                 if d.name and not d.is_anonymous and "node_id" in d.data}
        runs = client.read_flow_runs(
            flow_filter=FlowFilter(name=FlowFilterName(any_=["core_ingest"])),
            flow_run_filter=FlowRunFilter(start_time=FlowRunFilterStartTime(after_=since)),  # type: ignore[arg-type]
            sort=FlowRunSort.START_TIME_DESC, limit=MAX_RUNS)
    link: dict[str, tuple[datetime, dict[str, Any]]] = {}
    spool: dict[str, tuple[datetime, dict[str, Any]]] = {}
    failed = 0
    for name, at, payload, resource in latest_events(
            [events.LINK_STATS, events.SPOOL_WATERMARK, events.CHECKPOINT_FAILED], since, now):
        if name == events.CHECKPOINT_FAILED:
            # the core's own event: a copy forwarded in a node's name (refused by the gateway today,
            # perhaps stored before) is not a checkpoint attempt
            failed += resource.get("edgehaul.forwarded") != "true"
            continue
        latest, prefix = (link, "edgehaul.link.") if name == events.LINK_STATS else (spool, "edgehaul.spool.")
        node = _node_of(resource, prefix)
        if node and (node not in latest or at > latest[node][0]):
            latest[node] = (at, payload)
    batches: list[tuple[datetime, dict[str, Any]]] = []
    receipts: list[tuple[datetime, str, str]] = []
    # a bundle announced up to a window before `since` and committed in the window still counts
    for name, at, payload, resource in latest_events([events.LANDING_BATCH, events.BUNDLE_RECEIPT],
                                                     since - (now - since), now):
        if name == events.LANDING_BATCH:
            batches.append((at, payload))
        elif payload.get("status") == "committed" and at >= since:
            rid = resource.get("prefect.resource.id", "")
            receipts.append((at, resource.get("edgehaul.node.id", ""), rid.removeprefix("edgehaul.bundle.")))
    latency = fleet.commit_latencies(batches, receipts)
    log.info("fleet facts: %d nodes, %d with link stats, %d spool alerts, %d checkpoint failures, %d core runs, "
             "%d commit receipts", len(nodes), len(link), len(spool), failed, len(runs), len(receipts))
    return {"nodes": nodes, "link": link, "spool": spool, "checkpoint_failed": failed, "latency": latency,
            "core_runs": [(r.expected_start_time, r.start_time) for r in runs]}


@task(name="read-store-figures", **IO_RETRY, cache_policy=NO_CACHE)
def read_store_figures(store: ObjectStore, model_name: str, since: datetime, now: datetime) -> dict[str, Any]:
    return {"write_bps": fleet.write_throughput(store, since, now),
            "checkpoints": fleet.committed_checkpoints(store, since),
            "model": model_status(store, model_name, now)}


def model_status(store: ObjectStore, name: str, now: datetime) -> fleet.ModelStatus | None:
    """The published model `name` against its dataset's latest version; None when none is published."""
    from edgehaul.core.datasets import open_uri
    from edgehaul.training.registry import RegistryError, latest_uri, read_json

    try:
        pointer, _ = read_json(store, latest_uri(store, name))
    except RegistryError:
        return None
    uri, version = pointer.get("dataset_uri"), pointer.get("dataset_version")
    if uri is None or version is None:
        raise ValueError(f"published model {name} ({pointer.get('model_id')}) names no dataset_uri/dataset_version")
    latest = open_uri(str(uri), store.storage_options()).version()
    published = datetime.fromisoformat(str(pointer["published"]))
    return fleet.ModelStatus(str(pointer["model_id"]), str(uri), int(version), int(latest), published,
                       (now - published).total_seconds())


def passes_of(info: NodeInfo) -> list[Pass] | None:
    """The node's contact plan, None without one. A plan this process cannot read is logged and
    treated as none (the default silence bound applies), so one bad file does not hide the fleet."""
    if not info.pass_schedule:
        return None
    try:
        return load_passes(info.pass_schedule)
    except (OSError, PassScheduleError) as e:
        log.warning("node %s: pass schedule %s unreadable (%s): default silence bound", info.node_id,
                    info.pass_schedule, e)
        return None


@task(name="publish-fleet-view", **IO_RETRY, cache_policy=NO_CACHE)
def publish_view(store: ObjectStore, view: fleet.FleetView) -> str:
    return fleet.write_view(store, view)


def emit_alerts(view: fleet.FleetView, silences: list[fleet.Silence], stale: fleet.ModelStatus | None,
                policy: dict[str, float]) -> int:
    """NODE_SILENT per silent node and MODEL_STALE for a stale model, with the bound in the payload."""
    n = 0
    for s in silences:
        n += events.emit(events.NODE_SILENT, f"edgehaul.node.{s.node_id}", {
            "node_id": s.node_id, "last_seen": s.last_seen.isoformat() if s.last_seen else None,
            "allowed_s": round(s.allowed_s, 1), "reason": s.reason}, **{"edgehaul.node": s.node_id})
    if stale is not None:
        n += events.emit(events.MODEL_STALE, f"edgehaul.model.{stale.model_id}", {
            "model_id": stale.model_id, "dataset_uri": stale.dataset_uri, "trained_version": stale.trained_version,
            "latest_version": stale.latest_version, "versions_behind": stale.versions_behind,
            "age_s": round(stale.age_s, 1), **policy})
    return n


def window_start(now: datetime, window_s: float) -> datetime:
    return now - timedelta(seconds=window_s)
