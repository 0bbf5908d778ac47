"""Data contracts: one YAML file per observation kind and version in `data_contracts/`.

A contract gives the raw Arrow schema, the tensor layout (shape, dtype, channels, normalisation),
the label domain and the Great Expectations suite. Everything kind-specific downstream (the
bundle schema, feature columns, validation) is derived from it.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import yaml

CONTRACTS_DIR = Path(os.environ.get("EDGEHAUL_CONTRACTS_DIR", Path(__file__).resolve().parent / "data_contracts"))

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


def _parse(path: Path) -> Contract:
    raw = path.read_bytes()
    try:
        doc = yaml.safe_load(raw)
        t = doc["tensor"]
        for name, typ in doc["raw_columns"].items():
            if typ not in _ARROW_TYPES:
                raise ContractError(f"{path}: column {name!r} has unknown type {typ!r}")
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
            expectations=tuple(doc.get("expectations", [])),
            sha256=hashlib.sha256(raw).hexdigest(),
        )
    except (KeyError, TypeError, yaml.YAMLError) as e:
        raise ContractError(f"{path}: malformed contract ({type(e).__name__}: {e})") from e


@cache
def load_contract(kind: str, version: int | None = None, directory: Path = CONTRACTS_DIR) -> Contract:
    """Load `<kind>.v<version>.yaml`; without a version, the highest one present."""
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
        raise ContractError(f"{path}: declares {c.id}, file name says {kind}.v{version}")
    return c


def contract_by_id(contract_id: str, directory: Path = CONTRACTS_DIR) -> Contract:
    """`landsat_patch.v1` -> Contract, with a clear error for anything else."""
    kind, sep, ver = contract_id.rpartition(".v")
    if not sep or not ver.isdigit():
        raise ContractError(f"malformed contract id {contract_id!r} (expected '<kind>.v<N>')")
    return load_contract(kind, int(ver), directory)
