"""Object store block: endpoint, credentials and the bucket of each zone."""

from __future__ import annotations

import configparser
import io
import json
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from prefect.blocks.core import Block
from pydantic import Field, SecretStr, field_validator, model_validator

from edgehaul.platform.private_files import write_private
from edgehaul.platform.s3_errors import CLIENT_MAX_ATTEMPTS
from edgehaul.platform.settings import get_settings

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client


class CredentialsFileError(ValueError):
    """The credentials file an ObjectStore names is missing, readable by others, or lacks the profile."""


def read_credentials_file(path: Path, profile: str) -> dict[str, str]:
    """boto3 keyword arguments (`aws_access_key_id`, `aws_secret_access_key`, maybe `aws_session_token`)
    from an AWS shared-credentials (INI) file's `profile`, or from a JSON file: the `Credentials` of an STS
    answer (`AccessKeyId`, `SecretAccessKey`, `SessionToken`) or the same snake-case names as the INI.

    A file that group or other may read or write is refused: a key others can read is not the node's own."""
    try:
        st = path.stat()
    except OSError as e:
        raise CredentialsFileError(f"credentials file {path}: cannot read ({e.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise CredentialsFileError(f"credentials file {path}: not a regular file")
    if st.st_mode & 0o077:
        raise CredentialsFileError(
            f"credentials file {path}: mode {stat.S_IMODE(st.st_mode):04o} lets group/other read or write it; "
            f"make it 0600 (chmod 600 {path})"
        )
    text = path.read_text()
    if text.lstrip().startswith("{"):
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise CredentialsFileError(f"credentials file {path}: invalid JSON ({e.msg}, line {e.lineno})") from None
        doc = doc.get("Credentials", doc) if isinstance(doc, dict) else {}
        section = {
            "aws_access_key_id": doc.get("AccessKeyId") or doc.get("aws_access_key_id"),
            "aws_secret_access_key": doc.get("SecretAccessKey") or doc.get("aws_secret_access_key"),
            "aws_session_token": doc.get("SessionToken") or doc.get("aws_session_token"),
        }
    else:
        ini = configparser.ConfigParser(interpolation=None)
        try:
            ini.read_string(text, source=str(path))
        except configparser.Error as e:
            raise CredentialsFileError(f"credentials file {path}: invalid INI ({e})") from None
        if not ini.has_section(profile):
            raise CredentialsFileError(f"credentials file {path}: no profile [{profile}] (has {ini.sections()})")
        section = {k: ini.get(profile, k, fallback=None)
                   for k in ("aws_access_key_id", "aws_secret_access_key", "aws_session_token")}
    creds = {k: v.strip() for k, v in section.items() if isinstance(v, str) and v.strip()}
    missing = [k for k in ("aws_access_key_id", "aws_secret_access_key") if k not in creds]
    if missing:
        raise CredentialsFileError(f"credentials file {path} (profile {profile}): missing {', '.join(missing)}")
    return creds


def write_credentials_file(path: Path, profile: str, access_key_id: str, secret_access_key: str) -> Path:
    """Set `profile` in an AWS shared-credentials file (other profiles kept: nodes may share a file), 0600
    from its first byte and swapped in atomically (a reader never sees half a key); its folder is created
    0700."""
    ini = configparser.ConfigParser(interpolation=None)
    if path.exists():
        ini.read_string(path.read_text(), source=str(path))
    ini[profile] = {"aws_access_key_id": access_key_id, "aws_secret_access_key": secret_access_key}
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    text = io.StringIO()
    ini.write(text)
    write_private(path, text.getvalue())
    return path


Zone = Literal["landing", "curated", "quarantine", "cold", "checkpoints", "models", "ops"]


class ObjectStore(Block):
    """An S3-compatible object store (AWS S3, MinIO, Ceph RGW, SeaweedFS) and where each zone lives.

    Where the keys come from, most private first:
    - `credentials_file` (+ `profile`): a 0600 file on the host that runs the flow, read at each client
      creation (so a rotated key is picked up); the block holds only its path. Edge nodes use this: a
      block is readable by every client of the Prefect API, a file on the node is not.
    - nothing: boto3's default chain (environment, web identity / instance role), for workload identity.
    - `access_key_id` / `secret_access_key` in the block: stored encrypted by Prefect, but any API client
      can read them back (`include_secrets`): unsaved, one-off stores only; `edgehaul blocks apply` saves
      none (docs/SECURITY.md).

    Example:
        ```python
        from edgehaul.blocks import ObjectStore
        store = ObjectStore(endpoint_url="http://127.0.0.1:8333", access_key_id="...",
                            secret_access_key="...")
        store.save("central", overwrite=True)
        s3 = load_block(ObjectStore, "central").client()   # edgehaul.platform.block_loading
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
    credentials_file: str | None = Field(
        default=None,
        description="Path, on the host running the flow, of a 0600 AWS shared-credentials (INI) or JSON "
        "(STS `Credentials`) file; the block then holds no key.",
        examples=["/var/lib/edgehaul/s3-credentials"],
    )
    profile: str = Field(default="default", description="Profile (INI section) of `credentials_file`.")
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

    @model_validator(mode="after")
    def _one_credential_source(self) -> ObjectStore:
        if self.credentials_file and (self.access_key_id or self.secret_access_key):
            raise ValueError("give either credentials_file or access_key_id/secret_access_key, not both")
        return self

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
        """boto3 credential arguments; empty: boto3's default chain. Raises CredentialsFileError."""
        if self.credentials_file:
            return read_credentials_file(Path(self.credentials_file).expanduser(), self.profile)
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
            aws_session_token=creds.get("aws_session_token"),
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
            if "aws_session_token" in creds:
                opts["AWS_SESSION_TOKEN"] = creds["aws_session_token"]
        return opts

    @classmethod
    def from_env(cls, **overrides: Any) -> ObjectStore:
        """Build from the settings EDGEHAUL_S3_ENDPOINT, AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (local
        stack, CI); keys left unset fall back to boto3's default chain."""
        settings = get_settings()
        fields: dict[str, Any] = {"endpoint_url": settings.s3_endpoint}
        if creds := settings.aws_credentials():
            fields["access_key_id"], fields["secret_access_key"] = creds
        fields.update(overrides)
        return cls(**fields)
