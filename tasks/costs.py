"""Prefect tasks of the cost report: meter and price a month, write its outputs to the ops bucket.

No caching: storage is metered as of now and the metering log grows. Retries only on transport and
server-side errors (see tasks.lifecycle.is_transient); writes are to new or per-month keys.
"""

from __future__ import annotations

from datetime import datetime

from prefect import task
from prefect.cache_policies import NO_CACHE

from blocks import ObjectStore, PriceSheet
from edgehaul import costs
from tasks.lifecycle import _retry_io


@task(retries=2, retry_delay_seconds=[2, 10], retry_condition_fn=_retry_io, cache_policy=NO_CACHE)
def build_report_task(store: ObjectStore, prices: PriceSheet, month: str, now: datetime) -> costs.CostReport:
    return costs.build_report(store, prices, month, now=now)


@task(retries=2, retry_delay_seconds=[2, 10], retry_condition_fn=_retry_io, cache_policy=NO_CACHE)
def write_outputs_task(store: ObjectStore, report: costs.CostReport) -> dict[str, str]:
    return costs.write_outputs(store, report)
