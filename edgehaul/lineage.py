"""A registered model's lineage record, `models/<name>/<model_id>/lineage.json`, listed one way.

The trainer's registry writes it; quota checks, catch-up, the lifecycle and the cost report read it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import datetime
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

    from edgehaul.blocks import ObjectStore


class LineageError(RuntimeError):
    """A lineage record is not JSON; the message names the object."""


class Lineage(NamedTuple):
    key: str
    last_modified: datetime
    doc: dict[str, Any]


def list_lineages(store: ObjectStore, name: str = "", s3: S3Client | None = None) -> Iterator[Lineage]:
    """Every registered model's lineage record, or only model `name`'s."""
    s3 = s3 or store.client()
    bucket = store.bucket("models")
    prefix = store.key("models", f"{name}/" if name else "")
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for o in page.get("Contents", []):
            if not o["Key"].endswith("/lineage.json"):
                continue
            body = s3.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()
            try:
                doc = json.loads(body)
            except json.JSONDecodeError as e:
                raise LineageError(f"lineage record s3://{bucket}/{o['Key']} is not JSON: {e}") from e
            yield Lineage(o["Key"], o["LastModified"], doc)
