"""Run observability in the Prefect UI: a progress artifact for long work and a summary table per run.

Both are no-ops outside a flow or task run (plain function calls, unit tests) and never fail the
data path: a UI artifact is worth less than the data it describes.

    with Progress("core-ingest-progress", total=len(keys), description="bundles validated") as p:
        for k in keys:
            ...
            p.advance()
    summary_table("core-ingest-summary", rows, "bundles of this run")
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from types import TracebackType
from typing import Any
from uuid import UUID

from pydantic import BaseModel

log = logging.getLogger(__name__)

CHECK_TAG = "edgehaul-verify"
"""Runs of checks (`make verify`, demos' probes) carry this tag; their names start with CHECK_PREFIX,
which the alert automations exclude, so a check never pages anyone nor reads as a production failure."""
CHECK_PREFIX = "check: "


def artifact_key(text: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    key = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    return re.sub(r"-{2,}", "-", key)[:100] or "edgehaul"


def _in_run() -> bool:
    from prefect.context import FlowRunContext, TaskRunContext

    return FlowRunContext.get() is not None or TaskRunContext.get() is not None


class Progress:
    """A progress artifact (0-100 %) updated at most every `min_step` percent, to spare the API."""

    def __init__(self, key: str, total: int, description: str = "", min_step: float = 1.0) -> None:
        self.key, self.total, self.description, self.min_step = artifact_key(key), max(total, 1), description, min_step
        self.done = 0
        self._shown = -1.0
        self._id: UUID | None = None

    @property
    def percent(self) -> float:
        return min(100.0, 100.0 * self.done / self.total)

    def __enter__(self) -> Progress:
        if _in_run():
            try:
                from prefect.artifacts import create_progress_artifact

                self._id = create_progress_artifact(0.0, key=self.key, description=self.description)  # type: ignore[assignment]
                self._shown = 0.0
            except Exception as e:
                log.warning("progress artifact %s not created: %s", self.key, e)
        return self

    def advance(self, n: int = 1, description: str | None = None) -> None:
        """`n` more done; a new `description` (what the work is at) is always shown."""
        self.done += n
        pct = self.percent
        changed = description is not None and description != self.description
        if self._id is not None and (changed or pct - self._shown >= self.min_step or pct >= 100.0):
            try:
                from prefect.artifacts import update_progress_artifact

                update_progress_artifact(self._id, pct, description=description if changed else None)
                self._shown = pct
            except Exception as e:
                log.warning("progress artifact %s not updated: %s", self.key, e)
        if description is not None:
            self.description = description

    def show(self, percent: float, description: str | None = None) -> None:
        """Set the progress to `percent` (for work measured in percent, e.g. epochs of a training)."""
        self.advance(round(percent / 100 * self.total) - self.done, description)

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        if et is None and self.done < self.total:
            self.done = self.total  # finished early (e.g. nothing left): show completion
            self.advance(0)


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB': byte counts as a person reads them (binary units, 3 significant digits)."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.3g} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _counts_bytes(column: str, row: dict[str, Any]) -> bool:
    """A cell counts bytes when its column says so, or its row does: a metric/value row whose metric
    names bytes, or a quantity whose unit is bytes (the cost report's lines)."""
    return ("bytes" in column.lower()
            or (column == "value" and "bytes" in str(row.get("metric", "")).lower())
            or (column == "quantity" and row.get("unit") == "bytes"))


def human_table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows as a person reads them: same columns for every row, byte counts in units (`_counts_bytes`).
    Only the artifact is rewritten; the run's return value keeps the raw numbers."""
    cols = list(dict.fromkeys(k for r in rows for k in r))
    return [{c: human_bytes(v) if isinstance(v, int | float) and not isinstance(v, bool) and _counts_bytes(c, r) else v
             for c in cols for v in [r.get(c, "")]} for r in rows]


def summary_table(key: str, rows: list[dict[str, Any]], description: str = "") -> UUID | None:
    """A table artifact of the run (one dict per row, same keys; byte columns in human units);
    returns its id, None outside a run. The one way the product writes table artifacts."""
    if not _in_run():
        return None
    try:
        from prefect.artifacts import create_table_artifact

        return create_table_artifact(human_table(rows), key=artifact_key(key), description=description)  # type: ignore[return-value]
    except Exception as e:
        log.warning("table artifact %s not created: %s", key, e)
        return None


def run_namer(flow: str, params_model: type[BaseModel], describe: Callable[[Any], str]) -> Callable[[], str]:
    """A `flow_run_name` callable: '<flow>: <what the run is about> (<run id head>)', e.g.
    'core_ingest: 3 bundles (1f0c2a)', from the run's `params` (a dict, a model or absent: the defaults);
    prefixed with CHECK_PREFIX for a run tagged CHECK_TAG. Never raises: a run without a readable name is
    still a run (falls back to the flow's name)."""

    def name() -> str:
        from prefect.runtime import flow_run

        head = str(flow_run.id or "")[:6]
        try:
            raw = (flow_run.parameters or {}).get("params")
            p = raw if isinstance(raw, params_model) else params_model.model_validate(raw or {})
            what = describe(p)
        except Exception as e:
            log.debug("run name of %s from defaults: %s", flow, e)
            what = ""
        check = CHECK_PREFIX if CHECK_TAG in (flow_run.tags or []) else ""
        return f"{check}{flow}: {what} ({head})" if what else f"{check}{flow} ({head})"

    return name
