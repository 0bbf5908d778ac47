"""The product's Prefect events: names, resources, and one way to emit them.

Triggers (deployments/prefect.yaml) and alert automations match on these names, so they are
constants here rather than strings scattered through flows.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

BUNDLE_LANDED = "edgehaul.bundle.landed"
BUNDLE_QUARANTINED = "edgehaul.bundle.quarantined"
BUNDLE_RECEIPT = "edgehaul.bundle.receipt"
DATASET_COMMITTED = "edgehaul.dataset.committed"
MODEL_READY = "edgehaul.model.ready"
SPOOL_WATERMARK = "edgehaul.spool.watermark"  # payload: level, used_fraction
LINK_STATS = "edgehaul.link.stats"  # payload: retransmission_rate, goodput_bps, rate_cap_use
CHECKPOINT_FAILED = "edgehaul.checkpoint.failed"
CONTACT_OPENED = "edgehaul.contact.opened"
RETRY_EXPIRED = "edgehaul.retry.expired"
# Emitted by the fleet_report flow when its policy bound is exceeded (payload carries the bound).
NODE_SILENT = "edgehaul.node.silent"  # payload: node_id, last_seen, allowed_s, reason
MODEL_STALE = "edgehaul.model.stale"  # payload: model_id, trained_version, latest_version, age_s, bounds
# Landed bundles, coalesced: ONE event per gateway window or uplink drain run, payload `bundle_keys`
# (relative landing keys). The `bundle_landed` trigger turns each into one core_ingest run, so a flood
# of bundles is a bounded number of runs; per-bundle BUNDLE_LANDED events trigger nothing.
LANDING_BATCH = "edgehaul.landing.batch"
LANDING_BATCH_MAX = 200  # keys per batch event; below core_ingest's max_bundles (500), which truncates
NODE_RUN_SUMMARY = "edgehaul.node.run.summary"  # payload: counts of one edge run (ingest or drain)
LEDGER_COUNTS = "edgehaul.ledger.counts"  # payload: drops per stage and reason since the last report
# An edge run's drop folder had files rejected (or read with most rows rejected): payload node_id, message,
# files {name: why}, counts. A level-2 alert (edgehaul.services.automations).
DROP_REJECTED = "edgehaul.drop.rejected"

# What an edge node may have forwarded in its name (gateway hook `node-events`): its own alerts,
# statistics and summaries, never an event that starts work centrally (e.g. LANDING_BATCH).
DOWNLINK_APPLIED = "edgehaul.node.downlink.applied"  # payload: generation, previous, items
DOWNLINK_REFUSED = "edgehaul.node.downlink.refused"  # payload: generation, in_force, why
# CHECKPOINT_FAILED is the core's own (training runs centrally): a node's copy would be a forged page.
NODE_FORWARDED = frozenset({SPOOL_WATERMARK, LINK_STATS, CONTACT_OPENED, RETRY_EXPIRED,
                            NODE_RUN_SUMMARY, LEDGER_COUNTS, DOWNLINK_APPLIED, DOWNLINK_REFUSED,
                            DROP_REJECTED})
# What a routed node announces instead: each landed bundle goes through its outbox to the gateway hook
# `bundle-uploaded`, which coalesces every node's bundles into the LANDING_BATCH that starts core_ingest.
NODE_ANNOUNCED = frozenset({BUNDLE_LANDED})

log = logging.getLogger(__name__)

# Prefect triggers match resource labels with globs, never payload numbers. So the payload values
# alerts compare against are mirrored into labels as zero-padded permille strings ("0860" = 0.86),
# which `edgehaul.services.automations.at_least_globs` turns into a threshold. emit() adds them itself.
ALERT_LABELS = {
    "retransmission_rate": "edgehaul.link.retransmission.permille",
    "used_fraction": "edgehaul.spool.used.permille",
}


def permille_label(x: float) -> str:
    import math

    return f"{min(max(math.floor(round(x * 1000, 6)), 0), 9999):04d}"


def alert_labels(payload: dict[str, Any]) -> dict[str, str]:
    """Labels mirroring the alert-relevant numbers of `payload` (see ALERT_LABELS)."""
    out = {}
    for key, label in ALERT_LABELS.items():
        v = payload.get(key)
        if isinstance(v, int | float) and not isinstance(v, bool) and v == v and abs(v) != float("inf"):
            out[label] = permille_label(float(v))
    return out


def dataset_committed_labels(kind: str, trainable: bool) -> dict[str, str]:
    """Labels of a DATASET_COMMITTED event; the train trigger matches `edgehaul.dataset.trainable` "true"
    (the kind's contract has a training section)."""
    return {"edgehaul.dataset.kind": kind, "edgehaul.dataset.trainable": "true" if trainable else "false"}


def landing_batch(batch_id: str, source: str, bundles: list[tuple[str, str, str]],
                  **extra: Any) -> tuple[dict[str, str], dict[str, Any]]:
    """Resource and payload of a LANDING_BATCH event for (object_key, node_id, bundle_id) triples."""
    by_key = {k: b for k, _, b in bundles}  # a bundle announced twice is in the batch once
    keys = list(by_key)
    nodes = sorted({n for _, n, _ in bundles})
    resource = {"prefect.resource.id": f"edgehaul.landing.batch.{batch_id}", "edgehaul.batch.source": source}
    if len(nodes) == 1:
        resource["edgehaul.node.id"] = nodes[0]
    payload = {"bundle_keys": keys, "bundle_ids": list(by_key.values()), "nodes": nodes,
               "count": len(keys), "source": source, **extra}
    return resource, payload


# A sink takes (event, resource_id, payload, labels) and returns whether the event is kept.
Sink = Callable[[str, str, dict[str, Any], dict[str, str]], bool]
_route: ContextVar[Sink | None] = ContextVar("edgehaul_events_route", default=None)


@contextmanager
def routed(sink: Sink) -> Iterator[None]:
    """Send every `emit` of this context of an event in NODE_FORWARDED or NODE_ANNOUNCED to `sink` instead
    of Prefect (an edge node's outbox: one way out, so such an event is never both emitted directly and
    forwarded). LANDING_BATCH is withheld: only the centre starts work on landed bundles (the gateway
    coalesces the node's announcements; core_ingest's scheduled sweep catches any never announced)."""
    token = _route.set(sink)
    try:
        yield
    finally:
        _route.reset(token)


def routing() -> bool:
    """Whether `emit` in this context hands events to a `routed` sink (the node's outbox) instead of Prefect."""
    return _route.get() is not None


def emit(event: str, resource_id: str, payload: dict[str, Any] | None = None, **labels: str) -> bool:
    """Emit a Prefect event, or hand it to the sink of `routed`; never raises (an unreachable API
    must not fail the data path).

    Returns whether the event was handed to the events client (or kept by the sink).
    """
    sink = _route.get()
    if sink is not None and event == LANDING_BATCH:
        log.debug("%s for %s withheld: the node's outbox announces its bundles", event, resource_id)
        return False
    if sink is not None and (event in NODE_FORWARDED or event in NODE_ANNOUNCED):  # others still go straight out
        try:
            return sink(event, resource_id, dict(payload or {}), labels)
        except Exception as e:
            log.warning("event %s for %s not kept by the outbox: %s", event, resource_id, e)
            return False
    try:
        from prefect.events import emit_event

        resource = {"prefect.resource.id": resource_id, **alert_labels(payload or {}), **labels}
        return emit_event(event=event, resource=resource, payload=payload or {}) is not None
    except Exception as e:
        log.warning("event %s for %s not emitted: %s", event, resource_id, e)
        return False
