"""Core-side tasks: read landed manifests, validate a bundle, quarantine it, commit a dataset version,
compact a dataset. The ingest steps' bodies are the plain functions of `edgehaul.core.ingest` (which
the fault drills call too); these tasks add retries and caching.

Caching (issues 11, 17), results persisted as JSON (never pickle) to the central result storage the
flow names (`result_storage`; `edgehaul.platform.caching`: a prefix no edge identity can write):
- `validate_bundle_task` is keyed on the bundle's SHA-256 (from its manifest) + the landed object (bucket,
  key) and its ETag and size as the store reports them to the core (a HEAD by the core's identity: the
  store's own digest of the bytes it holds, not a claim of the node) + the contract file's SHA-256 +
  `VALIDATION_VERSION` + `CORE_CACHE_VERSION`. Its value is the `ValidationResult`, a small
  reference (bundle id, checksum, one row per check); the bytes stay in landing. A failing bundle
  raises `BundleRejected` instead of returning: Prefect caches only Completed states, so a failed or
  quarantined result is never cached as success. The commit re-checks the bytes against the
  validated checksum, so a cached success can never admit altered bytes.
- `compact_task` is keyed on the input file set's fingerprint + target size: a rerun over the same
  files is Cached and rewrites nothing.
- discovery, quarantine and commit are not cached (they depend on the store's current state); the
  commit is idempotent by itself (per-bundle Delta txn ids + claims), so retrying it is safe.
Retries only for transport / server-side errors, never for bad data.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from botocore.exceptions import ClientError
from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.context import TaskRunContext

from edgehaul.blocks import ObjectStore
from edgehaul.contracts import ContractError, contract_by_id
from edgehaul.core import compaction, datasets, ingest, landed
from edgehaul.core.ingest import BundleRejected as BundleRejected  # the flow and persisted results name it here
from edgehaul.core.validation import VALIDATION_VERSION, ValidationResult
from edgehaul.platform.caching import RESULT_SERIALIZER, cache_key
from edgehaul.platform.s3_errors import IO_RETRY, error_code

log = logging.getLogger(__name__)

CORE_CACHE_VERSION = "core-2"  # bump to invalidate every cached validation / compaction result


# ---------------------------------------------------------------- discovery


@task(name="core-discover", **IO_RETRY,
      cache_policy=NO_CACHE)
def discover_task(store: ObjectStore, prefix: str, limit: int) -> list[str]:
    """Landing keys of complete bundles (manifest present) under `prefix`, oldest day first, then those
    still without a manifest (reported as waiting, quarantined once past the wait limit)."""
    complete, incomplete = landed.discover(store, prefix)
    return [*complete, *incomplete][:limit]


@task(name="core-read-manifests", **IO_RETRY,
      cache_policy=NO_CACHE)
def read_manifests_task(store: ObjectStore, keys: list[str], manifest_wait_s: float) -> ingest.LandedScan:
    """Each key's manifest, rejection, wait or skip (see `ingest.read_manifests`)."""
    return ingest.read_manifests(store, keys, manifest_wait_s=manifest_wait_s)


@task(name="core-claim-batches", **IO_RETRY,
      cache_policy=NO_CACHE)
def claim_batches_task(store: ObjectStore, batches: list[ingest.QueuedBatch], taker: str) -> list[ingest.QueuedBatch]:
    """The queued batches this run wins (see `ingest.claim_batches`)."""
    return ingest.claim_batches(store, batches, taker)


@task(name="core-release-batches", **IO_RETRY,
      cache_policy=NO_CACHE)
def release_batch_claims_task(store: ObjectStore, batches: list[ingest.QueuedBatch]) -> None:
    """Drop the claims of the batches whose runs were completed (see `ingest.release_batch_claims`)."""
    ingest.release_batch_claims(store, batches)


@task(name="core-committed", **IO_RETRY,
      cache_policy=NO_CACHE)
def committed_task(store: ObjectStore, manifests: dict[str, dict[str, Any]]) -> dict[str, str]:
    """key -> bundle id of the bundles already in their dataset (see `ingest.already_committed`)."""
    return ingest.already_committed(store, manifests)


# ---------------------------------------------------------------- validation


def validation_key(bundle_sha256: str, landed_object: str, landed_etag: str, contract_sha256: str) -> str:
    return cache_key("core-validate", CORE_CACHE_VERSION, VALIDATION_VERSION, bundle_sha256, landed_object, landed_etag,
                     contract_sha256)


def landed_etag(store: ObjectStore, key: str) -> str:
    """`<ETag>:<size>` of the landed object as the store reports it to the core; 'missing' when it is not there
    (validation then rejects it, and rejections are never cached)."""
    try:
        head = store.client().head_object(Bucket=store.bucket("landing"), Key=key)
    except ClientError as e:
        if error_code(e) in ("404", "NoSuchKey", "NotFound"):
            return "missing"
        raise
    return f"{head['ETag'].strip(chr(34))}:{head['ContentLength']}"


def _validate_cache_key(ctx: TaskRunContext, params: dict[str, Any]) -> str:
    manifest: dict[str, Any] = params["manifest"]
    try:
        contract_sha = contract_by_id(manifest["contract"]).sha256
    except ContractError:
        contract_sha = f"unknown:{manifest['contract']}"  # the run fails; nothing is cached under it
    # The manifest's checksum alone is the node's claim: the store's digest of the landed bytes binds the entry
    # to what is actually there (validation then re-hashes the bytes it fetches; the commit does again).
    store: ObjectStore = params["store"]
    return validation_key(manifest["sha256"], f"{store.bucket('landing')}/{params['key']}",
                          landed_etag(store, params["key"]), contract_sha)


@task(
    name="core-validate", cache_key_fn=_validate_cache_key, cache_expiration=timedelta(days=30), persist_result=True,
    result_serializer=RESULT_SERIALIZER, **IO_RETRY,
    task_run_name="validate-{manifest[bundle_id]}",
)
def validate_bundle_task(store: ObjectStore, key: str, manifest: dict[str, Any]) -> ValidationResult:
    """Validate one landed bundle. Success returns the result (cached); failure raises BundleRejected."""
    return ingest.validate_landed(store, key, manifest)


# ---------------------------------------------------------------- quarantine


@task(name="core-quarantine", **IO_RETRY,
      cache_policy=NO_CACHE)
def quarantine_task(store: ObjectStore, key: str, result: dict[str, Any], manifest: dict[str, Any] | None) -> dict[str, Any]:
    """Move a rejected bundle to quarantine with its validation record; returns the record."""
    return ingest.quarantine_rejected(store, key, result, manifest)


# ---------------------------------------------------------------- commit


@task(name="core-commit", **IO_RETRY,
      cache_policy=NO_CACHE)
def commit_task(
    store: ObjectStore, contract_id: str, validated: list[tuple[str, ValidationResult]], run_id: str, lease_s: float,
) -> datasets.CommitResult:
    """Fetch the validated bundles again (by reference), check they are the bytes that were validated,
    and append them to the kind's dataset in one commit."""
    return ingest.commit_validated(store, contract_id, validated, run_id, lease_s)


# ---------------------------------------------------------------- compaction


@task(name="core-file-set", **IO_RETRY,
      cache_policy=NO_CACHE)
def file_set_task(store: ObjectStore, kind: str) -> compaction.FileSet:
    return compaction.file_set(store, kind)


def _compact_cache_key(ctx: TaskRunContext, params: dict[str, Any]) -> str:
    fs: compaction.FileSet = params["files"]
    return cache_key("core-compact", CORE_CACHE_VERSION, fs.fingerprint, str(params["target_size"]),
                     str(params["min_files"]))


@task(name="core-compact", cache_key_fn=_compact_cache_key, persist_result=True, cache_expiration=timedelta(days=7),
      result_serializer=RESULT_SERIALIZER, **IO_RETRY)
def compact_task(store: ObjectStore, files: compaction.FileSet, target_size: int, min_files: int) -> dict[str, Any]:
    """Compact the dataset whose current file set is `files` (the cache key); returns the result."""
    return compaction.compact(store, files.kind, target_size, min_files=min_files).to_dict()
