"""Flow `cost_report` (ops pool, scheduled monthly, e.g. cron `0 6 1 * *`): meter and price a month.

Meters uplink bytes per node and team (landing manifests counted, sizes as the store lists them,
node from the landing key, team from the node's EdgeNode block), storage bytes per class and team (a
listing, priced as one month at this snapshot, on billable bytes), accelerator hours per team (model
lineage) and S3 requests (the metering log, `edgehaul.ops.costs.record_usage`); prices from a PriceSheet.
Outputs: a Prefect table artifact and markdown summary, `reports/costs/<yyyy-mm>/report.parquet` and
`chart.png` (bytes per tier over time from the snapshots, cost per team) in the ops bucket, and a
storage snapshot under `metering/storage/`.

Blocks: `ObjectStore` (`store_block`), `PriceSheet` (`prices_block`), EdgeNode blocks (node -> team).
Cache policy: none (storage is metered as of the run; the metering log grows). A rerun for a month
overwrites that month's report and adds a snapshot.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from pydantic import BaseModel, Field

from edgehaul.blocks import ObjectStore, PriceSheet
from edgehaul.ops.costs import RequestMeter, UsageRecord, markdown_summary, record_usage
from edgehaul.platform.block_loading import load_block
from edgehaul.platform.fields import AwareTime
from edgehaul.platform.reporting import run_namer, summary_table
from edgehaul.platform.roles import DEFAULT_POLICY, StoreBlock
from edgehaul.tasks.costs import build_report_task, node_teams_task, write_outputs_task


class CostReportParams(BaseModel):
    store_block: str = Field(default=StoreBlock.LIFECYCLE, min_length=1, description="ObjectStore block name.")
    prices_block: str = Field(default=DEFAULT_POLICY, min_length=1, description="PriceSheet block name.")
    month: str | None = Field(default=None, pattern=r"^\d{4}-(0[1-9]|1[0-2])$",
                              description="Month to report (YYYY-MM); default: the month before `now`.")
    now: AwareTime | None = Field(default=None, description="Report time (tests, backfills); default: now.")


@flow(name="cost_report",
       flow_run_name=run_namer("cost_report", CostReportParams, lambda p: p.month or "last month"))
def cost_report(params: CostReportParams = CostReportParams()) -> dict[str, Any]:
    """Meter and price a month; publish table + markdown artifacts, a Parquet report and a chart."""
    logger = get_run_logger()
    now = params.now or datetime.now(UTC)
    month = params.month or f"{now.replace(day=1) - timedelta(days=1):%Y-%m}"
    store = load_block(ObjectStore, params.store_block, param="store_block")
    prices = load_block(PriceSheet, params.prices_block, param="prices_block")
    with RequestMeter.process() as meter:
        report = build_report_task(store, prices, month, now, node_teams_task())
        out = write_outputs_task(store, report)
    inline = out.pop("chart_inline")  # the artifact shows the chart itself; the run's result stays small
    # this run's own requests go to the metering log (they show in the report of `now`'s month)
    record_usage(store, UsageRecord(at=now, meter="requests", quantity=meter.count, source="cost_report"))
    key = f"cost-report-{month}"
    summary_table(key, [{**line, "cost": round(line["cost"], 6)} for line in report.lines],
                  f"Priced meters for {month} ({report.currency})")
    create_markdown_artifact(markdown_summary(report, out["chart"], out["chart_url"], out["report"], inline),
                             key=f"{key}-summary", description=f"Cost summary {month}")
    totals = report.totals()
    for line in report.problems:  # one line each, never the report
        logger.warning("cost report %s: not used: %s", month, line)
    logger.info("cost report %s: %d lines, total %.4f %s, %d inputs not used", month, len(report.lines),
                totals.get("cost", 0.0), report.currency, len(report.problems))
    return {"month": month, "total": round(totals.get("cost", 0.0), 6), "currency": report.currency, "totals": totals,
            "by_team": report.cost_by_team(), "requests": meter.count, **out}
