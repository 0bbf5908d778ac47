"""Core ingest's steps as plain functions (no Prefect): read landed manifests, validate a landed bundle,
quarantine a rejected one, fetch the validated bytes again and commit them as one dataset version.

`edgehaul.tasks.core` wraps each step in a task (retries, caching) and `flows/core_ingest.py` orders
them; the fault drills (`edgehaul_dev.drills`) call these same functions, so there is one
implementation of each step and the drills' accounting is a claim about it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from edgehaul.bundles import BundleManifest, read_bundle
from edgehaul.contracts import contract_by_id
from edgehaul.core import datasets, landed, quarantine
from edgehaul.core.validation import ValidationResult, expecting_validation, validate_bundle_batched

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

    from edgehaul.blocks import ObjectStore

Validator = Callable[[bytes, BundleManifest], tuple[pa.Table | None, ValidationResult]]


class BundleRejected(Exception):
    """A bundle failed validation; carries the result (as a dict) for quarantine. Never retried."""

    def __init__(self, result: dict[str, Any]) -> None:
        super().__init__(f"bundle {result.get('bundle_id')}: {result.get('reason')}: {str(result.get('error'))[:300]}")
        self.result = result

    def __reduce__(self) -> tuple[Any, ...]:  # results are persisted: keep the dict through pickling
        return (BundleRejected, (self.result,))


def read_manifests(store: ObjectStore, keys: list[str], *, s3: S3Client | None = None) -> dict[str, dict[str, Any] | str]:
    """key -> manifest (as a dict), or an error string for a missing or malformed manifest."""
    s3 = s3 or store.client()
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


def unreadable(key: str, error: str) -> ValidationResult:
    """The rejection of a bundle whose manifest cannot be read (node and bundle from its key)."""
    node, bundle = quarantine.ids_from_key(key)
    return ValidationResult(bundle_id=bundle, node_id=node, contract="", contract_sha256="", bundle_sha256="", rows=0,
                            success=False, reason="unreadable", error=error)


def validate_landed(
    store: ObjectStore, key: str, manifest: dict[str, Any], *, s3: S3Client | None = None,
    validate: Validator = validate_bundle_batched,
) -> ValidationResult:
    """Validate one landed bundle: returns the result on success, raises BundleRejected otherwise.
    `validate` is the check itself (default: the GE run shared with concurrent callers)."""
    m = BundleManifest(**manifest)
    # Announced before the fetch: concurrent validations in this process wait for this one, and
    # one Great Expectations run checks them all.
    with expecting_validation():
        lb = landed.fetch(store, key, s3=s3)
        if lb.data is None:
            raise BundleRejected(ValidationResult(
                bundle_id=m.bundle_id, node_id=m.node_id, contract=m.contract, contract_sha256="",
                bundle_sha256="", rows=m.row_count, success=False, reason="unreadable", error=lb.error,
            ).to_dict())
        _, result = validate(lb.data, m)
    if not result.success:
        raise BundleRejected(result.to_dict())
    return result


def quarantine_rejected(
    store: ObjectStore, key: str, result: dict[str, Any], manifest: dict[str, Any] | None, *,
    s3: S3Client | None = None, emit_event: bool = True,
) -> dict[str, Any]:
    """Move a rejected bundle to quarantine with its validation record; returns the record."""
    m = BundleManifest(**manifest) if manifest else None
    ids = None
    if m is None:  # no usable manifest: account for the samples from the file itself when it parses
        lb = landed.fetch(store, key, s3=s3)
        if lb.data is not None:
            try:
                ids = read_bundle(lb.data).column("sample_id").to_pylist()
            except (ValueError, KeyError):
                ids = None
    record = quarantine.quarantine_bundle(store, key, ValidationResult.from_dict(result), m, ids, s3=s3,
                                          emit_event=emit_event)
    return asdict(record)


def fetch_validated(
    store: ObjectStore, validated: list[tuple[str, ValidationResult]], *, s3: S3Client | None = None,
) -> list[datasets.ValidatedBundle]:
    """Fetch the validated bundles again (by reference) and check they are the bytes that were validated."""
    s3 = s3 or store.client()
    items = []
    for key, result in validated:
        lb = landed.fetch(store, key, s3=s3)
        if lb.data is None or lb.manifest is None:
            raise datasets.DatasetError(f"validated bundle {key} vanished from landing before commit: {lb.error}")
        # read_bundle re-checks the checksum against the manifest; the manifest must be the validated one
        if lb.manifest.sha256 != result.bundle_sha256:
            raise datasets.DatasetError(f"bundle {key} changed since validation ({result.bundle_sha256[:12]} -> "
                                        f"{lb.manifest.sha256[:12]}); rerun validation")
        items.append(datasets.ValidatedBundle(lb.manifest, read_bundle(lb.data, lb.manifest), result))
    return items


def commit_validated(
    store: ObjectStore, contract_id: str, validated: list[tuple[str, ValidationResult]], run_id: str, lease_s: float,
    *, s3: S3Client | None = None,
) -> datasets.CommitResult:
    """Append the validated bundles of one contract to its dataset in one commit (see `fetch_validated`)."""
    contract = contract_by_id(contract_id)
    s3 = s3 or store.client()
    items = fetch_validated(store, validated, s3=s3)
    return datasets.commit_bundles(store, contract, items, run_id=run_id, lease_s=lease_s, s3=s3)
