"""uplink_drain: move a node's spooled bundles into the landing zone over its (constrained) link.

What it does, in order:
1. expire the retry queue and the spool's TTLs (every dropped sample is recorded in the ledger);
2. abort orphaned multipart uploads under the node's landing prefix older than `orphan_age_s`;
3. drain the spool for up to `max_seconds`: high tier first (its own lane, chunks served before
   normal ones), then highest value, then oldest; token-bucket shaped at the link's rate cap (the
   rest of the bandwidth stays free for Prefect API calls and events); multipart with resume for
   large bundles; a bundle leaves the spool only after its object is verified (size + SHA-256) and
   its manifest written; bundles that keep failing go to the persistent retry queue;
   With `by_plan`, the drain covers the current contact window only: the node's predicted passes
   (`EdgeNode.pass_schedule` or the `pass_schedule` parameter, a YAML list of start, duration_s,
   rate_bps) are planned before the pass opens (`edgehaul.uplink.pass_plan`): urgent bundles first,
   then the largest value that fits the pass at the rate cap, counting each bundle's manifest and
   request round trips; the planned bundles are sent in plan order at the pass's rate, then the run
   stops; the rest waits for the next pass (a bundle is split only when its multipart upload can
   resume). No pass open and none within `contact_wait_s`: nothing is sent;
   Backup link (`backup_link_profile`, a second, dearer LinkProfile with its own rate cap and
   `monthly_budget_bytes`): while the primary link is down, urgent (tier high) bundles go over the
   backup as long as this month's budget (metered on the node, `uplink-backup/backup-YYYY-MM.json`)
   covers them; bulk always waits for the primary; an urgent bundle the budget cannot cover waits too
   (logged, counted in `backup_refusals`). `bytes_by_link` meters each link;
   Out of contact (the store does not answer one probe request; not probed with `contact_wait_s`):
   nothing is sent, the run completes at once with `out_of_contact` set, and the schedule tries again;
   In contact, before any data: the node's outbox (alerts, run summaries, link statistics raised out of
   contact) goes to the central gateway with the node's own key (`gateway_url`, `gateway_key_file`; in
   order, exactly once), and what the core published for the node is fetched and applied (`downlink`);
   the drain's own statistics are forwarded again at its end. A node-local run
   (`route_events_to_outbox`) emits nothing straight to a Prefect API: everything goes through the outbox,
   each landed bundle as an announcement for the gateway's `bundle-uploaded` hook (sent at the drain's
   end, or by the next drain in contact), never a landing batch of its own;
4. publish metrics, the queue figures as the drain left them: an `edgehaul.link.stats` event and a table
   artifact (goodput, rate cap use, retransmissions, queue length per tier and retry queue after the
   drain, capture-to-landed time per tier; by plan also the pass's
   capacity, planned vs sent bytes and value, and what the following passes are planned to carry).

Blocks: `edgehaul-edge-node` (spool location, retry queue cap/expiry), `edgehaul-link-profile`
(bandwidth, rate cap, chunk/multipart sizes, contact windows), `edgehaul-object-store` (landing
bucket; node credentials limited to the node's prefix).
Cache policy: none — every run moves bytes; idempotency comes from content-derived object keys.
Runs in the node's work pool (edge-*); one drain per node at a time (the spool's lock serialises
writers, and the deployment should set a concurrency limit of 1).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from prefect import flow, get_run_logger
from pydantic import BaseModel, Field, model_validator

from edgehaul import events
from edgehaul.blocks import EdgeNode, LinkProfile, ObjectStore
from edgehaul.edge.outbox import Outbox, node_outbox, record_run
from edgehaul.edge.spool import Spool
from edgehaul.platform import run_logging
from edgehaul.platform.block_loading import load_block
from edgehaul.platform.reporting import run_namer
from edgehaul.platform.roles import DEFAULT_POLICY, EXAMPLE_NODE, node_store
from edgehaul.tasks.downlink import sync_downlink
from edgehaul.tasks.forwarding import forward_node_events
from edgehaul.tasks.uplink import abort_orphans, drain_spool, expire_retries, probe_contact, publish_link_stats
from edgehaul.uplink.drain_figures import forwarded_totals, run_figures
from edgehaul.uplink.pass_plan import Pass, load_passes


class UplinkDrainParams(BaseModel):
    edge_node: str = Field(default=EXAMPLE_NODE, min_length=1, description="EdgeNode block name.")
    link_profile: str = Field(default=DEFAULT_POLICY, min_length=1, description="LinkProfile block name.")
    object_store: str | None = Field(default=None, min_length=1, description="ObjectStore block name (node "
                                     "credentials); None: the node's own, named after the EdgeNode block.")
    max_seconds: float = Field(default=300.0, gt=0, le=3600, description="Stop starting new bundles after this.")
    max_active: int = Field(default=2, ge=1, le=16, description="Concurrent normal transfers (plus one urgent lane).")
    orphan_age_s: float = Field(default=6 * 3600, ge=0, description="Abort multipart uploads older than this.")
    contact_wait_s: float = Field(default=0.0, ge=0, le=3600, description="Wait this long for a contact window.")
    simulate: bool = Field(default=False, description="Use the link simulator (demo/benchmarks), not the real link.")
    seed: int = Field(default=0, ge=0, description="Simulator seed.")
    by_plan: bool = Field(default=False, description="Drain only the current pass, by its value plan.")
    pass_schedule: str | None = Field(default=None, min_length=1, description="YAML file of predicted passes; "
                                      "None: the EdgeNode block's pass_schedule.")
    backup_link_profile: str | None = Field(default=None, min_length=1, description="LinkProfile block of the "
                                            "node's backup link (urgent bundles only, within its budget); None: none.")
    route_events_to_outbox: bool = Field(default=False, description="A node-local run: the node's events go to "
                                         "its outbox (forwarded to the gateway), never straight to a Prefect API.")
    gateway_url: str | None = Field(default=None, min_length=1, description="Central gateway the node forwards its "
                                    "outbox to when in contact (control traffic, before data); None: no forwarding.")
    gateway_key_file: str | None = Field(default=None, min_length=1, description="The node's own gateway key "
                                         "(0600 file, 'whsec_...').")
    gateway_sender: str | None = Field(default=None, min_length=1, description="Sender id of that key; None: the "
                                       "node id.")
    downlink: bool = Field(default=False, description="When in contact, fetch and apply what the core published "
                                                      "for this node (models, policies, contracts).")

    @model_validator(mode="after")
    def _gateway_needs_a_key(self) -> UplinkDrainParams:
        if self.gateway_url and not self.gateway_key_file:
            raise ValueError("gateway_url needs gateway_key_file (the node's own gateway key)")
        return self


@flow(name="uplink_drain",
       flow_run_name=run_namer("uplink_drain", UplinkDrainParams, lambda p: p.edge_node))
def uplink_drain(params: UplinkDrainParams | None = None) -> dict[str, Any]:
    """Drain one node's spool into the landing zone and publish link metrics."""
    p = params or UplinkDrainParams()
    node, profile, store, passes, backup = _blocks(p)
    box = node_outbox(node.spool_dir, node.node_id) if p.route_events_to_outbox else None
    with _node_scope(node, box):
        expired = expire_retries(node)
        # a drain told to wait for a contact window expects the store out of reach until the window opens
        if not p.contact_wait_s and (down := probe_contact(store)) is not None:
            get_run_logger().info("node %s: store out of reach, nothing sent; %d bundles wait (%s)", node.node_id,
                                  expired["spool_pending"], down)
            return {"out_of_contact": down, "bundles_landed": 0, **expired}
        forwarded = _forward(p, node) if p.gateway_url else None  # control traffic first
        synced = sync_downlink(store, node) if p.downlink else None
        aborted = abort_orphans(store, profile, node, p.orphan_age_s)
        metrics = drain_spool(
            store, profile, node, max_seconds=p.max_seconds, max_active=p.max_active, simulate=p.simulate,
            seed=p.seed, contact_wait_s=p.contact_wait_s, passes=passes, backup=backup,
        )
        # expiry counts from before the drain; the retry queue and the spool's figures from after it
        metrics = {**expired, **metrics, "orphans_aborted": aborted}
        publish_link_stats(node.node_id, metrics)
        if box is not None:
            record_run(box, "uplink_drain", run_figures(metrics), _ledger_totals(node))
        if p.gateway_url:  # this drain's own statistics, in the same contact
            metrics.update(forwarded_totals(forwarded, _forward(p, node)))
        if synced is not None:
            metrics["downlink"] = synced
    _log_drain(node.node_id, metrics)
    return metrics


def _blocks(p: UplinkDrainParams) -> tuple[EdgeNode, LinkProfile, ObjectStore, list[Pass] | None, LinkProfile | None]:
    """The node, its link, its store, its predicted passes (by plan) and its backup link."""
    node = load_block(EdgeNode, p.edge_node, param="edge_node")
    profile = load_block(LinkProfile, p.link_profile, param="link_profile")
    store = load_block(ObjectStore, p.object_store or node_store(p.edge_node), param="object_store")
    schedule = p.pass_schedule or node.pass_schedule
    if p.by_plan and not schedule:
        raise ValueError(f"uplink_drain by_plan: node {node.node_id} has no pass_schedule (EdgeNode block "
                         f"{p.edge_node!r}) and none was given")
    passes = load_passes(schedule) if p.by_plan and schedule else None
    backup = (load_block(LinkProfile, p.backup_link_profile, param="backup_link_profile")
              if p.backup_link_profile else None)
    return node, profile, store, passes, backup


@contextlib.contextmanager
def _node_scope(node: EdgeNode, box: Outbox | None) -> Iterator[None]:
    """The node on every domain log line of its drain; with an outbox, its events go there."""
    with contextlib.ExitStack() as scope:
        scope.enter_context(run_logging.for_node(node.node_id))
        if box is not None:
            scope.callback(box.close)
            scope.enter_context(events.routed(box.sink()))
        yield


def _log_drain(node_id: str, metrics: dict[str, Any]) -> None:
    logger = get_run_logger()
    logger.info(
        "node %s: %d bundles landed, goodput %.0f bit/s (%.0f%% of cap), %d in retry queue, %d orphans aborted",
        node_id, metrics["bundles_landed"], metrics["goodput_bps"], 100 * metrics["rate_cap_use"],
        metrics["retry_queue"], metrics["orphans_aborted"],
    )
    if (pp := metrics.get("pass_plan")) is not None:
        logger.info("pass: %d/%d planned bundles sent, %d of %d planned bytes, value %.1f of %.1f",
                    pp.get("sent_bundles", 0), pp.get("planned_bundles", 0), pp.get("sent_bytes", 0),
                    pp.get("planned_bytes", 0) + pp.get("planned_overhead_bytes", 0), pp.get("sent_value", 0.0),
                    pp.get("planned_value", 0.0))


def _forward(p: UplinkDrainParams, node: EdgeNode) -> dict[str, Any]:
    out = forward_node_events(node, str(p.gateway_url), str(p.gateway_key_file), sender_id=p.gateway_sender)
    if out["error"]:
        get_run_logger().info("node %s: %d events forwarded, %d wait (%s)", node.node_id, out["events"], out["left"],
                              out["error"])
    return out


def _ledger_totals(node: EdgeNode) -> dict[str, int]:
    spool = Spool.from_block(node)
    try:
        return {f"{s}/{r}": n for (s, r), n in spool.ledger.counts().items()}
    finally:
        spool.close()
