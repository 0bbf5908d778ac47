"""Task of the node's downlink: fetch, verify and apply what the core published for it.

No retries: an update that cannot be fetched now is fetched at the next contact, and a refused one is
reported (outbox) and left for the operator; neither may fail the drain that carries the node's data.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError
from prefect import task
from prefect.cache_policies import NO_CACHE

from edgehaul import downlink
from edgehaul.blocks import EdgeNode, ObjectStore
from edgehaul.edge.outbox import node_outbox
from edgehaul.platform.settings import get_settings

log = logging.getLogger(__name__)


@task(name="sync-downlink", cache_policy=NO_CACHE)
def sync_downlink(store: ObjectStore, node: EdgeNode) -> dict[str, Any]:
    """Apply the node's newest update (if newer than the one in force); the outcome goes to its outbox."""
    box = node_outbox(node.spool_dir, node.node_id)
    try:
        res = downlink.sync(store, node.node_id, Path(node.spool_dir), outbox=box)
    except (ClientError, BotoCoreError) as e:  # out of reach or not granted: the next contact tries again
        log.warning("node %s: downlink not fetched: %s", node.node_id, e)
        return {"applied": None, "refused": None, "error": f"{type(e).__name__}: {e}"}
    finally:
        box.close()
    installed: list[str] = []
    if res.applied:
        log.info("node %s: downlink generation %d applied: %s", node.node_id, res.applied, ", ".join(res.items))
        try:  # new contract versions become readable by the node's next runs
            installed = downlink.install_contracts(Path(node.spool_dir), get_settings().contracts_dir)
        except (downlink.DownlinkError, OSError) as e:
            log.warning("node %s: downlinked contracts not installed: %s", node.node_id, e)
    elif res.refused:
        log.warning("node %s: downlink generation %d refused: %s", node.node_id, res.refused, res.why)
    return {"applied": res.applied, "refused": res.refused, "why": res.why, "items": res.items,
            "contracts_installed": installed,
            "in_force": downlink.current_generation(Path(node.spool_dir))}
