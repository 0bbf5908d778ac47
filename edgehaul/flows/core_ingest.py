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
from typing import TYPE_CHECKING, Any

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from pydantic import BaseModel, Field

from edgehaul.blocks import ObjectStore
from edgehaul.contracts import ContractInvalid
from edgehaul.core.datasets import CommitResult
from edgehaul.core.ingest import LandedScan, QueuedBatch, ValidatedBatch, settled_batches, take_queued
from edgehaul.core.ingest_run import (
    IngestRun,
    artifact_rows,
    by_contract,
    emit_already_committed,
    emit_commit,
    scan_rejections,
)
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

if TYPE_CHECKING:
    from prefect.client.schemas.objects import FlowRun


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


def _same_work(a: CoreIngestParams, b: CoreIngestParams) -> bool:
    """Runs that differ only in their bundle keys: one may do the other's work."""
    return a.model_copy(update={"bundle_keys": []}) == b.model_copy(update={"bundle_keys": []})


def _queued_batches(p: CoreIngestParams, store: ObjectStore) -> list[QueuedBatch]:
    """The batches of this deployment's runs still waiting to start (oldest first) with the same parameters
    but their keys. Empty outside a deployment run, or when the API cannot tell (catching up is a saving,
    never a reason to fail)."""
    from prefect.runtime import deployment

    dep_id, own = deployment.get_id(), flow_run.get_id()
    if not dep_id:
        return []
    out = []
    for r in _scheduled_runs(dep_id):
        try:
            q = CoreIngestParams.model_validate((r.parameters or {}).get("params") or {})
        except ValueError:
            continue  # not ours to judge: that run fails on its own parameters
        if str(r.id) != own and q.bundle_keys and _same_work(p, q):
            out.append(QueuedBatch(str(r.id), tuple(_full_key(store, k) for k in dict.fromkeys(q.bundle_keys))))
    return out


def _scheduled_runs(dep_id: str) -> list[FlowRun]:
    """The deployment's runs still Scheduled, oldest first; none when the API cannot tell."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterDeploymentId,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.client.schemas.sorting import FlowRunSort

    try:
        with get_client(sync_client=True) as client:
            return client.read_flow_runs(
                flow_run_filter=FlowRunFilter(deployment_id=FlowRunFilterDeploymentId(any_=[uuid.UUID(dep_id)]),
                                              state=FlowRunFilterState(type=FlowRunFilterStateType(
                                                  any_=[StateType.SCHEDULED]))),
                sort=FlowRunSort.EXPECTED_START_TIME_ASC, limit=_QUEUE_READ)
    except Exception as e:  # any API trouble: this run does its own keys only
        get_run_logger().warning("core_ingest: queued runs not read (%s); taking only this run's keys", e)
        return []


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
    store = load_block(ObjectStore, p.store_block, param="store_block")
    store_probe.require(store, {
        "put-if-none-match": "core_ingest (Delta commits, bundle claims)",
        "put-if-match-quoted|put-if-match-unquoted": "core_ingest (taking over a dead run's claims)",
    })
    run_id = str(flow_run.get_id() or uuid.uuid4())
    run = _take_keys(p, store, run_id)
    # raises ContractInvalid (a broken contract) before anything moves: the run fails, naming file and field
    run.scan = _read_manifests(store, run.keys, p.manifest_wait_s)
    # Already in their dataset (a run before this one caught up with them): no validation, no commit.
    run.done_before = committed_task(store, run.scan.manifests) if run.scan.manifests else {}
    emit_already_committed(run.scan, run.done_before, run.own)
    run.checked, run.validation_tasks = _validate(store, run.scan, run.done_before, p)
    run.quarantined = _quarantine(store, run.scan, run.checked)
    run.commits = _commit(store, run.checked, run_id, p.lease_s)
    checked = run.checked
    summary_table(
        "core-ingest-validation", artifact_rows(list(checked.passed.values()), list(checked.rejected.values())),
        f"core_ingest: {len(checked.passed)} bundles valid, {len(checked.rejected)} quarantined, "
        f"{len(checked.errors)} errors",
    )
    if run.taken:
        run.covered = _complete_covered(store, settled_batches(run.taken, run.unsettled()), run_id)
        # Every claim goes now, completed or not: a claim only keeps runs starting together apart. A batch
        # left unsettled (or whose run started meanwhile) is its own run's again, or the next taker's.
        release_batch_claims_task(store, run.taken)
    summary = run.summary()
    _log_run(run, summary["versions"])
    return summary


def _take_keys(p: CoreIngestParams, store: ObjectStore, run_id: str) -> IngestRun:
    """The run's keys: those it was given (then, catching up, the whole batches of queued runs it claims), or
    those it discovers in landing."""
    if not p.bundle_keys:
        keys = discover_task(store, p.prefix, p.max_bundles, p.sweep)
        return IngestRun(keys=keys, own=set(keys))
    keys = [_full_key(store, k) for k in dict.fromkeys(p.bundle_keys)][: p.max_bundles]
    run = IngestRun(keys=keys, own=set(keys))
    if p.catch_up:
        # A run that starts late takes what queued behind it, so the runs queued after it end at once;
        # runs starting together split the queue (each batch is claimed by one of them).
        _, fits = take_queued(keys, _queued_batches(p, store), p.max_bundles)
        run.taken = claim_batches_task(store, fits, run_id) if fits else []
        run.keys = take_queued(keys, run.taken, p.max_bundles)[0]
        if run.taken:
            get_run_logger().info("core_ingest: took %d bundles of %d queued runs", len(run.keys) - len(run.own),
                                  len(run.taken))
    return run


def _read_manifests(store: ObjectStore, keys: list[str], manifest_wait_s: float) -> LandedScan:
    """What landing holds for each key (see `edgehaul.core.ingest.read_manifests`); what is left there, said."""
    logger = get_run_logger()
    scan = read_manifests_task(store, keys, manifest_wait_s) if keys else LandedScan()
    for key, why in scan.skipped.items():
        logger.warning("core_ingest: skipped %s: %s", key, why)
    if scan.quarantined:  # landing is write-once: an earlier run's quarantined bundles are still there
        logger.info("core_ingest: %d bundles already quarantined (left in landing)", len(scan.quarantined))
    if scan.waiting:
        logger.info("core_ingest: %d bundles waiting for their manifest (left in landing): %s", len(scan.waiting),
                    ", ".join(scan.waiting[:20]) + (" ..." if len(scan.waiting) > 20 else ""))
    return scan


def _validate(store: ObjectStore, scan: LandedScan, done_before: dict[str, str], p: CoreIngestParams
              ) -> tuple[ValidatedBatch, int]:
    """Validate the bundles not yet committed in chunks of `validate_batch`, one task run per chunk, all
    submitted at once; a chunk that fails after its retries stays in landing (`errors`). With the read's own
    rejections and errors: (every key's verdict, the number of validation task runs)."""
    # result_storage is named, never saved here: a flow that saved it would hand its keys to every
    # reader of the block
    pending = [(k, m) for k, m in scan.manifests.items() if k not in done_before]
    chunks = [pending[i:i + p.validate_batch] for i in range(0, len(pending), p.validate_batch)]
    futures = [validate_bundles_task.submit(store, chunk, p.result_storage, p.refresh_cache,
                                            f"{len(chunk)}-bundles-{n + 1}-of-{len(chunks)}")
               for n, chunk in enumerate(chunks)]
    out = ValidatedBatch(rejected=scan_rejections(scan))
    broken: list[BaseException] = []
    for chunk, fut in zip(chunks, futures, strict=True):
        fut.wait()
        state = fut.state
        if state.is_completed():
            batch: ValidatedBatch = fut.result()
            out.passed.update(batch.passed)
            out.rejected.update(batch.rejected)
            out.errors.update(batch.errors)
            out.cached += batch.cached
            continue
        exc = state.result(raise_on_failure=False)
        if isinstance(exc, ContractInvalid):
            broken.append(exc)
        else:  # transport trouble after retries: the chunk stays in landing for the next run
            out.errors.update({k: str(exc)[:300] for k, _ in chunk})
    if broken:  # the contract changed under the run: fail before quarantining anything
        raise broken[0]
    out.errors.update(scan.errors)
    return out, len(chunks)


def _quarantine(store: ObjectStore, scan: LandedScan, checked: ValidatedBatch) -> list[dict[str, Any]]:
    """Quarantine every rejected bundle (one task run each); one that fails is that bundle's, left in landing."""
    usable = scan.manifests
    q_futures = {k: quarantine_task.submit(store, k, r, usable.get(k)) for k, r in checked.rejected.items()}
    quarantined = []
    for key, q_fut in q_futures.items():
        q_fut.wait()
        if q_fut.state.is_completed():
            quarantined.append(q_fut.result())
        else:
            checked.errors[key] = f"quarantine failed: {str(q_fut.state.result(raise_on_failure=False))[:300]}"
    return quarantined


def _commit(store: ObjectStore, checked: ValidatedBatch, run_id: str, lease_s: float) -> list[CommitResult]:
    """One commit per contract of its valid bundles, then its events; a commit that fails leaves its bundles in
    landing for the next run (`errors`) and the other contracts still commit."""
    commits = []
    for contract_id, items in by_contract(checked.passed):
        c_state = commit_task(store, contract_id, items, run_id, lease_s, return_state=True)
        if not c_state.is_completed():
            checked.errors.update(
                {k: f"commit failed: {str(c_state.result(raise_on_failure=False))[:300]}" for k, _ in items})
            continue
        c = c_state.result()
        commits.append(c)
        emit_commit(c, contract_id)
    return commits


def _log_run(run: IngestRun, versions: dict[str, int | None]) -> None:
    logger = get_run_logger()
    scan, checked, errors, deferred = run.scan, run.checked, run.errors, run.deferred
    logger.info("core_ingest: %d bundles (%d of %d queued runs, %d completed), %d already committed, %d valid "
                "(%d cached), %d quarantined, %d waiting, %d skipped, %d errors, %d deferred; versions %s",
                len(run.keys), len(run.keys) - len(run.own), len(run.taken), run.covered, len(run.done_before),
                len(checked.passed), len(checked.cached), len(run.quarantined), len(scan.waiting), len(scan.skipped),
                len(errors), len(deferred), versions)
    if errors:  # left in landing for the next run; said with the reason, never silent
        logger.warning("core_ingest: %d bundles not validated (left in landing for the next run): %s", len(errors),
                       "; ".join(f"{k}: {e}" for k, e in list(errors.items())[:5]) + (" ..." if len(errors) > 5 else ""))
    if deferred:
        # Left in landing for the next run (another live run holds their claims); said, never silent.
        logger.warning("core_ingest: %d bundles deferred (claimed by another live run, retried by the next run): %s",
                       len(deferred), ", ".join(deferred[:20]) + (" ..." if len(deferred) > 20 else ""))
