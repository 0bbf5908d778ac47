"""Reading the landing zone from the core side: which bundles are complete, and their bytes + manifest."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from botocore.exceptions import ClientError

from edgehaul.bundles import BundleError, BundleManifest
from edgehaul.contracts import DEFAULT_LIMITS, ContractError, contract_by_id, max_manifest_bytes
from edgehaul.platform.s3_errors import error_code

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

    from edgehaul.blocks import ObjectStore

MANIFEST_SUFFIX = ".manifest.json"


def complete_bundles(store: ObjectStore, prefix: str = "", *, s3: S3Client | None = None) -> list[str]:
    """Landing keys (Parquet objects) of every bundle under `prefix` whose manifest is present.

    The manifest is written after the data, so a bundle without one is still uploading: skipped.
    """
    return discover(store, prefix, s3=s3)[0]


def discover(store: ObjectStore, prefix: str = "", *, s3: S3Client | None = None) -> tuple[list[str], list[str]]:
    """(complete, incomplete): landing keys of the Parquet objects under `prefix` with and without their
    manifest (incomplete ones are still uploading, or orphans once old: see `ingest.read_manifests`)."""
    s3 = s3 or store.client()
    keys: set[str] = set()
    paginator = s3.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=store.bucket("landing"), Prefix=store.key("landing", prefix)):
        keys.update(o["Key"] for o in page.get("Contents", []))
    data = {k for k in keys if k.endswith(".parquet")}
    complete = {k.removesuffix(MANIFEST_SUFFIX) + ".parquet" for k in keys if k.endswith(MANIFEST_SUFFIX)} & data
    return sorted(complete), sorted(data - complete)


class TooLarge(Exception):
    """An object is larger than its limit (found by a ranged read: at most limit + 1 bytes came down)."""


def read_limited(s3: S3Client, bucket: str, key: str, limit: int) -> bytes:
    """The object's bytes, reading at most `limit + 1` of them: raises TooLarge past the limit, so an
    oversized object from an edge node costs one bounded read, never its whole size."""
    try:
        body = s3.get_object(Bucket=bucket, Key=key, Range=f"bytes=0-{limit}")["Body"].read()
    except ClientError as e:
        if error_code(e) in ("InvalidRange", "416"):  # a 0-byte object has no byte 0
            return b""
        raise
    if len(body) > limit:
        raise TooLarge(f"{key} is larger than {limit} bytes")
    return body


def bundle_limit(manifest: BundleManifest | None) -> int:
    """Byte limit of a bundle: its contract's, or the default one when the contract is unknown."""
    try:
        return contract_by_id(manifest.contract).max_bundle_bytes if manifest else DEFAULT_LIMITS["max_bundle_bytes"]
    except ContractError:
        return DEFAULT_LIMITS["max_bundle_bytes"]


@dataclass
class LandedBundle:
    key: str  # landing key of the Parquet object
    data: bytes | None  # None when the object is missing
    manifest: BundleManifest | None  # None when missing or malformed
    error: str = ""  # why data or manifest could not be read
    too_large: bool = False  # a piece was over its limit (not downloaded)

    @property
    def nbytes(self) -> int:
        return len(self.data or b"")


def fetch(store: ObjectStore, key: str, *, s3: S3Client | None = None) -> LandedBundle:
    """Download a landed bundle and parse its manifest. Missing, malformed or oversized pieces (limits
    from the contract, see `read_limited`) are reported in `error`, not raised; transport errors
    (connection, 5xx) do raise, so the caller may retry."""
    s3 = s3 or store.client()
    bucket = store.bucket("landing")
    manifest_key = key.removesuffix(".parquet") + MANIFEST_SUFFIX
    errors = []
    too_large = False
    manifest = None
    try:
        manifest = BundleManifest.from_json(read_limited(s3, bucket, manifest_key, max_manifest_bytes()))
    except s3.exceptions.NoSuchKey:
        errors.append(f"manifest {manifest_key} missing")
    except (BundleError, TooLarge) as e:
        too_large = isinstance(e, TooLarge)
        errors.append(f"{manifest_key}: {e}")
    data = None
    try:
        data = read_limited(s3, bucket, key, bundle_limit(manifest))
    except s3.exceptions.NoSuchKey:
        errors.append(f"object {key} missing")
    except TooLarge as e:
        too_large = True
        errors.append(str(e))
    return LandedBundle(key=key, data=data, manifest=manifest, error="; ".join(errors), too_large=too_large)
