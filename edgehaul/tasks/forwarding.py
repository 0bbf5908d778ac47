"""Task of the node's store and forward: drain its outbox to the central gateway.

No retries here: whatever is not acknowledged stays in the outbox, in order, for the next run, so an
unreachable gateway is a normal outcome (reported), not a failure. A refusal (the gateway's 4xx:
wrong key, a node the key may not speak for) fails the task, since only an operator can fix it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from edgehaul.blocks import EdgeNode
from edgehaul.edge.outbox import node_outbox
from edgehaul.uplink.forwarder import Forwarder
from edgehaul.uplink.link import Link

log = logging.getLogger(__name__)

@task(name="forward-node-events", cache_policy=NO_CACHE)
def forward_node_events(node: EdgeNode, gateway_url: str, key_file: str, *, sender_id: str | None = None,
                        link: Link | None = None, max_batches: int = 1_000) -> dict[str, Any]:
    """Send the node's outbox to `gateway_url` as the node (its key in the 0600 `key_file`), over `link`
    when given (same cap as data, ahead of it). Returns what was sent and what is left."""
    box = node_outbox(node.spool_dir, node.node_id)
    try:
        fw = Forwarder.to_gateway(box, gateway_url, Path(key_file), sender_id=sender_id, link=link)
        try:
            rep = fw.forward(max_batches=max_batches)
        finally:
            fw.client.close()
        return {"events": rep.events, "announced": rep.announced, "batches": rep.batches, "bytes": rep.bytes,
                "left": rep.left, "error": rep.error, "dropped": box.dropped()}
    finally:
        box.close()
