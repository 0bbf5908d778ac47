"""edge_ingest: raw observations on an edge node -> checked, scored, tiered bundles in its durable spool.

What it does, per raw batch (a bounded slice of the source, so memory follows the batch size, not
the input size): preprocess against the data contract (rejects go to the node's ledger with their
reason), score every sample (the policy's scorer), route by value (high: urgent bundles at once;
normal: bundles with the low tier's summary rows; low: full rows kept in the local raw store) and
put the bundles in the spool (cap, watermarks and full policy of the EdgeNode block). One task run
per batch (default 50k samples: 20 task runs per 1M samples), never one per sample. At the end:
spool TTL expiry, watermark check, and artifacts (a per-tier table with value captured per uplinked
byte against the no-tiering baseline, progress).

Blocks: `edgehaul-edge-node` (or inline `node_id` + `spool_dir`), `edgehaul-tiering-policy`
(default policy if none), `edgehaul-object-store` (only for the model scorer), `edgehaul-link-profile` (only
to plan the budget: `link_profile`). No result-storage block:
cached results are JSON records on the node's own disk (`<spool_dir>/prefect-results/`,
`edgehaul.platform.caching.edge_result_storage`), which nothing central ever reads (`result_storage`
names another block only for tests and benchmarks). Cache policy: one entry per batch, keyed on the
raw batch's content key (per-sample pixel SHA-256s + the other columns' bytes) + contract SHA-256 +
code version + scorer version + policy fingerprint + node; values are references (bundle ids, sizes,
checksums), never the data; a cached batch whose receipt is missing from the spool is recomputed;
`refresh_cache=True` recomputes everything for this run. Runs in the node's work pool (edge-*).

A drop folder (`edgehaul.edge.drop_folder.DropRun`): a file that cannot be read goes to `rejected/` with its
reason and the run goes on; a run that rejected files (or read files with most rows rejected) ends Completed
with a state message naming each file and why, and a level-2 `edgehaul.drop.rejected` alert.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, cast

import pyarrow as pa
from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from prefect.states import Completed
from pydantic import BaseModel, Field, model_validator

from edgehaul import downlink
from edgehaul.blocks import EdgeNode, LinkProfile, ObjectStore, TieringPolicy
from edgehaul.contracts import Contract, contract_by_id
from edgehaul.edge.drop_folder import DropFolder, DropPart, DropRun
from edgehaul.edge.preprocess import batch_key
from edgehaul.edge.run_report import SpoolUpkeep, report_node_run, spool_upkeep, sum_counts, tier_rows
from edgehaul.edge.scoring import ContextualScorer
from edgehaul.edge.sources import generated_batches, parquet_batches
from edgehaul.edge.tiering import TierReport
from edgehaul.platform import run_logging
from edgehaul.platform.block_loading import load_block
from edgehaul.platform.caching import edge_result_storage
from edgehaul.platform.fields import Name
from edgehaul.platform.reporting import Progress, run_namer, summary_table
from edgehaul.platform.roles import EXAMPLE_NODE
from edgehaul.platform.runners import from_environment
from edgehaul.tasks.edge import (
    EdgeBatch,
    context_key,
    ingest_batch,
    make_scorer,
    merge_reports,
    node_link_budget,
    scorer_key,
)


class EdgeIngestParams(BaseModel):
    edge_node: str | None = Field(default=EXAMPLE_NODE,
                                  description="EdgeNode block name (or None and set node_id/spool_dir).")
    node_id: Name | None = Field(default=None, description="Inline node id.")
    spool_dir: str | None = Field(default=None, description="Inline spool folder (with node_id).")
    spool_cap_bytes: int = Field(default=2 * 1024**3, gt=0, description="Inline spool cap.")
    tiering_policy: str | None = Field(default=None, description="TieringPolicy block name; None: the default policy.")
    object_store: str | None = Field(default=None, description="ObjectStore block for the model scorer.")
    link_profile: str | None = Field(default=None, description="LinkProfile block of the node's uplink: a policy "
                                     "without its own budget_share gets the share the link plans to carry.")
    observed_bytes_per_s: float | None = Field(default=None, gt=0, description="Full-row bytes per second "
                                               "the node observes (with link_profile; the rows as a bundle carries "
                                               "them, uncompressed); None: as the first batch's capture times say.")
    contract: str = Field(default="landsat_patch.v1", description="Data contract id of the raw observations.")
    source: Literal["generate", "parquet", "drop"] = Field(
        default="generate", description="generate: Landsat demo patches; parquet: every Parquet file of a folder, "
        "every run; drop: an instrument's drop folder (Parquet, Arrow IPC, CSV, or one file per observation of a file "
        "kind, e.g. *.png with an optional <stem>.json sidecar; each file once, then to done_path).")
    source_path: str | None = Field(default=None, description="The folder (source=parquet or drop).")
    settle_s: float = Field(default=5.0, ge=0, le=3600, description="source=drop: a file modified more recently "
                            "than this may still be written: it waits for the next run.")
    route_events_to_outbox: bool = Field(default=False, description="A node-local run: its summary and alerts go "
                                         "to the node's outbox (forwarded when in contact), not to a Prefect API.")
    done_path: str | None = Field(default=None, description="source=drop: where read files go (beside it, "
                                  "`rejected/` for files that cannot be read, each with <name>.reason.txt); the "
                                  "read-once log is in the spool.")
    n_samples: int = Field(default=10_000, ge=1, le=100_000_000, description="Samples to generate.")
    batch_size: int = Field(default=50_000, ge=100, le=200_000, description="Samples per raw batch (one task run each).")
    seed: int = Field(default=0, ge=0, description="Generator seed.")
    start_seq: int | None = Field(default=None, ge=0, description="First sequence number of generated samples; "
                                  "None: past every number this node generated before (ids never repeat).")
    class_weights: dict[int, float] | None = Field(default=None, description="Generated class mix.")
    result_storage: str | None = Field(
        default=None, description="Result storage block slug; None: the node's disk (<spool_dir>/prefect-results)."
    )
    refresh_cache: bool = Field(default=False, description="Recompute every cached step of this run.")

    @model_validator(mode="after")
    def _check(self) -> EdgeIngestParams:
        if not self.edge_node and not (self.node_id and self.spool_dir):
            raise ValueError("set edge_node (a block name) or both node_id and spool_dir")
        if self.source in ("parquet", "drop") and not self.source_path:
            raise ValueError(f"source {self.source!r} needs source_path")
        if self.source == "drop" and not self.done_path:
            raise ValueError("source 'drop' needs done_path")
        return self


def _raw_batches(p: EdgeIngestParams, node: EdgeNode, drop: DropRun | None
                 ) -> Iterator[tuple[pa.Table, DropPart | None]]:
    """Raw batches; a drop folder's batches name their file (`DropPart`), so the caller records a file only
    once all of it is spooled."""
    if p.source == "generate":
        yield from ((t, None) for t in generated_batches(
            node.node_id, str(node.spool_dir), p.n_samples, run_id=str(flow_run.get_id() or uuid.uuid4()),
            batch_size=p.batch_size, seed=p.seed, class_weights=p.class_weights, start_seq=p.start_seq))
    elif drop is not None:
        yield from drop.batches()
    else:
        yield from ((t, None) for t in parquet_batches(cast(str, p.source_path), p.batch_size))


def _resolve(p: EdgeIngestParams) -> tuple[EdgeNode, TieringPolicy, ObjectStore | None]:
    if p.edge_node:
        node = load_block(EdgeNode, p.edge_node, param="edge_node")
    else:
        node = EdgeNode(node_id=cast(str, p.node_id), spool_dir=cast(str, p.spool_dir), spool_cap_bytes=p.spool_cap_bytes)
    policy = load_block(TieringPolicy, p.tiering_policy, param="tiering_policy") if p.tiering_policy else TieringPolicy()
    if (f := downlink.current_file(Path(node.spool_dir), "policy", "tiering")) is not None:
        # the core's policy for this node, downlinked and verified: it wins over the node's own block
        policy = TieringPolicy.model_validate_json(f.read_bytes())
        get_run_logger().info("node %s: tiering policy %s from the downlink (%s)", node.node_id, policy.version,
                              f.parent.name)
    store = load_block(ObjectStore, p.object_store, param="object_store") if p.object_store else None
    return node, policy, store


def _about(p: EdgeIngestParams) -> str:
    node = p.node_id or p.edge_node
    return f"{node}, {p.n_samples} samples" if p.source == "generate" else f"{node}, {p.source_path}"


@flow(name="edge_ingest", task_runner=from_environment(),  # EDGEHAUL_TASK_RUNNER of the run's process
       flow_run_name=run_namer("edge_ingest", EdgeIngestParams, _about))
def edge_ingest(params: EdgeIngestParams | None = None) -> dict[str, Any]:
    """Preprocess, score, tier and bundle raw observations into the node's durable spool."""
    p = params or EdgeIngestParams()
    logger = get_run_logger()
    node, policy, store = _resolve(p)
    contract = contract_by_id(p.contract)
    # A model scorer's version (its model id) is fixed for the run: resolve it once, not per batch.
    first = make_scorer(policy, node, contract, store)
    fixed_version = None if isinstance(first, ContextualScorer) else first.version
    drop = _open_drop(p, node, contract)
    with run_logging.for_node(node.node_id):
        done, policy = _ingest_batches(p, node, policy, store, contract, fixed_version, drop)
    files, problem = _close_drop(p, drop)
    upkeep = spool_upkeep(node)
    report = merge_reports([t.report for t in done])
    summary = _summary(node.node_id, done, upkeep, files, report, policy.budget_share)
    n_in, rejects = summary["samples_in"], summary["rejected"]
    summary_table(f"edge-ingest-{node.node_id}", tier_rows(report),
                  f"edge_ingest {node.node_id}: {n_in} samples, {sum(rejects.values())} rejected, "
                  f"scorer's own value per uplinked byte {100 * report.gain:+.0f}% vs no tiering")
    report_node_run(node, summary, upkeep.ledger, to_outbox=p.route_events_to_outbox, problem=problem,
                    problems=drop.problems() if drop is not None and problem else None, files=files)
    # the low tier's draw sends part of it in full: counted apart, "low 2361" read as 79% kept on a node that kept 40%
    logger.info("node %s: %d samples in %d batches, %d rejected, %d bundles, tiers %s (low drawn in full: %d), "
                "value/MB %.1f vs %.1f baseline", node.node_id, n_in, len(done), sum(rejects.values()),
                summary["bundles"], report.samples, report.sampled_low, report.value_per_mb,
                report.baseline_value_per_mb)
    if problem:  # the run's state says which files were rejected and why (the UI's run list shows it)
        return Completed(message=problem[:2000], data=summary)  # type: ignore[return-value]
    return summary


def _open_drop(p: EdgeIngestParams, node: EdgeNode, contract: Contract) -> DropRun | None:
    """A drop folder's run (claims its files once), or None for the other sources."""
    if p.source != "drop":
        return None
    logger = get_run_logger()
    folder = DropFolder(cast(str, p.source_path), cast(str, p.done_path), node.spool_dir, settle_s=p.settle_s,
                        contract=contract)
    drop = DropRun(folder, contract, p.batch_size, logger.warning)
    if (c := drop.claimed) and (c.waiting or c.duplicates or c.rejected):
        logger.info("drop folder: %d files to read, %d still being written, %d already read, %d rejected %s",
                    len(c.files), len(c.waiting), len(c.duplicates), len(c.rejected), c.rejected or "")
    return drop


def _ingest_batches(p: EdgeIngestParams, node: EdgeNode, policy: TieringPolicy, store: ObjectStore | None,
                    contract: Contract, fixed_version: str | None,
                    drop: DropRun | None) -> tuple[list[EdgeBatch], TieringPolicy]:
    """One `edge-ingest-batch` task run per raw batch; a cached result whose receipt the spool lost is recomputed.
    Returns the batches and the policy they ran under (with `link_profile`: the link's budget)."""
    logger = get_run_logger()
    # the node's own disk unless named: an edge cache is never shared with the core or another node
    opts: dict[str, Any] = {"refresh_cache": p.refresh_cache,
                            "result_storage": p.result_storage or edge_result_storage(node.spool_dir)}
    batch_task = ingest_batch.with_options(**opts)
    expected = max(1, -(-p.n_samples // p.batch_size)) if p.source == "generate" else 0
    done: list[EdgeBatch] = []
    # the progress artifact moves every 10%: an API call each, not one per batch on long runs
    with Progress(f"edge-ingest-{node.node_id}-progress", total=expected,
                  description=f"edge_ingest on {node.node_id}: batches done", min_step=10) as progress:
        for i, (raw, part) in enumerate(_raw_batches(p, node, drop)):
            if i == 0 and p.link_profile:  # the budget the link plans for, fixed for the run
                policy = node_link_budget(policy, load_block(LinkProfile, p.link_profile, param="link_profile"), node,
                                          raw, contract, p.observed_bytes_per_s, logger.info)
            raw_key, hashes = batch_key(raw, contract.payload_column or "")
            version = fixed_version or scorer_key(policy, node, context_key(raw_key, contract, node.node_id), store,
                                                  contract)
            res = batch_task(raw, raw_key, contract.id, policy, node, version, store, hashes)
            if not res.is_intact():  # a cached result whose spool has lost its receipt: wiped or replaced
                logger.info("batch %d: receipt %s missing from the spool; recomputing", i, res.receipt)
                res = ingest_batch.with_options(**{**opts, "refresh_cache": True})(
                    raw, raw_key, contract.id, policy, node, version, store, hashes)
            del raw, hashes
            done.append(res)
            if part is not None:  # a drop folder's batch: its file is recorded once all of it is through
                assert drop is not None
                drop.done(part, res.n_input, res.accepted, res.reject_counts)
            if expected:  # a folder source has no known total: the artifact shows 100% at the end
                progress.advance()
    return done, policy


def _summary(node_id: str, done: list[EdgeBatch], upkeep: SpoolUpkeep, files: dict[str, Any],
             report: TierReport, budget_share: float | None) -> dict[str, Any]:
    return {
        "node_id": node_id, "batches": len(done), "samples_in": sum(s.n_input for s in done),
        "rejected": sum_counts(s.reject_counts for s in done), "bundles": sum(len(t.bundles) for t in done),
        "bundles_refused": sum(1 for t in done for b in t.bundles if not b["spooled"]), "pending": upkeep.pending,
        "expired": upkeep.expired, "spool_used_fraction": round(upkeep.used_fraction, 4), "ledger": upkeep.ledger,
        "budget_share": budget_share,
        "bundle_ids": [b["bundle_id"] for t in done for b in t.bundles], **files, **report.summary(),
    }


def _close_drop(p: EdgeIngestParams, drop: DropRun | None) -> tuple[dict[str, Any], str | None]:
    """The drop folder's figures and the run's state message (None: no file with a problem)."""
    if drop is None:
        return {}, None
    drop.folder.close()
    files = drop.summary()
    get_run_logger().info("drop folder: %d files read and moved to %s, %d rejected to %s", files["files_read"],
                          p.done_path, files["files_rejected"], drop.folder.rejected_dir)
    return files, drop.message()


if __name__ == "__main__":
    edge_ingest()
