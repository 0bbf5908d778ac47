"""Edge tasks: one preprocess task and one score/tier/bundle/spool task per raw batch.

Caching (issue 11), results persisted to the ops bucket by the flow (`result_storage`):
- `preprocess_batch` is keyed on the raw batch's SHA-256 (`edgehaul.landsat.table_sha256`, computed
  by the caller from the content) + contract sha256 + preprocess code version + node. Its value is
  a `StagedBatch` reference: the accepted rows live in the spool's staging area as an Arrow IPC file
  (node-local: preprocessed pixels are exactly what must not cross the link), with its SHA-256.
  The flow checks the file before use and recomputes (refresh) when it is gone or altered.
- `tier_and_spool` is keyed on the staged batch key (itself a content key) + scorer cache version
  + policy fingerprint + node. Its value lists the bundles it spooled (ids, sizes, checksums) and
  the tier report; the bundles themselves are in the spool, and a cache hit writes nothing.
- Exceptions are never cached (Prefect caches only Completed states); retries only for OSError
  (disk), never for bad data or a full spool (which is not an error: the ledger records it).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
from prefect import task
from prefect.context import TaskRunContext

from blocks import EdgeNode, ObjectStore, TieringPolicy
from edgehaul import ledger as ledger_mod
from edgehaul.caching import cache_key
from edgehaul.contracts import Contract, contract_by_id
from edgehaul.preprocess import CODE_VERSION, preprocess
from edgehaul.scoring import NoveltyScorer, NoveltyState, get_scorer, scorer_cache_version
from edgehaul.spool import Spool, SpoolError
from edgehaul.tiering import Batcher, TierReport, assign

log = logging.getLogger(__name__)

PRE_CACHE_VERSION = "edge-pre-1"  # bump to invalidate every cached preprocess result
TIER_CACHE_VERSION = "edge-tier-1"  # bump to invalidate every cached score/tier result
NOVELTY_STATE = Path("scorer") / "novelty-state.json"


def retry_on_disk_errors(task: Any, task_run: Any, state: Any) -> bool:
    """Retry only I/O errors of the local disk; bad data, full spool, checksum errors fail at once."""
    try:
        exc = state.result(raise_on_failure=False)
    except Exception as e:
        exc = e
    return isinstance(exc, OSError) and not isinstance(exc, SpoolError)


def open_spool(node: EdgeNode) -> Spool:
    return Spool.from_block(node)


def novelty_state_path(node: EdgeNode) -> Path:
    return Path(node.spool_dir) / NOVELTY_STATE


@dataclass(frozen=True)
class StagedBatch:
    key: str  # content key of the preprocessed batch (raw sha + contract + code version)
    path: str
    sha256: str
    nbytes: int
    rows: int
    n_input: int
    reject_counts: dict[str, int] = field(default_factory=dict)

    def is_intact(self) -> bool:
        """Cheap check before reuse (present, right size); `load_staged` verifies the SHA-256."""
        p = Path(self.path)
        return p.exists() and p.stat().st_size == self.nbytes


@dataclass(frozen=True)
class TieredBatch:
    key: str
    scorer_version: str
    bundles: list[dict[str, Any]]  # bundle_id, tier, rows, nbytes, sha256, reason, spooled
    report: dict[str, Any]


def preprocess_key(raw_sha: str, contract: Contract, node_id: str) -> str:
    return cache_key("edge-pre", PRE_CACHE_VERSION, CODE_VERSION, raw_sha, contract.sha256, node_id)


def _pre_cache_key(ctx: TaskRunContext, params: dict[str, Any]) -> str:
    return preprocess_key(params["raw_sha"], contract_by_id(params["contract_id"]), params["node"].node_id)


@task(
    name="edge-preprocess", cache_key_fn=_pre_cache_key, cache_expiration=timedelta(days=1), persist_result=True,
    retries=2, retry_delay_seconds=[1, 5], retry_condition_fn=retry_on_disk_errors,
)
def preprocess_batch(raw: pa.Table, raw_sha: str, contract_id: str, node: EdgeNode) -> StagedBatch:
    """Preprocess a raw batch, record its rejects in the ledger, stage the accepted rows."""
    contract = contract_by_id(contract_id)
    result = preprocess(raw, contract, node_id=node.node_id)
    key = preprocess_key(raw_sha, contract, node.node_id)
    spool = open_spool(node)
    try:
        if result.rejects.num_rows:
            rj = result.rejects
            rows = list(zip(rj.column("sample_id").to_pylist(), rj.column("reason").to_pylist(),
                            rj.column("detail").to_pylist(), strict=True))
            spool.ledger.record_many(rows, stage=ledger_mod.STAGE_PREPROCESS)
        sink = pa.BufferOutputStream()
        with pa.ipc.new_file(sink, result.accepted.schema) as w:
            w.write_table(result.accepted)
        data = sink.getvalue().to_pybytes()
        path = spool.write_staging(f"{key}.arrow", data)
    finally:
        spool.close()
    counts = result.reject_counts
    log.info("preprocess %s: %d in, %d accepted, %d rejected %s", key[:20], result.n_input,
             result.accepted.num_rows, result.rejects.num_rows, counts or "")
    return StagedBatch(key=key, path=str(path), sha256=hashlib.sha256(data).hexdigest(), nbytes=len(data),
                       rows=result.accepted.num_rows, n_input=result.n_input, reject_counts=counts)


def load_staged(staged: StagedBatch) -> pa.Table:
    p = Path(staged.path)
    data = p.read_bytes() if p.exists() else b""
    if hashlib.sha256(data).hexdigest() != staged.sha256:
        raise SpoolError(f"staged batch {staged.key} at {p} is missing or altered; rerun with refresh_cache")
    return pa.ipc.open_file(pa.BufferReader(data)).read_all()


def scorer_key(policy: TieringPolicy, node: EdgeNode, staged_key: str, store: ObjectStore | None = None,
               contract: Contract | None = None) -> str:
    """What a batch's scores depend on besides the batch (part of the tier cache key)."""
    if policy.scorer == "novelty":
        state = NoveltyState.load(novelty_state_path(node))
        return scorer_cache_version(NoveltyScorer(contract or contract_by_id("landsat_patch.v1"), state), staged_key)
    return get_scorer(policy, store, contract=contract).version


def _tier_cache_key(ctx: TaskRunContext, params: dict[str, Any]) -> str:
    staged: StagedBatch = params["staged"]
    policy: TieringPolicy = params["policy"]
    return cache_key("edge-tier", TIER_CACHE_VERSION, staged.key, params["scorer_version"], policy.fingerprint,
                     params["node"].node_id)


@task(
    name="edge-tier-and-spool", cache_key_fn=_tier_cache_key, cache_expiration=timedelta(days=7), persist_result=True,
    retries=2, retry_delay_seconds=[1, 5], retry_condition_fn=retry_on_disk_errors,
)
def tier_and_spool(
    staged: StagedBatch, contract_id: str, policy: TieringPolicy, node: EdgeNode, scorer_version: str,
    store: ObjectStore | None = None,
) -> TieredBatch:
    """Score the staged batch, assign tiers, cut bundles (urgent / normal with summaries / raw
    store) and put them in the spool. `scorer_version` is the caller's `scorer_key(...)`."""
    contract = contract_by_id(contract_id)
    table = load_staged(staged)
    if policy.scorer == "novelty":
        state_path = novelty_state_path(node)
        scorer: Any = NoveltyScorer(contract, NoveltyState.load(state_path))
        values = scorer.score(table, batch_key=staged.key)
        scorer.fold(table, staged.key)
        scorer.state.save(state_path)
    else:
        scorer = get_scorer(policy, store, contract=contract)
        values = scorer.score(table)
    scored = assign(table, values, policy, contract)
    batcher = Batcher(policy, contract, scorer_version=scorer_version, team=node.team)
    built = batcher.add(scored) + batcher.flush() if scored.num_rows else []
    spool = open_spool(node)
    out = []
    try:
        for b in built:
            entry = spool.put(b.data, b.manifest)
            out.append({"bundle_id": b.manifest.bundle_id, "tier": b.manifest.tier, "rows": b.manifest.row_count,
                        "nbytes": b.manifest.nbytes, "sha256": b.manifest.sha256, "reason": b.reason,
                        "spooled": entry is not None})
    finally:
        spool.close()
    refused = sum(1 for o in out if not o["spooled"])
    log.info("tier %s: %d rows -> %d bundles (%d refused by the spool), %s", staged.key[:20], scored.num_rows,
             len(out), refused, batcher.report.samples)
    return TieredBatch(key=staged.key, scorer_version=scorer_version, bundles=out, report=_report_dict(batcher.report))


def _report_dict(r: TierReport) -> dict[str, Any]:
    return {"samples": dict(r.samples), "uplink_bytes": dict(r.uplink_bytes), "raw_store_bytes": r.raw_store_bytes,
            "bundles": dict(r.bundles), "value_sent": r.value_sent, "value_total": r.value_total}


def merge_reports(parts: list[dict[str, Any]]) -> TierReport:
    total = TierReport()
    for p in parts:
        for k, v in p["samples"].items():
            total.samples[k] = total.samples.get(k, 0) + v
        for k, v in p["uplink_bytes"].items():
            total.uplink_bytes[k] = total.uplink_bytes.get(k, 0) + v
        for k, v in p["bundles"].items():
            total.bundles[k] = total.bundles.get(k, 0) + v
        total.raw_store_bytes += p["raw_store_bytes"]
        total.value_sent += p["value_sent"]
        total.value_total += p["value_total"]
    return total
