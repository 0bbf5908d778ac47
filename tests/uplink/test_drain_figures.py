"""uplink_drain reports the queues as the drain left them: a drain that lands every bundle of the retry
queue reports an empty retry queue and spool, in its result, its link-stats event and so the fleet view."""

from __future__ import annotations

import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import pytest

from edgehaul import events
from edgehaul.blocks import EdgeNode, LinkProfile, ObjectStore
from edgehaul.edge.spool import Spool
from edgehaul.flows.uplink_drain import UplinkDrainParams, uplink_drain
from edgehaul.ops.fleet import node_figures
from edgehaul.uplink.retry_queue import RetryQueue
from edgehaul_dev import localstack
from tests.builders import bundle
from tests.uplink.test_uplink_flow import _poll


@pytest.mark.integration
def test_a_drain_that_lands_the_retry_queue_reports_it_empty(stack: localstack.StackState, store: ObjectStore,
                                                             tmp_path: Path) -> None:
    tag = uuid.uuid4().hex[:8]
    node_id = f"node-q{tag}"
    node = EdgeNode(node_id=node_id, spool_dir=str(tmp_path / "spool"))
    node.save(f"fig-node-{tag}")
    LinkProfile(bandwidth_bps=50e6).save(f"fig-link-{tag}")
    store.save(f"fig-store-{tag}")
    spool = Spool.from_block(node)
    # three bundles that failed a minute ago: in the retry queue, due again now
    queue = RetryQueue(Path(node.spool_dir) / "retry_queue.sqlite", cap=node.retry_queue_cap,
                       expiry_seconds=node.retry_expiry_seconds, ledger=spool.ledger, clock=lambda: time.time() - 60,
                       emit_events=False)
    for s in range(3):
        d, m = bundle(40, node_id, seed=s, start_seq=100 * s)
        assert spool.put(d, m) is not None
        queue.add(m, error="ConnectionError: link down")
    assert len(queue) == 3 and not queue.blocked_ids(time.time())
    queue.close()
    spool.close()

    metrics = uplink_drain(UplinkDrainParams(edge_node=f"fig-node-{tag}", link_profile=f"fig-link-{tag}",
                                             object_store=f"fig-store-{tag}", max_seconds=60))
    assert metrics["bundles_landed"] == 3 and metrics["retry_expired"] == 0
    assert metrics["retry_queue"] == 0 and metrics["spool_pending"] == 0, metrics  # after the drain, not before
    assert not any(metrics["queue_lengths"].values())
    # the event the fleet view reads carries the same figures: its uplink queue for the node is 0, not 3
    evs = _poll(f"{stack.prefect_api_url}/events/filter", {"filter": {
        "event": {"name": [events.LINK_STATS]}, "resource": {"id": [f"edgehaul.link.{node_id}"]}}, "limit": 5}, "events")
    assert evs and evs[0]["payload"]["retry_queue"] == 0
    now = datetime.now(UTC)
    assert node_figures(node_id, (now, evs[0]["payload"]), None, now).uplink_queue == 0.0
