"""The figures of one drain: link metrics with the queues as the drain left them, planned vs sent of a
pass, what a node's run summary and its forwarding add. Pure functions over a `DrainReport`."""

from __future__ import annotations

from typing import Any

from edgehaul.uplink.pass_plan import PassPlan
from edgehaul.uplink.transfer import DrainReport

# What a node-local drain records in its outbox run summary.
RUN_FIGURES = ("bundles_landed", "bytes_landed", "bundles_failed", "retry_queue", "retry_expired", "ttl_expired",
               "orphans_aborted")


def drain_metrics(rep: DrainReport, cap_bytes_per_s: float, *, retry_queue: int, spool_pending: int,
                  spool_used_fraction: float, plan: PassPlan | None = None, later: list[PassPlan] | None = None,
                  values: dict[str, float] | None = None) -> dict[str, Any]:
    """The link metrics of a drain, with the retry queue and the spool as the drain left them; by plan also
    the pass's planned vs sent and what the following passes are planned to carry."""
    metrics = rep.metrics(cap_bytes_per_s)
    metrics["queue_lengths"] = {t: n for t, n in metrics["queue_lengths"].items()}
    metrics["retry_queue"] = retry_queue
    metrics["spool_pending"] = spool_pending
    metrics["spool_used_fraction"] = round(spool_used_fraction, 4)  # the fleet view's spool figure
    metrics["link"] = rep.link
    metrics["landed_keys"] = [r.key for r in rep.landed]
    metrics["failed"] = rep.failed
    metrics["bytes_by_link"] = dict(rep.bytes_by_link)
    metrics["backup_refusals"] = rep.backup_refusals
    if plan is not None:
        metrics["pass_plan"] = pass_report(plan, rep, values or {})
        metrics["later_passes"] = [pp.summary() for pp in later or []]
    return metrics


def pass_report(plan: PassPlan, rep: DrainReport, values: dict[str, float]) -> dict[str, Any]:
    """Planned vs sent for one pass: bytes (bundles + manifests as sent over the link) and value."""
    landed = {r.bundle_id: r for r in rep.landed}
    planned = set(plan.bundle_ids)
    sent_bytes = sum((0 if r.already_present else r.nbytes) + r.manifest_nbytes for r in landed.values())
    return {
        **plan.summary(),
        "sent_bundles": len(landed),
        "sent_bytes": sent_bytes,
        "sent_value": round(sum(values.get(b, 0.0) for b in landed), 3),
        "planned_ids": plan.bundle_ids,
        "not_sent": sorted(planned - landed.keys()),
    }


def no_pass_metrics(retry_queue: int, next_pass: str | None) -> dict[str, Any]:
    """The metrics of a drain by plan with no pass open: nothing sent, the next pass named."""
    metrics = DrainReport().metrics(0.0)
    metrics.update(retry_queue=retry_queue, link={}, landed_keys=[], failed={},
                   pass_plan={"next_pass": next_pass, "planned_bundles": 0, "sent_bundles": 0})
    return metrics


def run_figures(metrics: dict[str, Any]) -> dict[str, Any]:
    """A drain's counts for the node's outbox run summary."""
    return {k: metrics.get(k) for k in RUN_FIGURES}


def forwarded_totals(before: dict[str, Any] | None, after: dict[str, Any]) -> dict[str, int]:
    """Events and bundle announcements forwarded in one contact (before the data and after it), and the
    events left in the outbox."""
    before = before or {}
    return {"events_forwarded": before.get("events", 0) + after.get("events", 0),
            "bundles_announced": before.get("announced", 0) + after.get("announced", 0),
            "events_left": after.get("left", 0)}
