"""Uplink tasks: thin wrappers over edgehaul.uplink.transfer / link / retry_queue.

Retries are for I/O only, when `edgehaul.platform.s3_errors.retry_condition` says the error is safe to retry
(connection errors, link down, 5xx, throttling); AccessDenied, NoSuchBucket or a checksum that keeps
failing fail at once. Nothing here is cached: every run moves bytes and must really happen.
"""

from __future__ import annotations

import contextlib
import logging
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from edgehaul import events
from edgehaul.blocks import EdgeNode, LinkProfile, ObjectStore
from edgehaul.edge.spool import Spool
from edgehaul.platform.reporting import summary_table
from edgehaul.platform.s3_errors import TASK_RETRIES, TASK_RETRY_DELAYS_S, retry_condition
from edgehaul.uplink.backup import BackupLedger
from edgehaul.uplink.drain_figures import drain_metrics, no_pass_metrics
from edgehaul.uplink.link import Link, SimulatedLink
from edgehaul.uplink.pass_drain import plan_pass_drain, wait_for_pass
from edgehaul.uplink.pass_plan import Pass, PassPlan, upcoming
from edgehaul.uplink.retry_queue import RetryQueue
from edgehaul.uplink.transfer import Drainer, Uplink

log = logging.getLogger(__name__)


def make_link(profile: LinkProfile, *, simulate: bool, seed: int = 0, node_id: str = "") -> Link:
    rid = f"edgehaul.link.{node_id or 'local'}"
    if simulate:
        return SimulatedLink(profile, seed=seed, resource_id=rid)
    return Link(profile, resource_id=rid)


def spool_discard(spool: Spool, bundle_id: str) -> None:
    """Remove a bundle's bytes from the spool after the retry queue gave up on it (its samples are
    already in the ledger)."""
    spool.discard(bundle_id)


def open_retry_queue(spool: Spool, node: EdgeNode, *, emit_events: bool = True) -> RetryQueue:
    return RetryQueue(
        Path(spool.root) / "retry_queue.sqlite", cap=node.retry_queue_cap, expiry_seconds=node.retry_expiry_seconds,
        ledger=spool.ledger, discard=lambda b: spool_discard(spool, b),
        resource_id=f"edgehaul.uplink.{node.node_id}.retry", emit_events=emit_events,
    )


@task(name="expire-retry-queue", cache_policy=NO_CACHE)
def expire_retries(node: EdgeNode) -> dict[str, int]:
    """Expire old retry-queue entries and spool TTLs; every drop lands in the ledger."""
    spool = Spool.from_block(node)
    try:
        q = open_retry_queue(spool, node)
        expired = q.expire()
        ttl = spool.expire()
        return {"retry_expired": len(expired), "ttl_expired": len(ttl), "retry_queue": len(q),
                "spool_pending": len(spool.pending())}
    finally:
        spool.close()


@task(name="probe-contact", cache_policy=NO_CACHE)
def probe_contact(store: ObjectStore, timeout_s: float = 5.0) -> str | None:
    """None when the store answers (any answer, a refusal included); else why it is out of reach.

    One request, no retries: out of contact, a drain attempt costs seconds instead of a failed run
    that waited through every retry (the node's schedule simply tries again)."""
    from botocore.exceptions import ClientError, HTTPClientError
    from botocore.exceptions import ConnectionError as BotoConnectionError

    client = store.client(connect_timeout=timeout_s, read_timeout=timeout_s, retries={"total_max_attempts": 1})
    try:
        client.head_bucket(Bucket=store.bucket("landing"))
    except ClientError:
        return None  # e.g. 403 to a prefix-scoped node identity: the store is there
    except (BotoConnectionError, HTTPClientError) as e:
        return f"{type(e).__name__}: {e}"
    return None


@task(name="abort-orphaned-uploads", retries=TASK_RETRIES, retry_delay_seconds=TASK_RETRY_DELAYS_S,
      retry_condition_fn=retry_condition, cache_policy=NO_CACHE)
def abort_orphans(store: ObjectStore, profile: LinkProfile, node: EdgeNode, older_than_s: float) -> int:
    spool = Spool.from_block(node)
    try:
        live = {e.bundle_id for e in spool.pending()}
    finally:
        spool.close()
    up = Uplink(store, Link(profile), Path(node.spool_dir) / "uplink")
    return len(up.abort_orphans(node.node_id, older_than_s=older_than_s, live_bundles=live))


@task(name="drain-spool", retries=TASK_RETRIES, retry_delay_seconds=[5, 30],  # link outages: longer waits
      retry_condition_fn=retry_condition, cache_policy=NO_CACHE)
def drain_spool(
    store: ObjectStore, profile: LinkProfile, node: EdgeNode, *, max_seconds: float, max_active: int,
    simulate: bool = False, seed: int = 0, contact_wait_s: float = 0.0, passes: list[Pass] | None = None,
    backup: LinkProfile | None = None,
) -> dict[str, Any]:
    """Drain the node's spool for up to max_seconds; returns the link metrics of the run.

    With `passes` (the node's predicted passes), only the current pass is drained, by its plan: the
    pass open now (or the next one, if it opens within `contact_wait_s`) is planned before sending,
    and `metrics["pass_plan"]` holds planned vs sent bytes and value.

    Per-bundle failures are retried inside the drain and then parked in the retry queue, so this
    task only fails (and retries) when the whole drain cannot run (e.g. the store is unreachable)."""
    spool = Spool.from_block(node)
    try:
        queue = open_retry_queue(spool, node)
        plan: PassPlan | None = None
        later: list[PassPlan] = []
        values: dict[str, float] = {}
        if passes is not None:
            ahead = upcoming(passes, datetime.now(UTC))
            wait_s = wait_for_pass(ahead, datetime.now(UTC), contact_wait_s)
            if wait_s is None:
                nxt = ahead[0].start.isoformat() if ahead else None
                log.info("no pass open (next %s): nothing drained", nxt or "none scheduled")
                metrics = no_pass_metrics(len(queue), nxt)
                queue.close()
                return metrics
            time.sleep(wait_s)
            pd = plan_pass_drain(spool, queue, node, profile, ahead, datetime.now(UTC), max_active=max_active,
                                 max_seconds=max_seconds)
            plan, later, values, profile, max_seconds = pd.plan, pd.later, pd.values, pd.profile, pd.max_seconds
        link = make_link(profile, simulate=simulate, seed=seed, node_id=node.node_id)
        up = Uplink(store, link, Path(node.spool_dir) / "uplink", contact_wait_s=contact_wait_s)
        backup_up, budget_left, ledger = None, None, BackupLedger(Path(node.spool_dir) / "uplink-backup")
        if backup is not None:  # fail-over for urgent bundles while the primary is down
            blink = make_link(backup, simulate=simulate, seed=seed + 1, node_id=node.node_id)
            backup_up = Uplink(store, blink, Path(node.spool_dir) / "uplink-backup")
            if backup.monthly_budget_bytes is not None:
                budget_left = max(0, backup.monthly_budget_bytes - ledger.used(f"{datetime.now(UTC):%Y-%m}"))
        drainer = Drainer(up, spool, max_active=max_active, retry_queue=queue,
                          plan=plan.bundle_ids if plan is not None else None, backup=backup_up,
                          backup_budget_bytes=budget_left)
        rep = drainer.run(max_seconds=max_seconds)
        ledger.add(datetime.now(UTC), rep.landed)
        metrics = drain_metrics(rep, link.cap_bytes_per_s, retry_queue=len(queue), spool_pending=len(spool.pending()),
                                spool_used_fraction=spool.usage().fraction, plan=plan, later=later, values=values)
        log.info("drained %d bundles (%d bytes) in %.1fs, %d failed (%d gone from the spool), %d in retry queue",
                 len(rep.landed), rep.bytes_landed, rep.seconds, len(rep.failed), len(rep.gone), len(queue))
        queue.close()
        return metrics
    finally:
        with contextlib.suppress(Exception):
            spool.close()


@task(name="publish-link-stats", cache_policy=NO_CACHE)
def publish_link_stats(node_id: str, metrics: dict[str, Any]) -> bool:
    """LINK_STATS event (retransmission rate is level 1) and a table artifact of the run."""
    payload = {
        "level": 1,
        "retransmission_rate": metrics.get("retransmission_rate", 0.0),
        "goodput_bps": metrics.get("goodput_bps", 0.0),
        "rate_cap_use": metrics.get("rate_cap_use", 0.0),
        "queue_lengths": metrics.get("queue_lengths", {}),
        "retry_queue": metrics.get("retry_queue", 0),
        "bundles_landed": metrics.get("bundles_landed", 0),
        "capture_to_landed_p50_s": metrics.get("capture_to_landed_p50_s", {}),
        "capture_to_landed_p99_s": metrics.get("capture_to_landed_p99_s", {}),
        "spool_used_fraction": metrics.get("spool_used_fraction"),
    }
    ok = events.emit(events.LINK_STATS, f"edgehaul.link.{node_id}", payload, **{"edgehaul.node": node_id})
    rows = [{"metric": k, "value": v if isinstance(v, int | float) else str(v)} for k, v in payload.items()]
    # Planned vs sent of the pass, and what the following passes are planned to carry.
    for i, pp in enumerate([metrics.get("pass_plan"), *metrics.get("later_passes", [])]):
        if pp:
            what = "pass" if i == 0 else f"pass +{i} (planned)"
            rows += [{"metric": f"{what} {k}", "value": v if isinstance(v, int | float) else str(v)} for k, v in pp.items()
                     if k not in ("planned_ids", "not_sent")]
    summary_table(f"uplink-{node_id}", rows, f"Uplink metrics of node {node_id}")
    return ok
