"""Core-side tasks: read landed manifests, validate a bundle, quarantine it, commit a dataset version,
compact a dataset. The ingest steps' bodies are the plain functions of `edgehaul.core.ingest` (which
the fault drills call too); these tasks add retries and caching.

Caching (reruns do no work twice; no cached record is writable by an edge identity), results persisted as
JSON (never pickle) to the central result storage the flow names (`result_storage`;
`edgehaul.platform.caching`: a prefix no edge identity can write):
- `validate_bundles_task` validates a chunk of bundles in one task run (a task run per bundle
  set the core's pace at fleet scale) and keeps the cache per bundle by hand
  (`edgehaul.core.validation_cache`): keyed on the bundle's SHA-256 + the landed object and its ETag and
  size as the store reports them to the core + the contract file's SHA-256 + the validation and cache
  versions; only successes are written, and a record is read only as JSON holding this bundle's success.
  The commit re-checks the bytes against the validated checksum, so a cached success can never admit
  altered bytes.
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

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.context import TaskRunContext

from edgehaul.blocks import ObjectStore
from edgehaul.bundles import BundleManifest
from edgehaul.core import compaction, datasets, ingest, landed
from edgehaul.core.validation import ValidationResult
from edgehaul.core.validation_cache import CORE_CACHE_VERSION, ValidationCache
from edgehaul.platform.caching import RESULT_SERIALIZER, cache_key
from edgehaul.platform.s3_errors import IO_RETRY

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- discovery


@task(name="core-discover", **IO_RETRY,
      cache_policy=NO_CACHE)
def discover_task(store: ObjectStore, prefix: str, limit: int, unsettled_only: bool = False) -> list[str]:
    """Landing keys of complete bundles (manifest present) under `prefix`, oldest day first, then those
    still without a manifest (reported as waiting, quarantined once past the wait limit). With
    `unsettled_only` (a sweep), bundles already committed or quarantined are left out before the limit."""
    complete, incomplete = landed.discover(store, prefix)
    keys = [*complete, *incomplete]
    if unsettled_only:
        done = ingest.settled(store, keys)
        keys = [k for k in keys if k not in done]
    return keys[:limit]


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
def committed_task(store: ObjectStore, manifests: dict[str, BundleManifest]) -> dict[str, str]:
    """key -> bundle id of the bundles already in their dataset (see `ingest.already_committed`)."""
    return ingest.already_committed(store, manifests)


# ---------------------------------------------------------------- validation


@task(name="core-validate", **IO_RETRY, cache_policy=NO_CACHE, task_run_name="validate-{label}")
def validate_bundles_task(
    store: ObjectStore, items: list[tuple[str, BundleManifest]], result_storage: str, refresh: bool, label: str,
) -> ingest.ValidatedBatch:
    """Validate a chunk of landed bundles (one GE run, reads in parallel), each bundle's success cached by
    hand in `result_storage` (see `edgehaul.core.validation_cache`); rejections are results, not errors."""
    cache = ValidationCache.named(result_storage, store)  # refused unless the pinned central folder
    return ingest.validate_landed_many(store, items, cache=cache, refresh=refresh)


# ---------------------------------------------------------------- quarantine


@task(name="core-quarantine", **IO_RETRY,
      cache_policy=NO_CACHE)
def quarantine_task(store: ObjectStore, key: str, result: dict[str, Any], manifest: BundleManifest | None) -> dict[str, Any]:
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
