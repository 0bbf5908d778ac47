"""train_model: train the model of a kind on a dataset version, on the central work pool.

The kind (`dataset_kind`) picks the contract (its newest version); its `training:` section gives the
model family (cnn2d, cnn1d, mlp), the model name and the epochs, batch size, learning rate and width
defaults, which parameters override. A kind without a training section is refused.

Checks placement (refuses edge-* pools; a call outside a deployment needs allow_local), resolves
the dataset version (the newest committed one, once: see `edgehaul.training.catch_up`; `catch_up=False`
trains exactly `dataset_version`), refuses when the team's
TeamQuota would be exceeded (accelerators x max_hours, storage), then trains in this process or as
`torchrun` processes (nproc_per_node > 1 or PET_* rendezvous variables from the job, e.g. a
Kubernetes GPU pool), with checkpoints to the checkpoints zone. A retried run (same run_id, by
default derived from the flow run id) resumes from the last committed checkpoint. Outputs: metrics
table and plot artifacts, the model and lineage.json in the models zone, a MODEL_READY event, and
optionally the model published to the edge (publish=True).

Blocks: ObjectStore `store_block` (trainer credentials), TeamQuota `quota_block` (default: the team
name). Cache policy: none; training is idempotent by run_id (a registered run is not retrained).
"""

from __future__ import annotations

from typing import Any
from uuid import UUID

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from prefect.states import Completed
from pydantic import BaseModel, Field

from edgehaul.blocks import ObjectStore, TeamQuota
from edgehaul.contracts import Contract, ContractError, TrainingSpec, load_contract
from edgehaul.platform.block_loading import load_block
from edgehaul.platform.fields import Name, RunId
from edgehaul.platform.reporting import run_namer
from edgehaul.platform.roles import DEFAULT_TEAM, StoreBlock
from edgehaul.tasks.train import check_team_quota, plan_training, publish, report_training, train_run
from edgehaul.training.catch_up import NOTHING_TO_TRAIN
from edgehaul.training.model import arch_for, estimate_storage_bytes
from edgehaul.training.placement import check_placement
from edgehaul.training.trainer import DEFAULT_PATIENCE, TrainConfig


class TrainModelParams(BaseModel):
    team: Name = DEFAULT_TEAM
    dataset_kind: str = Field(default="landsat_patch", min_length=1)
    dataset_version: int | None = Field(default=None, ge=0, description="Delta version; None: latest.")
    run_id: RunId | None = Field(default=None,
                                 description="Checkpoint folder / model id; None: train-<flow run id>.")
    model_name: Name | None = Field(default=None,
                                    description="None: the contract's training.model_name.")
    store_block: str = Field(default=StoreBlock.TRAINER)
    quota_block: str | None = Field(default=None, description="TeamQuota block name; None: the team name.")
    nproc_per_node: int = Field(default=1, ge=1, le=64, description="Processes (accelerators) per node.")
    nnodes: int = Field(default=1, ge=1, le=1024, description="Nodes (torchrun PET_NNODES on the job).")
    max_hours: float = Field(default=1.0, gt=0, le=720, description="Wall-clock limit; the quota request.")
    epochs: int | None = Field(default=None, ge=1, le=10_000, description="None: the contract's.")
    batch_size: int | None = Field(default=None, ge=1, le=65_536, description="None: the contract's.")
    lr: float | None = Field(default=None, gt=0, le=1, description="None: the contract's.")
    seed: int = Field(default=0, ge=0)
    width: int | None = Field(default=None, ge=4, le=512, description="None: the contract's.")
    val_fraction: float = Field(default=0.1, ge=0, lt=1)
    patience: int | None = Field(default=None, ge=0, le=10_000, description="Stop after this many epochs without a "
                                 "better validation macro-F1 whose mean is not above the mean of the as many before "
                                 "(a rising trend goes on); 0: never stop early; None: the trainer's default.")
    checkpoint_every_steps: int | None = Field(default=None, ge=1, description="None: adapt to a 5% cost.")
    num_threads: int | None = Field(default=None, ge=1, le=256)
    allow_local: bool = Field(default=False, description="Allow a run outside any work pool (local call).")
    publish: bool = Field(default=False, description="Publish the model to the edge when done (if it passes "
                          "the publish gate).")
    quality_gate: bool = Field(default=True, description="Register nothing when the best validation macro-F1 is "
                               "not above a label-blind guesser's (off only for plumbing tests).")
    catch_up: bool = Field(default=True, description="Train the newest committed version, once: an older "
                           "dataset_version is superseded by the newest, and a newest version some registered "
                           "model of this name already covers is not trained again. False: train as asked.")


def current_work_pool() -> str | None:
    run_id = flow_run.id
    if not run_id:
        return None
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(UUID(run_id)).work_pool_name


class KindNotTrainable(ContractError):
    """The kind's contract has no training section (or no label to train on)."""


def training_of(kind: str) -> tuple[Contract, TrainingSpec]:
    """The contract a kind trains under and its training section; a kind without one is refused."""
    contract = load_contract(kind)
    if contract.training is None:
        raise KindNotTrainable(f"kind {kind!r} is not trained: its contract {contract.id} ({contract.source}) has no "
                               "training section (training: model, model_name)")
    return contract, contract.training


def _about(p: TrainModelParams) -> str:
    return f"{p.model_name or 'model'} on {p.dataset_kind}@{'latest' if p.dataset_version is None else p.dataset_version}"


@flow(name="train_model", log_prints=True, flow_run_name=run_namer("train_model", TrainModelParams, _about))
def train_model(params: TrainModelParams | None = None) -> dict[str, Any]:
    """Train a kind's model on the central GPU pool; see the module docstring."""
    p = params or TrainModelParams()
    logger = get_run_logger()
    where = check_placement(current_work_pool(), p.allow_local)
    contract, spec = training_of(p.dataset_kind)
    model_name = p.model_name or spec.model_name
    width = p.width or spec.width
    store = load_block(ObjectStore, p.store_block, param="store_block")
    quota = load_block(TeamQuota, p.quota_block or p.team, param="quota_block")
    if quota.team != p.team:
        raise ValueError(f"quota block {p.quota_block or p.team!r} is for team {quota.team!r}, not {p.team!r}")
    run_id = p.run_id or f"train-{flow_run.id or 'local'}"
    accelerators = p.nproc_per_node * p.nnodes
    arch = arch_for(contract, width)
    keep = TrainConfig.model_fields["keep_checkpoints"].default
    # the quota first: a request over it is refused whatever the data (no silent skip of a bad request)
    usage = check_team_quota(store, quota, accelerators, p.max_hours, estimate_storage_bytes(arch, keep))
    uri, plan = plan_training(store, p.dataset_kind, p.dataset_version, model_name, p.catch_up, run_id)
    logger.info("train_model: %s", plan.reason)
    if plan.version is None:  # a newer run already trained the newest version: this one is covered
        out = {"run_id": run_id, "skipped": True, "reason": plan.reason, "model_id": plan.covered_by,
               "dataset_uri": uri, "dataset_version": plan.latest, "requested_version": plan.requested,
               "work_pool": where, "history": []}
        # The reason is the run's final state message too: the UI's run list shows it, and a run this short
        # can exit before its last log lines are shipped. Callers still get the dict (the state's data).
        return Completed(message=f"{NOTHING_TO_TRAIN}: {plan.reason}", data=out)  # type: ignore[return-value]
    version = plan.version
    cfg = TrainConfig(
        run_id=run_id, dataset_uri=uri, dataset_version=version, team=p.team, model_name=model_name,
        contract_id=contract.id, seed=p.seed, epochs=p.epochs or spec.epochs, batch_size=p.batch_size or spec.batch_size,
        lr=p.lr or spec.lr, width=width, augment=spec.augment, val_fraction=p.val_fraction,
        checkpoint_every_steps=p.checkpoint_every_steps, num_threads=p.num_threads, flow_run_id=flow_run.id,
        quality_gate=p.quality_gate, patience=DEFAULT_PATIENCE if p.patience is None else p.patience,
    )
    logger.info("team %s: %.3g accelerator-h used in %s; training %s (%s %s) on %s v%d in %s", p.team,
                usage["accelerator_hours"], usage["month"], run_id, spec.model, model_name, uri, version, where)
    result = train_run.with_options(timeout_seconds=p.max_hours * 3600)(cfg, store, p.nproc_per_node)
    links = report_training(store, result, model_name)
    published = publish(store, model_name, result["model_id"]) if p.publish else None
    final = result["history"][-1] if result["history"] else {}
    logger.info("model %s: %d steps, final %s, checkpoint share %s", result["model_id"], result["steps"], final,
                result["checkpoint"])
    return {
        "run_id": run_id, "model_id": result["model_id"], "model_name": model_name, "kind": contract.kind,
        "contract": contract.id, "model_family": spec.model, "work_pool": where, "dataset_uri": uri,
        "dataset_version": version, "requested_version": plan.requested, "history": result["history"],
        "checkpoint": result["checkpoint"],
        "resumed_from_step": result["resumed_from_step"], "world_size": result["world_size"],
        "rank_files": result["rank_files"],
        "model_uri": result["lineage"].get("model_uri"), "plot_uri": links["plot_uri"], "published": published,
    }


if __name__ == "__main__":
    train_model(TrainModelParams(allow_local=True))
