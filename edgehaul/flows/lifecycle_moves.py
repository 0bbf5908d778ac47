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
    with RequestMeter.process() as meter:
        # Plan first: it sees interrupted moves too, and says which files are referenced now, so
        # finishing an old journalled batch never removes a file a version needs today.
        plan = plan_task(store, policy, now, params.force_reason)
        recovered = 0
        if not params.dry_run:
            for bid, (planned_at, actions) in pending_task(store).items():
                res = run_batch_task(store, actions, planned_at, label=f"recover-{bid[:8]}",
                                     protected=frozenset(plan.protected_keys))
                done.update(res.done)
                errors.extend(res.errors)
                recovered += 1
        if not params.dry_run:
            for i, batch in enumerate(plan.batches(params.batch_size)):
                res = run_batch_task(store, batch, now, label=str(i))
                done.update(res.done)
                errors.extend(res.errors)
        pruned = 0
        if not params.dry_run and not errors:
            # finished batches are kept a while for audit; their markers use the server's clock
            pruned = prune_journal_task(store, datetime.now(UTC) - timedelta(days=params.journal_keep_days))
        config: list[dict[str, Any]] = []
        changed: list[str] = []
        if params.apply_store_lifecycle and not params.dry_run:
            for r in apply_config_task(store, policy):
                config.append({"bucket": r.bucket, "applied": [x["ID"] for x in r.applied], "refused": r.refused,
                               "round_trip_ok": r.round_trip_ok, "changed_by_server": r.changed_rules,
                               "withdrawn": r.withdrawn, "notes": r.notes})
                changed += [f"{r.bucket}: {rid}" for rid in r.changed_rules]
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
    md = [f"# lifecycle_moves at {now:%Y-%m-%d %H:%M} UTC" + (" (dry run)" if params.dry_run else ""), "",
          "| what | count |", "|---|---:|"]
    md += [f"| planned {k} | {v} |" for k, v in sorted(plan.counts().items())]
    md += [f"| done: {k} | {v} |" for k, v in sorted(done.items())]
    md += [f"| {k} | {v} |" for k, v in sorted(plan.skipped.items())]
    md += [f"| errors | {len(errors)} |", f"| S3 requests | {meter.count} |"]
    md += [f"| store lifecycle rule changed by the server, withdrawn | {c} |" for c in changed]
    if params.force_reason:
        md += ["", f"Forced: {params.force_reason}"]
    create_markdown_artifact("\n".join(md), key="lifecycle-moves", description="lifecycle_moves summary")
    logger.info("lifecycle: planned %s, done %s, skipped %d, errors %d", plan.counts(), dict(done),
                sum(plan.skipped.values()), len(errors))
    failed = [f"{len(errors)} lifecycle action(s) failed; first: " + "; ".join(errors[:3])] if errors else []
    if changed:
        # The rules were taken off again, but the store does not do what the policy asked: the run says so
        # in its state (a WARNING in a Completed run went unseen while the store moved small manifests).
        failed.append(f"the store at {store.endpoint_url or 'AWS'} stored lifecycle rule(s) {'; '.join(changed)} "
                      "differently (e.g. dropped the size filter); withdrawn, the mover applies the policy: run "
                      "with apply_store_lifecycle=false on this store")
    if failed:
        # A failed batch stays journalled for the next run, but this run did not do its job: say so in its state.
        raise LifecycleMovesFailed(". ".join(failed))
    return summary


class LifecycleMovesFailed(RuntimeError):
    """Some moves failed (each error names the object and the storage class), or the store changed a lifecycle
    rule it was given (each rule named)."""
