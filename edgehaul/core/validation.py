"""Validation of landed bundles: checksum, manifest, schema and the contract's Great Expectations suite.

Great Expectations (1.x) reads pandas, so a bundle goes Arrow -> pandas with only the columns the suite names,
never a tensor's or file's bytes (converting megabytes of binary to Python objects dominates otherwise). The
payload is checked per layout in `row_problems` with Arrow compute: a tensor's byte length, a file's size and
media type, typed columns' nulls, ranges and categories. An expectation on a derived feature (`norm_<column>`,
which no bundle carries) reads it as derived here from the row's columns (`decode.with_derived_features`).
The GE context and each contract's suite are built once per process, keyed by the contract's
sha256, and reused for every bundle. `validate_bundle` never raises for bad data: it returns a
`ValidationResult` whose `reason` names what failed, ready to be written as JSON beside a quarantined
bundle or shown as a Prefect table artifact.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import math
import os
import threading
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from edgehaul.bundles import BundleError, BundleManifest, Unpacked, read_bundle
from edgehaul.contracts import MEDIA_MAGIC, Contract, ContractError, ContractInvalid, contract_by_id
from edgehaul.decode import with_derived_features

log = logging.getLogger(__name__)

# Bump when the checks below change meaning: cached validation results keyed on it go stale.
VALIDATION_VERSION = "5"  # 2: ids, owner, size limits, tensor lengths, finite floats; 3: payload per layout;
# 4: inclusion_p in range; 5: unpacked-size budget, files decoded, min_inclusion_p, spread needs 10 values

# Reasons, most specific first; "ok" means the bundle may enter a dataset version.
SLOT_COLUMN = "__bundle"  # which bundle a row of a batched GE run came from

REASONS = (
    "ok", "bad_id", "wrong_node", "too_large", "manifest_missing", "checksum", "unreadable", "unknown_contract",
    "row_count", "manifest_mismatch", "schema_drift", "tensor_length", "file_invalid", "column_values", "non_finite",
    "inclusion_p", "expectations", "bundle_error",
)


@dataclass(frozen=True)
class ExpectationRow:
    expectation: str
    column: str | None
    success: bool
    observed_value: float | str | None = None
    unexpected_count: int | None = None
    details: str = ""


@dataclass(frozen=True)
class ValidationResult:
    bundle_id: str
    node_id: str
    contract: str
    contract_sha256: str
    bundle_sha256: str
    rows: int
    success: bool
    reason: str
    error: str = ""
    expectations: tuple[ExpectationRow, ...] = field(default_factory=tuple)
    validation_version: str = VALIDATION_VERSION

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["expectations"] = [asdict(e) for e in self.expectations]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ValidationResult:
        d = dict(d)
        d["expectations"] = tuple(ExpectationRow(**e) for e in d.get("expectations", []))
        return cls(**d)

    def table_rows(self) -> list[dict[str, Any]]:
        """One row per check, for a Prefect table artifact."""
        head = {"bundle": self.bundle_id[:12], "node": self.node_id}
        if not self.expectations:
            return [{**head, "check": self.reason, "column": "", "success": self.success,
                     "observed": "", "unexpected": "", "details": self.error[:200]}]
        return [
            {**head, "check": e.expectation, "column": e.column or "", "success": e.success,
             "observed": "" if e.observed_value is None else e.observed_value,
             "unexpected": "" if e.unexpected_count is None else e.unexpected_count, "details": e.details[:200]}
            for e in self.expectations
        ]

    def summary(self) -> dict[str, Any]:
        failed = [e.expectation + (f"({e.column})" if e.column else "") for e in self.expectations if not e.success]
        return {"bundle_id": self.bundle_id, "success": self.success, "reason": self.reason,
                "checks": len(self.expectations), "failed": failed}


class _Suite:
    """A GE ephemeral context with one pandas dataframe asset and the contract's suite."""

    def __init__(self, contract: Contract) -> None:
        os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
        import great_expectations as gx
        from great_expectations.data_context.types.base import ProgressBarsConfig
        from great_expectations.expectations.expectation_configuration import ExpectationConfiguration

        self.context = gx.get_context(mode="ephemeral")
        self.context.variables.progress_bars = ProgressBarsConfig(globally=False, metric_calculations=False)
        asset = self.context.data_sources.add_pandas("edgehaul").add_dataframe_asset(contract.id)
        self.batch_definition = asset.add_batch_definition_whole_dataframe("bundle")
        suite = gx.ExpectationSuite(name=f"{contract.id}-{contract.sha256[:12]}")
        for i, exp in enumerate(contract.expectations):
            try:
                suite.add_expectation_configuration(ExpectationConfiguration(type=exp["type"], kwargs=exp["kwargs"]))
            except Exception as e:  # GE raises several types for a bad expectation name/kwargs
                raise ContractInvalid(f"{contract.source or contract.id}: field expectations[{i}] "
                                      f"({exp.get('type')}): {type(e).__name__}: {str(e)[:300]}") from e
        self.suite = self.context.suites.add(suite)
        self.columns = sorted({str(e["kwargs"]["column"]) for e in contract.expectations if "column" in e["kwargs"]})
        # derived features the suite reads, and the bundle columns it reads them from
        self.derived = [c for c in self.columns if c in contract.derived_feature_columns]
        self.reads = sorted({*(c for c in self.columns if c not in self.derived),
                             *(c.removeprefix("norm_") for c in self.derived)})
        self.lock = threading.Lock()  # a GE context is not meant for concurrent use


_SUITES: dict[str, _Suite] = {}
_SUITES_LOCK = threading.Lock()


def suite_for(contract: Contract) -> _Suite:
    """The process-wide GE suite of a contract, built on first use (keyed by the contract file's sha256)."""
    with _SUITES_LOCK:
        s = _SUITES.get(contract.sha256)
        if s is None:
            s = _SUITES[contract.sha256] = _Suite(contract)
            log.info("built GE suite for %s (%d expectations)", contract.id, len(contract.expectations))
        return s


def _json_value(v: Any) -> float | str | None:
    if v is None:
        return None
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int | float) or hasattr(v, "__float__"):
        try:
            f = float(v)
            return f if math.isfinite(f) else str(f)
        except (TypeError, ValueError):
            pass
    return str(v)[:200]


def _ge_frame(tables: list[pa.Table], columns: list[str], slot: bool) -> Any:
    """The columns the suite reads, as pandas; with `slot`, a `__bundle` column numbering the tables."""
    # Only the columns the suite reads; above all not a tensor's or file's bytes. float32 -> float64: GE's pandas
    # between-check is vectorised only for the Python-float dtype and loops per row otherwise (~10x).
    parts = []
    for i, t in enumerate(tables):
        sel = t.select([c for c in columns if c in t.column_names])
        wide = pa.schema([pa.field(f.name, pa.float64()) if pa.types.is_float32(f.type) else f for f in sel.schema])
        sel = sel.cast(wide)
        if slot:
            sel = sel.append_column(SLOT_COLUMN, pa.array(np.full(t.num_rows, i, dtype=np.int32)))
        parts.append(sel)
    return pa.concat_tables(parts, promote_options="permissive").to_pandas()


def _row(cfg: Any, success: bool, result: dict[str, Any], exception_info: Any) -> ExpectationRow:
    # GE's config accessors copy on every access: read type and kwargs once
    kind, kwargs = (cfg.type, cfg.kwargs) if cfg is not None else ("unknown", {})
    return _row_of(kind, kwargs.get("column"), success, result, exception_info)


def _row_of(kind: str, column: str | None, success: bool, result: dict[str, Any], exception_info: Any) -> ExpectationRow:
    exc = (exception_info or {}).get("exception_message") if isinstance(exception_info, dict) else None
    partial = result.get("partial_unexpected_list") or []
    details = f"exception: {exc}" if exc else (f"e.g. {partial[:5]}" if partial else "")
    return ExpectationRow(
        expectation=kind,
        column=column,
        success=bool(success),
        observed_value=_json_value(result.get("observed_value")),
        unexpected_count=None if result.get("unexpected_count") is None else int(result["unexpected_count"]),
        details=details,
    )


def run_expectations(table: pa.Table, contract: Contract) -> tuple[ExpectationRow, ...]:
    """Run the contract's expectation suite over a table (bundle schema) and return one row each."""
    s = suite_for(contract)
    df = _ge_frame([with_derived_features(table, contract, s.derived)], s.columns, slot=False)
    with s.lock:
        batch = s.batch_definition.get_batch(batch_parameters={"dataframe": df})
        res = batch.validate(s.suite, result_format="BASIC")
    return tuple(_row(r.expectation_config, bool(r.success), r.result or {}, r.exception_info) for r in res.results)


# Column aggregates whose per-bundle value is recomputed from the bundle's rows when several bundles
# share one GE run (GE computes them over the whole batch). Same definitions as GE's pandas metrics
# (stdev: sample, ddof=1); checked against GE's own batch-wide value on every run.
_AGGREGATES: dict[str, Any] = {
    "expect_column_mean_to_be_between": np.nanmean,
    "expect_column_stdev_to_be_between": lambda a: np.nanstd(a, ddof=1),
    "expect_column_min_to_be_between": np.nanmin,
    "expect_column_max_to_be_between": np.nanmax,
    "expect_column_sum_to_be_between": np.nansum,
    "expect_column_median_to_be_between": np.nanmedian,
}


def _floats(col: pa.ChunkedArray | pa.Array) -> Any:
    """A column as float64 numpy with nulls as NaN (pandas' skipna, as GE's metrics see it)."""
    return col.cast(pa.float64()).to_numpy(zero_copy_only=False)


class _NotAttributable(Exception):
    """A batch result that cannot be split exactly per bundle: validate those bundles one by one."""


def _in_bounds(v: float | None, kw: dict[str, Any]) -> bool:
    if v is None or not math.isfinite(v):
        return False
    lo, hi = kw.get("min_value"), kw.get("max_value")
    if lo is not None and (v <= lo if kw.get("strict_min") else v < lo):
        return False
    return not (hi is not None and (v >= hi if kw.get("strict_max") else v > hi))


def _split(r: Any, tables: list[pa.Table]) -> list[ExpectationRow]:
    """One batch result -> one row per bundle (slot), each as if GE had run on that bundle alone."""
    cfg, result, exc_info = r.expectation_config, dict(r.result or {}), r.exception_info
    exc = exc_info if isinstance(exc_info, dict) else {}
    if cfg is None or exc.get("raised_exception"):
        raise _NotAttributable("expectation raised")
    kind, kw = cfg.type, dict(cfg.kwargs)
    col = kw.get("column")
    if "unexpected_index_list" in result:  # row-level: the unexpected rows name their bundle
        by_slot: dict[int, list[Any]] = {}
        for d in result["unexpected_index_list"]:
            by_slot.setdefault(int(d[SLOT_COLUMN]), []).append(d.get(col))
        rows = []
        for i, t in enumerate(tables):
            bad = by_slot.get(i, [])
            if kind == "expect_column_values_to_be_unique":  # duplicates within this bundle only
                seen = collections.Counter(str(v) for v in bad)
                bad = [v for v in bad if seen[str(v)] > 1]
            n = t.num_rows if kind == "expect_column_values_to_not_be_null" else t.num_rows - t.column(col).null_count
            mostly = kw.get("mostly")
            ok = not bad if mostly is None else (n == 0 or 1 - len(bad) / n >= float(mostly))
            rows.append(_row_of(kind, col, ok, {"unexpected_count": len(bad), "partial_unexpected_list": bad[:20]}, None))
        return rows
    agg = _AGGREGATES.get(kind)
    if agg is None or col is None:
        raise _NotAttributable(f"{kind} is not split per bundle")
    values = [_floats(t.column(col)) for t in tables]
    with warnings.catch_warnings():  # an all-null column: NaN, which fails the bounds as GE does
        warnings.simplefilter("ignore", RuntimeWarning)
        whole = float(agg(np.concatenate(values)))
        per_bundle = [float(agg(v)) if len(v) else float("nan") for v in values]
    ge = result.get("observed_value")
    if ge is None or not math.isclose(whole, float(ge), rel_tol=1e-6, abs_tol=1e-9):
        raise _NotAttributable(f"{kind}({col}): batch value {whole} differs from GE's {ge}")
    return [_row_of(kind, col, _in_bounds(v, kw), {"observed_value": v}, None) for v in per_bundle]


def run_expectations_batch(tables: list[pa.Table], contract: Contract) -> list[tuple[ExpectationRow, ...]]:
    """The contract's suite over several bundles in ONE Great Expectations run, results per bundle.

    GE's fixed cost per run (building the metric graph) dominates small bundles, so the bundles of
    one ingest run are validated together, each row tagged with its bundle: row-level expectations
    name the bundle of every unexpected row (GE's unexpected index), and column aggregates (mean,
    stdev, ...) are recomputed per bundle after checking the batch-wide value against GE's. Any
    expectation that cannot be split exactly this way sends the bundles through one GE run each.
    """
    if len(tables) <= 1:
        return [run_expectations(t, contract) for t in tables]
    s = suite_for(contract)
    tables = [with_derived_features(t, contract, s.derived) for t in tables]
    df = _ge_frame(tables, s.columns, slot=True)
    fmt = {"result_format": "COMPLETE", "unexpected_index_column_names": [SLOT_COLUMN],
           "return_unexpected_index_query": False}
    with s.lock:
        batch = s.batch_definition.get_batch(batch_parameters={"dataframe": df})
        res = batch.validate(s.suite, result_format=fmt)
    try:
        per_expectation = [_split(r, tables) for r in res.results]
    except _NotAttributable as e:
        log.info("batch validation of %d bundles not split per bundle (%s): one GE run each", len(tables), e)
        return [run_expectations(t, contract) for t in tables]
    return [tuple(rows[i] for rows in per_expectation) for i in range(len(tables))]


def _classify(e: Exception) -> str:
    if isinstance(e, ContractError):
        return "unknown_contract"
    if isinstance(e, Unpacked):
        return "too_large"
    msg = str(e)
    for needle, reason in (("checksum", "checksum"), ("not a readable Parquet", "unreadable"),
                           ("malformed bundle manifest", "unreadable"), ("rows, manifest says", "row_count"),
                           ("schema drift", "schema_drift"), ("file says", "manifest_mismatch")):
        if needle in msg:
            return reason
    return "bundle_error"


def check_manifest_matches(table: pa.Table, manifest: BundleManifest) -> str:
    """Every sample the manifest promises is in the file and vice versa, all from the manifest's node."""
    ids = table.column("sample_id")
    if sorted(ids.to_pylist()) != sorted(manifest.sample_ids):
        return f"bundle {manifest.bundle_id}: sample ids in the file differ from the manifest's"
    nodes = pc.unique(table.column("node_id")).to_pylist()
    if nodes != [manifest.node_id]:
        return f"bundle {manifest.bundle_id}: rows from nodes {nodes}, manifest says {manifest.node_id}"
    return ""


def _read_lean(data: bytes, manifest: BundleManifest, contract: Contract) -> pa.Table:
    """`read_bundle`'s checks (checksum, readable footer, contract, row count, schema, the unpacked-size budget)
    decoding only the columns validation reads: the payload only for the row checks (a tensor's or file's bytes
    are most of a bundle's bytes, and GE never sees them). A commit decodes the whole bundle again (and re-checks
    its checksum) from the validated bytes."""
    # + what `row_problems` reads: the payload (a tensor's or file's bytes are dropped after the check) and the floats
    wanted = sorted({*suite_for(contract).reads, "sample_id", "node_id", *contract.payload_columns, "is_summary",
                     *_float_columns(contract)})
    return read_bundle(data, manifest, columns=wanted)


def _float_columns(contract: Contract) -> list[str]:
    return [f.name for f in contract.bundle_schema if pa.types.is_floating(f.type)]


def _examples(table: pa.Table, mask: pa.ChunkedArray | pa.Array, n: int = 5) -> list[str]:
    return [str(v) for v in table.column("sample_id").filter(mask).to_pylist()[:n]]


def row_problems(table: pa.Table, contract: Contract) -> tuple[str, str]:
    """(reason, error) of the first per-row check that fails, ("", "") when all pass: at most the
    contract's rows; each full row's payload as its layout says (a tensor: exactly shape x dtype bytes;
    a file: at most `file.max_bytes`, starting like its media type; typed columns: no null in a
    non-nullable column, numbers in [min, max], categories in their values) and a summary row's payload
    null; no NaN/inf in a float column the contract does not list in `limits.allow_nonfinite`.
    Errors give the counts and the first sample ids, so a node's operator can find the rows."""
    if table.num_rows > contract.max_rows:
        return "too_large", f"{table.num_rows} rows, contract {contract.id} allows {contract.max_rows}"
    if "is_summary" in table.column_names and all(c in table.column_names for c in contract.payload_columns):
        check = {"tensor": _tensor_problems, "file": _file_problems, "columns": _column_problems}[contract.layout]
        reason, error = check(table, contract)
        if reason:
            return reason, error
    problems = []
    first: list[str] = []
    for col in _float_columns(contract):
        if col in contract.allow_nonfinite or col not in table.column_names:
            continue
        bad = pc.invert(pc.fill_null(pc.is_finite(table.column(col)), True))
        n_bad = int(pc.sum(bad).as_py() or 0)
        if n_bad:
            problems.append(f"{col}: {n_bad}")
            first = first or _examples(table, bad)
    if problems:
        return "non_finite", f"NaN/inf in {', '.join(problems)} rows, e.g. samples {first}"
    return _inclusion_problems(table, contract.min_inclusion_p)


def _inclusion_problems(table: pa.Table, floor: float) -> tuple[str, str]:
    """A full row stands for 1/inclusion_p samples in training: p in [floor, 1] (`limits.min_inclusion_p`: a
    node cannot make one row outweigh the dataset). A summary may carry 0 (a tier sampled at rate 0). A bundle
    from before the column (read lean: absent) has nothing to check."""
    if "inclusion_p" not in table.column_names or "is_summary" not in table.column_names:
        return "", ""
    p = table.column("inclusion_p")
    # float32 on the wire: the floor as float32 too, so a node writing exactly the floor passes
    low = pc.if_else(table.column("is_summary"), pc.less(p, 0.0), pc.less(p, pa.scalar(floor, p.type)))
    bad = pc.fill_null(pc.or_(low, pc.greater(p, 1.0)), True)
    n_bad = int(pc.sum(bad).as_py() or 0)
    if not n_bad:
        return "", ""
    values = sorted({str(v) for v in p.filter(bad).to_pylist()})[:5]
    return "inclusion_p", (f"{n_bad} rows with inclusion_p outside [{floor:g}, 1] (the contract's min_inclusion_p; "
                           f"summaries [0, 1]), values {values}, e.g. samples {_examples(table, bad)}")


def _summary_payload(table: pa.Table, name: str) -> pa.ChunkedArray:
    """Summary rows that carry a payload (they must not)."""
    return pc.and_(table.column("is_summary"), pc.is_valid(table.column(name)))


def _tensor_problems(table: pa.Table, contract: Contract) -> tuple[str, str]:
    name = contract.payload_columns[0]
    want = contract.sample_nbytes
    lengths = pc.binary_length(table.column(name))
    full_bad = pc.and_(pc.invert(table.column("is_summary")), pc.fill_null(pc.not_equal(lengths, want), True))
    bad = pc.or_(full_bad, _summary_payload(table, name))
    n_bad = int(pc.sum(bad).as_py() or 0)
    if not n_bad:
        return "", ""
    observed = sorted({str(v) for v in lengths.filter(bad).to_pylist()})[:5]
    return "tensor_length", (f"{n_bad} rows with {name} not {want} bytes (shape {list(contract.shape)} "
                             f"{contract.dtype}; summary rows: none), lengths {observed}, "
                             f"e.g. samples {_examples(table, bad)}")


def _file_problems(table: pa.Table, contract: Contract) -> tuple[str, str]:
    f = contract.file
    assert f is not None
    col = table.column(f.column)
    full = pc.invert(table.column("is_summary"))
    sizes = pc.binary_length(col)
    checks: list[tuple[str, Any]] = [
        ("missing", pc.and_(full, pc.is_null(col))),
        (f"over {f.max_bytes} bytes", pc.and_(full, pc.fill_null(pc.greater(sizes, f.max_bytes), False))),
    ]
    if magics := MEDIA_MAGIC[f.media_type]:
        ok = pc.fill_null(pc.starts_with(col, magics[0]), False)
        for m in magics[1:]:
            ok = pc.or_(ok, pc.fill_null(pc.starts_with(col, m), False))
        checks.append((f"not starting like {f.media_type}", pc.and_(pc.and_(full, pc.is_valid(col)), pc.invert(ok))))
    checks.append(("a summary row with a file", _summary_payload(table, f.column)))
    reason, error = _first_problem(table, "file_invalid", f.column, checks)
    if reason or f.decode is None:
        return reason, error
    return _undecodable(table, contract)


def _undecodable(table: pa.Table, contract: Contract) -> tuple[str, str]:
    """Every full row's file decodes to the contract's tensor (`edge.decode`, what training runs): a file that
    only starts like its media type is refused here, so training never meets it. The whole bundle is
    refused (a bundle is committed or quarantined whole, with every sample id accounted for)."""
    from edgehaul.decode import DecodeError, decode_file

    f = contract.file
    assert f is not None and f.decode is not None
    full = pc.invert(table.column("is_summary")).to_numpy(zero_copy_only=False)
    ids = table.column("sample_id").to_pylist()
    bad: list[str] = []
    why = ""
    for i, v in enumerate(table.column(f.column).to_pylist()):
        if not full[i] or v is None:
            continue
        try:
            decode_file(v, f.decode)
        except DecodeError as e:
            bad.append(str(ids[i]))
            why = why or str(e).split(": ", 1)[-1]
    if not bad:
        return "", ""
    return "file_invalid", (f"{len(bad)} rows with {f.column} that do not decode to {list(f.decode.shape)} "
                            f"{f.decode.dtype} ({why[:200]}), e.g. samples {bad[:5]}")


def _column_problems(table: pa.Table, contract: Contract) -> tuple[str, str]:
    full = pc.invert(table.column("is_summary"))
    for c in contract.columns:
        col = table.column(c.name)
        checks: list[tuple[str, Any]] = [("a summary row with a value", _summary_payload(table, c.name))]
        if not c.nullable:
            checks.append(("null", pc.and_(full, pc.is_null(col))))
        if c.min is not None:
            checks.append((f"below {c.min:g}", pc.fill_null(pc.less(col, c.min), False)))
        if c.max is not None:
            checks.append((f"above {c.max:g}", pc.fill_null(pc.greater(col, c.max), False)))
        if c.type == "category":
            checks.append((f"not in {list(c.values)}", pc.and_(pc.is_valid(col), pc.invert(
                pc.fill_null(pc.is_in(col, value_set=pa.array(c.values, pa.string())), True)))))
        reason, error = _first_problem(table, "column_values", c.name, checks)
        if reason:
            return reason, error
    return "", ""


def _first_problem(table: pa.Table, reason: str, column: str, checks: list[tuple[str, Any]]) -> tuple[str, str]:
    for what, mask in checks:
        n_bad = int(pc.sum(mask).as_py() or 0)
        if n_bad:
            return reason, f"{n_bad} rows with {column} {what}, e.g. samples {_examples(table, mask)}"
    return "", ""


def _prechecks(
    data: bytes, manifest: BundleManifest, full: bool = True,
) -> tuple[Contract | None, pa.Table | None, ValidationResult]:
    """Contract, checksum, readability, schema and manifest checks: a result that is final unless it
    is `reason="pending"` (the bundle still needs its expectation suite)."""
    base = ValidationResult(
        bundle_id=manifest.bundle_id, node_id=manifest.node_id, contract=manifest.contract, contract_sha256="",
        bundle_sha256=manifest.sha256, rows=manifest.row_count, success=False, reason="bundle_error",
    )
    try:
        contract = contract_by_id(manifest.contract)
    except ContractInvalid:
        raise  # the contract file is broken, not the bundle: fail loudly, quarantine nothing
    except ContractError as e:
        return None, None, replace(base, reason="unknown_contract", error=str(e),
                                   bundle_sha256=hashlib.sha256(data).hexdigest())
    base = replace(base, contract_sha256=contract.sha256)
    try:
        table = read_bundle(data, manifest) if full else _read_lean(data, manifest, contract)
    except (BundleError, ContractError) as e:
        return contract, None, replace(base, reason=_classify(e), error=str(e),
                                       bundle_sha256=hashlib.sha256(data).hexdigest())
    # past the checksum check: the bytes' sha256 is the manifest's
    nodes = pc.unique(table.column("node_id")).to_pylist()
    if nodes != [manifest.node_id]:  # the manifest's node is the landing prefix's (`ingest.manifest_problem`)
        return contract, table, replace(base, reason="wrong_node", error=f"bundle {manifest.bundle_id} of "
                                        f"{manifest.node_id}: rows name nodes {[str(n)[:40] for n in nodes[:5]]}")
    mismatch = check_manifest_matches(table, manifest)
    if mismatch:
        return contract, table, replace(base, reason="manifest_mismatch", error=mismatch)
    reason, error = row_problems(table, contract)
    if reason:
        return contract, table, replace(base, reason=reason, error=f"bundle {manifest.bundle_id}: {error}")
    binary = contract.payload_column  # a tensor's or file's bytes: read for the row checks only, never by GE
    if not full and binary is not None and binary in table.column_names:
        table = table.drop_columns([binary])
    return contract, table, replace(base, reason="pending")


# A spread is a statistic of many values: on one row GE observes NaN, and two or three rows of an urgent
# bundle (an alert, a burst of anomalies) may well sit close together. Such a bundle is not evidence of a dead
# or wild sensor: a spread check over fewer than SPREAD_MIN_VALUES values does not apply (recorded as such),
# and every row-level check still does. Normal bundles carry hundreds of rows.
SPREAD_EXPECTATIONS = frozenset({"expect_column_stdev_to_be_between"})
SPREAD_MIN_VALUES = 10


def not_applicable_to_small(rows: tuple[ExpectationRow, ...], table: pa.Table) -> tuple[ExpectationRow, ...]:
    """Spread expectations on a column with fewer than SPREAD_MIN_VALUES values pass as 'not applicable'."""
    out = []
    for r in rows:
        if (r.expectation in SPREAD_EXPECTATIONS and not r.success and r.column in table.column_names
                and (n := len(table) - table.column(r.column).null_count) < SPREAD_MIN_VALUES):
            r = replace(r, success=True, observed_value=None,
                        details=f"not applicable: {n} value(s), a spread needs {SPREAD_MIN_VALUES}")
        out.append(r)
    return tuple(out)


def _finish(base: ValidationResult, rows: tuple[ExpectationRow, ...]) -> ValidationResult:
    failed = [r for r in rows if not r.success]
    error = "; ".join(
        f"{r.expectation}({r.column}) observed {r.observed_value}" + (f", {r.unexpected_count} unexpected"
                                                                        if r.unexpected_count else "")
        for r in failed
    )
    return replace(base, success=not failed, reason="expectations" if failed else "ok", error=error,
                   expectations=rows)


def validate_bundle(data: bytes, manifest: BundleManifest) -> tuple[pa.Table | None, ValidationResult]:
    """Check a landed bundle end to end. Returns the table (None when unreadable) and the result;
    bad data never raises."""
    return validate_bundles([(data, manifest)])[0]


def validate_bundles(
    items: Sequence[tuple[bytes, BundleManifest]], *, full_tables: bool = True,
) -> list[tuple[pa.Table | None, ValidationResult]]:
    """`validate_bundle` for several bundles, with one Great Expectations run per contract for all of
    them (see `run_expectations_batch`); results in input order, each exactly as if alone.
    `full_tables=False`: decode only the columns validation reads (the returned tables hold just those),
    for callers that keep the verdict and not the data."""
    out: list[tuple[pa.Table | None, ValidationResult]] = []
    todo: dict[str, tuple[Contract, list[int]]] = {}
    for data, manifest in items:
        try:
            contract, table, res = _prechecks(data, manifest, full_tables)
        except ContractInvalid:
            raise
        except Exception as e:  # bytes no check foresaw: this bundle's verdict, never the batch's failure
            contract, table, res = None, None, _failed(data, manifest, "bundle_error", e)
        if res.reason == "pending" and contract is not None and table is not None:
            todo.setdefault(contract.sha256, (contract, []))[1].append(len(out))
        out.append((table, res))
    for contract, idx in todo.values():
        tables = [t for t in (out[i][0] for i in idx) if t is not None]
        # a ContractInvalid (bad expectation) propagates: the contract is broken, not these bundles
        try:
            per_bundle: list[tuple[ExpectationRow, ...] | Exception] = list(run_expectations_batch(tables, contract))
        except ContractInvalid:
            raise
        except Exception as e:  # one bundle's values broke the batch run: each bundle alone, so only it fails
            log.warning("batch validation of %d bundles raised (%s: %s): one GE run each", len(tables),
                        type(e).__name__, str(e)[:200])
            per_bundle = [_expectations_alone(t, contract) for t in tables]
        for i, rows in zip(idx, per_bundle, strict=True):
            table = out[i][0]
            assert table is not None  # `todo` holds only bundles whose table was read
            if isinstance(rows, Exception):
                out[i] = (None, replace(out[i][1], reason="expectations",
                                        error=f"the expectation suite raised {type(rows).__name__}: {str(rows)[:300]}"))
            else:
                out[i] = (table, _finish(out[i][1], not_applicable_to_small(rows, table)))
    return out


def _expectations_alone(table: pa.Table, contract: Contract) -> tuple[ExpectationRow, ...] | Exception:
    try:
        return run_expectations(table, contract)
    except ContractInvalid:
        raise
    except Exception as e:
        return e


def _failed(data: bytes, manifest: BundleManifest, reason: str, e: Exception) -> ValidationResult:
    return ValidationResult(
        bundle_id=manifest.bundle_id, node_id=manifest.node_id, contract=manifest.contract, contract_sha256="",
        bundle_sha256=hashlib.sha256(data).hexdigest(), rows=manifest.row_count, success=False, reason=reason,
        error=f"bundle {manifest.bundle_id}: {type(e).__name__}: {str(e)[:300]}")
