"""Reading the landing zone from the core side: which bundles are complete, and their bytes + manifest."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from edgehaul.bundles import BundleError, BundleManifest

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

    from edgehaul.blocks import ObjectStore

MANIFEST_SUFFIX = ".manifest.json"


def complete_bundles(store: ObjectStore, prefix: str = "", *, s3: S3Client | None = None) -> list[str]:
    """Landing keys (Parquet objects) of every bundle under `prefix` whose manifest is present.

    The manifest is written after the data, so a bundle without one is still uploading: skipped.
    """
    s3 = s3 or store.client()
    keys: set[str] = set()
    paginator = s3.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=store.bucket("landing"), Prefix=store.key("landing", prefix)):
        keys.update(o["Key"] for o in page.get("Contents", []))
    return sorted(
        k.removesuffix(MANIFEST_SUFFIX) + ".parquet"
        for k in keys
        if k.endswith(MANIFEST_SUFFIX) and k.removesuffix(MANIFEST_SUFFIX) + ".parquet" in keys
    )


@dataclass
class LandedBundle:
    key: str  # landing key of the Parquet object
    data: bytes | None  # None when the object is missing
    manifest: BundleManifest | None  # None when missing or malformed
    error: str = ""  # why data or manifest could not be read

    @property
    def nbytes(self) -> int:
        return len(self.data or b"")


def fetch(store: ObjectStore, key: str, *, s3: S3Client | None = None) -> LandedBundle:
    """Download a landed bundle and parse its manifest. Missing or malformed pieces are reported in
    `error`, not raised; transport errors (connection, 5xx) do raise, so the caller may retry."""
    s3 = s3 or store.client()
    bucket = store.bucket("landing")
    manifest_key = key.removesuffix(".parquet") + MANIFEST_SUFFIX
    errors = []
    manifest = None
    try:
        raw = s3.get_object(Bucket=bucket, Key=manifest_key)["Body"].read()
        manifest = BundleManifest.from_json(raw)
    except s3.exceptions.NoSuchKey:
        errors.append(f"manifest {manifest_key} missing")
    except BundleError as e:
        errors.append(f"{manifest_key}: {e}")
    data = None
    try:
        data = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    except s3.exceptions.NoSuchKey:
        errors.append(f"object {key} missing")
    return LandedBundle(key=key, data=data, manifest=manifest, error="; ".join(errors))
