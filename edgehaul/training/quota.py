"""Team quota checks before training starts: accelerator hours this month, accelerators per run,
storage bytes. Usage comes from the model registry's lineage records (what finished runs used)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from edgehaul.blocks import TeamQuota


class QuotaExceeded(RuntimeError):
    """Starting this run would take a team over its quota."""


@dataclass(frozen=True)
class Usage:
    team: str
    month: str  # YYYY-MM
    accelerator_hours: float
    storage_bytes: int
    runs: int


def usage_from_lineage(records: Iterable[dict[str, Any]], team: str, now: datetime | None = None) -> Usage:
    """Accelerator hours of the team's runs finished this calendar month (UTC), and the bytes its
    registered models and retained checkpoints keep (all months)."""
    now = now or datetime.now(UTC)
    month = now.strftime("%Y-%m")
    hours = 0.0
    stored = 0
    runs = 0
    for r in records:
        if r.get("team") != team:
            continue
        stored += int(r.get("storage_bytes", r.get("model_bytes", 0)) or 0)
        if str(r.get("finished", "")).startswith(month):
            hours += float(r.get("accelerator_hours", 0.0) or 0.0)
            runs += 1
    return Usage(team, month, hours, stored, runs)


def check_quota(quota: TeamQuota, usage: Usage, accelerators: int, hours: float, storage_bytes: int) -> None:
    """Raise QuotaExceeded naming the team, the quota, the usage and the request when any limit is hit."""
    if quota.team != usage.team:
        raise ValueError(f"quota block is for team {quota.team!r}, usage for {usage.team!r}")
    problems = []
    if accelerators > quota.max_accelerators_per_run:
        problems.append(
            f"{accelerators} accelerators requested, max_accelerators_per_run is {quota.max_accelerators_per_run}"
        )
    want = accelerators * hours
    if usage.accelerator_hours + want > quota.accelerator_hours_per_month:
        problems.append(
            f"accelerator_hours_per_month is {quota.accelerator_hours_per_month:g} h, {usage.accelerator_hours:.3g} h "
            f"used in {usage.month} by {usage.runs} run(s), request is {accelerators} x {hours:g} h = {want:.3g} h"
        )
    if usage.storage_bytes + storage_bytes > quota.storage_bytes:
        problems.append(
            f"storage_bytes quota is {quota.storage_bytes} B, {usage.storage_bytes} B kept, "
            f"request adds {storage_bytes} B"
        )
    if problems:
        raise QuotaExceeded(f"team {quota.team!r} quota exceeded, training refused: " + "; ".join(problems))
