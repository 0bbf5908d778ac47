"""core_ingest: validate landed bundles, quarantine the bad ones, commit the good ones as one dataset version.

What it does, in order:
1. takes the landing keys of bundles (`bundle_keys`, e.g. the `key` of `edgehaul.bundle.landed` events) or
   discovers every bundle under the landing `prefix` (with `sweep`, only those neither committed nor
   quarantined: the scheduled deployment `landing-sweep` commits what no event announced); everything in
   landing is untrusted input (`edgehaul.core.ingest.read_manifests`): a key that is not
   `<node>/<day>/<bundle>.parquet` with safe ids is skipped (logged, named); a bundle without its manifest
   waits (left in landing, reported) until `manifest_wait_s` old; a manifest over its contract's limits
   (ranged reads, never a whole download), malformed (parsed bounded: nesting, number length), or naming
   another node or bundle than the prefix holding it is quarantined; no one landed object fails the run for
   the others (a surprise is its own rejection; transport trouble, a quarantine or a commit that fails
   leaves only its own bundles in landing, in `errors`). A broken
   contract (YAML, a field, an unknown expectation) fails the run before anything moves; a bundle an
   earlier run quarantined is done (`already_quarantined`), or skipped as `landing_changed` when its
   landing objects were rewritten since; a bundle its dataset already holds is done (`already_committed`)
   before any validation. Catching up (`catch_up`): a deployment run also takes the keys of the
   runs of its deployment still queued with the same parameters (whole batches, up to `max_bundles`),
   and marks those runs Completed ("covered by ...") once all their bundles are settled, so a run that
   starts late commits everything queued behind it and the queue does not outgrow the runs' start-up cost;
2. validates the bundles in chunks of `validate_batch` (one task run per chunk: checksum, manifest row count
   and sample ids, schema, what the bundle unpacks to against its contract's budget (from the page headers,
   before anything is built), the rows (file payloads decoded, `inclusion_p` floor), the contract's Great
   Expectations suite in one GE run, verdicts per bundle; the chunk's reads in parallel), so a run's Prefect
   cost does not grow with its bundles;
3. copies each failing bundle to `quarantine/<node>/<bundle>/` with `validation.json` (reason, every
   check, every sample id, the landing ETags) and emits `edgehaul.bundle.quarantined`; landing is
   write-once, so nothing is deleted there (the janitor, lifecycle_moves, moves landing to cold);
4. appends the valid bundles of each contract to its Delta table in ONE commit (lineage in the
   commit metadata); a bundle already committed is a no-op; a bundle another live run is committing
   is deferred (left in landing for the next run);
5. emits `edgehaul.dataset.committed` (with the version) and one `edgehaul.bundle.receipt` per bundle
   in the dataset, and publishes the validation results as a table artifact of the run.

Blocks: `ObjectStore` (`store_block`, the core ingest identity: reads landing, never writes it; writes curated,
quarantine and ops); the S3Bucket `result_storage` block (deployments: `edgehaul-core-results`, saved by
`edgehaul blocks apply`; this flow never saves a block). Cache policy: validation is cached on bundle
SHA-256 + the landed object's ETag + contract SHA-256, per bundle, by hand (`edgehaul.core.validation_cache`:
a chunk is one task run, the cache stays per bundle), as JSON records in
`result_storage`, which must be writable by central identities only (`prefect-results/core/`); left
empty, results go to Prefect's default result storage of the worker process (its local disk, or
PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK): correct, but a cache no other worker shares.
Rejections are never cached; `refresh_cache=True` re-validates everything.
Runs on the central pool; safe to run concurrently with itself (commits are optimistic, bundles
are claimed).
"""

from __future__ import annotations

import uuid
from typing import Any

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from pydantic import BaseModel, Field

from edgehaul import events
from edgehaul.blocks import ObjectStore
from edgehaul.contracts import ContractInvalid, contract_by_id
from edgehaul.core.ingest import LandedScan, QueuedBatch, ValidatedBatch, settled_batches, take_queued
from edgehaul.core.validation import ValidationResult
from edgehaul.ops import store_probe
from edgehaul.platform.block_loading import load_block
from edgehaul.platform.reporting import run_namer, summary_table
from edgehaul.platform.roles import StoreBlock
from edgehaul.platform.runners import from_environment
from edgehaul.tasks.core import (
    claim_batches_task,
    commit_task,
    committed_task,
    discover_task,
    quarantine_task,
    read_manifests_task,
    release_batch_claims_task,
    validate_bundles_task,
)


class CoreIngestParams(BaseModel):
    store_block: str = Field(default=StoreBlock.INGEST, min_length=1,
                             description="ObjectStore block (core ingest identity).")
    bundle_keys: list[str] = Field(default_factory=list, max_length=10_000,
                                   description="Landing keys of bundles (Parquet object or manifest); empty: discover.")
    prefix: str = Field(default="", description="Discover complete bundles under this landing prefix, e.g. 'node-a/'.")
    sweep: bool = Field(default=False, description="Discovery takes only bundles neither committed nor quarantined "
                        "(the scheduled sweep of landing for bundles no event announced): one listing of landing and "
                        "of quarantine when nothing is new.")
    max_bundles: int = Field(default=500, ge=1, le=10_000, description="At most this many bundles per run.")
    lease_s: float = Field(default=900.0, ge=1, le=86_400,
                           description="A claim older than this is presumed dead and taken over.")
    manifest_wait_s: float = Field(default=24 * 3600.0, ge=0, le=30 * 86_400,
                                   description="A bundle without its manifest waits this long, then is quarantined.")
    refresh_cache: bool = Field(default=False, description="Re-validate even bundles with a cached result.")
    validate_batch: int = Field(default=100, ge=1, le=1_000,
                                description="Bundles per validation task run (one GE run; a task runner spreads "
                                "the chunks: Dask across its workers).")
    result_storage: str = Field(default="", description="Result storage block slug (central identities only, e.g. "
                                "'s3-bucket/edgehaul-core-results'); empty: the worker's default (local) storage.")
    catch_up: bool = Field(default=True, description="Also take the bundle keys of this deployment's runs still "
                           "queued with the same parameters (up to max_bundles), and complete those runs once "
                           "their bundles are settled.")


def _full_key(store: ObjectStore, key: str) -> str:
    key = key.removesuffix(".manifest.json") + ".parquet" if key.endswith(".manifest.json") else key
    base = store.key("landing", "")
    return key if base and key.startswith(base) else store.key("landing", key)


def _rejection(key: str, reason: str, error: str) -> dict[str, Any]:
    from edgehaul.core.ingest import unreadable

    return unreadable(key, error, reason).to_dict()


def _artifact_rows(passed: list[ValidationResult], rejected: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for r in passed:
        rows.append({"bundle": r.bundle_id[:12], "node": r.node_id, "rows": r.rows, "success": True, "reason": "ok",
                     "checks": f"{len(r.expectations)}/{len(r.expectations)}", "failed": ""})
    for d in rejected:
        r = ValidationResult.from_dict(d)
        failed = [f"{e.expectation}({e.column})={e.observed_value}" for e in r.expectations if not e.success]
        ok = sum(e.success for e in r.expectations)
        rows.append({"bundle": r.bundle_id[:12], "node": r.node_id, "rows": r.rows, "success": False,
                     "reason": r.reason, "checks": f"{ok}/{len(r.expectations)}",
                     "failed": "; ".join(failed) or r.error[:300]})
    return rows


def _same_work(a: CoreIngestParams, b: CoreIngestParams) -> bool:
    """Runs that differ only in their bundle keys: one may do the other's work."""
    return a.model_copy(update={"bundle_keys": []}) == b.model_copy(update={"bundle_keys": []})


def _queued_batches(p: CoreIngestParams, store: ObjectStore) -> list[QueuedBatch]:
    """The batches of this deployment's runs still waiting to start (oldest first) with the same parameters
    but their keys. Empty outside a deployment run, or when the API cannot tell (catching up is a saving,
    never a reason to fail)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterDeploymentId,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.client.schemas.sorting import FlowRunSort
    from prefect.runtime import deployment

    dep_id, own = deployment.get_id(), flow_run.get_id()
    if not dep_id:
        return []
    try:
        with get_client(sync_client=True) as client:
            runs = client.read_flow_runs(
                flow_run_filter=FlowRunFilter(deployment_id=FlowRunFilterDeploymentId(any_=[uuid.UUID(dep_id)]),
                                              state=FlowRunFilterState(type=FlowRunFilterStateType(
                                                  any_=[StateType.SCHEDULED]))),
                sort=FlowRunSort.EXPECTED_START_TIME_ASC, limit=_QUEUE_READ)
    except Exception as e:  # any API trouble: this run does its own keys only
        get_run_logger().warning("core_ingest: queued runs not read (%s); taking only this run's keys", e)
        return []
    out = []
    for r in runs:
        try:
            q = CoreIngestParams.model_validate((r.parameters or {}).get("params") or {})
        except ValueError:
            continue  # not ours to judge: that run fails on its own parameters
        if str(r.id) != own and q.bundle_keys and _same_work(p, q):
            out.append(QueuedBatch(str(r.id), tuple(_full_key(store, k) for k in dict.fromkeys(q.bundle_keys))))
    return out


def _complete_covered(store: ObjectStore, batches: list[QueuedBatch], run_id: str) -> int:
    """Mark the queued runs whose batches this run settled as Completed, so they never start; a run that
    has left Scheduled meanwhile is left alone (it finds its bundles committed and ends at once). The
    caller drops the claims."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import StateType
    from prefect.client.schemas.responses import OrchestrationResult, SetStateStatus
    from prefect.states import Completed

    done: list[QueuedBatch] = []
    try:
        with get_client(sync_client=True) as client:
            for b in batches:
                fr = client.read_flow_run(uuid.UUID(b.run_id))
                if fr.state is None or fr.state.type != StateType.SCHEDULED:
                    continue
                res: OrchestrationResult[Any] = client.set_flow_run_state(uuid.UUID(b.run_id), Completed(
                    message=f"covered by core_ingest run {run_id}: its {len(b.keys)} bundles were settled there"))
                if res.status == SetStateStatus.ACCEPT:
                    done.append(b)
    except Exception as e:  # the covered runs then start and find nothing to do
        get_run_logger().warning("core_ingest: covered runs not completed (%s); they will start and find "
                                 "their bundles settled", e)
    return len(done)


_QUEUE_READ = 200  # queued runs read per catch-up (each holds up to a gateway batch, 200 keys)


def _about(p: CoreIngestParams) -> str:
    return f"{len(p.bundle_keys)} bundles" if p.bundle_keys else f"{'sweep ' if p.sweep else ''}landing/{p.prefix or '*'}"


@flow(name="core_ingest", task_runner=from_environment(),  # EDGEHAUL_TASK_RUNNER of the run's process
       flow_run_name=run_namer("core_ingest", CoreIngestParams, _about))
def core_ingest(params: CoreIngestParams | None = None) -> dict[str, Any]:
    """Validate landed bundles, quarantine failures, commit the rest as one dataset version per contract."""
    p = params or CoreIngestParams()
    logger = get_run_logger()
    store = load_block(ObjectStore, p.store_block, param="store_block")
    store_probe.require(store, {
        "put-if-none-match": "core_ingest (Delta commits, bundle claims)",
        "put-if-match-quoted|put-if-match-unquoted": "core_ingest (taking over a dead run's claims)",
    })
    run_id = str(flow_run.get_id() or uuid.uuid4())
    keys = [_full_key(store, k) for k in dict.fromkeys(p.bundle_keys)][: p.max_bundles] if p.bundle_keys else \
        discover_task(store, p.prefix, p.max_bundles, p.sweep)
    own = set(keys)
    taken: list[QueuedBatch] = []
    if p.bundle_keys and p.catch_up:
        # A run that starts late takes what queued behind it, so the runs queued after it end at once;
        # runs starting together split the queue (each batch is claimed by one of them).
        _, fits = take_queued(keys, _queued_batches(p, store), p.max_bundles)
        taken = claim_batches_task(store, fits, run_id) if fits else []
        keys = take_queued(keys, taken, p.max_bundles)[0]
        if taken:
            logger.info("core_ingest: took %d bundles of %d queued runs", len(keys) - len(own), len(taken))
    # raises ContractInvalid (a broken contract) before anything moves: the run fails, naming file and field
    scan = read_manifests_task(store, keys, p.manifest_wait_s) if keys else LandedScan()
    for key, why in scan.skipped.items():
        logger.warning("core_ingest: skipped %s: %s", key, why)
    if scan.quarantined:  # landing is write-once: an earlier run's quarantined bundles are still there
        logger.info("core_ingest: %d bundles already quarantined (left in landing)", len(scan.quarantined))
    if scan.waiting:
        logger.info("core_ingest: %d bundles waiting for their manifest (left in landing): %s", len(scan.waiting),
                    ", ".join(scan.waiting[:20]) + (" ..." if len(scan.waiting) > 20 else ""))

    # Already in their dataset (a run before this one caught up with them): no validation, no commit.
    done_before = committed_task(store, scan.manifests) if scan.manifests else {}
    todo = {k: m for k, m in scan.manifests.items() if k not in done_before}
    for key, b in done_before.items():
        if key in own:  # the trigger named it: answer its node, as a commit of it would
            m = scan.manifests[key]
            events.emit(events.BUNDLE_RECEIPT, f"edgehaul.bundle.{b}",
                        {"status": "already_committed", "kind": contract_by_id(m["contract"]).kind, "version": None,
                         "node_id": m["node_id"]},
                        **{"edgehaul.node.id": m["node_id"]})

    # result_storage is named, never saved here: a flow that saved it would hand its keys to every
    # reader of the block
    pending = list(todo.items())
    chunks = [pending[i:i + p.validate_batch] for i in range(0, len(pending), p.validate_batch)]
    futures = [validate_bundles_task.submit(store, chunk, p.result_storage, p.refresh_cache,
                                            f"{len(chunk)}-bundles-{n + 1}-of-{len(chunks)}")
               for n, chunk in enumerate(chunks)]
    rejected: dict[str, dict[str, Any]] = {k: _rejection(k, r, e) for k, (r, e) in scan.rejected.items()}
    passed: dict[str, ValidationResult] = {}
    errors: dict[str, str] = {}
    cached: list[str] = []
    broken: list[BaseException] = []
    for chunk, fut in zip(chunks, futures, strict=True):
        fut.wait()
        state = fut.state
        if state.is_completed():
            batch: ValidatedBatch = fut.result()
            passed.update(batch.passed)
            rejected.update(batch.rejected)
            errors.update(batch.errors)
            cached += batch.cached
            continue
        exc = state.result(raise_on_failure=False)
        if isinstance(exc, ContractInvalid):
            broken.append(exc)
        else:  # transport trouble after retries: the chunk stays in landing for the next run
            errors.update({k: str(exc)[:300] for k, _ in chunk})
    if broken:  # the contract changed under the run: fail before quarantining anything
        raise broken[0]

    errors.update(scan.errors)
    usable = scan.manifests
    q_futures = {k: quarantine_task.submit(store, k, r, usable.get(k)) for k, r in rejected.items()}
    quarantined = []
    for key, q_fut in q_futures.items():  # one bundle's quarantine that fails is that bundle's, left in landing
        q_fut.wait()
        if q_fut.state.is_completed():
            quarantined.append(q_fut.result())
        else:
            errors[key] = f"quarantine failed: {str(q_fut.state.result(raise_on_failure=False))[:300]}"

    by_contract: dict[str, list[tuple[str, ValidationResult]]] = {}
    for key, res in passed.items():
        by_contract.setdefault(res.contract, []).append((key, res))
    commits = []
    for contract_id, items in sorted(by_contract.items()):
        c_state = commit_task(store, contract_id, items, run_id, p.lease_s, return_state=True)
        if not c_state.is_completed():  # left in landing for the next run; the other contracts still commit
            errors.update({k: f"commit failed: {str(c_state.result(raise_on_failure=False))[:300]}" for k, _ in items})
            continue
        c = c_state.result()
        commits.append(c)
        if c.version is not None:  # a commit with no new row makes none: no training run for nothing new
            events.emit(events.DATASET_COMMITTED, f"edgehaul.dataset.{c.kind}",
                        {"kind": c.kind, "version": c.version, "parent": c.parent, "bundles": c.bundles,
                         "nodes": c.nodes, "rows": c.rows, "contract": contract_id},
                        **events.dataset_committed_labels(c.kind, contract_by_id(contract_id).training is not None))
        for (node, b), status in [*((r, "committed") for r in c.nodes_of("bundles")),
                                  *((r, "already_committed") for r in c.nodes_of("already_committed"))]:
            events.emit(events.BUNDLE_RECEIPT, f"edgehaul.bundle.{b}",
                        {"status": status, "kind": c.kind, "version": c.version, "node_id": node},
                        **{"edgehaul.node.id": node})

    summary_table(
        "core-ingest-validation", _artifact_rows(list(passed.values()), list(rejected.values())),
        f"core_ingest: {len(passed)} bundles valid, {len(rejected)} quarantined, {len(errors)} errors",
    )
    deferred = sorted(b for c in commits for b in c.deferred)
    key_of = {f"{r.node_id}/{r.bundle_id}": k for k, r in passed.items()}  # a bundle id is unique per node only
    unsettled = {*scan.waiting, *errors, *(key_of[r] for c in commits for r in c.refs.get("deferred", []) if r in key_of)}
    covered = _complete_covered(store, settled_batches(taken, unsettled), run_id) if taken else 0
    if taken:
        # Every claim goes now, completed or not: a claim only keeps runs starting together apart. A batch
        # left unsettled (or whose run started meanwhile) is its own run's again, or the next taker's.
        release_batch_claims_task(store, taken)
    summary = {
        "bundles": len(keys),
        "taken_from_queue": len(keys) - len(own),
        "taken_runs": [b.run_id for b in taken],
        "queued_runs_completed": covered,
        "already_committed": sorted(done_before.values()),
        "valid": len(passed),
        "cached": len(cached),  # of the valid: served from the validation cache, not fetched again
        "validation_tasks": len(chunks),
        "waiting": scan.waiting,
        "skipped": scan.skipped,
        "already_quarantined": sorted(scan.quarantined),
        "quarantined": [{"bundle_id": q["bundle_id"], "reason": q["reason"], "prefix": q["quarantine_prefix"],
                         "samples": len(q["sample_ids"])} for q in quarantined],
        "errors": errors,
        "commits": [c.to_dict() for c in commits],
        "versions": {c.kind: c.version for c in commits},
    }
    summary["deferred"] = deferred
    logger.info("core_ingest: %d bundles (%d of %d queued runs, %d completed), %d already committed, %d valid "
                "(%d cached), %d quarantined, %d waiting, %d skipped, %d errors, %d deferred; versions %s", len(keys),
                len(keys) - len(own), len(taken), covered, len(done_before), len(passed), len(cached), len(quarantined),
                len(scan.waiting), len(scan.skipped), len(errors), len(deferred), summary["versions"])
    if errors:  # left in landing for the next run; said with the reason, never silent
        logger.warning("core_ingest: %d bundles not validated (left in landing for the next run): %s", len(errors),
                       "; ".join(f"{k}: {e}" for k, e in list(errors.items())[:5]) + (" ..." if len(errors) > 5 else ""))
    if deferred:
        # Left in landing for the next run (another live run holds their claims); said, never silent.
        logger.warning("core_ingest: %d bundles deferred (claimed by another live run, retried by the next run): %s",
                       len(deferred), ", ".join(deferred[:20]) + (" ..." if len(deferred) > 20 else ""))
    return summary
