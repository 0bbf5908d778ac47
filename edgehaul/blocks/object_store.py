"""Object store block: endpoint, credentials and the bucket of each zone."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from prefect.blocks.core import Block
from pydantic import Field, SecretStr, field_validator

from edgehaul.platform.s3_errors import CLIENT_MAX_ATTEMPTS

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

Zone = Literal["landing", "curated", "quarantine", "cold", "checkpoints", "models", "ops"]


class ObjectStore(Block):
    """An S3-compatible object store (AWS S3, MinIO, Ceph RGW, SeaweedFS) and where each zone lives.

    Credentials left empty come from the environment or the instance role (boto3's default chain),
    which is what production should use; keys in the block are stored encrypted by Prefect.

    Example:
        ```python
        from edgehaul.blocks import ObjectStore
        store = ObjectStore(endpoint_url="http://127.0.0.1:8333", access_key_id="...",
                            secret_access_key="...")
        store.save("central", overwrite=True)
        s3 = ObjectStore.load("central").client()
        s3.list_objects_v2(Bucket=store.bucket("landing"), Prefix=store.key("landing", "node-a/"))
        ```
    """

    _block_type_name = "edgehaul Object Store"
    _block_type_slug = "edgehaul-object-store"
    _description = "S3-compatible object store and the bucket/prefix of each data zone."

    endpoint_url: str | None = Field(
        default=None, description="S3 endpoint URL; empty for AWS S3 itself.", examples=["http://127.0.0.1:8333"]
    )
    region: str = Field(default="us-east-1", description="Signing region.")
    access_key_id: SecretStr | None = Field(
        default=None, description="Access key id; empty to use the environment or instance role."
    )
    secret_access_key: SecretStr | None = Field(
        default=None, description="Secret access key; empty to use the environment or instance role."
    )
    path_style: bool = Field(default=True, description="Path-style addressing (MinIO, SeaweedFS, Ceph).")
    landing_bucket: str = Field(default="edgehaul-landing", description="Where edge nodes upload bundles.")
    curated_bucket: str = Field(default="edgehaul-curated", description="Versioned datasets and quarantine.")
    cold_bucket: str = Field(default="edgehaul-cold", description="Cold tier for data no longer hot.")
    checkpoints_bucket: str = Field(default="edgehaul-checkpoints", description="Checkpoints and models.")
    ops_bucket: str = Field(default="edgehaul-ops", description="Cache results, reports, ledgers.")
    prefix: str = Field(default="", description="Prefix under every bucket, e.g. a tenant or environment.")

    @field_validator("endpoint_url")
    @classmethod
    def _check_endpoint(cls, v: str | None) -> str | None:
        if v and not v.startswith(("http://", "https://")):
            raise ValueError(f"endpoint_url must start with http:// or https://, got {v!r}")
        return v.rstrip("/") if v else v

    @field_validator("landing_bucket", "curated_bucket", "cold_bucket", "checkpoints_bucket", "ops_bucket")
    @classmethod
    def _check_bucket(cls, v: str) -> str:
        import re

        if not re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", v):
            raise ValueError(f"{v!r} is not a valid S3 bucket name (3-63 chars, a-z 0-9 . -)")
        return v

    def bucket(self, zone: Zone) -> str:
        return {
            "landing": self.landing_bucket,
            "curated": self.curated_bucket,
            "quarantine": self.curated_bucket,
            "cold": self.cold_bucket,
            "checkpoints": self.checkpoints_bucket,
            "models": self.checkpoints_bucket,
            "ops": self.ops_bucket,
        }[zone]

    def key(self, zone: Zone, path: str = "") -> str:
        """Object key of `path` inside a zone (quarantine and models are prefixes of a shared bucket)."""
        sub = {"quarantine": "quarantine/", "models": "models/", "curated": "datasets/"}.get(zone, "")
        base = f"{self.prefix.strip('/')}/" if self.prefix.strip("/") else ""
        return f"{base}{sub}{path.lstrip('/')}"

    def uri(self, zone: Zone, path: str = "") -> str:
        return f"s3://{self.bucket(zone)}/{self.key(zone, path)}"

    def _credentials(self) -> dict[str, str]:
        if self.access_key_id and self.secret_access_key:
            return {
                "aws_access_key_id": self.access_key_id.get_secret_value(),
                "aws_secret_access_key": self.secret_access_key.get_secret_value(),
            }
        return {}

    def client(self, **config: Any) -> S3Client:
        """A boto3 S3 client. `config` overrides botocore Config fields (timeouts, retries)."""
        import boto3
        from botocore.config import Config

        cfg = Config(
            s3={"addressing_style": "path" if self.path_style else "auto"},
            retries={"total_max_attempts": CLIENT_MAX_ATTEMPTS, "mode": "standard"},  # the one S3 retry budget
            connect_timeout=5,
            read_timeout=60,
            # Checksums only when an operation asks for one: some S3-compatible servers reject
            # the newer default trailing checksums.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        ).merge(Config(**config))
        creds = self._credentials()
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=self.region,
            config=cfg,
            aws_access_key_id=creds.get("aws_access_key_id"),
            aws_secret_access_key=creds.get("aws_secret_access_key"),
        )

    def storage_options(self) -> dict[str, str]:
        """Options for deltalake / polars / pyarrow readers of s3:// URIs (object_store crate names)."""
        opts = {"AWS_REGION": self.region}
        if self.endpoint_url:
            opts["AWS_ENDPOINT_URL"] = self.endpoint_url
            if self.endpoint_url.startswith("http://"):
                opts["AWS_ALLOW_HTTP"] = "true"
        if self.path_style:
            opts["AWS_VIRTUAL_HOSTED_STYLE_REQUEST"] = "false"
        creds = self._credentials()
        if creds:
            opts["AWS_ACCESS_KEY_ID"] = creds["aws_access_key_id"]
            opts["AWS_SECRET_ACCESS_KEY"] = creds["aws_secret_access_key"]
        return opts

    @classmethod
    def from_env(cls, **overrides: Any) -> ObjectStore:
        """Build from EDGEHAUL_S3_ENDPOINT and the AWS_* variables (local stack, CI)."""
        import os

        fields: dict[str, Any] = {"endpoint_url": os.environ.get("EDGEHAUL_S3_ENDPOINT")}
        if os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY"):
            fields["access_key_id"] = SecretStr(os.environ["AWS_ACCESS_KEY_ID"])
            fields["secret_access_key"] = SecretStr(os.environ["AWS_SECRET_ACCESS_KEY"])
        fields.update(overrides)
        return cls(**fields)
