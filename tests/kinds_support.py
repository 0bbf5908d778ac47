"""One kind through the whole loop on the real stack, with only the product's entry points (what a node and the core
run): edge_ingest from a drop folder -> spool -> uplink_drain -> core_ingest -> dataset version -> train_model
(published) -> `edgehaul downlink publish --model` -> downlink sync -> the node's model scorer. Nothing kind-specific:
the kind is a contract id and a folder of files."""

from __future__ import annotations

import sqlite3
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from edgehaul.blocks import EdgeNode, LinkProfile, ObjectStore, TeamQuota, TieringPolicy
from edgehaul.contracts import Contract
from edgehaul.edge.spool import Spool

MiB = 2**20


@dataclass
class Loop:
    contract: Contract
    node_id: str
    spool_dir: Path
    edge: dict[str, Any]
    landed: list[str]
    core: dict[str, Any]
    version: int | None
    dataset: pa.Table
    rejected: dict[str, list[tuple[str, str]]]  # sample id -> [(stage, reason)] in the node's ledger
    blocks: dict[str, str]
    drained: dict[str, Any] = field(default_factory=dict)  # uplink_drain's figures
    waiting_bytes: int = 0  # the bundle bytes that waited when the drain began
    train: dict[str, Any] | None = None
    scores: list[float] = field(default_factory=list)
    scorer_version: str | None = None


def blocks(store: ObjectStore, node_id: str, spool_dir: Path, tag: str,
           policy: TieringPolicy | None = None) -> dict[str, str]:
    """The blocks a node and the core load, saved under fresh names."""
    names = {k: f"kd-{k}-{tag}" for k in ("store", "node", "link", "policy", "quota")}
    store.save(names["store"], overwrite=True)
    EdgeNode(node_id=node_id, spool_dir=str(spool_dir), spool_cap_bytes=512 * MiB).save(names["node"], overwrite=True)
    LinkProfile(bandwidth_bps=8 * 200 * MiB, chunk_bytes=256 * 1024).save(names["link"], overwrite=True)
    # by default every row travels in full (no low tier): what the trainer gets is what the node observed
    (policy or TieringPolicy(version=f"kd-{tag}", low_threshold=0.0)).save(names["policy"], overwrite=True)
    TeamQuota(team="geo", accelerator_hours_per_month=100, storage_bytes=10**9).save(names["quota"], overwrite=True)
    return names


def run_loop(store: ObjectStore, contract: Contract, drop: Path, tmp_path: Path, *, node_id: str | None = None,
             batch_size: int = 500, policy: TieringPolicy | None = None,
             passes: Callable[[int, float], Path] | None = None) -> Loop:
    """The node's drop folder to a dataset version: edge_ingest, uplink_drain, core_ingest. With `passes` (the
    bundle bytes spooled and the link's rate cap -> a pass schedule, written once the edge has spooled), the
    drain is by plan: it waits for the pass and thins what the pass cannot carry."""
    from edgehaul.core.datasets import read_version
    from edgehaul.flows.core_ingest import CoreIngestParams, core_ingest
    from edgehaul.flows.edge_ingest import EdgeIngestParams, edge_ingest
    from edgehaul.flows.uplink_drain import UplinkDrainParams, uplink_drain

    tag = uuid.uuid4().hex[:8]
    node_id = node_id or f"kd-{tag}"
    spool_dir = tmp_path / f"spool-{tag}"
    names = blocks(store, node_id, spool_dir, tag, policy)
    edge = edge_ingest(EdgeIngestParams(
        edge_node=names["node"], tiering_policy=names["policy"], contract=contract.id, source="drop",
        source_path=str(drop), done_path=str(tmp_path / f"done-{tag}"), settle_s=0, batch_size=batch_size))
    spool = Spool.from_block(EdgeNode(node_id=node_id, spool_dir=str(spool_dir)))
    try:
        waiting = sum(e.manifest.nbytes for e in spool.pending())
    finally:
        spool.close()
    schedule = str(passes(waiting, LinkProfile.load(names["link"]).rate_cap_fraction)) if passes else None
    drained = uplink_drain(UplinkDrainParams(edge_node=names["node"], link_profile=names["link"],
                                             object_store=names["store"], max_seconds=120, max_active=2,
                                             by_plan=schedule is not None, pass_schedule=schedule,
                                             contact_wait_s=120 if schedule else 0.0))
    assert drained["bundles_failed"] == 0, drained
    landed = list(drained["landed_keys"])
    core = core_ingest(CoreIngestParams(store_block=names["store"], bundle_keys=landed))
    version = core["versions"].get(contract.kind)
    dataset = read_version(store, contract.kind, version) if version is not None else pa.table({})
    spool = Spool.from_block(EdgeNode(node_id=node_id, spool_dir=str(spool_dir)))
    try:
        rejected = spool.ledger.lookup(_ledger_ids(spool_dir))
    finally:
        spool.close()
    return Loop(contract, node_id, spool_dir, edge, landed, core, version, dataset, rejected, names, drained, waiting)


def _ledger_ids(spool_dir: Path) -> list[str]:
    """Every sample id the node's ledger holds (its SQLite file in the spool root, read only): the Ledger has
    lookups by id, and the test must also see ids it did not expect."""
    con = sqlite3.connect(f"file:{spool_dir / 'ledger.sqlite'}?mode=ro", uri=True)
    try:
        return [r[0] for r in con.execute("SELECT DISTINCT sample_id FROM ledger")]
    finally:
        con.close()


def close_the_loop(loop: Loop, store: ObjectStore, epochs: int | None = None, width: int | None = 8) -> None:
    """Train the kind's model on the committed version (the contract's training section; `epochs`, `width`: a
    smaller run), publish it, send it down to the node and score with it."""
    from edgehaul import downlink
    from edgehaul.cli import main
    from edgehaul.edge.preprocess import preprocess
    from edgehaul.flows.train_model import TrainModelParams, train_model
    from edgehaul.tasks.edge import make_scorer

    training, names = loop.contract.training, loop.blocks
    assert training is not None and loop.version is not None
    loop.train = train_model(TrainModelParams(
        team="geo", dataset_kind=loop.contract.kind, model_name=training.model_name, store_block=names["store"],
        quota_block=names["quota"], epochs=epochs, width=width, num_threads=1,
        checkpoint_every_steps=50, allow_local=True, max_hours=0.5, publish=True, catch_up=False,
        dataset_version=loop.version, run_id=f"kd-{loop.contract.kind.replace('_', '-')}-{loop.node_id}"))
    assert main(["downlink", "publish", "--node", loop.node_id, "--model", training.model_name,
                 "--store-block", names["store"]]) == 0
    assert downlink.sync(store, loop.node_id, loop.spool_dir).applied
    node = EdgeNode(node_id=loop.node_id, spool_dir=str(loop.spool_dir))
    scorer = make_scorer(TieringPolicy(scorer="model", model_uri=f"downlink:{training.model_name}"), node,
                         loop.contract)
    loop.scorer_version = scorer.version
    # the node scores its next observations with the model trained on what it sent
    sample = loop.dataset.filter(pc.invert(loop.dataset.column("is_summary"))).slice(0, 64)
    raw = sample.select([n for n in loop.contract.raw_schema.names if n in sample.column_names])
    accepted = preprocess(raw, loop.contract, node_id=loop.node_id).accepted
    loop.scores = [float(v) for v in scorer.score(accepted)]
