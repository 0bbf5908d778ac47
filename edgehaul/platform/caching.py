"""Prefect result storage in the ops bucket, and cache keys from content.

Cached task results must be visible to every worker (an edge node's rerun, a central worker on
another machine), so they live in object storage through a prefect-aws `S3Bucket` block, not on a
worker's disk. Cached values are small references (paths/keys + checksums); the data stays where
it lives.

    slug = ensure_result_storage(store)          # saves the block, returns "s3-bucket/<name>"
    my_task.with_options(result_storage=slug, persist_result=True)
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from edgehaul.blocks.object_store import ObjectStore

RESULTS_BLOCK = "edgehaul-ops-results"
RESULTS_FOLDER = "prefect-results"


def cache_key(stage: str, *parts: str) -> str:
    """A flat, filename-safe cache key: the stage name + SHA-256 of every part that determines the result."""
    h = hashlib.sha256("\x1f".join(parts).encode())
    return f"{stage}-{h.hexdigest()[:40]}"


def ensure_result_storage(store: ObjectStore, name: str = RESULTS_BLOCK, folder: str = RESULTS_FOLDER) -> str:
    """Save (or update) an S3Bucket block pointing at the ops bucket; returns its slug for `result_storage`."""
    from prefect_aws import AwsCredentials, S3Bucket
    from prefect_aws.client_parameters import AwsClientParameters
    from pydantic import SecretStr

    creds = store._credentials()
    secret = creds.get("aws_secret_access_key")
    params = AwsClientParameters(
        endpoint_url=store.endpoint_url,
        config={"s3": {"addressing_style": "path" if store.path_style else "auto"}},
    )
    credentials = AwsCredentials(
        aws_access_key_id=creds.get("aws_access_key_id"),
        aws_secret_access_key=SecretStr(secret) if secret else None,
        region_name=store.region,
        aws_client_parameters=params,
    )
    S3Bucket(bucket_name=store.bucket("ops"), credentials=credentials, bucket_folder=store.key("ops", folder)).save(
        name, overwrite=True
    )
    return f"s3-bucket/{name}"
