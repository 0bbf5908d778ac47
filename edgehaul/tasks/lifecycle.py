"""Prefect tasks of the lifecycle: plan, run a batch, finish pending batches, apply the S3 configuration.

No caching: every result depends on `now` and on the store's current state. Retries only on transport
errors and server-side (5xx / throttling) answers; each action is idempotent, so a retried batch
finishes what the failed try started.
"""

from __future__ import annotations

from datetime import datetime

from prefect import task
from prefect.cache_policies import NO_CACHE

from edgehaul.blocks import ObjectStore, RetentionPolicy
from edgehaul.ops import lifecycle as lc
from edgehaul.ops.lifecycle_config import ApplyResult, apply_configuration
from edgehaul.platform.s3_errors import IO_RETRY


@task(**IO_RETRY, cache_policy=NO_CACHE)
def plan_task(store: ObjectStore, policy: RetentionPolicy, now: datetime, force_reason: str | None) -> lc.Plan:
    return lc.plan(store, policy, now, force_reason=force_reason)


@task(**IO_RETRY, cache_policy=NO_CACHE)
def pending_task(store: ObjectStore) -> dict[str, tuple[datetime, list[lc.Action]]]:
    return lc.pending_batches(store)


@task(**IO_RETRY, cache_policy=NO_CACHE,
      task_run_name="lifecycle-batch-{label}")
def run_batch_task(
    store: ObjectStore, actions: list[lc.Action], now: datetime, label: str, protected: frozenset[str] = frozenset()
) -> lc.BatchResult:
    return lc.run_batch(store, actions, now, protected=protected)


@task(**IO_RETRY, cache_policy=NO_CACHE)
def apply_config_task(store: ObjectStore, policy: RetentionPolicy) -> list[ApplyResult]:
    return apply_configuration(store, policy)


@task(**IO_RETRY, cache_policy=NO_CACHE)
def prune_journal_task(store: ObjectStore, older_than: datetime) -> int:
    return lc.prune_journal(store, older_than)
