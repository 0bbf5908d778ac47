"""One raw batch through the edge path: preprocess -> rejects to the ledger -> score -> tier ->
bundles into the spool.

A plain function (no Prefect): `tasks/edge.py` wraps it in one cached task per batch, and the edge
benchmark runs the very same function directly to measure what orchestration adds on top.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from edgehaul.contracts import Contract
from edgehaul.edge import ledger as ledger_mod
from edgehaul.edge.preprocess import preprocess
from edgehaul.edge.scoring import ContextualScorer, Scorer, feature_matrix, values_or_fallback
from edgehaul.edge.spool import Spool
from edgehaul.edge.tiering import Batcher, TierReport, assign

if TYPE_CHECKING:
    from edgehaul.blocks.policies import TieringPolicy

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchResult:
    key: str  # the raw batch's content key (`edgehaul.edge.preprocess.batch_key`)
    n_input: int
    accepted: int
    reject_counts: dict[str, int]
    bundles: list[dict[str, Any]]  # bundle_id, tier, rows, nbytes, sha256, reason, spooled
    report: TierReport


def ingest_batch(
    raw: pa.Table, contract: Contract, policy: TieringPolicy, spool: Spool, scorer: Scorer, *,
    key: str, hashes: pa.Array | None = None, context_key: str | None = None, node_id: str | None = None,
    scorer_version: str = "", team: str = "default",
) -> BatchResult:
    """Run one raw batch through the edge path and put its bundles in `spool`.

    `key`, `hashes`: `batch_key(raw)` (the hashes save hashing the payload twice). `context_key`: the
    key a ContextualScorer files this batch under (default `key`); it scores the batch against the
    batches folded before it, then folds it. The caller persists the scorer's state.
    """
    result = preprocess(raw, contract, node_id=node_id, key=key, hashes=hashes)
    if result.rejects.num_rows:
        rj = result.rejects
        rows = list(zip(rj.column("sample_id").to_pylist(), rj.column("reason").to_pylist(),
                        rj.column("detail").to_pylist(), strict=True))
        spool.ledger.record_many(rows, stage=ledger_mod.STAGE_PREPROCESS)
    table, rejects = result.accepted, result.reject_counts
    ctx = context_key or key
    values = values_or_fallback(scorer, table, ctx)  # a scorer that cannot score says so: a uniform sample
    if isinstance(scorer, ContextualScorer):
        scorer.fold(table, ctx)
    scored = assign(table, values, policy, contract)
    # a budgeted draw spreads its rows over the features the edge holds (derived ones too; no bundle carries them)
    features = feature_matrix(table, contract) if policy.budget_share is not None else None
    del table, result
    batcher = Batcher(policy, contract, scorer_version=scorer_version, team=team)
    built = batcher.add(scored, features) + batcher.flush() if scored.num_rows else []
    out: list[dict[str, Any]] = []
    for b in built:
        entry = spool.put(b.data, b.manifest)
        out.append({"bundle_id": b.manifest.bundle_id, "tier": b.manifest.tier, "rows": b.manifest.row_count,
                    "nbytes": b.manifest.nbytes, "sha256": b.manifest.sha256, "reason": b.reason,
                    "spooled": entry is not None})
    log.info("batch %s: %d in, %d accepted, %d rejected, %d bundles", key[:12], raw.num_rows, scored.num_rows,
             raw.num_rows - scored.num_rows, len(out))
    return BatchResult(key=key, n_input=raw.num_rows, accepted=scored.num_rows, reject_counts=rejects, bundles=out,
                       report=batcher.report)
