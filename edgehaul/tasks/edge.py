"""Edge task: one cached task run per raw batch (preprocess, score, tier, bundle, spool).

One task per batch, not two: staging the preprocessed rows between a preprocess task and a tier
task (an Arrow file written, fsynced, read back and checksummed twice) cost more than the
preprocessing it let a policy change skip (benchmarks/bench_edge.py), so a new policy or scorer
re-runs the whole batch.

Caching (reruns do no work twice; nothing a node caches is read centrally), results persisted as JSON on
the node's own disk by the flow (`result_storage`, default `edgehaul.platform.caching.edge_result_storage`:
`<spool>/prefect-results/`), shared with nobody:
- `ingest_batch` is keyed on the raw batch's content key (`edgehaul.edge.preprocess.batch_key`, computed
  by the caller) + contract sha256 + preprocess code version + scorer cache version + policy
  fingerprint + node. Its value lists the bundles it spooled (ids, sizes, checksums), the reject
  counts and the tier report, never the data; a cache hit writes nothing.
- The task leaves a small receipt in the spool's staging area (`<cache key>.receipt.json`, pruned
  with staging after a day, like the cache entry). A cached value whose receipt is gone (spool
  wiped or replaced, receipt pruned) is recomputed by the flow: puts are idempotent on bundle id
  and skip acknowledged bundles, so a recompute never duplicates.
- Exceptions are never cached (Prefect caches only Completed states); retries only for OSError
  (disk), never for bad data or a full spool (which is not an error: the ledger records it).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import partial
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from prefect import task
from prefect.context import TaskRunContext

from edgehaul import downlink
from edgehaul.blocks import EdgeNode, LinkProfile, ObjectStore, TieringPolicy
from edgehaul.contracts import Contract, contract_by_id
from edgehaul.edge.batch import ingest_batch as run_batch
from edgehaul.edge.preprocess import CODE_VERSION, batch_key, preprocess
from edgehaul.edge.scorer_registry import ScorerContext, build_scorer, scorer_state_dir
from edgehaul.edge.scoring import ContextualScorer, NoveltyScorer, Scorer, scorer_cache_version
from edgehaul.edge.spool import Spool, SpoolError
from edgehaul.edge.tiering import TierReport, for_pass_rows, full_row_bytes, packed_row_bytes
from edgehaul.platform.caching import RESULT_SERIALIZER, cache_key
from edgehaul.uplink.pass_plan import Pass, PassScheduleError, load_passes, planned_pass_rows, planned_share

BATCH_CACHE_VERSION = "edge-batch-1"  # bump to invalidate every cached edge batch result
LEGACY_NOVELTY_STATE = Path("scorer") / "novelty-state.json"  # before scorer state was kept per kind
RECEIPT_SUFFIX = ".receipt.json"


def retry_on_disk_errors(task: Any, task_run: Any, state: Any) -> bool:
    """Retry only I/O errors of the local disk; bad data, full spool, checksum errors fail at once."""
    try:
        exc = state.result(raise_on_failure=False)
    except Exception as e:
        exc = e
    return isinstance(exc, OSError) and not isinstance(exc, SpoolError)


def open_spool(node: EdgeNode) -> Spool:
    return Spool.from_block(node)


def make_scorer(policy: TieringPolicy, node: EdgeNode, contract: Contract, store: ObjectStore | None = None) -> Scorer:
    """The policy's scorer for this node and kind, its state in the node's folder for that kind."""
    state_dir = scorer_state_dir(node.spool_dir, policy.scorer, contract)
    legacy = Path(node.spool_dir) / LEGACY_NOVELTY_STATE
    if policy.scorer == "novelty" and contract.id == "landsat_patch.v1" and legacy.exists():
        # one state per node was only ever Landsat's: it becomes that kind's state (once, atomically)
        state_dir.mkdir(parents=True, exist_ok=True)
        os.replace(legacy, state_dir / NoveltyScorer.STATE_FILE)
    return build_scorer(policy.scorer, ScorerContext(contract=contract, policy=policy, store=store,
                                                     state_dir=state_dir,
                                                     downlinked=partial(downlink.current_file, Path(node.spool_dir))))


@dataclass(frozen=True)
class EdgeBatch:
    key: str  # cache key of this batch's result (also names its receipt)
    receipt: str  # path of the receipt in the node's spool
    n_input: int
    accepted: int
    scorer_version: str
    bundles: list[dict[str, Any]]  # bundle_id, tier, rows, nbytes, sha256, reason, spooled
    report: dict[str, Any]
    reject_counts: dict[str, int] = field(default_factory=dict)

    def is_intact(self) -> bool:
        """The spool that holds this batch's bundles still has its receipt (else: recompute)."""
        return Path(self.receipt).is_file()


@dataclass(frozen=True)
class ObservedRate:
    """What a node's first raw batch says it observes, in `budget_share`'s unit."""

    bytes_per_s: float | None  # full-row bytes per second; None where its capture times span no time
    row_bytes: float | None  # mean full-row bytes of its accepted rows; None where it has none
    wire_row_bytes: float | None = None  # a row's bytes packed in a bundle (`tiering.packed_row_bytes`)


def observed_rate(raw: pa.Table, contract: Contract, node_id: str | None = None,
                  policy: TieringPolicy | None = None) -> ObservedRate:
    """A raw batch preprocessed as the edge path does (its bad rows rejected, nothing recorded): the full-row bytes
    of its accepted rows (`tiering.full_row_bytes`, what a share of them buys) over the span of their capture
    times, and a row's bytes once packed (`tiering.packed_row_bytes`, what a pass's bytes buy). A raw row's Arrow
    bytes are another unit: gait's 95 B make a 179 B full row, and a share planned on them drew 1.9 times what the
    link carries."""
    key, hashes = batch_key(raw, contract.payload_column or "")
    rows = preprocess(raw, contract, node_id=node_id, key=key, hashes=hashes).accepted
    if not rows.num_rows:
        return ObservedRate(None, None)
    total = float(full_row_bytes(rows, contract).sum())
    row_bytes = total / rows.num_rows
    if rows.num_rows < 2:
        return ObservedRate(None, row_bytes)
    wire = packed_row_bytes(rows, contract, policy or TieringPolicy())
    lo, hi = pc.min(rows.column("capture_time")).as_py(), pc.max(rows.column("capture_time")).as_py()
    span = (hi - lo).total_seconds() if lo is not None and hi is not None else 0.0
    return ObservedRate(total / span if span > 0 else None, row_bytes, wire)


def link_budget(policy: TieringPolicy, profile: LinkProfile, raw_bytes_per_s: float | None, *,
                passes: Sequence[Pass] = (), now: datetime | None = None,
                row_bytes: float | None = None, wire_row_bytes: float | None = None) -> TieringPolicy:
    """The policy a node tiers with under its link. One that fixes `budget_share` keeps it; otherwise the share
    of what the node observes (full-row bytes per second) that its link plans to carry (`pass_plan.planned_share`:
    the passes' or the profile's bytes per second over the observed bytes per second; with passes and `row_bytes`,
    the surplus a pass thins, and the tilt a pass of that many rows draws with: `tiering.for_pass_rows`; rows
    counted packed with `wire_row_bytes`), to two
    significant digits: both are in the policy's fingerprint, which keys the batch cache, and a rate measured a
    little differently each run must not recompute every batch. Without a known rate, the policy as it is."""
    if policy.budget_share is not None or not raw_bytes_per_s or raw_bytes_per_s <= 0:
        return policy
    share = planned_share(profile, raw_bytes_per_s=raw_bytes_per_s, passes=passes, now=now, row_bytes=row_bytes,
                          wire_row_bytes=wire_row_bytes)
    tilted = for_pass_rows(policy, planned_pass_rows(profile, passes, row_bytes, now=now,
                                                     wire_row_bytes=wire_row_bytes))
    return tilted.model_copy(update={"budget_share": min(1.0, float(f"{share:.2g}"))})


def node_link_budget(policy: TieringPolicy, profile: LinkProfile, node: EdgeNode, raw: pa.Table, contract: Contract,
                     observed: float | None = None, log: Callable[..., Any] | None = None) -> TieringPolicy:
    """`link_budget` for a node: its pass schedule (none when unreadable, said in the log), and its rate as given
    (`observed`, full-row bytes per second), else as its first raw batch says (`observed_rate`), which also gives
    the full-row bytes a pass's rows are counted in."""
    passes: list[Pass] = []
    if node.pass_schedule:
        try:
            passes = load_passes(node.pass_schedule)
        except (OSError, PassScheduleError) as e:
            if log:
                log("node %s: pass schedule %s unreadable (%s): planned from the link profile", node.node_id,
                    node.pass_schedule, e)
    first = observed_rate(raw, contract, node.node_id, policy)
    rate = observed or first.bytes_per_s
    out = link_budget(policy, profile, rate, passes=passes, row_bytes=first.row_bytes,
                      wire_row_bytes=first.wire_row_bytes)
    if log:
        log("node %s: budget_share %s, coverage %s (%s; observed %s full-row B/s, %s B a row, %s packed, %d passes "
            "planned)", node.node_id, out.budget_share, out.coverage,
            "the policy's own" if policy.budget_share is not None else "planned for the link" if rate
            else "no observed rate: none", None if rate is None else round(rate),
            None if first.row_bytes is None else round(first.row_bytes),
            None if first.wire_row_bytes is None else round(first.wire_row_bytes), len(passes))
    return out


def context_key(raw_key: str, contract: Contract, node_id: str) -> str:
    """What the novelty sketch files a batch under: its content at this contract, code and node."""
    return cache_key("edge-pre", CODE_VERSION, raw_key, contract.sha256, node_id)


def batch_cache_key(raw_key: str, contract: Contract, scorer_version: str, policy: TieringPolicy, node_id: str) -> str:
    return cache_key("edge-batch", BATCH_CACHE_VERSION, CODE_VERSION, raw_key, contract.sha256, scorer_version,
                     policy.fingerprint, node_id)


def _batch_cache_key(ctx: TaskRunContext, params: dict[str, Any]) -> str:
    return batch_cache_key(params["raw_key"], contract_by_id(params["contract_id"]), params["scorer_version"],
                           params["policy"], params["node"].node_id)


def scorer_key(policy: TieringPolicy, node: EdgeNode, ctx_key: str, store: ObjectStore | None = None,
               contract: Contract | None = None) -> str:
    """What a batch's scores depend on besides the batch (part of the batch cache key)."""
    return scorer_cache_version(make_scorer(policy, node, contract or contract_by_id("landsat_patch.v1"), store),
                                ctx_key)


@task(
    name="edge-ingest-batch", cache_key_fn=_batch_cache_key, cache_expiration=timedelta(days=1), persist_result=True,
    result_serializer=RESULT_SERIALIZER, retries=2, retry_delay_seconds=[1, 5], retry_condition_fn=retry_on_disk_errors,
)
def ingest_batch(
    raw: pa.Table, raw_key: str, contract_id: str, policy: TieringPolicy, node: EdgeNode, scorer_version: str,
    store: ObjectStore | None = None, hashes: pa.Array | None = None,
) -> EdgeBatch:
    """Preprocess, score, tier and spool one raw batch. `raw_key`, `hashes`: the caller's
    `batch_key(raw)`; `scorer_version`: the caller's `scorer_key(...)`."""
    contract = contract_by_id(contract_id)
    ctx = context_key(raw_key, contract, node.node_id)
    scorer = make_scorer(policy, node, contract, store)
    spool = open_spool(node)
    try:
        res = run_batch(raw, contract, policy, spool, scorer, key=raw_key, hashes=hashes, context_key=ctx,
                        node_id=node.node_id, scorer_version=scorer_version, team=node.team)
        if isinstance(scorer, ContextualScorer):
            scorer.save()
        key = batch_cache_key(raw_key, contract, scorer_version, policy, node.node_id)
        receipt = spool.write_staging(f"{key}{RECEIPT_SUFFIX}", json.dumps(
            {"raw_key": raw_key, "bundles": [b["bundle_id"] for b in res.bundles]}).encode())
    finally:
        spool.close()
    return EdgeBatch(key=key, receipt=str(receipt), n_input=res.n_input, accepted=res.accepted,
                     scorer_version=scorer_version, bundles=res.bundles, report=report_dict(res.report),
                     reject_counts=res.reject_counts)


def report_dict(r: TierReport) -> dict[str, Any]:
    return r.to_dict()


def merge_reports(parts: list[dict[str, Any]]) -> TierReport:
    return TierReport.merge(parts)
