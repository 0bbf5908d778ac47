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
    # what a bundle may unpack to in the core (decompressed pages, and rows as built in memory): a bomb is
    # refused before it is built; the core also holds it to its rows x each column's largest value
    "max_unpacked_bytes": 2**30,
}
# The smallest inclusion probability a full row may carry: training weights a row by 1/p, so one row at 1e-40
# outweighs the dataset (a node setting its own weight). 1e-4: a row standing for 10,000 of its kind.
DEFAULT_MIN_INCLUSION_P = 1e-4


LAYOUTS = ("tensor", "file", "columns")  # what one observation is: a tensor, an opaque file, or typed columns
LABEL_KINDS = ("class", "anomaly", "none")
MODEL_FAMILIES = ("cnn2d", "cnn1d", "mlp")
FEATURE_STATS = ("mean", "std", "min", "max")
# Typed columns of a `columns` kind: Arrow type names plus `category` (a string from a fixed set).
COLUMN_TYPES = ("float32", "float64", "int16", "int32", "int64", "bool", "string", "category", "timestamp")
# Media types a file kind may declare, with the leading bytes every such file starts with (checked per row).
MEDIA_MAGIC: dict[str, tuple[bytes, ...]] = {
    "image/png": (b"\x89PNG\r\n\x1a\n",),
    "image/jpeg": (b"\xff\xd8\xff",),
    "image/tiff": (b"II*\x00", b"MM\x00*"),  # GeoTIFF too
    "application/x-parquet": (b"PAR1",),
    "application/octet-stream": (),  # anything: size limit only
}
# Columns every kind's bundle carries before its own (identity, time, order, content digest).
IDENTITY_COLUMNS = ("sample_id", "node_id", "capture_time", "seq")
# The probability that a row's sample travels in full (set by tiering; the trainer weights rows by 1/p).
INCLUSION_P = "inclusion_p"
# Columns added to every bundle schema after bundles were already written, with the value an older bundle's
# rows have by definition: before tier sampling every full row was sent with certainty (docs/MIGRATIONS.md).
ADDED_COLUMNS: dict[str, float] = {INCLUSION_P: 1.0}


@dataclass(frozen=True)
class TensorSpec:
    """A tensor per observation, carried as its raw bytes in one binary column (C-order, `dtype`)."""

    column: str
    shape: tuple[int, ...]
    dtype: str
    channel_axis: int  # index into shape (non-negative); -1 in the file means the last axis
    channels: tuple[str, ...]
    scale: float = 1.0
    offset: float = 0.0
    max_nan_fraction: float = 0.0

    @property
    def np_dtype(self) -> np.dtype[Any]:
        return np.dtype(self.dtype)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * self.np_dtype.itemsize

    def channels_last(self, x: np.ndarray) -> np.ndarray:
        """(m, *shape) -> (m, elements per channel, C), a view when the channel axis is already last."""
        x = np.moveaxis(x, 1 + self.channel_axis, -1)
        return x.reshape(x.shape[0], int(np.prod(x.shape[1:-1])), len(self.channels))  # explicit: m may be 0


@dataclass(frozen=True)
class FileSpec:
    """An opaque file per observation (a PNG frame, a GeoTIFF) in one binary column, at most `max_bytes`.
    `decode` is the tensor the file decodes to, for features and training (None: the file is never decoded)."""

    column: str
    media_type: str
    max_bytes: int
    decode: TensorSpec | None = None


@dataclass(frozen=True)
class ColumnSpec:
    """One typed data column of a `columns` kind."""

    name: str
    type: str  # one of COLUMN_TYPES
    unit: str | None = None
    min: float | None = None
    max: float | None = None
    values: tuple[str, ...] = ()  # the domain of a category column
    nullable: bool = False

    @property
    def arrow_type(self) -> pa.DataType:
        if self.type == "category":
            return pa.string()
        if self.type == "timestamp":
            return pa.timestamp("ms", tz="UTC")
        return _ARROW_TYPES[self.type]

    @property
    def numeric(self) -> bool:
        return self.type in ("float32", "float64", "int16", "int32", "int64")


@dataclass(frozen=True)
class LabelSpec:
    column: str | None  # None when kind is "none"
    kind: str  # one of LABEL_KINDS
    values: tuple[int, ...] = ()  # class ids; (0, 1) for an anomaly flag
    names: tuple[str, ...] = ()  # optional display names, one per value
    nullable: bool = True


@dataclass(frozen=True)
class FeatureSpec:
    """What the edge derives per observation: statistics per tensor channel (`mean_<channel>`...), the mean of
    each cell of a coarse spatial grid per channel (`per: grid`, `cells: [rows, cols]`: `grid_<channel>_r<i>c<j>`,
    a layout descriptor the scorers can tell shapes apart by where channel statistics cannot), each numeric
    column normalised to its declared range (`per: column`: `norm_<column>` = (x - min) / (max - min), x itself
    where no range is declared), or a named function `module:function(table, contract) -> {name: float32 array}`."""

    per: str | None  # "channel" | "grid" | "column" | None for a function
    stats: tuple[str, ...] = ("mean", "std")
    columns: tuple[str, ...] = ()  # per: column; empty = every numeric column
    function: str | None = None
    outputs: tuple[str, ...] = ()  # the columns a function returns
    cells: tuple[int, int] = (0, 0)  # per: grid: cells along the tensor's two spatial axes


def grid_feature_names(channels: tuple[str, ...], cells: tuple[int, int]) -> list[str]:
    """`grid_<channel>_r<i>c<j>`, channel-major then row-major (the order `decode.grid_means` returns)."""
    return [f"grid_{ch}_r{i}c{j}" for ch in channels for i in range(cells[0]) for j in range(cells[1])]


# How a raw file may write `capture_time` (`raw.capture_time`): ISO 8601 text with a zone is always read; a
# number (or digits in a CSV) only in the epoch unit the contract declares, since 1.7e9 could be s or ms.
TIME_FORMATS = ("iso8601", "epoch_s", "epoch_ms", "epoch_us")
EPOCH_MS_PER_UNIT = {"epoch_s": 1000.0, "epoch_ms": 1.0, "epoch_us": 0.001}
# What a node may derive when a raw file lacks the column (`raw.derive`), and from what.
DERIVATIONS = {"sample_id": ("content-hash",), "capture_time": ("file-time",), "seq": ("row-order",)}


@dataclass(frozen=True)
class RawSpec:
    """How raw files write the identity columns (`raw:` in a contract; absent = ISO 8601, nothing derived)."""

    capture_time: str = "iso8601"  # one of TIME_FORMATS
    derive: tuple[tuple[str, str], ...] = ()  # (column, how) for columns a file may lack

    @property
    def derived(self) -> dict[str, str]:
        return dict(self.derive)


@dataclass(frozen=True)
class TrainingSpec:
    model: str  # one of MODEL_FAMILIES
    model_name: str  # the registry name models of this kind are trained and published under
    epochs: int = 3
    batch_size: int = 64
    lr: float = 2e-3
    width: int = 32
    augment: bool = True  # random flips/rotations (cnn2d only): off where orientation is the label (digits)
    balance_classes: bool = True  # weight each class's loss by its inverse share (rare classes still learnt)


@dataclass(frozen=True)
class Contract:
    kind: str
    version: int
    layout: str  # one of LAYOUTS
    label: LabelSpec
    raw_columns: dict[str, str]
    expectations: tuple[dict[str, Any], ...]
    sha256: str = field(repr=False)
    source: str = ""  # the contract file, for errors
    description: str = ""
    tensor_spec: TensorSpec | None = None
    file: FileSpec | None = None
    columns: tuple[ColumnSpec, ...] = ()
    features: tuple[FeatureSpec, ...] = ()
    training: TrainingSpec | None = None
    max_manifest_bytes: int = DEFAULT_LIMITS["max_manifest_bytes"]
    max_bundle_bytes: int = DEFAULT_LIMITS["max_bundle_bytes"]
    max_rows: int = DEFAULT_LIMITS["max_rows"]
    max_unpacked_bytes: int = DEFAULT_LIMITS["max_unpacked_bytes"]
    min_inclusion_p: float = DEFAULT_MIN_INCLUSION_P
    # A low-tier row left on the node sends a summary only where its row is this many times the summary's bytes
    # (None: the tiering policy's `summary_min_ratio`): the kind knows what its summary is worth to training.
    summary_min_ratio: float | None = None
    allow_nonfinite: tuple[str, ...] = ()  # float columns where NaN/inf are data, not an error
    raw: RawSpec = RawSpec()

    @property
    def id(self) -> str:
        return f"{self.kind}.v{self.version}"

    # The tensor of one observation: the tensor itself, or what a file decodes to.
    @property
    def tensor(self) -> TensorSpec | None:
        if self.tensor_spec is not None:
            return self.tensor_spec
        return self.file.decode if self.file is not None else None

    def _need_tensor(self) -> TensorSpec:
        t = self.tensor
        if t is None:
            raise ContractError(f"contract {self.id} ({self.layout}) has no tensor")
        return t

    # Tensor shorthands (Landsat-era names), for kinds with a tensor.
    @property
    def shape(self) -> tuple[int, ...]:
        return self._need_tensor().shape

    @property
    def dtype(self) -> str:
        return self._need_tensor().dtype

    @property
    def channels(self) -> tuple[str, ...]:
        return self._need_tensor().channels

    @property
    def scale(self) -> float:
        return self._need_tensor().scale

    @property
    def offset(self) -> float:
        return self._need_tensor().offset

    @property
    def max_nan_fraction(self) -> float:
        return self._need_tensor().max_nan_fraction

    @property
    def np_dtype(self) -> np.dtype[Any]:
        return self._need_tensor().np_dtype

    @property
    def sample_nbytes(self) -> int:
        return self._need_tensor().nbytes

    @property
    def label_column(self) -> str | None:
        return self.label.column

    @property
    def label_values(self) -> tuple[int, ...]:
        return self.label.values

    @property
    def payload_columns(self) -> tuple[str, ...]:
        """The columns that hold the observation itself (null in a summary row)."""
        if self.layout == "tensor":
            return (self._need_tensor().column,)
        if self.layout == "file":
            assert self.file is not None
            return (self.file.column,)
        return tuple(c.name for c in self.columns)

    @property
    def payload_column(self) -> str | None:
        """The one binary column of a tensor or file kind (None for a columns kind)."""
        return self.payload_columns[0] if self.layout != "columns" else None

    @property
    def numeric_columns(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns if c.numeric)

    @property
    def raw_schema(self) -> pa.Schema:
        return pa.schema([pa.field(n, _ARROW_TYPES[t]) for n, t in self.raw_columns.items()])

    @property
    def required_raw_columns(self) -> tuple[str, ...]:
        """The raw columns a file must carry: identity (less node_id, which the node fills in), the payload and
        every non-nullable data column, less what `raw.derive` derives. The label and nullable columns may
        be absent (null in every row)."""
        derived = self.raw.derived
        need = [n for n in IDENTITY_COLUMNS if n != "node_id" and n not in derived]
        need += list(self.payload_columns) if self.layout != "columns" else [
            c.name for c in self.columns if not c.nullable]
        return tuple(need)

    @property
    def feature_columns(self) -> list[str]:
        out: list[str] = []
        for f in self.features:
            if f.per == "channel":
                out += [f"{stat}_{ch}" for stat in f.stats for ch in self.channels]
            elif f.per == "grid":
                out += grid_feature_names(self.channels, f.cells)
            elif f.per == "column":
                out += [f"{stat}_{c}" for stat in f.stats for c in (f.columns or self.numeric_columns)]
            else:
                out += list(f.outputs)
        return out

    @property
    def derived_feature_columns(self) -> list[str]:
        """Features a core derives from the row's own columns (`norm_<column>`: the reading scaled by the
        contract's range; `grid_...`: cell means of the decoded payload; `decode.with_derived_features`): the edge
        computes them to score, no bundle carries them, so no reading travels twice."""
        return [f"{stat}_{c}" for f in self.features if f.per == "column"
                for stat in f.stats for c in (f.columns or self.numeric_columns)] + self.grid_feature_columns

    @property
    def grid_feature_columns(self) -> list[str]:
        """The `per: grid` features (derived: a core decodes the payload for them)."""
        return [n for f in self.features if f.per == "grid" for n in grid_feature_names(self.channels, f.cells)]

    @property
    def grid_cells(self) -> tuple[int, int] | None:
        """The grid of the contract's `per: grid` feature (at most one), None without one."""
        return next((f.cells for f in self.features if f.per == "grid"), None)

    @property
    def bundle_schema(self) -> pa.Schema:
        """Schema of preprocessed, scored rows as they travel in bundles and land in datasets: every feature
        but the derived ones (`derived_feature_columns`)."""
        derived = set(self.derived_feature_columns)
        return self._row_schema([c for c in self.feature_columns if c not in derived])

    @property
    def edge_schema(self) -> pa.Schema:
        """The rows as a node holds them to score: the bundle schema with every feature, derived ones included."""
        return self._row_schema(self.feature_columns)

    def _row_schema(self, features: list[str]) -> pa.Schema:
        fields = [
            pa.field("sample_id", pa.string(), nullable=False),
            pa.field("node_id", pa.string(), nullable=False),
            pa.field("capture_time", pa.timestamp("ms", tz="UTC"), nullable=False),
            pa.field("seq", pa.int64(), nullable=False),
        ]
        if self.label.column is not None:
            fields.append(pa.field(self.label.column, pa.int16()))
        fields.append(pa.field("content_sha256", pa.string(), nullable=False))
        if self.layout == "columns":
            fields += [pa.field(c.name, c.arrow_type) for c in self.columns]  # null in a summary row
        else:
            # Raw tensor or file bytes; null for low-tier summary rows.
            fields.append(pa.field(self.payload_columns[0], pa.binary()))
        fields += [pa.field(c, pa.float32(), nullable=False) for c in features]
        fields += [
            pa.field("value", pa.float32(), nullable=False),
            pa.field("tier", pa.string(), nullable=False),
            pa.field("is_summary", pa.bool_(), nullable=False),
            pa.field(INCLUSION_P, pa.float32(), nullable=False),
        ]
        return pa.schema(fields, metadata={b"edgehaul.contract": self.id.encode()})


class _Doc:
    """Reads one contract file's fields, each error naming the file and the field (`tensor.shape[1]`)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def fail(self, where: str, what: str) -> ContractInvalid:
        return ContractInvalid(f"{self.path}: field {where} {what}")

    def mapping(self, v: Any, where: str, known: set[str] | None = None) -> dict[str, Any]:
        if not isinstance(v, dict):
            raise self.fail(where, f"must be a mapping, got {type(v).__name__}")
        if known is not None and (unknown := sorted(set(v) - known)):
            raise self.fail(where, f"has unknown keys {unknown} (known: {sorted(known)})")
        return v

    def need(self, m: dict[str, Any], key: str, where: str) -> Any:
        if key not in m:
            raise self.fail(f"{where}.{key}" if where else key, "is missing")
        return m[key]

    def string(self, v: Any, where: str, choices: tuple[str, ...] | None = None) -> str:
        if not isinstance(v, str) or not v:
            raise self.fail(where, f"must be a non-empty string, got {v!r}")
        if choices is not None and v not in choices:
            raise self.fail(where, f"must be one of {list(choices)}, got {v!r}")
        return v

    def name(self, v: Any, where: str) -> str:
        s = self.string(v, where)
        if not s.replace("_", "").isalnum() or not (s[0].isalpha() or s[0] == "_"):
            raise self.fail(where, f"must be an identifier (letters, digits, _), got {s!r}")
        return s

    def integer(self, v: Any, where: str, lo: int = 1) -> int:
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            raise self.fail(where, f"must be an integer >= {lo}, got {v!r}")
        return v

    def number(self, v: Any, where: str) -> float:
        if not isinstance(v, int | float) or isinstance(v, bool):
            raise self.fail(where, f"must be a number, got {v!r}")
        return float(v)

    def strings(self, v: Any, where: str) -> tuple[str, ...]:
        if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v):
            raise self.fail(where, f"must be a list of strings, got {v!r}")
        return tuple(v)

    def tensor(self, v: Any, where: str, default_column: str) -> TensorSpec:
        t = self.mapping(v, where, {"column", "shape", "dtype", "channel_axis", "channels", "scale", "offset",
                                    "max_nan_fraction"})
        raw_shape = self.need(t, "shape", where)
        if not isinstance(raw_shape, list) or not raw_shape:
            raise self.fail(f"{where}.shape", f"must be a non-empty list of sizes, got {raw_shape!r}")
        shape = tuple(self.integer(x, f"{where}.shape[{i}]") for i, x in enumerate(raw_shape))
        try:
            dtype = str(np.dtype(self.string(self.need(t, "dtype", where), f"{where}.dtype")))
        except TypeError as e:
            raise self.fail(f"{where}.dtype", f"is not a numpy dtype ({e})") from e
        if np.dtype(dtype).kind not in "uif":
            raise self.fail(f"{where}.dtype", f"must be an integer or float dtype, got {dtype}")
        axis = t.get("channel_axis", -1)
        if not isinstance(axis, int) or isinstance(axis, bool) or not -len(shape) <= axis < len(shape):
            raise self.fail(f"{where}.channel_axis", f"must index shape {list(shape)}, got {axis!r}")
        axis %= len(shape)
        channels = self.strings(self.need(t, "channels", where), f"{where}.channels")
        if len(channels) != shape[axis]:
            raise self.fail(f"{where}.channels", f"names {len(channels)} channels, shape {list(shape)} has "
                                                 f"{shape[axis]} on axis {axis}")
        if len(set(channels)) != len(channels):
            raise self.fail(f"{where}.channels", "has duplicate names")
        for i, ch in enumerate(channels):
            self.name(ch, f"{where}.channels[{i}]")
        nan = self.number(t.get("max_nan_fraction", 0.0), f"{where}.max_nan_fraction")
        if not 0.0 <= nan <= 1.0:
            raise self.fail(f"{where}.max_nan_fraction", f"must be in [0, 1], got {nan}")
        return TensorSpec(
            column=self.name(t.get("column", default_column), f"{where}.column"), shape=shape, dtype=dtype,
            channel_axis=axis, channels=channels, scale=self.number(t.get("scale", 1.0), f"{where}.scale"),
            offset=self.number(t.get("offset", 0.0), f"{where}.offset"), max_nan_fraction=nan,
        )

    def file(self, v: Any) -> FileSpec:
        f = self.mapping(v, "file", {"column", "media_type", "max_bytes", "decode"})
        media = self.string(self.need(f, "media_type", "file"), "file.media_type", tuple(MEDIA_MAGIC))
        decode = f.get("decode")
        return FileSpec(
            column=self.name(f.get("column", "content"), "file.column"), media_type=media,
            max_bytes=self.integer(self.need(f, "max_bytes", "file"), "file.max_bytes"),
            decode=None if decode is None else self.tensor(decode, "file.decode", "decoded"),
        )

    def columns(self, v: Any) -> tuple[ColumnSpec, ...]:
        cols = self.mapping(v, "columns")
        if not cols:
            raise self.fail("columns", "must name at least one column")
        out = []
        for name, spec in cols.items():
            where = f"columns.{name}"
            self.name(name, where)
            if name in (*IDENTITY_COLUMNS, "content_sha256", "value", "tier", "is_summary", INCLUSION_P):
                raise self.fail(where, "is a column every bundle already has; name it otherwise")
            c = self.mapping(spec, where, {"type", "unit", "min", "max", "values", "nullable"})
            typ = self.string(self.need(c, "type", where), f"{where}.type", COLUMN_TYPES)
            lo = None if c.get("min") is None else self.number(c["min"], f"{where}.min")
            hi = None if c.get("max") is None else self.number(c["max"], f"{where}.max")
            if (lo is not None or hi is not None) and typ not in ("float32", "float64", "int16", "int32", "int64"):
                raise self.fail(where, f"has a range, but type {typ} is not numeric")
            if lo is not None and hi is not None and lo > hi:
                raise self.fail(f"{where}.min", f"{lo} is above max {hi}")
            values: tuple[str, ...] = ()
            if typ == "category":
                values = self.strings(self.need(c, "values", where), f"{where}.values")
            elif "values" in c:
                raise self.fail(f"{where}.values", f"is only for category columns, not {typ}")
            unit = c.get("unit")
            if unit is not None and not isinstance(unit, str):
                raise self.fail(f"{where}.unit", f"must be a string, got {unit!r}")
            nullable = c.get("nullable", False)
            if not isinstance(nullable, bool):
                raise self.fail(f"{where}.nullable", f"must be true or false, got {nullable!r}")
            out.append(ColumnSpec(name, typ, unit, lo, hi, values, nullable))
        return tuple(out)

    def label(self, v: Any) -> LabelSpec:
        if v is None:
            return LabelSpec(column=None, kind="none")
        lab = self.mapping(v, "label", {"column", "kind", "values", "names", "nullable"})
        kind = self.string(lab.get("kind", "class"), "label.kind", LABEL_KINDS)
        if kind == "none":
            if set(lab) - {"kind"}:
                raise self.fail("label", "of kind none takes no other keys")
            return LabelSpec(column=None, kind="none")
        column = self.name(self.need(lab, "column", "label"), "label.column")
        raw = lab.get("values", [0, 1] if kind == "anomaly" else None)
        if raw is None:
            raise self.fail("label.values", "is missing (the class ids, e.g. [1, 2, 3])")
        if not isinstance(raw, list) or not raw:
            raise self.fail("label.values", f"must be a non-empty list of integers, got {raw!r}")
        values = tuple(self.integer(x, f"label.values[{i}]", lo=-32768) for i, x in enumerate(raw))
        if len(set(values)) != len(values) or max(values) > 32767:
            raise self.fail("label.values", "must be distinct int16 values")
        if kind == "anomaly" and sorted(values) != [0, 1]:
            raise self.fail("label.values", f"of an anomaly flag must be [0, 1], got {list(values)}")
        names = self.strings(lab["names"], "label.names") if "names" in lab else ()
        if names and len(names) != len(values):
            raise self.fail("label.names", f"has {len(names)} names for {len(values)} values")
        nullable = lab.get("nullable", True)
        if not isinstance(nullable, bool):
            raise self.fail("label.nullable", f"must be true or false, got {nullable!r}")
        return LabelSpec(column=column, kind=kind, values=values, names=names, nullable=nullable)

    def features(self, v: Any, layout: str, tensor: TensorSpec | None, columns: tuple[ColumnSpec, ...]
                 ) -> tuple[FeatureSpec, ...]:
        if v is None:  # the default: channel statistics of a tensor, the numeric columns of a table
            return (FeatureSpec(per="channel"),) if tensor is not None else (
                (FeatureSpec(per="column", stats=("norm",)),) if any(c.numeric for c in columns) else ())
        if not isinstance(v, list):
            raise self.fail("features", f"must be a list, got {type(v).__name__}")
        return tuple(self.feature(raw, f"features[{i}]", layout, tensor, columns) for i, raw in enumerate(v))

    def feature(self, raw: Any, where: str, layout: str, tensor: TensorSpec | None,
                columns: tuple[ColumnSpec, ...]) -> FeatureSpec:
        f = self.mapping(raw, where, {"per", "stats", "columns", "function", "outputs", "cells"})
        if "function" in f:
            fn = self.string(f["function"], f"{where}.function")
            if ":" not in fn:
                raise self.fail(f"{where}.function", f"must be 'module:function', got {fn!r}")
            outputs = self.strings(self.need(f, "outputs", where), f"{where}.outputs")
            return FeatureSpec(per=None, function=fn, outputs=outputs, stats=())
        per = self.string(self.need(f, "per", where), f"{where}.per", ("channel", "grid", "column"))
        if "cells" in f and per != "grid":
            raise self.fail(f"{where}.cells", f"belongs to per: grid, not per: {per}")
        if per == "grid":
            return self.grid_feature(f, where, layout, tensor)
        if per == "channel":
            if tensor is None:
                raise self.fail(f"{where}.per", f"is channel, but a {layout} kind has no tensor to decode")
            stats = self.strings(f.get("stats", ["mean", "std"]), f"{where}.stats")
            if bad := [s for s in stats if s not in FEATURE_STATS]:
                raise self.fail(f"{where}.stats", f"has unknown statistics {bad} (known: {list(FEATURE_STATS)})")
            return FeatureSpec(per="channel", stats=stats)
        if layout != "columns":
            raise self.fail(f"{where}.per", f"is column, but a {layout} kind has no typed columns")
        numeric = {c.name for c in columns if c.numeric}
        cols = self.strings(f.get("columns", [c.name for c in columns if c.numeric]), f"{where}.columns")
        if bad := [c for c in cols if c not in numeric]:
            raise self.fail(f"{where}.columns", f"names {bad}, not numeric columns of this kind")
        return FeatureSpec(per="column", stats=("norm",), columns=cols)

    def grid_feature(self, f: dict[str, Any], where: str, layout: str, tensor: TensorSpec | None) -> FeatureSpec:
        if tensor is None:
            raise self.fail(f"{where}.per", f"is grid, but a {layout} kind has no tensor to decode")
        spatial = [s for i, s in enumerate(tensor.shape) if i != tensor.channel_axis]
        if len(spatial) != 2:
            raise self.fail(f"{where}.per", f"is grid, which needs a tensor with two spatial axes besides its "
                                            f"channels; shape {list(tensor.shape)} has {len(spatial)}")
        raw = self.need(f, "cells", where)
        if not isinstance(raw, list) or len(raw) != 2:
            raise self.fail(f"{where}.cells", f"must be [rows, cols], got {raw!r}")
        cells = tuple(self.integer(x, f"{where}.cells[{i}]") for i, x in enumerate(raw))
        if not all(1 <= c <= s for c, s in zip(cells, spatial, strict=True)):
            raise self.fail(f"{where}.cells", f"must be between 1 and the spatial size {spatial}, got {list(cells)}")
        if "stats" in f and f["stats"] != ["mean"]:
            raise self.fail(f"{where}.stats", f"a grid holds cell means only, got {f['stats']!r}")
        return FeatureSpec(per="grid", stats=("mean",), cells=(cells[0], cells[1]))

    def training(self, v: Any, layout: str, tensor: TensorSpec | None, label: LabelSpec, kind: str
                 ) -> TrainingSpec | None:
        if v is None:
            return None
        t = self.mapping(v, "training", {"model", "model_name", "epochs", "batch_size", "lr", "width",
                                           "augment", "balance_classes"})
        model = self.string(self.need(t, "model", "training"), "training.model", MODEL_FAMILIES)
        if label.kind == "none":
            raise self.fail("training", "needs a label (label.kind class or anomaly) to train on")
        if model in ("cnn2d", "cnn1d"):
            rank = 3 if model == "cnn2d" else 2
            if tensor is None or len(tensor.shape) != rank:
                got = "no tensor" if tensor is None else f"a rank-{len(tensor.shape)} tensor"
                raise self.fail("training.model", f"{model} needs a rank-{rank} tensor, this kind has {got}")
        if model == "mlp" and layout == "file" and tensor is None:
            raise self.fail("training.model", "mlp on a file kind needs file.decode")
        lr = self.number(t.get("lr", 2e-3), "training.lr")
        if not 0 < lr <= 1:
            raise self.fail("training.lr", f"must be in (0, 1], got {lr}")
        return TrainingSpec(
            model=model, model_name=self.string(t.get("model_name", kind.replace("_", "-")), "training.model_name"),
            epochs=self.integer(t.get("epochs", 3), "training.epochs"),
            batch_size=self.integer(t.get("batch_size", 64), "training.batch_size"), lr=lr,
            width=self.integer(t.get("width", 32), "training.width"), augment=self._bool(t, "augment", True, "training"),
            balance_classes=self._bool(t, "balance_classes", True, "training"),
        )

    def _bool(self, m: dict[str, Any], key: str, default: bool, where: str) -> bool:
        v = m.get(key, default)
        if not isinstance(v, bool):
            raise self.fail(f"{where}.{key}", f"must be true or false, got {v!r}")
        return v


_TOP_KEYS = {"kind", "version", "description", "tensor", "file", "columns", "label", "features", "training",
             "limits", "raw_columns", "expectations", "raw"}


def _raw_spec(d: _Doc, v: Any) -> RawSpec:
    if v is None:
        return RawSpec()
    r = d.mapping(v, "raw", {"capture_time", "derive"})
    fmt = d.string(r.get("capture_time", "iso8601"), "raw.capture_time", TIME_FORMATS)
    derive = d.mapping(r.get("derive") or {}, "raw.derive", set(DERIVATIONS))
    for col, how in derive.items():
        d.string(how, f"raw.derive.{col}", DERIVATIONS[col])
    return RawSpec(capture_time=fmt, derive=tuple(sorted(derive.items())))


def _limits(d: _Doc, doc: dict[str, Any]) -> dict[str, Any]:
    raw = d.mapping(doc.get("limits") or {}, "limits",
                    {*DEFAULT_LIMITS, "allow_nonfinite", "min_inclusion_p", "summary_min_ratio"})
    out: dict[str, Any] = {}
    for name, default in DEFAULT_LIMITS.items():
        out[name] = d.integer(raw.get(name, default), f"limits.{name}")
    p = d.number(raw.get("min_inclusion_p", DEFAULT_MIN_INCLUSION_P), "limits.min_inclusion_p")
    if not 0 < p <= 1:
        raise d.fail("limits.min_inclusion_p", f"must be in (0, 1], got {p}")
    out["min_inclusion_p"] = p
    if "summary_min_ratio" in raw:
        r = d.number(raw["summary_min_ratio"], "limits.summary_min_ratio")
        if not r >= 1:
            raise d.fail("limits.summary_min_ratio", f"must be >= 1 (a summary smaller than its row), got {r}")
        out["summary_min_ratio"] = r
    out["allow_nonfinite"] = d.strings(raw.get("allow_nonfinite", []), "limits.allow_nonfinite") \
        if raw.get("allow_nonfinite") else ()
    return out


def _default_raw_columns(layout: str, tensor: TensorSpec | None, file: FileSpec | None,
                         columns: tuple[ColumnSpec, ...], label: LabelSpec) -> dict[str, str]:
    """The raw schema a node reads when the contract does not spell one out."""
    raw = {"sample_id": "string", "node_id": "string", "capture_time": "timestamp[ms, tz=UTC]", "seq": "int64"}
    if label.column is not None:
        raw[label.column] = "int16"
    if layout == "tensor" and tensor is not None:
        raw[tensor.column] = "binary"
    elif layout == "file" and file is not None:
        raw[file.column] = "binary"
    for c in columns:
        raw[c.name] = "string" if c.type == "category" else (
            "timestamp[ms, tz=UTC]" if c.type == "timestamp" else c.type)
    return raw


def _layout(d: _Doc, doc: dict[str, Any]) -> str:
    given = [k for k in ("tensor", "file", "columns") if k in doc]
    if len(given) != 1:
        raise ContractInvalid(f"{d.path}: a contract describes its observation with exactly one of tensor, file or "
                              f"columns; it has {given or 'none'}")
    return given[0]


def _raw_columns(d: _Doc, doc: dict[str, Any], layout: str, tensor: TensorSpec | None, file: FileSpec | None,
                 columns: tuple[ColumnSpec, ...], label: LabelSpec) -> dict[str, str]:
    raw_columns = doc.get("raw_columns")
    if raw_columns is None:
        raw_columns = _default_raw_columns(layout, tensor, file, columns, label)
    for name, typ in d.mapping(raw_columns, "raw_columns").items():
        if typ not in _ARROW_TYPES:
            raise d.fail(f"raw_columns.{name}", f"has unknown type {typ!r} (known: {sorted(_ARROW_TYPES)})")
    return dict(raw_columns)


def _expectations(d: _Doc, doc: dict[str, Any]) -> tuple[dict[str, Any], ...]:
    expectations = doc.get("expectations", [])
    if not isinstance(expectations, list):
        raise d.fail("expectations", "must be a list")
    for i, exp in enumerate(expectations):
        if not isinstance(exp, dict) or not isinstance(exp.get("type"), str) or not isinstance(exp.get("kwargs"), dict):
            raise d.fail(f"expectations[{i}]", "needs a string `type` and a `kwargs` mapping")
    return tuple(expectations)


def _parse(path: Path) -> Contract:
    raw = path.read_bytes()
    d = _Doc(path)
    try:
        doc = yaml.safe_load(raw)
    except yaml.YAMLError as e:
        raise ContractInvalid(f"{path}: not valid YAML ({e})") from e
    doc = d.mapping(doc, "(top level)", _TOP_KEYS)
    kind = d.name(d.need(doc, "kind", ""), "kind")
    version = d.integer(d.need(doc, "version", ""), "version")
    layout = _layout(d, doc)
    tensor = d.tensor(doc["tensor"], "tensor", "pixels") if layout == "tensor" else None
    file = d.file(doc["file"]) if layout == "file" else None
    columns = d.columns(doc["columns"]) if layout == "columns" else ()
    label = d.label(doc.get("label"))
    if label.column is not None and label.column in {c.name for c in columns}:
        raise d.fail("label.column", f"{label.column!r} is also a data column")
    decoded = tensor or (file.decode if file else None)
    features = d.features(doc.get("features"), layout, decoded, columns)
    training = d.training(doc.get("training"), layout, decoded, label, kind)
    raw_columns = _raw_columns(d, doc, layout, tensor, file, columns, label)
    expectations = _expectations(d, doc)
    description = doc.get("description", "")
    c = Contract(
        kind=kind, version=version, layout=layout, label=label, raw_columns=raw_columns,
        expectations=expectations, sha256=hashlib.sha256(raw).hexdigest(), source=str(path),
        description=str(description or "").strip(), tensor_spec=tensor, file=file, columns=columns,
        features=features, training=training, raw=_raw_spec(d, doc.get("raw")), **_limits(d, doc),
    )
    names = c.edge_schema.names
    if dup := sorted({n for n in names if names.count(n) > 1}):
        raise ContractInvalid(f"{path}: columns {dup} appear twice in the bundle schema (a feature, data or "
                              "label column clashes with another)")
    return c


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
