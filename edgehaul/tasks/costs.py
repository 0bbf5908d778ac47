"""Prefect tasks of the cost report: meter and price a month, write its outputs to the ops bucket.

No caching: storage is metered as of now and the metering log grows. Retries only on transport and
server-side errors (edgehaul.platform.s3_errors); writes are to new or per-month keys.
"""

from __future__ import annotations

from datetime import datetime

from prefect import task
from prefect.cache_policies import NO_CACHE

from edgehaul.blocks import EdgeNode, ObjectStore, PriceSheet
from edgehaul.ops import costs
from edgehaul.platform.s3_errors import IO_RETRY


@task(name="read-node-teams", retries=2, retry_delay_seconds=[5, 30], cache_policy=NO_CACHE)
def node_teams_task() -> dict[str, str]:
    """Node -> team from the EdgeNode blocks: the operator's word, never what a node's manifest claims."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        docs = client.read_block_documents_by_type(EdgeNode.get_block_type_slug(), include_secrets=False)
    return {str(d.data["node_id"]): str(d.data.get("team") or costs.UNASSIGNED) for d in docs
            if d.name and not d.is_anonymous and "node_id" in d.data}


@task(**IO_RETRY, cache_policy=NO_CACHE)
def build_report_task(store: ObjectStore, prices: PriceSheet, month: str, now: datetime,
                      node_teams: dict[str, str] | None = None) -> costs.CostReport:
    return costs.build_report(store, prices, month, now=now, node_teams=node_teams)


@task(**IO_RETRY, cache_policy=NO_CACHE)
def write_outputs_task(store: ObjectStore, report: costs.CostReport) -> dict[str, str]:
    return costs.write_outputs(store, report)
