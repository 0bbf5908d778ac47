"""Prefect tasks of the cost report: meter and price a month, write its outputs to the ops bucket.

No caching: storage is metered as of now and the metering log grows. Retries only on transport and
server-side errors (edgehaul.platform.s3_errors); writes are to new or per-month keys.
"""

from __future__ import annotations

from datetime import datetime

from prefect import task
from prefect.cache_policies import NO_CACHE

from edgehaul.blocks import ObjectStore, PriceSheet
from edgehaul.ops import costs
from edgehaul.platform.s3_errors import IO_RETRY


@task(**IO_RETRY, cache_policy=NO_CACHE)
def build_report_task(store: ObjectStore, prices: PriceSheet, month: str, now: datetime) -> costs.CostReport:
    return costs.build_report(store, prices, month, now=now)


@task(**IO_RETRY, cache_policy=NO_CACHE)
def write_outputs_task(store: ObjectStore, report: costs.CostReport) -> dict[str, str]:
    return costs.write_outputs(store, report)
