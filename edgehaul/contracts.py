"""Data contracts: one YAML file per observation kind and version in `data_contracts/`.

A contract gives the raw Arrow schema, the tensor layout (shape, dtype, channels, normalisation),
the label domain and the Great Expectations suite. Everything kind-specific downstream (the
bundle schema, feature columns, validation) is derived from it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import yaml

from edgehaul.platform.settings import get_settings

_ARROW_TYPES: dict[str, pa.DataType] = {
    "string": pa.string(),
    "int16": pa.int16(),
    "int32": pa.int32(),
    "int64": pa.int64(),
    "float32": pa.float32(),
    "float64": pa.float64(),
    "binary": pa.binary(),
    "bool": pa.bool_(),
    "timestamp[ms, tz=UTC]": pa.timestamp("ms", tz="UTC"),
}

TIERS = ("high", "normal", "low")  # the one tier order: most urgent first
TIER_RANK = {tier: rank for rank, tier in enumerate(TIERS)}


def tier_rank(tier: str) -> int:
    """0 for the most urgent tier; an unknown tier ranks after every known one."""
    return TIER_RANK.get(tier, len(TIERS))


class ContractError(ValueError):
    """A contract file is missing or malformed, or data refers to an unknown contract."""


class ContractInvalid(ContractError):
    """A contract file exists but is broken (YAML, a field, an expectation): the operator's error, so a run
    that needs it fails loudly and moves nothing (never a reason to quarantine the data)."""


# Limits on what an edge node may send (`limits:` in a contract); checked before anything is downloaded.
DEFAULT_LIMITS: dict[str, int] = {
    "max_manifest_bytes": 16 * 2**20,  # ~400k sample ids
    "max_bundle_bytes": 512 * 2**20,
    "max_rows": 250_000,
}


@dataclass(frozen=True)
class Contract:
    kind: str
    version: int
    shape: tuple[int, ...]
    dtype: str
    channels: tuple[str, ...]
    scale: float
    offset: float
    max_nan_fraction: float
    label_column: str
    label_values: tuple[int, ...]
    raw_columns: dict[str, str]
    expectations: tuple[dict[str, Any], ...]
    sha256: str = field(repr=False)
    source: str = ""  # the contract file, for errors
    max_manifest_bytes: int = DEFAULT_LIMITS["max_manifest_bytes"]
    max_bundle_bytes: int = DEFAULT_LIMITS["max_bundle_bytes"]
    max_rows: int = DEFAULT_LIMITS["max_rows"]
    allow_nonfinite: tuple[str, ...] = ()  # float columns where NaN/inf are data, not an error

    @property
    def id(self) -> str:
        return f"{self.kind}.v{self.version}"

    @property
    def np_dtype(self) -> np.dtype[Any]:
        return np.dtype(self.dtype)

    @property
    def sample_nbytes(self) -> int:
        return int(np.prod(self.shape)) * self.np_dtype.itemsize

    @property
    def raw_schema(self) -> pa.Schema:
        return pa.schema([pa.field(n, _ARROW_TYPES[t]) for n, t in self.raw_columns.items()])

    @property
    def feature_columns(self) -> list[str]:
        return [f"{stat}_{ch}" for stat in ("mean", "std") for ch in self.channels]

    @property
    def bundle_schema(self) -> pa.Schema:
        """Schema of preprocessed, scored rows as they travel in bundles and land in datasets."""
        fields = [
            pa.field("sample_id", pa.string(), nullable=False),
            pa.field("node_id", pa.string(), nullable=False),
            pa.field("capture_time", pa.timestamp("ms", tz="UTC"), nullable=False),
            pa.field("seq", pa.int64(), nullable=False),
            pa.field(self.label_column, pa.int16()),
            pa.field("content_sha256", pa.string(), nullable=False),
            # Raw tensor bytes (dtype/shape from the contract); null for low-tier summary rows.
            pa.field("pixels", pa.binary()),
            *[pa.field(c, pa.float32(), nullable=False) for c in self.feature_columns],
            pa.field("value", pa.float32(), nullable=False),
            pa.field("tier", pa.string(), nullable=False),
            pa.field("is_summary", pa.bool_(), nullable=False),
        ]
        return pa.schema(fields, metadata={b"edgehaul.contract": self.id.encode()})


def _limits(path: Path, doc: dict[str, Any]) -> dict[str, Any]:
    raw = doc.get("limits") or {}
    if not isinstance(raw, dict):
        raise ContractInvalid(f"{path}: field limits must be a mapping, got {type(raw).__name__}")
    unknown = sorted(set(raw) - {*DEFAULT_LIMITS, "allow_nonfinite"})
    if unknown:
        raise ContractInvalid(f"{path}: field limits has unknown keys {unknown}")
    out: dict[str, Any] = {}
    for name, default in DEFAULT_LIMITS.items():
        v = raw.get(name, default)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ContractInvalid(f"{path}: field limits.{name} must be a positive integer, got {v!r}")
        out[name] = v
    allow = raw.get("allow_nonfinite", [])
    if not isinstance(allow, list) or not all(isinstance(c, str) for c in allow):
        raise ContractInvalid(f"{path}: field limits.allow_nonfinite must be a list of column names")
    out["allow_nonfinite"] = tuple(allow)
    return out


def _parse(path: Path) -> Contract:
    raw = path.read_bytes()
    try:
        doc = yaml.safe_load(raw)
        if not isinstance(doc, dict):
            raise ContractInvalid(f"{path}: not a YAML mapping")
        t = doc["tensor"]
        for name, typ in doc["raw_columns"].items():
            if typ not in _ARROW_TYPES:
                raise ContractInvalid(f"{path}: field raw_columns.{name} has unknown type {typ!r}")
        expectations = doc.get("expectations", [])
        for i, e in enumerate(expectations):
            if not isinstance(e, dict) or not isinstance(e.get("type"), str) or not isinstance(e.get("kwargs"), dict):
                raise ContractInvalid(f"{path}: field expectations[{i}] needs a string `type` and a `kwargs` mapping")
        return Contract(
            kind=str(doc["kind"]),
            version=int(doc["version"]),
            shape=tuple(int(x) for x in t["shape"]),
            dtype=str(np.dtype(t["dtype"])),
            channels=tuple(str(c) for c in t["channels"]),
            scale=float(t.get("scale", 1.0)),
            offset=float(t.get("offset", 0.0)),
            max_nan_fraction=float(t.get("max_nan_fraction", 0.0)),
            label_column=str(doc["label"]["column"]),
            label_values=tuple(int(v) for v in doc["label"]["values"]),
            raw_columns=dict(doc["raw_columns"]),
            expectations=tuple(expectations),
            sha256=hashlib.sha256(raw).hexdigest(),
            source=str(path),
            **_limits(path, doc),
        )
    except KeyError as e:
        raise ContractInvalid(f"{path}: malformed contract (missing field {e})") from e
    except (TypeError, ValueError, AttributeError, yaml.YAMLError) as e:
        if isinstance(e, ContractInvalid):
            raise
        raise ContractInvalid(f"{path}: malformed contract ({type(e).__name__}: {e})") from e


def load_contract(kind: str, version: int | None = None, directory: Path | None = None) -> Contract:
    """Load `<kind>.v<version>.yaml` from `directory` (default: EDGEHAUL_CONTRACTS_DIR, else the package's
    contracts); without a version, the highest one present."""
    return _load_contract(kind, version, directory or get_settings().contracts_dir)


@cache
def _load_contract(kind: str, version: int | None, directory: Path) -> Contract:
    if version is None:
        versions = sorted(
            int(p.stem.rsplit(".v", 1)[1]) for p in directory.glob(f"{kind}.v*.yaml")
        )
        if not versions:
            raise ContractError(f"no data contract for kind {kind!r} in {directory}")
        version = versions[-1]
    path = directory / f"{kind}.v{version}.yaml"
    if not path.exists():
        known = sorted(p.stem for p in directory.glob("*.yaml"))
        raise ContractError(f"unknown contract {kind}.v{version}; known: {', '.join(known) or 'none'}")
    c = _parse(path)
    if c.kind != kind or c.version != version:
        raise ContractInvalid(f"{path}: declares {c.id}, file name says {kind}.v{version}")
    return c


def max_manifest_bytes(directory: Path | None = None) -> int:
    """The largest manifest any readable contract accepts: the limit before a manifest (and so its
    contract) is known; each manifest is then held to its own contract's limit."""
    directory = directory or get_settings().contracts_dir
    limits = []
    for p in sorted(directory.glob("*.v*.yaml")):
        kind, _, ver = p.stem.rpartition(".v")
        try:
            limits.append(load_contract(kind, int(ver), directory).max_manifest_bytes)
        except (ContractError, ValueError):
            continue  # a broken contract fails the runs whose bundles name it, not this bound
    return max(limits, default=DEFAULT_LIMITS["max_manifest_bytes"])


def contract_by_id(contract_id: str, directory: Path | None = None) -> Contract:
    """`landsat_patch.v1` -> Contract, with a clear error for anything else."""
    kind, sep, ver = contract_id.rpartition(".v")
    if not sep or not ver.isdigit():
        raise ContractError(f"malformed contract id {contract_id!r} (expected '<kind>.v<N>')")
    return load_contract(kind, int(ver), directory)
