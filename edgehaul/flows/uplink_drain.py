"""uplink_drain: move a node's spooled bundles into the landing zone over its (constrained) link.

What it does, in order:
1. expire the retry queue and the spool's TTLs (every dropped sample is recorded in the ledger);
2. abort orphaned multipart uploads under the node's landing prefix older than `orphan_age_s`;
3. drain the spool for up to `max_seconds`: high tier first (its own lane, chunks served before
   normal ones), then highest value, then oldest; token-bucket shaped at the link's rate cap (the
   rest of the bandwidth stays free for Prefect API calls and events); multipart with resume for
   large bundles; a bundle leaves the spool only after its object is verified (size + SHA-256) and
   its manifest written; bundles that keep failing go to the persistent retry queue;
4. publish metrics: an `edgehaul.link.stats` event and a table artifact (goodput, rate cap use,
   retransmissions, queue length per tier, capture-to-landed time per tier).

Blocks: `edgehaul-edge-node` (spool location, retry queue cap/expiry), `edgehaul-link-profile`
(bandwidth, rate cap, chunk/multipart sizes, contact windows), `edgehaul-object-store` (landing
bucket; node credentials limited to the node's prefix).
Cache policy: none — every run moves bytes; idempotency comes from content-derived object keys.
Runs in the node's work pool (edge-*); one drain per node at a time (the spool's lock serialises
writers, and the deployment should set a concurrency limit of 1).
"""

from __future__ import annotations

from typing import Any, cast

from prefect import flow, get_run_logger
from pydantic import BaseModel, Field

from edgehaul.blocks import EdgeNode, LinkProfile, ObjectStore
from edgehaul.tasks.uplink import abort_orphans, drain_spool, expire_retries, publish_link_stats


class UplinkDrainParams(BaseModel):
    edge_node: str = Field(default="node-a", min_length=1, description="EdgeNode block name.")
    link_profile: str = Field(default="default", min_length=1, description="LinkProfile block name.")
    object_store: str = Field(default="node-a", min_length=1, description="ObjectStore block name (node credentials).")
    max_seconds: float = Field(default=300.0, gt=0, le=3600, description="Stop starting new bundles after this.")
    max_active: int = Field(default=2, ge=1, le=16, description="Concurrent normal transfers (plus one urgent lane).")
    orphan_age_s: float = Field(default=6 * 3600, ge=0, description="Abort multipart uploads older than this.")
    contact_wait_s: float = Field(default=0.0, ge=0, le=3600, description="Wait this long for a contact window.")
    simulate: bool = Field(default=False, description="Use the link simulator (demo/benchmarks), not the real link.")
    seed: int = Field(default=0, ge=0, description="Simulator seed.")


@flow(name="uplink_drain")
def uplink_drain(params: UplinkDrainParams | None = None) -> dict[str, Any]:
    """Drain one node's spool into the landing zone and publish link metrics."""
    p = params or UplinkDrainParams()
    logger = get_run_logger()
    # Block.load is typed sync-or-async; in a sync flow it returns the block.
    node = cast(EdgeNode, EdgeNode.load(p.edge_node))
    profile = cast(LinkProfile, LinkProfile.load(p.link_profile))
    store = cast(ObjectStore, ObjectStore.load(p.object_store))
    expired = expire_retries(node)
    aborted = abort_orphans(store, profile, node, p.orphan_age_s)
    metrics = drain_spool(
        store, profile, node, max_seconds=p.max_seconds, max_active=p.max_active, simulate=p.simulate,
        seed=p.seed, contact_wait_s=p.contact_wait_s,
    )
    metrics["orphans_aborted"] = aborted
    metrics.update(expired)
    publish_link_stats(node.node_id, metrics)
    logger.info(
        "node %s: %d bundles landed, goodput %.0f bit/s (%.0f%% of cap), %d in retry queue, %d orphans aborted",
        node.node_id, metrics["bundles_landed"], metrics["goodput_bps"], 100 * metrics["rate_cap_use"],
        metrics["retry_queue"], aborted,
    )
    return metrics
