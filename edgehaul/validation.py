"""Validation of landed bundles: checksum, manifest, schema and the contract's Great Expectations suite.

Great Expectations (1.x) reads pandas, so a bundle goes Arrow -> pandas without its `pixels` column
(no expectation reads it, and converting megabytes of binary to Python objects dominates otherwise).
The GE context and each contract's suite are built once per process, keyed by the contract's
sha256, and reused for every bundle. `validate_bundle` never raises for bad data: it returns a
`ValidationResult` whose `reason` names what failed, ready to be written as JSON beside a quarantined
bundle or shown as a Prefect table artifact.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import threading
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from edgehaul.bundles import BundleError, BundleManifest, read_bundle
from edgehaul.contracts import Contract, ContractError, contract_by_id

log = logging.getLogger(__name__)

# Bump when the checks below change meaning: cached validation results keyed on it go stale.
VALIDATION_VERSION = "1"

# Reasons, most specific first; "ok" means the bundle may enter a dataset version.
REASONS = (
    "ok", "checksum", "unreadable", "unknown_contract", "row_count", "manifest_mismatch",
    "schema_drift", "expectations", "bundle_error",
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
        for exp in contract.expectations:
            try:
                suite.add_expectation_configuration(ExpectationConfiguration(type=exp["type"], kwargs=exp["kwargs"]))
            except Exception as e:  # GE raises several types for a bad expectation name/kwargs
                raise ContractError(f"contract {contract.id}: bad expectation {exp!r}: {e}") from e
        self.suite = self.context.suites.add(suite)
        self.columns = sorted({str(e["kwargs"]["column"]) for e in contract.expectations if "column" in e["kwargs"]})
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


def run_expectations(table: pa.Table, contract: Contract) -> tuple[ExpectationRow, ...]:
    """Run the contract's expectation suite over a table (bundle schema) and return one row each."""
    s = suite_for(contract)
    present = [c for c in s.columns if c in table.column_names]
    # Only the columns the suite reads; above all not `pixels`. float32 -> float64: GE's pandas
    # between-check is vectorised only for the Python-float dtype and loops per row otherwise (~10x).
    sel = table.select(present)
    wide = pa.schema([pa.field(f.name, pa.float64()) if pa.types.is_float32(f.type) else f for f in sel.schema])
    df = sel.cast(wide).to_pandas()
    with s.lock:
        batch = s.batch_definition.get_batch(batch_parameters={"dataframe": df})
        res = batch.validate(s.suite, result_format="BASIC")
    rows = []
    for r in res.results:
        cfg = r.expectation_config
        result = r.result or {}
        exc = (r.exception_info or {}).get("exception_message") if isinstance(r.exception_info, dict) else None
        partial = result.get("partial_unexpected_list") or []
        details = f"exception: {exc}" if exc else (f"e.g. {partial[:5]}" if partial else "")
        rows.append(ExpectationRow(
            expectation=cfg.type if cfg else "unknown",
            column=cfg.kwargs.get("column") if cfg else None,
            success=bool(r.success),
            observed_value=_json_value(result.get("observed_value")),
            unexpected_count=None if result.get("unexpected_count") is None else int(result["unexpected_count"]),
            details=details,
        ))
    return tuple(rows)


def _classify(e: Exception) -> str:
    if isinstance(e, ContractError):
        return "unknown_contract"
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


def validate_bundle(data: bytes, manifest: BundleManifest) -> tuple[pa.Table | None, ValidationResult]:
    """Check a landed bundle end to end. Returns the table (None when unreadable) and the result;
    bad data never raises."""
    base = ValidationResult(
        bundle_id=manifest.bundle_id, node_id=manifest.node_id, contract=manifest.contract, contract_sha256="",
        bundle_sha256=hashlib.sha256(data).hexdigest(), rows=manifest.row_count, success=False, reason="bundle_error",
    )
    try:
        contract = contract_by_id(manifest.contract)
    except ContractError as e:
        return None, replace(base, reason="unknown_contract", error=str(e))
    base = replace(base, contract_sha256=contract.sha256)
    try:
        table = read_bundle(data, manifest)
    except (BundleError, ContractError) as e:
        return None, replace(base, reason=_classify(e), error=str(e))
    mismatch = check_manifest_matches(table, manifest)
    if mismatch:
        return table, replace(base, reason="manifest_mismatch", error=mismatch)
    try:
        rows = run_expectations(table, contract)
    except ContractError as e:
        return table, replace(base, reason="bundle_error", error=str(e))
    failed = [r for r in rows if not r.success]
    error = "; ".join(
        f"{r.expectation}({r.column}) observed {r.observed_value}" + (f", {r.unexpected_count} unexpected"
                                                                        if r.unexpected_count else "")
        for r in failed
    )
    return table, replace(base, success=not failed, reason="expectations" if failed else "ok", error=error,
                          expectations=rows)
