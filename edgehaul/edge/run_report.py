"""What an edge_ingest run reports: the spool's upkeep at its end, the per-tier table, and the node-local
summary and drop-folder alert (to the node's outbox, or straight out)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from edgehaul import events
from edgehaul.blocks import EdgeNode
from edgehaul.edge.drop_folder import emit_drop_rejected
from edgehaul.edge.outbox import node_outbox, record_run
from edgehaul.edge.spool import Spool
from edgehaul.edge.tiering import TierReport

# What a node-local run records in its outbox run summary (the drop-folder figures only when it read one).
OUTBOX_FIGURES = ("batches", "samples_in", "rejected", "bundles", "bundles_refused", "pending", "expired",
                  "spool_used_fraction", "files_read", "files_rejected")


@dataclass(frozen=True)
class SpoolUpkeep:
    expired: int  # bundles whose TTL ran out
    used_fraction: float
    ledger: dict[str, int]  # "stage/reason" -> samples
    pending: int


def spool_upkeep(node: EdgeNode) -> SpoolUpkeep:
    """Expire the spool's TTLs and check its watermarks; the spool's figures after that."""
    spool = Spool.from_block(node)
    try:
        expired = spool.expire()
        usage = spool.check_watermarks()
        ledger_counts = spool.ledger.counts()
        pending = len(spool.pending())
    finally:
        spool.close()
    return SpoolUpkeep(expired=len(expired), used_fraction=usage.fraction,
                       ledger={f"{s}/{r}": n for (s, r), n in ledger_counts.items()}, pending=pending)


def sum_counts(parts: Iterable[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for part in parts:
        for k, v in part.items():
            out[k] = out.get(k, 0) + v
    return out


def tier_rows(report: TierReport) -> list[dict[str, object]]:
    """One row per tier and a total, then value per uplinked MB against the no-tiering baseline."""
    rows = report.rows()
    rows.append({"tier": "value/MB sent", "samples": round(report.value_per_mb, 2), "uplink_bytes": "", "local_bytes": ""})
    rows.append({"tier": "value/MB no-tiering (est.)", "samples": round(report.baseline_value_per_mb, 2),
                 "uplink_bytes": "", "local_bytes": ""})
    return rows


def report_node_run(node: EdgeNode, summary: dict[str, Any], ledger: dict[str, int], *, to_outbox: bool,
                    problem: str | None = None, problems: dict[str, str] | None = None,
                    files: dict[str, Any] | None = None) -> None:
    """A node-local run (`to_outbox`) records its summary and ledger in the node's outbox; a drop-folder
    `problem` (with `problems` per file and the drop folder's `files` counts) becomes the level-2 alert naming
    each file and why, forwarded with the node's others when node-local, else emitted at once."""
    if not to_outbox:
        if problem:
            emit_drop_rejected(node.node_id, problem, problems or {}, files or {})
        return
    box = node_outbox(node.spool_dir, node.node_id)
    try:
        record_run(box, "edge_ingest", {k: summary[k] for k in OUTBOX_FIGURES if k in summary}, ledger)
        if problem:
            with events.routed(box.sink()):
                emit_drop_rejected(node.node_id, problem, problems or {}, files or {})
    finally:
        box.close()
