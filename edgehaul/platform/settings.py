"""The product's settings: every environment variable edgehaul reads, typed, described and validated.

    from edgehaul.platform.settings import get_settings
    get_settings().task_runner          # EDGEHAUL_TASK_RUNNER, else the default

`Settings` reads `EDGEHAUL_*` from the environment, then from a `.env` file in the working directory;
`get_settings()` hands out one validated object and builds a new one only when one of those variables
changes in `os.environ`, so a flow run's worker environment and a test's `monkeypatch.setenv` both take
effect without anyone clearing a cache (a changed `.env` file is read by the next process). A bad value
raises `SettingsError` naming the variable. `edgehaul settings` prints the effective values, secrets
masked, and where each came from.

Standard variables of other tools are not renamed: `Settings` also reads `AWS_ACCESS_KEY_ID` /
`AWS_SECRET_ACCESS_KEY` (the product builds an `ObjectStore` from them; boto3 reads them too), and
`TorchrunEnv` is the typed view of what torchrun sets in each training process (`RANK`, ...). Prefect's
own variables (`PREFECT_API_URL`, ...) belong to Prefect's settings. The development harness has its
own `edgehaul_dev.settings`. The settings table of docs/OPERATIONS.md lists all of them;
tests/platform/test_settings.py keeps code, these classes and that table in step.

Imports nothing of edgehaul: any module may use it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import Field, PositiveInt, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

PACKAGE_DIR = Path(__file__).resolve().parents[1]
ENV_FILE = ".env"

S = TypeVar("S", bound="EnvSettings")
_MAPPING_ONLY: ContextVar[bool] = ContextVar("edgehaul_settings_mapping_only", default=False)


class SettingsError(ValueError):
    """An environment variable holds a value the product cannot use; the message names it."""


def _blank_to_none(v: Any) -> Any:
    if isinstance(v, str):
        v = v.strip()
        return v or None
    return v


def _http_url(v: str | None) -> str | None:
    if v is not None and not v.startswith(("http://", "https://")):
        raise ValueError("must be an http(s) URL")
    return v


class EnvSettings(BaseSettings):
    """Base of edgehaul's settings classes: `load(cls, mapping)` validates a mapping alone, no environment."""

    @classmethod
    def settings_customise_sources(
        cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource, dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        if _MAPPING_ONLY.get():
            return (init_settings,)
        return init_settings, env_settings, dotenv_settings, file_secret_settings

    @field_validator("*", mode="before")
    @classmethod
    def _strip(cls, v: Any) -> Any:
        return _blank_to_none(v)


class Settings(EnvSettings):
    """edgehaul's own settings (`EDGEHAUL_*`) plus the AWS credentials it reads itself."""

    model_config = SettingsConfigDict(
        env_prefix="EDGEHAUL_", env_file=ENV_FILE, env_ignore_empty=True, extra="ignore", frozen=True,
        validate_by_name=True,
    )

    # data contracts and lineage
    contracts_dir: Path = Field(
        default=PACKAGE_DIR / "data_contracts",
        description="Folder of the data contract YAML files (default: the contracts shipped in the package).",
    )
    code_version: str | None = Field(
        default=None,
        description="Code version recorded in model lineage (e.g. the image's git sha); unset: `git rev-parse HEAD` "
                    "of the checkout, else 'unknown'.",
    )
    # task runner of the data-parallel flows (read when each flow run starts: edgehaul.platform.runners)
    task_runner: Literal["thread", "dask"] = Field(
        default="thread", description="Task runner of edge_ingest, core_ingest and compact_dataset: thread or dask.")
    threads: PositiveInt | None = Field(
        default=None, description="Threads of the thread runner (unset: Prefect's default).")
    dask_address: str | None = Field(
        default=None, description="Scheduler of an existing Dask cluster, e.g. tcp://dask-scheduler:8786 "
                                  "(unset with task_runner=dask: a local cluster per flow run).")
    dask_workers: PositiveInt | None = Field(
        default=None, description="Worker processes of that local Dask cluster, one thread each (unset: CPU count).")
    # alerts and the webhook gateway
    alert_webhook_url: str | None = Field(
        default=None, description="Where the alert automations send notifications (`edgehaul automations`).")
    alert_webhook_token: SecretStr | None = Field(
        default=None, description="Bearer token sent with those notifications.")
    alert_log: Path = Field(
        default=Path("alerts.jsonl"), description="File the gateway's POST /alerts appends to (JSON lines).")
    gateway_port: int = Field(default=8787, ge=1, le=65535, description="Port of the webhook gateway (`edgehaul gateway`).")
    gateway_secret: SecretStr | None = Field(
        default=None, description="The gateway's own secret (its /alerts token derives from it); unset: the 0600 "
                                  "file `gateway-secret` in its state dir. Senders sign with their own keys.")
    gateway_senders: Path | None = Field(
        default=None, description="Senders registry of the webhook gateway: JSON file (mode 0600) of each sender's "
                                  "keys, nodes and hook kinds (format: edgehaul.services.gateway); unset: every hook "
                                  "is refused.")
    gateway_state_dir: Path = Field(
        default=Path("gateway-state"), description="Folder of the gateway's SQLite file (replay store and queue "
                                                   "of landed bundles); must survive restarts.")
    gateway_batch_window_s: float = Field(
        default=5.0, gt=0, le=3600, description="The gateway sends queued landed bundles as one batch event "
                                                "(one core_ingest run) at most this long after the first.")
    gateway_batch_max: int = Field(
        default=200, ge=1, le=500, description="...or as soon as this many bundles wait (core_ingest takes at "
                                               "most 500 per run).")
    core_results_uri: str | None = Field(
        default=None, pattern=r"^s3://[a-z0-9][a-z0-9.-]{1,62}/[^\s]*$",
        description="The one result storage core_ingest's validation cache may use, `s3://<bucket>/<folder>` "
                    "(central hosts' environment, not a block: API clients can edit blocks). Unset: the core "
                    "store's ops bucket, folder `<prefix>prefect-results/core`. A result-storage block naming "
                    "another bucket, folder or endpoint is refused (no cache, every bundle validated).")
    # object store of ObjectStore.from_env (local stack, CI, training children)
    s3_endpoint: str | None = Field(
        default=None, description="S3 endpoint URL of `ObjectStore.from_env()` (unset: AWS's own endpoints).")
    aws_access_key_id: SecretStr | None = Field(
        default=None, validation_alias="AWS_ACCESS_KEY_ID",
        description="Standard AWS variable: access key of `ObjectStore.from_env()` and of torchrun's training "
                    "processes (unset: boto3's default chain, e.g. an instance role).")
    aws_secret_access_key: SecretStr | None = Field(
        default=None, validation_alias="AWS_SECRET_ACCESS_KEY",
        description="Standard AWS variable: the secret key that goes with AWS_ACCESS_KEY_ID.")

    @field_validator("task_runner", mode="before")
    @classmethod
    def _runner_kind(cls, v: Any) -> Any:
        return (v or "thread").lower() if isinstance(v, str) or v is None else v

    @field_validator("dask_address")
    @classmethod
    def _scheduler_url(cls, v: str | None) -> str | None:
        if v is not None and "://" not in v:
            raise ValueError("must be a scheduler URL like tcp://host:8786")
        return v

    @field_validator("alert_webhook_url", "s3_endpoint")
    @classmethod
    def _urls(cls, v: str | None) -> str | None:
        return _http_url(v)

    def aws_credentials(self) -> tuple[SecretStr, SecretStr] | None:
        """Both AWS keys, or None when either is missing (then boto3's default chain applies)."""
        if self.aws_access_key_id and self.aws_secret_access_key:
            return self.aws_access_key_id, self.aws_secret_access_key
        return None


class TorchrunEnv(EnvSettings):
    """What torchrun sets in each training process it starts (not configuration: read, never set by us)."""

    model_config = SettingsConfigDict(env_file=None, env_ignore_empty=True, extra="ignore", frozen=True)

    rank: int = Field(default=0, ge=0, description="torchrun: global rank of this process.")
    world_size: PositiveInt = Field(default=1, description="torchrun: number of training processes.")
    local_rank: int = Field(default=0, ge=0, description="torchrun: rank on this machine (selects the GPU).")
    pet_rdzv_endpoint: str | None = Field(
        default=None, description="torchrun (PET_* = its options): multi-node rendezvous host:port; "
                                  "unset: a single-node --standalone run.")


# --- names, loading and the cache -------------------------------------------------------------------------

def env_names(cls: type[BaseSettings]) -> dict[str, str]:
    """field name -> the environment variable it reads (upper case)."""
    prefix = str(cls.model_config.get("env_prefix") or "")
    out = {}
    for name, f in cls.model_fields.items():
        alias = f.validation_alias
        out[name] = (alias if isinstance(alias, str) else prefix + name).upper()
    return out


def _error(cls: type[BaseSettings], e: ValidationError) -> SettingsError:
    names = env_names(cls)
    by_key = {**{k.lower(): v for k, v in names.items()}, **{v.lower(): v for v in names.values()}}
    secret = {names[f] for f, info in cls.model_fields.items() if "SecretStr" in str(info.annotation)}
    lines = []
    for err in e.errors(include_url=False):
        key = str(err["loc"][0]) if err["loc"] else ""
        var = by_key.get(key.lower(), key or cls.__name__)
        shown = "***" if var in secret else repr(err.get("input"))
        msg = str(err["msg"]).removeprefix("Value error, ")
        lines.append(f"{var}: {msg} (got {shown})")
    return SettingsError(f"invalid {cls.__name__}: " + "; ".join(lines))


def load(cls: type[S], env: Mapping[str, str] | None = None) -> S:
    """Validate `cls` from the process environment (+ .env), or from `env` alone when given."""
    try:
        if env is None:
            return cls()
        names = env_names(cls)
        upper = {k.upper(): v for k, v in env.items()}
        values = {f: upper[n] for f, n in names.items() if upper.get(n, "").strip()}
        token = _MAPPING_ONLY.set(True)
        try:
            return cls(**values)
        finally:
            _MAPPING_ONLY.reset(token)
    except ValidationError as e:
        raise _error(cls, e) from None


def _env_key(names: frozenset[str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in os.environ.items() if k.upper() in names))


def cached(cls: type[S]) -> Callable[[], S]:
    """An accessor for `cls` that validates again only when one of its variables changed in os.environ."""
    names = frozenset(env_names(cls).values())
    last: list[tuple[tuple[tuple[str, str], ...], S]] = []

    def get() -> S:
        key = _env_key(names)
        if last and last[0][0] == key:
            return last[0][1]
        value = load(cls)
        last[:] = [(key, value)]
        return value

    get.__doc__ = f"The current {cls.__name__} (validated once per set of values of its variables)."
    return get


get_settings = cached(Settings)


def torchrun_env() -> TorchrunEnv:
    return load(TorchrunEnv)


# --- `edgehaul settings` ----------------------------------------------------------------------------------

def _dotenv() -> dict[str, str]:
    if not Path(ENV_FILE).is_file():
        return {}
    from dotenv import dotenv_values

    return {k.upper(): v for k, v in dotenv_values(ENV_FILE).items() if v}


def describe(settings: BaseSettings) -> list[dict[str, str]]:
    """One row per field: variable, effective value (secrets masked), source, description."""
    cls = type(settings)
    present = {k.upper() for k, v in os.environ.items() if v.strip()}
    dotenv = _dotenv() if cls.model_config.get("env_file") else {}
    rows = []
    for field, var in env_names(cls).items():
        value = getattr(settings, field)
        shown = "********" if isinstance(value, SecretStr) else "" if value is None else str(value)
        source = "environment" if var in present else f"{ENV_FILE} file" if var in dotenv else "default"
        rows.append({"variable": var, "value": shown, "source": source,
                     "description": cls.model_fields[field].description or ""})
    return rows


def print_table(rows: list[dict[str, str]], out: Any = None) -> None:
    out = out or sys.stdout
    cols = ("variable", "value", "source", "description")
    width = {c: max(len(c), *(len(r[c]) for r in rows)) for c in cols[:-1]}
    print("  ".join(c.upper().ljust(width.get(c, 0)) for c in cols).rstrip(), file=out)
    for r in rows:
        print("  ".join(r[c].ljust(width.get(c, 0)) for c in cols).rstrip(), file=out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="edgehaul settings",
                                 description="the effective settings (environment, .env, defaults), secrets masked")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = ap.parse_args(argv)
    try:
        rows = describe(load(Settings))
    except SettingsError as e:
        print(f"edgehaul settings: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print_table(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
