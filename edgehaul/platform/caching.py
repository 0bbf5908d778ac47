"""Where cached task results live, in which format, and cache keys from content.

A cached result is deserialised by whoever reads it, and Prefect decodes a record with the
serializer the record itself names (pickle included). So the trust rule is about storage: nothing a
central worker reads as a cached result may be writable by an edge identity.

- Central results (core_ingest, compact_dataset): the S3Bucket block `CORE_RESULTS_BLOCK`, folder
  `prefect-results/core/` of the ops bucket, written by the ingest identity (the block names its profile,
  never a key: the central workers' AWS_SHARED_CREDENTIALS_FILE or environment holds it). Nodes have no
  grant on the ops bucket. The block is saved once, at deploy time (`edgehaul blocks apply`,
  `core_result_storage_block`), and named by the deployments; flows never save blocks.
- Edge results (edge_ingest): on the node's own disk (`edge_result_storage`: a folder under the
  spool folder), never shared with another node or the core.
- Every cached task writes JSON (`RESULT_SERIALIZER`): values are small references (ids, keys,
  checksums, counts) that round-trip as data, never pickle.

    CoreIngestParams(result_storage=f"s3-bucket/{CORE_RESULTS_BLOCK}")  # the validation cache (core_ingest)
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prefect_aws import S3Bucket

    from edgehaul.blocks.object_store import ObjectStore

__all__ = ["CORE_RESULTS_BLOCK", "CORE_RESULTS_FOLDER", "EDGE_RESULTS_DIR", "RESULT_SERIALIZER", "cache_key",
           "core_result_storage_block", "edge_result_storage"]

RESULT_SERIALIZER = "json"  # Prefect's JSONSerializer; a record is data a reader can inspect, never code
CORE_RESULTS_BLOCK = "edgehaul-core-results"  # S3Bucket block (ingest profile, no key), saved by `edgehaul blocks apply`
CORE_RESULTS_FOLDER = "prefect-results/core"  # in the ops bucket; only central identities may write it
EDGE_RESULTS_DIR = "prefect-results"  # under the node's spool folder


def cache_key(stage: str, *parts: str) -> str:
    """A flat, filename-safe cache key: the stage name + SHA-256 of every part that determines the result."""
    h = hashlib.sha256("\x1f".join(parts).encode())
    return f"{stage}-{h.hexdigest()[:40]}"


def core_result_storage_block(store: ObjectStore, folder: str = CORE_RESULTS_FOLDER) -> S3Bucket:
    """The central result storage as an (unsaved) S3Bucket block on `store`'s ops bucket, holding no key.

    `store` must be a central identity (ingest): the folder must not be writable by any node. Its
    AwsCredentials name `store.profile` (boto3 reads it from AWS_SHARED_CREDENTIALS_FILE, the central
    credentials file, in the workers' environment) or nothing (the default chain: env keys, workload
    identity). A store with keys in its block is refused: they would be copied into this block."""
    from prefect_aws import AwsCredentials, S3Bucket
    from prefect_aws.client_parameters import AwsClientParameters

    if store.access_key_id is not None or store.secret_access_key is not None:
        raise ValueError("core results block: the store holds keys; give it a credentials_file (or none: the "
                         "environment's) so no key is copied into a block (docs/SECURITY.md)")
    params = AwsClientParameters(
        endpoint_url=store.endpoint_url,
        config={"s3": {"addressing_style": "path" if store.path_style else "auto"}},
    )
    credentials = AwsCredentials(
        profile_name=store.profile if store.credentials_file else None,
        region_name=store.region,
        aws_client_parameters=params,
    )
    return S3Bucket(bucket_name=store.bucket("ops"), credentials=credentials, bucket_folder=store.key("ops", folder))


def edge_result_storage(spool_dir: str | Path) -> Path:
    """The node's own result storage, `<spool_dir>/prefect-results/` on its disk: a `result_storage` path
    (Prefect reads it as a LocalFileSystem; an unsaved block would be refused, and flows save none)."""
    path = Path(spool_dir) / EDGE_RESULTS_DIR
    path.mkdir(parents=True, exist_ok=True)
    return path
