"""Core-side tasks: read landed manifests, validate a bundle, quarantine it, commit a dataset version,
compact a dataset.

Caching (issue 11), results persisted to the ops bucket by the flow (`result_storage`):
- `validate_bundle_task` is keyed on the bundle's SHA-256 (from its manifest) + the contract file's
  SHA-256 + `VALIDATION_VERSION` + `CORE_CACHE_VERSION`. Its value is the `ValidationResult`, a small
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
from dataclasses import asdict
from datetime import timedelta
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.context import TaskRunContext

from edgehaul.blocks import ObjectStore
from edgehaul.bundles import BundleManifest, read_bundle
from edgehaul.contracts import ContractError, contract_by_id
from edgehaul.core import compaction, datasets, landed, quarantine
from edgehaul.core.validation import VALIDATION_VERSION, ValidationResult, expecting_validation, validate_bundle_batched
from edgehaul.platform.caching import cache_key
from edgehaul.platform.s3_errors import IO_RETRY

log = logging.getLogger(__name__)

CORE_CACHE_VERSION = "core-1"  # bump to invalidate every cached validation / compaction result


class BundleRejected(Exception):
    """A bundle failed validation; carries the result (as a dict) for quarantine. Never retried."""

    def __init__(self, result: dict[str, Any]) -> None:
        super().__init__(f"bundle {result.get('bundle_id')}: {result.get('reason')}: {str(result.get('error'))[:300]}")
        self.result = result

    def __reduce__(self) -> tuple[Any, ...]:  # results are persisted: keep the dict through pickling
        return (BundleRejected, (self.result,))


# ---------------------------------------------------------------- discovery


@task(name="core-discover", **IO_RETRY,
      cache_policy=NO_CACHE)
def discover_task(store: ObjectStore, prefix: str, limit: int) -> list[str]:
    """Landing keys of complete bundles (manifest present) under `prefix`, oldest day first."""
    return landed.complete_bundles(store, prefix)[:limit]


@task(name="core-read-manifests", **IO_RETRY,
      cache_policy=NO_CACHE)
def read_manifests_task(store: ObjectStore, keys: list[str]) -> dict[str, dict[str, Any] | str]:
    """key -> manifest (as a dict), or an error string for a missing or malformed manifest."""
    s3 = store.client()
    out: dict[str, dict[str, Any] | str] = {}
    for key in keys:
        mkey = quarantine.manifest_key_for(key)
        try:
            raw = s3.get_object(Bucket=store.bucket("landing"), Key=mkey)["Body"].read()
            out[key] = asdict(BundleManifest.from_json(raw))
        except s3.exceptions.NoSuchKey:
            out[key] = f"manifest {mkey} missing"
        except ValueError as e:  # BundleError: malformed
            out[key] = f"{mkey}: {e}"
    return out


# ---------------------------------------------------------------- validation


def validation_key(bundle_sha256: str, contract_sha256: str) -> str:
    return cache_key("core-validate", CORE_CACHE_VERSION, VALIDATION_VERSION, bundle_sha256, contract_sha256)


def _validate_cache_key(ctx: TaskRunContext, params: dict[str, Any]) -> str:
    manifest: dict[str, Any] = params["manifest"]
    try:
        contract_sha = contract_by_id(manifest["contract"]).sha256
    except ContractError:
        contract_sha = f"unknown:{manifest['contract']}"  # the run fails; nothing is cached under it
    return validation_key(manifest["sha256"], contract_sha)


@task(
    name="core-validate", cache_key_fn=_validate_cache_key, cache_expiration=timedelta(days=30), persist_result=True,
    **IO_RETRY,
    task_run_name="validate-{manifest[bundle_id]}",
)
def validate_bundle_task(store: ObjectStore, key: str, manifest: dict[str, Any]) -> ValidationResult:
    """Validate one landed bundle. Success returns the result (cached); failure raises BundleRejected."""
    m = BundleManifest(**manifest)
    # Announced before the fetch: the run's other validations (concurrent task runs in this process)
    # wait for this one, and one Great Expectations run checks them all.
    with expecting_validation():
        lb = landed.fetch(store, key)
        if lb.data is None:
            raise BundleRejected(ValidationResult(
                bundle_id=m.bundle_id, node_id=m.node_id, contract=m.contract, contract_sha256="",
                bundle_sha256="", rows=m.row_count, success=False, reason="unreadable", error=lb.error,
            ).to_dict())
        _, result = validate_bundle_batched(lb.data, m)
    if not result.success:
        raise BundleRejected(result.to_dict())
    return result


# ---------------------------------------------------------------- quarantine


@task(name="core-quarantine", **IO_RETRY,
      cache_policy=NO_CACHE)
def quarantine_task(store: ObjectStore, key: str, result: dict[str, Any], manifest: dict[str, Any] | None) -> dict[str, Any]:
    """Move a rejected bundle to quarantine with its validation record; returns the record."""
    m = BundleManifest(**manifest) if manifest else None
    ids = None
    if m is None:  # no usable manifest: account for the samples from the file itself when it parses
        lb = landed.fetch(store, key)
        if lb.data is not None:
            try:
                ids = read_bundle(lb.data).column("sample_id").to_pylist()
            except (ValueError, KeyError):
                ids = None
    record = quarantine.quarantine_bundle(store, key, ValidationResult.from_dict(result), m, ids)
    return asdict(record)


# ---------------------------------------------------------------- commit


@task(name="core-commit", **IO_RETRY,
      cache_policy=NO_CACHE)
def commit_task(
    store: ObjectStore, contract_id: str, validated: list[tuple[str, ValidationResult]], run_id: str, lease_s: float,
) -> datasets.CommitResult:
    """Fetch the validated bundles again (by reference), check they are the bytes that were validated,
    and append them to the kind's dataset in one commit."""
    contract = contract_by_id(contract_id)
    items = []
    s3 = store.client()
    for key, result in validated:
        lb = landed.fetch(store, key, s3=s3)
        if lb.data is None or lb.manifest is None:
            raise datasets.DatasetError(f"validated bundle {key} vanished from landing before commit: {lb.error}")
        # read_bundle re-checks the checksum against the manifest; the manifest must be the validated one
        if lb.manifest.sha256 != result.bundle_sha256:
            raise datasets.DatasetError(f"bundle {key} changed since validation ({result.bundle_sha256[:12]} -> "
                                        f"{lb.manifest.sha256[:12]}); rerun validation")
        items.append(datasets.ValidatedBundle(lb.manifest, read_bundle(lb.data, lb.manifest), result))
    return datasets.commit_bundles(store, contract, items, run_id=run_id, lease_s=lease_s, s3=s3)


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
      **IO_RETRY)
def compact_task(store: ObjectStore, files: compaction.FileSet, target_size: int, min_files: int) -> dict[str, Any]:
    """Compact the dataset whose current file set is `files` (the cache key); returns the result."""
    return compaction.compact(store, files.kind, target_size, min_files=min_files).to_dict()
