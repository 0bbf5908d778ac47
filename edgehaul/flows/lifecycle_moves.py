"""Flow `lifecycle_moves` (ops pool, scheduled daily): move data no longer hot to the cold tier, expire old data.

What it does, in order:
1. plans at `now` from the retention policy: by age, by last use, by data class; referenced dataset
   versions (latest N, pinned, in a model's lineage) keep every file they read; storage-class cost
   rules (128 KiB minimum size, 30/90/180-day minimum durations) skip what would cost more, unless
   `force_reason` is given (recorded in every forced action's reason);
2. finishes every journalled batch an interrupted run left (`edgehaul.ops.lifecycle.pending_batches`),
   skipping files the plan found referenced now;
3. runs the plan in batches (one task per batch of `batch_size` objects), server-side copies + deletes;
4. optionally applies the equivalent S3 lifecycle configuration (refused rule classes are reported; a rule
   the server stored differently, e.g. without its size filter, is withdrawn and fails the run, named);
5. prunes finished journal batches older than `journal_keep_days`;
6. appends its S3 request count to the metering log and publishes a markdown artifact.

Blocks: `ObjectStore` (`store_block`), `RetentionPolicy` (`policy_block`).
Cache policy: none (decisions depend on `now` and the store's state); batches are idempotent and
journalled, so a retry or rerun finishes work instead of repeating it.
"""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime, timedelta
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from pydantic import BaseModel, Field

from edgehaul.blocks import ObjectStore, RetentionPolicy
from edgehaul.ops import store_probe
from edgehaul.ops.costs import RequestMeter, UsageRecord, record_usage
from edgehaul.ops.lifecycle import Plan
from edgehaul.ops.lifecycle_report import config_rows, failure_message, summary_markdown
from edgehaul.platform.block_loading import load_block
from edgehaul.platform.fields import AwareTime
from edgehaul.platform.reporting import run_namer
from edgehaul.platform.roles import DEFAULT_POLICY, StoreBlock
from edgehaul.tasks.lifecycle import apply_config_task, pending_task, plan_task, prune_journal_task, run_batch_task


class LifecycleParams(BaseModel):
    store_block: str = Field(default=StoreBlock.LIFECYCLE, min_length=1, description="ObjectStore block name.")
    policy_block: str = Field(default=DEFAULT_POLICY, min_length=1, description="RetentionPolicy block name.")
    now: AwareTime | None = Field(default=None, description="Decision time (tests, backfills); default: now.")
    dry_run: bool = Field(default=False, description="Plan and report only; change nothing.")
    force_reason: str | None = Field(
        default=None, min_length=3, max_length=200,
        description="Allow moves/deletes before the minimum storage duration; recorded with each forced action.",
    )
    batch_size: int = Field(default=500, ge=1, le=10_000, description="Objects per batch task.")
    apply_store_lifecycle: bool = Field(default=False, description="Also put the equivalent S3 lifecycle config.")
    journal_keep_days: int = Field(default=30, ge=0, le=3650, description="Keep finished journal batches this long.")


@flow(name="lifecycle_moves", log_prints=False,
       flow_run_name=run_namer("lifecycle_moves", LifecycleParams, lambda p: "dry run" if p.dry_run else ""))
def lifecycle_moves(params: LifecycleParams = LifecycleParams()) -> dict[str, Any]:
    """Move, restore and expire objects by the retention policy; safe to interrupt and rerun."""
    logger = get_run_logger()
    now = params.now or datetime.now(UTC)
    store = load_block(ObjectStore, params.store_block, param="store_block")
    policy = load_block(RetentionPolicy, params.policy_block, param="policy_block")
    # A class the store does not have fails every move of every run: refuse the policy now, naming it.
    store_probe.check_policy(store, policy)
    done: Counter[str] = Counter()
    errors: list[str] = []
    recovered = pruned = 0
    config: list[dict[str, Any]] = []
    changed: list[str] = []
    with RequestMeter.process() as meter:
        # Plan first: it sees interrupted moves too, and says which files are referenced now, so
        # finishing an old journalled batch never removes a file a version needs today.
        plan = plan_task(store, policy, now, params.force_reason)
        if not params.dry_run:
            recovered = _finish_pending(store, plan, done, errors)
            _run_plan(store, plan, now, params.batch_size, done, errors)
            if not errors:
                # finished batches are kept a while for audit; their markers use the server's clock
                pruned = prune_journal_task(store, datetime.now(UTC) - timedelta(days=params.journal_keep_days))
            if params.apply_store_lifecycle:
                config, changed = config_rows(apply_config_task(store, policy))
    if not params.dry_run:
        record_usage(store, UsageRecord(at=now, meter="requests", quantity=meter.count, source="lifecycle_moves",
                                        team="shared"))
    summary = {
        "now": now.isoformat(), "dry_run": params.dry_run, "recovered_batches": recovered, "planned": plan.counts(),
        "done": dict(done), "skipped": dict(plan.skipped), "pruned_batches": pruned, "errors": errors,
        "requests": meter.count,
        "protected_versions": {k: {str(v): w for v, w in d.items()} for k, d in plan.protected_versions.items()},
        "notes": plan.notes, "store_lifecycle": config,
    }
    create_markdown_artifact(summary_markdown(now, plan, done, errors, meter.count, changed, dry_run=params.dry_run,
                                              force_reason=params.force_reason),
                             key="lifecycle-moves", description="lifecycle_moves summary")
    logger.info("lifecycle: planned %s, done %s, skipped %d, errors %d", plan.counts(), dict(done),
                sum(plan.skipped.values()), len(errors))
    if (failed := failure_message(errors, changed, store.endpoint_url)) is not None:
        # A failed batch stays journalled for the next run, but this run did not do its job: say so in its state.
        raise LifecycleMovesFailed(failed)
    return summary


def _finish_pending(store: ObjectStore, plan: Plan, done: Counter[str], errors: list[str]) -> int:
    """Finish the journalled batches an interrupted run left, never removing a file the plan protects now."""
    pending = pending_task(store)
    for bid, (planned_at, actions) in pending.items():
        res = run_batch_task(store, actions, planned_at, label=f"recover-{bid[:8]}",
                             protected=frozenset(plan.protected_keys))
        done.update(res.done)
        errors.extend(res.errors)
    return len(pending)


def _run_plan(store: ObjectStore, plan: Plan, now: datetime, batch_size: int, done: Counter[str],
              errors: list[str]) -> None:
    for i, batch in enumerate(plan.batches(batch_size)):
        res = run_batch_task(store, batch, now, label=str(i))
        done.update(res.done)
        errors.extend(res.errors)


class LifecycleMovesFailed(RuntimeError):
    """Some moves failed (each error names the object and the storage class), or the store changed a lifecycle
    rule it was given (each rule named)."""
