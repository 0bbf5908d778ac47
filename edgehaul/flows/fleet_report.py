"""Flow `fleet_report` (ops pool, scheduled every 5 minutes): the fleet's metrics as one picture.

Per node: link utilisation, retransmission rate, spool fill, uplink queue length, accelerator
utilisation (each node's latest LINK_STATS event, as the node reports it), landed-to-committed latency
percentiles (the core's own records: landing announcements and commit receipts) and silence. A node's
malformed event costs one warning line and NaN figures for that node, never the report. For the core:
core_ingest queue time (Prefect flow runs), checkpoint success rate (COMMIT.json markers vs the core's
CHECKPOINT_FAILED events), curated-zone write throughput, and the published model's dataset version vs
the dataset's latest. Window: the last `window_s`.

Outputs: a keyed table artifact `fleet-view` and a markdown artifact `fleet-view-chart` with the chart
inline (the UI keeps each key's history), `reports/fleet/latest.json` in the ops bucket (what
`edgehaul metrics serve` exposes to Prometheus), and alert events: NODE_SILENT for a node quiet
longer than its contact plan (EdgeNode.pass_schedule) or `max_silence_s` allows, MODEL_STALE for a
published model behind its dataset beyond the policy bound.

Blocks: `ObjectStore` (`store_block`; reads curated, checkpoints, models; writes ops). EdgeNode blocks
(all of them: the fleet). Cache policy: none (a view of now).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from pydantic import BaseModel, Field

from edgehaul.blocks import ObjectStore
from edgehaul.ops import fleet
from edgehaul.platform.block_loading import load_block
from edgehaul.platform.fields import AwareTime, Name
from edgehaul.platform.reporting import run_namer, summary_table
from edgehaul.platform.roles import StoreBlock
from edgehaul.tasks.fleet import emit_alerts, passes_of, publish_view, read_facts, read_store_figures, window_start

ARTIFACT_KEY = "fleet-view"


class FleetReportParams(BaseModel):
    store_block: str = Field(default=StoreBlock.LIFECYCLE, min_length=1, description="ObjectStore block name.")
    model_name: Name = Field(default="landcover",
                             description="Published model whose data version is watched.")
    window_s: float = Field(default=3600, ge=60, le=7 * 86400, description="Look-back for events, runs and writes.")
    max_silence_s: float = Field(default=6 * 3600, ge=60, description="Silence bound of a node without a contact "
                                 "plan; nodes with one must speak in every pass.")
    silence_grace_s: float = Field(default=600, ge=0, le=86400, description="Slack after a pass ends before its "
                                   "missing report counts.")
    model_max_age_s: float = Field(default=86400, gt=0, description="A published model older than this while newer "
                                   "data exists is stale.")
    model_max_versions_behind: int = Field(default=5, ge=0, description="Stale at once beyond this many versions.")
    now: AwareTime | None = Field(default=None, description="Report time (tests, backfills); default: now.")


@flow(name="fleet_report",
       flow_run_name=run_namer("fleet_report", FleetReportParams, lambda p: f"last {p.window_s / 3600:g} h"))
def fleet_report(params: FleetReportParams | None = None) -> dict[str, Any]:
    """Build the fleet view, publish it (artifacts, ops bucket) and emit silent-node / stale-model alerts."""
    p = params or FleetReportParams()
    logger = get_run_logger()
    now = p.now or datetime.now(UTC)
    since = window_start(now, p.window_s)
    store = load_block(ObjectStore, p.store_block, param="store_block")
    facts = read_facts(since, now)
    figures = read_store_figures(store, p.model_name, since, now)

    problems: list[str] = []  # a node's malformed event costs a line here, never the view
    nodes = {n: fleet.node_figures(n, facts["link"].get(n), facts["spool"].get(n), now, facts["latency"].get(n),
                                   problems)
             for n in sorted(set(facts["nodes"]) | set(facts["link"]) | set(facts["latency"]))}
    for line in problems:
        logger.warning("fleet view: %s", line)
    model: fleet.ModelStatus | None = figures["model"]
    core = fleet.CoreFigures(
        queue_s=fleet.queue_times(facts["core_runs"]),
        checkpoint_success=fleet.checkpoint_success(figures["checkpoints"], facts["checkpoint_failed"]),
        checkpoints_committed=figures["checkpoints"], checkpoints_failed=facts["checkpoint_failed"],
        write_bps=figures["write_bps"],
        model_versions_behind=float(model.versions_behind) if model else fleet.NAN,
        model_age_s=model.age_s if model else fleet.NAN)
    view = fleet.FleetView(at=now, window_s=p.window_s, nodes=nodes, core=core)

    silences = [s for n, info in facts["nodes"].items()
                if (s := fleet.silence(n, nodes[n].last_seen, passes_of(info), now, default_s=p.max_silence_s,
                                       grace_s=p.silence_grace_s)) is not None]
    stale = model if model and fleet.is_stale(model, max_age_s=p.model_max_age_s,
                                               max_versions_behind=p.model_max_versions_behind) else None
    emitted = emit_alerts(view, silences, stale, {"max_age_s": p.model_max_age_s,
                                                  "max_versions_behind": p.model_max_versions_behind})
    uri = publish_view(store, view)
    summary_table(ARTIFACT_KEY, fleet.table_rows(view), f"Fleet view at {now:%Y-%m-%d %H:%M} UTC")
    create_markdown_artifact(fleet.markdown(view, fleet.chart_png(view)), key=f"{ARTIFACT_KEY}-chart",
                             description="Fleet view chart")
    logger.info("fleet view: %d nodes, %d silent, model %s, %d alert events; %s", len(nodes), len(silences),
                "stale" if stale else ("current" if model else "none published"), emitted, uri)
    return {"view": uri, "nodes": sorted(nodes), "silent": [s.node_id for s in silences],
            "stale_model": stale.model_id if stale else None, "alerts_emitted": emitted}
