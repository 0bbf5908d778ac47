"""The training loop: streamed batches, DDP when launched by torchrun, committed checkpoints, resume.

One code path for every launch: `train(cfg, store)` in-process on CPU, or the same function in each
process of `torchrun --nproc_per_node N -m edgehaul.training ...` (rank, world size and the
rendezvous come from the environment torchrun sets; gloo on CPU, nccl on CUDA).

Exactness under DDP: every step all ranks agree on the global count of training rows, and each
rank's loss is sum(w * CE)/global_weight * world, so DDP's gradient average equals the weighted mean
over the global batch even when a rank's shard ran dry (it then steps with an empty batch) or rows
were filtered out. The epoch ends when every rank's shard is exhausted.

What is trained follows the contract (`cfg.contract_id`): the model family of its training section,
inputs decoded by `edgehaul.decode` and standardised by statistics measured on the data, the label
column it names. The estimator: a row the edge kept with probability p stands for 1/p rows of the stream
(Horvitz-Thompson), so 1/p-weighted counts give the stream's class mix and every validation metric is
weighted by 1/p. Where `training.balance_classes` (on by default) asks for balanced training, a row's loss
weighs (1/p)^`weight_power` times its class's weight, the inverse of the class's share of those same
weights, so every class weighs the same in the loss; the decision rule puts the 1/p-weighted (stream's)
class prior back. `weight_power` 1 is Horvitz-Thompson within classes too; 0 counts the landed rows of a
class alike; the default 0.5 sits between: unbiased across classes, biased within a class toward the rows the
edge valued by at most the square root of the spread of p (which the policy's coverage floor bounds), for a
loss that does not hang on the few rows with the smallest p. Without balancing the loss weighs 1/p.

The run, in phases (`train`): set up (model, optimiser, data, statistics, class weights), resume from
the last checkpoint, epochs (shuffled batches, validation metrics per class, checkpoints) until the
epochs are done or `patience` epochs bring no better validation macro-F1 and no rising trend (`_Run.keep_best`;
validation judges a moving average of the weights, `WeightAverage`), then the best epoch's decision rule is
chosen on the validation rows (how much of the class balancing to undo at decision time: `_Run.calibrate`), and
its weights are checked and registered. A run registers nothing when its loss is not
finite (`NonFiniteLoss`) or when its best validation macro-F1 is not above a uniform-prior guesser's
(`QualityGateFailed`). A row whose payload does not decode is skipped and named in the lineage
(`skipped_samples`), never a failed run.
"""

from __future__ import annotations

import copy
import logging
import math
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import torch
import torch.distributed as dist
import torch.nn.functional as F
from pydantic import BaseModel, Field

from edgehaul import events
from edgehaul.blocks import ObjectStore
from edgehaul.contracts import Contract, contract_by_id
from edgehaul.decode import DecodeError
from edgehaul.platform.fields import Name, RunId
from edgehaul.platform.settings import torchrun_env
from edgehaul.training import registry
from edgehaul.training.checkpoints import CheckpointError, CheckpointStore, IntervalController, check_resumable
from edgehaul.training.data import (
    VAL_BLOCK_ROWS,
    DatasetRef,
    Position,
    decodable,
    epoch_order,
    is_validation,
    open_fragments,
    sample_weights,
    shard,
    stream,
    trainable,
    val_block_rows,
)
from edgehaul.training.metrics import chance_of, class_metrics, rare_labels, val_classes_present
from edgehaul.training.model import (
    arch_for,
    build_model,
    empty_inputs,
    input_statistics,
    inputs,
    labels_to_targets,
)

log = logging.getLogger(__name__)

MAX_SKIPPED_NAMED = 100  # undecodable samples named in the lineage (all are counted)


class TrainingFailed(RuntimeError):
    """The run ended without a model worth registering; nothing was registered. Not retryable: the same data
    gives the same outcome."""

    retryable = False


class NonFiniteLoss(TrainingFailed):
    """A batch's loss (or the final weights) is NaN or infinite."""


class QualityGateFailed(TrainingFailed):
    """The best validation macro-F1 is not above a uniform-prior guesser's."""


DEFAULT_PATIENCE = 3  # epochs with no better validation macro-F1 (and no rising trend) before a run stops early


class TrainConfig(BaseModel):
    """Everything that defines a training run (recorded in checkpoints and lineage)."""

    run_id: RunId = Field(description="Checkpoint folder and model id.")
    dataset_uri: str = Field(description="Delta table URI (s3://...).")
    dataset_version: int = Field(ge=0, description="Delta version to train on.")
    team: str = Field(default="default", description="Team billed for accelerator hours.")
    model_name: Name = "landcover"
    contract_id: str = Field(default="landsat_patch.v1")
    seed: int = Field(default=0, ge=0)
    epochs: int = Field(default=3, ge=1, le=10_000)
    batch_size: int = Field(default=64, ge=1, le=65_536)
    lr: float = Field(default=2e-3, gt=0, le=1)
    weight_decay: float = Field(default=1e-4, ge=0, le=1)
    width: int = Field(default=32, ge=4, le=512)
    augment: bool = Field(default=True, description="Random flips/rotations per batch (seeded; cnn2d only).")
    val_fraction: float = Field(default=0.1, ge=0, lt=1,
                                description="Held-out share, by stretches of consecutive readings per node.")
    patience: int = Field(default=DEFAULT_PATIENCE, ge=0, le=10_000,
                          description="Stop after this many epochs without a better validation macro-F1 whose mean "
                          "is not above the mean of the as many before (the best epoch's weights are registered); 0: "
                          "never stop early.")
    quality_gate: bool = Field(default=True, description="Register nothing when the best validation macro-F1 "
                               "is not above a uniform-prior guesser's (`metrics.chance_macro_f1`).")
    calibrate: bool = Field(default=True, description="After training, choose the decision rule on the validation "
                            "rows (`_Run.calibrate`: one more read of the data).")
    shuffle: bool = Field(default=True, description="Permute rows within each file (seeded per epoch).")
    checkpoint_every_steps: int | None = Field(default=None, ge=1, description="Fixed interval; None adapts.")
    max_checkpoint_share: float = Field(default=0.05, gt=0, lt=1, description="Checkpoint cost cap per interval.")
    first_checkpoint_steps: int = Field(default=20, ge=1, description="Calibration interval when adapting.")
    keep_checkpoints: int = Field(default=3, ge=1, le=100)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    num_threads: int | None = Field(default=None, ge=1, le=256)
    flow_run_id: str | None = None
    emit_events: bool = Field(default=True, description="Emit Prefect events (off where no API is reachable).")
    ema_decay: float = Field(default=0.99, ge=0, lt=1, description=(
        "Validation, early stopping and the registered model use an exponential moving average of the weights "
        "(`WeightAverage`: this decay per optimiser step, warmed up); 0: the raw weights of the last step."))
    weight_power: float = Field(default=0.5, ge=0, le=1, description=(
        "With balanced classes, a row's loss weight is (1/inclusion_p)^this x its class weight: 0 counts a "
        "class's landed rows alike (the class mix still from 1/p), 1 is Horvitz-Thompson within classes; 0.5 "
        "bounds the within-class bias by the square root of p's spread (docs/ARCHITECTURE.md)."))
    rank_by: Literal["macro_f1", "balanced_loss"] = Field(default="macro_f1", description=(
        "What early stopping ranks epochs by on the validation rows: macro-F1, or the class-balanced cross-entropy "
        "(each class's weighted mean loss, averaged over classes; lower ranks higher)."))


@dataclass
class DistContext:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str | None = None

    @classmethod
    def from_env(cls, device: str = "auto") -> DistContext:
        """Rank/world from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT)."""
        env = torchrun_env()
        world, rank, local_rank = env.world_size, env.rank, env.local_rank
        use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
        if device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("device 'cuda' requested but torch sees no CUDA device")
        dev = torch.device(f"cuda:{local_rank}") if use_cuda else torch.device("cpu")
        if use_cuda:
            torch.cuda.set_device(dev)
        backend = None
        if world > 1:
            backend = "nccl" if use_cuda else "gloo"
            if not dist.is_initialized():
                dist.init_process_group(backend=backend, init_method="env://")
        return cls(rank, world, local_rank, dev, backend)

    def all_sum(self, values: list[float]) -> list[float]:
        if self.world == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device if self.backend == "nccl" else "cpu")
        dist.all_reduce(t)
        return [float(v) for v in t.cpu().tolist()]

    def gather(self, obj: Any) -> list[Any]:
        if self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj: Any) -> Any:
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def _rng_state(device: torch.device) -> dict[str, Any]:
    np_state: Any = np.random.get_state()
    out: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": [str(np_state[0]), torch.from_numpy(np.asarray(np_state[1], dtype=np.int64)), int(np_state[2]),
                  int(np_state[3]), float(np_state[4])],
        "python": random.getstate(),
    }
    if device.type == "cuda":
        out["cuda"] = torch.cuda.get_rng_state(device)
    return out


def _set_rng_state(s: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(s["torch"])
    n = s["numpy"]
    np.random.set_state((n[0], n[1].numpy().astype(np.uint32), n[2], n[3], n[4]))
    py = s["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    if device.type == "cuda" and "cuda" in s:
        torch.cuda.set_rng_state(s["cuda"], device)


def _augment(x: torch.Tensor) -> torch.Tensor:
    k = int(torch.randint(0, 4, (1,)).item())
    if k:
        x = torch.rot90(x, k, dims=(2, 3))
    if float(torch.rand(1).item()) < 0.5:
        x = torch.flip(x, dims=(3,))
    return x


class WeightAverage:
    """An exponential moving average of a model's weights, the copy that validation judges and the registry keeps.

    Why: one optimiser step on a small, weighted batch moves a model more than its validation can tell, so the
    raw weights of an epoch's last step are one noisy draw; the average is many, and ranks epochs and decides more
    steadily. The decay is warmed up, min(decay, (1 + t) / (10 + t)) at update t, so the first steps' random weights
    do not linger. Buffers (none in the shipped models) are copied as they are."""

    def __init__(self, model: torch.nn.Module, decay: float) -> None:
        self.model = copy.deepcopy(model).eval()  # dropout off: the copy only ever predicts
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.decay, self.updates = decay, 0

    def update(self, src: torch.nn.Module) -> None:
        self.updates += 1
        keep = min(self.decay, (1 + self.updates) / (10 + self.updates))
        with torch.no_grad():
            for avg, p in zip(self.model.parameters(), src.parameters(), strict=True):
                avg.lerp_(p.detach(), 1.0 - keep)
            for avg_b, b in zip(self.model.buffers(), src.buffers(), strict=True):
                avg_b.copy_(b)

    def reset(self, src: torch.nn.Module) -> None:
        """Start again from `src`'s weights (a resumed run whose checkpoint holds no average)."""
        self.model.load_state_dict(src.state_dict())
        self.updates = 0

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "updates": self.updates}

    def load(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.updates = int(state["updates"])


@dataclass
class _Acc:
    """Per-rank sums of one epoch (reduced across ranks at the epoch's end)."""

    loss: float = 0.0  # sum of weighted cross-entropy
    correct: float = 0.0
    n: float = 0.0
    val_loss: float = 0.0
    val_correct: float = 0.0
    val_n: float = 0.0
    steps: int = 0
    wsum: float = 0.0  # sum of training rows' weights
    val_confusion: list[float] = field(default_factory=list)  # weighted, row-major [true][predicted]
    val_rows: list[float] = field(default_factory=list)  # validation rows per true class, unweighted
    val_class_loss: list[float] = field(default_factory=list)  # weighted cross-entropy per true class...
    val_class_w: list[float] = field(default_factory=list)  # ...and the weights it is summed over

    @classmethod
    def restore(cls, d: dict[str, Any], n_classes: int) -> _Acc:
        acc = cls(**d)
        if "wsum" not in d:  # a checkpoint of an unweighted (pre-weights) run: every weight was 1
            acc.wsum = acc.n
        if not acc.val_confusion:
            acc.val_confusion = [0.0] * n_classes * n_classes
        if not acc.val_rows:  # a checkpoint from before the count: the epoch's ranking waits for the next one
            acc.val_rows = [0.0] * n_classes
        if not acc.val_class_loss:  # ... and before the per-class loss
            acc.val_class_loss, acc.val_class_w = [0.0] * n_classes, [0.0] * n_classes
        return acc

    def as_list(self) -> list[float]:
        return [self.loss, self.correct, self.n, self.val_loss, self.val_correct, self.val_n, self.wsum,
                *self.val_confusion, *self.val_rows, *self.val_class_loss, *self.val_class_w]


def balanced_loss(sums: list[float]) -> float:
    """Mean over the classes present of each class's weighted mean cross-entropy: `sums` is the per-class weighted
    losses, then the per-class weights. A proper score of every class alike, as balanced training weighs them; NaN
    where no validation row was seen."""
    half = len(sums) // 2
    loss, w = np.asarray(sums[:half], dtype=np.float64), np.asarray(sums[half:], dtype=np.float64)
    seen = w > 0
    return float((loss[seen] / w[seen]).mean()) if seen.any() else math.nan


@dataclass
class TrainResult:
    run_id: str
    model_id: str
    history: list[dict[str, float]]
    steps: int
    resumed_from_step: int | None
    world_size: int
    checkpoint: dict[str, float | int]
    checkpoint_failures: int
    samples_per_s: float
    accelerator_hours: float
    lineage: dict[str, Any]
    rank_files: list[dict[str, list[str]]]  # per rank: epoch -> data files it read


DECISION_TAUS = (0.0, 0.25, 0.5, 0.75, 1.0)  # shares of the balancing undone at decision time (`_Run.calibrate`)
RANKING_MIN_ROWS = 5  # validation rows per class, at least, before early stopping ranks epochs by them
CALIBRATION_MIN_ROWS = 10  # validation rows of every class present, at least, before tau is chosen on them

@dataclass
class _Part:
    """One side (training or validation) of a batch, on the device."""

    x: torch.Tensor
    y: torch.Tensor
    w: torch.Tensor  # per-row loss weight (1/inclusion_p)


def _part(rows: pa.RecordBatch, contract: Contract, arch: dict[str, Any], device: torch.device) -> _Part:
    assert contract.label_column is not None
    with np.errstate(over="ignore"):
        w = sample_weights(rows).astype(np.float32)
    if not np.isfinite(w).all():  # 1/p overflows float32 (p below ~3e-39): it would make the loss or metrics NaN
        i = int(np.flatnonzero(~np.isfinite(w))[0])
        raise NonFiniteLoss(f"sample {rows.column('sample_id')[i].as_py()}: loss weight 1/inclusion_p is not finite "
                            f"in float32 ({int((~np.isfinite(w)).sum())} of {len(w)} rows of the batch): "
                            "nothing registered")
    return _Part(inputs(rows, contract, arch).to(device),
                 labels_to_targets(rows.column(contract.label_column), contract).to(device),
                 torch.from_numpy(w).to(device))


def _decoded(rows: pa.RecordBatch, contract: Contract, arch: dict[str, Any], device: torch.device,
             skipped: dict[str, str]) -> _Part:
    """`_part`, skipping (and adding to `skipped`: sample id -> why) rows whose payload does not decode."""
    try:
        return _part(rows, contract, arch, device)
    except DecodeError:
        good, bad = decodable(rows, contract)
        for b in bad:
            if b["sample_id"] not in skipped:
                log.warning("sample %s skipped: its payload does not decode (%s)", b["sample_id"], b["reason"])
            skipped[b["sample_id"]] = b["reason"]
        return _part(good, contract, arch, device)


def _prepare(batch: pa.RecordBatch, contract: Contract, arch: dict[str, Any], val_fraction: float,
             device: torch.device, skipped: dict[str, str] | None = None,
             val_block: int = VAL_BLOCK_ROWS) -> tuple[_Part, _Part]:
    rows = trainable(batch, contract)
    val = is_validation(rows, val_fraction, val_block)
    tr, va = rows.take(pa.array(np.flatnonzero(~val))), rows.take(pa.array(np.flatnonzero(val)))
    sk = skipped if skipped is not None else {}
    return _decoded(tr, contract, arch, device, sk), _decoded(va, contract, arch, device, sk)


def _empty(contract: Contract, arch: dict[str, Any], device: torch.device) -> _Part:
    return _Part(empty_inputs(contract, arch).to(device), torch.zeros(0, dtype=torch.long, device=device),
                 torch.zeros(0, device=device))


def weighted_loss_sum(logits: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sum_i w_i * CE_i: with every weight 1, the plain summed cross-entropy."""
    return (F.cross_entropy(logits, y, reduction="none") * w).sum()


def _sample_rows(fragments: list[Any], columns: list[str], contract: Contract, max_rows: int,
                 batch_size: int = 4096) -> Iterator[pa.RecordBatch]:
    """Trainable rows from the data files in path order (every rank and a resumed run read the same), up
    to about `max_rows`."""
    n = 0
    for frag in fragments:
        have = frag.physical_schema.names  # a file from before a column was added lacks it
        for batch in frag.to_batches(columns=[c for c in columns if c in have], batch_size=batch_size):
            rows = trainable(batch, contract)
            if rows.num_rows:
                yield rows
                n += rows.num_rows
            if n >= max_rows:
                return


def _input_statistics(fragments: list[Any], columns: list[str], contract: Contract, arch: dict[str, Any],
                      max_rows: int = 8192) -> dict[str, list[float]]:
    """Input mean/std of up to `max_rows` trainable rows, for `model.standardise`. Every family is
    standardised: a small net learns slowly from inputs far from zero mean and unit spread."""
    parts = [_decoded(rows, contract, arch, torch.device("cpu"), {}).x.numpy()
             for rows in _sample_rows(fragments, columns, contract, max_rows)]
    parts = [p for p in parts if len(p)]
    if not parts:
        return {}
    return input_statistics(np.concatenate(parts)[:max_rows])


def _inverse_shares(counts: np.ndarray, max_weight: float) -> np.ndarray:
    """Inverse share per class, the commonest 1, capped at `max_weight`; an absent class as the rarest present."""
    present = counts > 0
    w = np.ones(len(counts), dtype=np.float64)
    if present.any():
        w[present] = np.minimum(counts[present].max() / counts[present], max_weight)
        w[~present] = w[present].max()
    return w


def _class_weights(fragments: list[Any], columns: list[str], contract: Contract, n_classes: int,
                   max_rows: int = 65_536, max_weight: float = 100.0,
                   power: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """(loss class weights, population class weights, rows per class): inverse class shares of the row weights
    the loss uses, (1/inclusion_p)^power, so the loss weighs every class the same; and of the 1/inclusion_p
    counts (the stream's mix), whose log the decision rule puts back as the prior."""
    assert contract.label_column is not None
    counts = np.zeros((3, n_classes), dtype=np.float64)
    for rows in _sample_rows(fragments, columns, contract, max_rows, batch_size=8192):
        y = labels_to_targets(rows.column(contract.label_column), contract).numpy()
        w = sample_weights(rows)
        w = np.where(np.isfinite(w), w, 0.0)
        np.add.at(counts[0], y, w**power)
        np.add.at(counts[1], y, w)
        np.add.at(counts[2], y, 1.0)
    loss_w, pop_w = (_inverse_shares(c, max_weight) for c in counts[:2])
    log.info("class weights %s (population %s)", [round(float(v), 3) for v in loss_w],
             [round(float(v), 3) for v in pop_w])
    return torch.from_numpy(loss_w.astype(np.float32)), torch.from_numpy(pop_w.astype(np.float32)), counts[2]


ProgressFn = Callable[[float, str], None]
"""Rank 0's progress: (percent of the run's epochs done, what just happened), e.g. for a progress artifact."""


@dataclass
class _Best:
    """The best epoch so far by validation macro-F1, with its weights (rank 0's copy on the CPU)."""

    epoch: int = -1
    macro_f1: float = -math.inf
    state: dict[str, Any] | None = None
    stopped_early: bool = False


class _Run:
    """One training run's state, advanced phase by phase by `train`."""

    def __init__(self, cfg: TrainConfig, store: ObjectStore, progress: ProgressFn | None) -> None:
        self.cfg, self.store, self.progress = cfg, store, progress
        self.started = datetime.now(UTC)
        self.t_start = time.perf_counter()
        self.d = DistContext.from_env(cfg.device)
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        self.contract = contract_by_id(cfg.contract_id)
        self.arch = arch_for(self.contract, cfg.width)
        self.n_classes = int(self.arch["n_classes"])
        self.augment = cfg.augment and self.arch["family"] == "cnn2d"  # flips/rotations only make sense for images
        self.step, self.pos = 0, Position()
        self.history: list[dict[str, float]] = []
        self.acc = _Acc.restore({}, self.n_classes)
        self.best = _Best()
        self.elapsed_before = 0.0
        self.resumed_from: int | None = None
        self.samples, self.train_s = 0, 0.0
        self.since_steps, self.since_train_s = 0, 0.0
        self.rank_files: dict[str, list[str]] = {}
        self.skipped: dict[str, str] = {}  # sample id -> why its payload does not decode

    # ---- phase 1: set up
    def registered(self) -> dict[str, Any] | None:
        d, cfg = self.d, self.cfg
        return d.broadcast(registry.read_lineage(self.store, cfg.model_name, cfg.run_id) if d.rank == 0 else None)

    def setup(self) -> None:
        cfg, d, contract = self.cfg, self.d, self.contract
        # Same seed on every rank for the initial weights; then a per-rank stream for augmentation/dropout.
        torch.manual_seed(cfg.seed)
        self.raw_model = build_model(self.arch).to(d.device)
        self.model: torch.nn.Module = self.raw_model
        if d.world > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.model = DDP(self.raw_model, device_ids=[d.local_rank] if d.device.type == "cuda" else None)
        self.opt = torch.optim.AdamW(self.raw_model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.average = WeightAverage(self.raw_model, cfg.ema_decay) if cfg.ema_decay > 0 else None
        rank_seed = cfg.seed * 1000 + d.rank + 1
        torch.manual_seed(rank_seed)
        np.random.seed(rank_seed)
        random.seed(rank_seed)
        self.ckpts = CheckpointStore(self.store, cfg.run_id, keep=cfg.keep_checkpoints, emit_events=cfg.emit_events)
        ref = DatasetRef(cfg.dataset_uri, cfg.dataset_version, self.store.storage_options())
        self.fragments, self.columns = open_fragments(ref, contract)
        # the held-out stretches are as long as the version allows: a small one still holds some rows out
        self.val_block = val_block_rows(sum(f.count_rows() for f in self.fragments), cfg.val_fraction)
        # every rank reads the same rows: the same statistics and weights
        self.arch.update(_input_statistics(self.fragments, self.columns, contract, self.arch))
        balance = contract.training is None or contract.training.balance_classes
        self.class_w: torch.Tensor | None = None  # the loss's, per class
        self.prior_w: torch.Tensor | None = None  # 1/share of the stream (1/p-weighted): the decision rule's prior
        self.class_rows: np.ndarray | None = None  # rows per class in the version (of a sample of it)
        if balance:
            cw, pw, self.class_rows = _class_weights(self.fragments, self.columns, contract, self.n_classes,
                                                     power=cfg.weight_power)
            self.class_w, self.prior_w = cw.to(d.device), pw
        self.ctl = IntervalController(
            target_share=cfg.max_checkpoint_share,
            interval=cfg.checkpoint_every_steps or cfg.first_checkpoint_steps,
            fixed=cfg.checkpoint_every_steps is not None,
        )
        self.meta = {"dataset_uri": cfg.dataset_uri, "dataset_version": cfg.dataset_version, "world_size": d.world,
                     "seed": cfg.seed, "config": cfg.model_dump(mode="json")}

    # ---- phase 2: resume
    def resume(self) -> None:
        cfg, d = self.cfg, self.d
        latest = d.broadcast(self.ckpts.latest() if d.rank == 0 else None)
        if latest is not None:
            check_resumable(latest.meta, cfg.dataset_uri, cfg.dataset_version, d.world)
            state = self.ckpts.load(latest)
            self.raw_model.load_state_dict(state["model"])
            self.opt.load_state_dict(state["optimizer"])
            if self.average is not None:
                if "average" in state:
                    self.average.load(state["average"])
                else:  # a checkpoint written without an average: it starts from the resumed weights
                    self.average.reset(self.raw_model)
            mine = state["ranks"][d.rank]
            _set_rng_state(mine["rng"], d.device)
            self.pos = Position.from_dict(mine["position"])
            self.acc = _Acc.restore(mine["acc"], self.n_classes)
            self.skipped = dict(mine.get("skipped", {}))
            self.step = int(state["step"])
            self.history = list(state["history"])
            self.elapsed_before = float(state["elapsed_s"])
            if "best" in state:
                self.best = _Best(**state["best"])
            if not self.ctl.fixed:
                self.ctl.interval = int(state["interval"])
            self.resumed_from = self.step
            log.info("run %s rank %d resumes at step %d epoch %d file %d batch %d", cfg.run_id, d.rank, self.step,
                     self.pos.epoch, self.pos.file, self.pos.batch)
            self.report(100.0 * self.pos.epoch / cfg.epochs,
                        f"resumed at step {self.step}, epoch {self.pos.epoch + 1}/{cfg.epochs}")
        if d.rank == 0:
            cleaned = self.ckpts.clean_orphans()
            if any(cleaned.values()):
                log.info("run %s: removed orphans of killed writers %s", cfg.run_id, cleaned)

    def report(self, pct: float, what: str) -> None:
        if self.progress is not None and self.d.rank == 0:
            try:
                self.progress(pct, what)
            except Exception as e:  # a progress display is worth less than the training it shows
                log.warning("run %s: progress not reported: %s", self.cfg.run_id, e)

    def checkpoint(self) -> None:
        d, cfg = self.d, self.cfg
        t0 = time.perf_counter()
        mine = {"rng": _rng_state(d.device), "position": self.pos.to_dict(), "acc": self.acc.__dict__.copy(),
                "skipped": dict(self.skipped)}
        ranks = d.gather(mine)
        interval = self.ctl.interval
        if d.rank == 0:
            state = {
                "model": self.raw_model.state_dict(), "optimizer": self.opt.state_dict(), "ranks": ranks,
                "step": self.step, "history": self.history, "interval": self.ctl.interval,
                "elapsed_s": self.elapsed_before + time.perf_counter() - self.t_start, "best": self.best.__dict__,
                **({"average": self.average.state()} if self.average is not None else {}),
            }
            try:
                self.ckpts.write(state, self.step, {**self.meta, "epoch": self.pos.epoch})
                committed = True
            except CheckpointError as e:
                # Training goes on; the next interval tries again (each failure already emitted an event).
                log.error("%s", e)
                committed = False
            interval = self.ctl.observe(time.perf_counter() - t0, self.since_train_s, self.since_steps)
            if committed:
                log.info("checkpoint committed run=%s step=%d interval=%d", cfg.run_id, self.step, interval)
                self.report(100.0 * self.pos.epoch / cfg.epochs,
                            f"epoch {self.pos.epoch + 1}/{cfg.epochs}, checkpoint committed at step {self.step}")
        self.ctl.interval = int(d.broadcast(interval))
        self.since_steps, self.since_train_s = 0, 0.0

    # ---- phase 3: epochs
    def judged(self) -> torch.nn.Module:
        """The weights validation judges, early stopping keeps and the registry stores: the average, if any."""
        return self.average.model if self.average is not None else self.raw_model

    def validate(self, va: _Part) -> None:
        acc, n = self.acc, self.n_classes
        model = self.judged()
        model.eval()
        with torch.no_grad():
            lv = model(va.x)
            pred = lv.argmax(1)
            acc.val_loss += float(F.cross_entropy(lv, va.y, reduction="sum"))
            acc.val_correct += float((pred == va.y).sum())
            acc.val_n += len(va.y)
            y, w = va.y.cpu(), va.w.double().cpu()
            cm = torch.zeros(n * n, dtype=torch.float64)
            cm.index_add_(0, y * n + pred.cpu(), w)
            acc.val_confusion = [a + b for a, b in zip(acc.val_confusion, cm.tolist(), strict=True)]
            rows = torch.bincount(y, minlength=n).double()
            acc.val_rows = [a + b for a, b in zip(acc.val_rows, rows.tolist(), strict=True)]
            ce = F.cross_entropy(lv, va.y, reduction="none").double().cpu()
            lc = torch.zeros(n, dtype=torch.float64).index_add_(0, y, ce * w)
            wc = torch.zeros(n, dtype=torch.float64).index_add_(0, y, w)
            acc.val_class_loss = [a + b for a, b in zip(acc.val_class_loss, lc.tolist(), strict=True)]
            acc.val_class_w = [a + b for a, b in zip(acc.val_class_w, wc.tolist(), strict=True)]
        self.raw_model.train()

    def step_on(self, tr: _Part, global_w: float) -> None:
        x = _augment(tr.x) if self.augment and len(tr.y) else tr.x
        logits = self.model(x)
        loss_sum = weighted_loss_sum(logits, tr.y, tr.w)
        if not torch.isfinite(loss_sum):
            raise NonFiniteLoss(
                f"run {self.cfg.run_id}: loss {float(loss_sum)} at step {self.step} (epoch {self.pos.epoch}, "
                f"{len(tr.y)} rows, weights up to {float(tr.w.max()) if len(tr.w) else 0:.3g}): nothing registered")
        loss = loss_sum * (self.d.world / global_w)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        if self.average is not None:
            self.average.update(self.raw_model)
        acc = self.acc
        acc.loss += float(loss_sum.detach())
        acc.wsum += float(tr.w.sum())
        acc.correct += float((logits.detach().argmax(1) == tr.y).sum())
        acc.n += len(tr.y)
        self.samples += len(tr.y)

    def epoch(self, epoch: int) -> dict[str, float]:
        cfg, d, contract = self.cfg, self.d, self.contract
        files = shard(epoch_order(len(self.fragments), cfg.seed, epoch), d.rank, d.world)
        self.rank_files[str(epoch)] = [self.fragments[i].path for i in files]
        start = self.pos if self.pos.epoch == epoch else Position(epoch)
        it = stream(self.fragments, files, start, cfg.batch_size, self.columns,
                    shuffle_seed=cfg.seed if cfg.shuffle else None)
        while True:
            t0 = time.perf_counter()
            nxt = next(it, None)
            tr = va = _empty(contract, self.arch, d.device)
            if nxt is not None:
                self.pos, batch = nxt
                tr, va = _prepare(batch, contract, self.arch, cfg.val_fraction, d.device, self.skipped,
                                  self.val_block)
                if self.class_w is not None:  # the loss only: validation metrics stay weighted to the population
                    tr.w = tr.w ** self.cfg.weight_power * self.class_w[tr.y]
            has_batch, global_n, global_w = d.all_sum([float(nxt is not None), float(len(tr.y)), float(tr.w.sum())])
            if has_batch == 0:
                break
            if len(va.y):
                self.validate(va)
            if global_n > 0:
                self.step_on(tr, global_w)
            self.step += 1
            self.acc.steps += 1
            dt = time.perf_counter() - t0
            self.since_steps += 1
            self.since_train_s += dt
            self.train_s += dt
            if self.since_steps >= self.ctl.interval:
                self.checkpoint()
        s = d.all_sum(self.acc.as_list())
        row = {
            "epoch": epoch, "step": self.step,
            "train_loss": s[0] / s[6] if s[6] else float("nan"), "train_acc": s[1] / s[2] if s[2] else float("nan"),
            "val_loss": s[3] / s[5] if s[5] else float("nan"), "val_acc": s[4] / s[5] if s[5] else float("nan"),
            "train_samples": s[2], "val_samples": s[5],
            **class_metrics(np.asarray(s[7 : 7 + self.n_classes**2]).reshape(self.n_classes, self.n_classes),
                            contract.label_values),
            **{f"val_rows_{v}": s[7 + self.n_classes**2 + i] for i, v in enumerate(contract.label_values)},
            "val_balanced_loss": balanced_loss(s[7 + self.n_classes**2 + self.n_classes:]),
        }
        row["val_chance_macro_f1"] = chance_of(row, contract.label_values)
        self.history.append(row)
        if d.rank == 0:
            log.info("run %s epoch %d: loss %.4f acc %.3f val_loss %.4f val_acc %.3f macro_f1 %.3f (chance %.3f) "
                     "rare_recall %.3f (%d samples)", cfg.run_id, epoch, row["train_loss"], row["train_acc"],
                     row["val_loss"], row["val_acc"], row["val_macro_f1"], row["val_chance_macro_f1"],
                     row["val_rare_recall"], int(s[2]))
            self.report(100.0 * (epoch + 1) / cfg.epochs, f"epoch {epoch + 1}/{cfg.epochs}: loss "
                        f"{row['train_loss']:.4f}, val_loss {row['val_loss']:.4f}, val_acc {row['val_acc']:.3f}, "
                        f"macro-F1 {row['val_macro_f1']:.3f} (step {self.step})")
        self.acc = _Acc.restore({}, self.n_classes)
        self.pos = Position(epoch + 1)
        return row

    def ranking_f1(self, row: dict[str, float]) -> float:
        """The epoch's validation macro-F1 as early stopping ranks it: NaN (cannot rank) with fewer than
        `RANKING_MIN_ROWS` validation rows of some class the version holds: a dozen readings cannot rank epochs
        (the barely trained first epochs would win by chance and be registered), and three rows, or none, of a
        rare class let an epoch that never predicts it win (macro-F1 counts the classes present; gait at 10%: half
        of the models answered 'normal' to everything)."""
        rows = np.asarray([row.get(f"val_rows_{v}", 0.0) for v in self.contract.label_values])
        held = self.class_rows > 0 if self.class_rows is not None else rows > 0
        if row.get("val_samples", 0) < RANKING_MIN_ROWS * self.n_classes or (rows[held] < RANKING_MIN_ROWS).any():
            return math.nan
        if self.cfg.rank_by == "balanced_loss":
            return -float(row.get("val_balanced_loss", math.nan))
        return float(row["val_macro_f1"])

    def keep_best(self, row: dict[str, float]) -> bool:
        """Remember the epoch if its validation macro-F1 is the best; True when training should stop: `patience`
        epochs brought no better one, and the mean of those epochs is not above the mean of the `patience` before
        them. Why the trend: macro-F1 on a stretch with a dozen rows of a rare class jumps a few points from epoch
        to epoch, so one lucky epoch stopped a model that was still learning (gait at 10%, FIFO's rows: a stop at
        epoch 24 of 72 on epoch 9's spike scored 0.635 on the test set; the same rows trained on scored 0.755-0.789).
        Every epoch is 'best' while it cannot be ranked (`ranking_f1`): the last is kept."""
        f1 = self.ranking_f1(row)
        if not math.isfinite(f1) or f1 > self.best.macro_f1:
            self.best = _Best(int(row["epoch"]), f1 if math.isfinite(f1) else -math.inf,
                              copy.deepcopy(self.judged().state_dict()) if self.d.rank == 0 else None)
            return False
        p = self.cfg.patience
        if p <= 0 or row["epoch"] - self.best.epoch < p:
            return False
        ranked = [self.ranking_f1(h) for h in self.history[-2 * p:]]  # the history ends with this epoch
        recent, before = ranked[-p:], ranked[:-p]
        if before and all(math.isfinite(f) for f in ranked) and np.mean(recent) > np.mean(before):
            return False  # no new best, but still rising: the best was a spike
        self.best.stopped_early = True
        log.info("run %s: no better validation %s than epoch %d's %.3f for %d epochs, and no rising trend: "
                 "stopping", self.cfg.run_id, self.cfg.rank_by, self.best.epoch, abs(self.best.macro_f1), p)
        return True

    def best_row(self) -> dict[str, float]:
        return next((h for h in self.history if h["epoch"] == self.best.epoch), self.history[-1]) if self.history \
            else {}

    def gate(self) -> dict[str, Any]:
        """The quality gate's verdict on the best epoch; raises when it fails (and the gate is on)."""
        row = self.best_row()
        f1, chance = float(row.get("val_macro_f1", math.nan)), float(row.get("val_chance_macro_f1", math.nan))
        measured = math.isfinite(f1) and math.isfinite(chance)
        verdict = {"measured": measured, "val_macro_f1": f1 if measured else None,
                   "chance_macro_f1": chance if measured else None, "passed": measured and f1 > chance,
                   "epoch": self.best.epoch}
        if self.cfg.quality_gate and measured and not f1 > chance:
            if len(present := val_classes_present(row)) == 1:  # the split cannot judge; the model may be fine
                raise QualityGateFailed(
                    f"run {self.cfg.run_id}: its validation rows hold one class only ({present[0]}), so its quality "
                    "cannot be judged: nothing registered (the held-out stretches of this version missed every "
                    "other class)")
            raise QualityGateFailed(
                f"run {self.cfg.run_id}: best validation macro-F1 {f1:.3f} (epoch {self.best.epoch}) is not above "
                f"a uniform-prior guesser's {chance:.3f}: the model learnt nothing usable, nothing registered")
        return verdict

    # ---- phase 4: the decision rule, then check and register
    def calibrate(self) -> dict[str, float]:
        """The decision rule of the balanced model, chosen on the validation rows: the output bias less tau x
        log(population class weight: 1/p-weighted) for the tau of `DECISION_TAUS` with the best validation macro-F1
        (weighted by 1/p, as every validation metric). Balanced training makes the rare class as likely as the commonest
        a priori (tau 0); tau 1 puts the population's prior back (Bayes). A kind whose classes overlap loses macro-F1 to
        false alarms at tau 0; one whose classes separate keeps tau 0. Written into the model's last layer, so every
        reader of the model file (the edge scorer included) decides the same way. With fewer than `CALIBRATION_MIN_ROWS`
        validation rows of some class, tau stays 0."""
        cfg, d, n = self.cfg, self.d, self.n_classes
        if not cfg.calibrate or self.prior_w is None or cfg.val_fraction <= 0:
            return {}
        shift = torch.log(self.prior_w.to(torch.float64)).cpu()
        cms = np.zeros((len(DECISION_TAUS), n * n))
        support = np.zeros(n)
        files = shard(epoch_order(len(self.fragments), cfg.seed, 0), d.rank, d.world)
        self.raw_model.eval()
        with torch.no_grad():
            for _, batch in stream(self.fragments, files, Position(), cfg.batch_size, self.columns):
                _, va = _prepare(batch, self.contract, self.arch, cfg.val_fraction, d.device, {}, self.val_block)
                if not len(va.y):
                    continue
                logits = self.raw_model(va.x).double().cpu()
                y, w = va.y.cpu(), va.w.double().cpu()
                support += np.bincount(y.numpy(), minlength=n)
                for i, tau in enumerate(DECISION_TAUS):
                    pred = (logits - tau * shift).argmax(1)
                    cms[i] += torch.bincount(y * n + pred, weights=w, minlength=n * n).numpy()
        self.raw_model.train()
        summed = np.asarray(d.all_sum(cms.ravel().tolist())).reshape(len(DECISION_TAUS), n, n)
        rows = np.asarray(d.all_sum(support.tolist()))
        f1 = [class_metrics(cm, self.contract.label_values)["val_macro_f1"] for cm in summed]
        fewest = int(rows[rows > 0].min()) if (rows > 0).any() else 0
        if not all(math.isfinite(f) for f in f1) or fewest < CALIBRATION_MIN_ROWS:
            # a handful of validation rows of a class would pick tau by chance (and tau 1 can hand the commonest
            # class every answer): the balanced model decides as trained
            return {"tau": 0.0, "fewest_validation_rows": fewest}
        best = max(range(len(f1)), key=lambda i: (round(f1[i], 9), -i))  # a tie keeps the smaller correction
        tau = DECISION_TAUS[best]
        if tau:
            last = [m for m in self.raw_model.modules() if isinstance(m, torch.nn.Linear)][-1]
            with torch.no_grad():
                last.bias.sub_((tau * shift).to(last.bias.dtype).to(last.bias.device))
        row = self.best_row()
        if row:  # the registered model's figures: the gate judges the model as it will decide
            row.update({"val_macro_f1_argmax": row.get("val_macro_f1", math.nan), "decision_tau": tau,
                        **class_metrics(summed[best], self.contract.label_values)})
        if d.rank == 0:
            log.info("run %s: decision rule tau %.2f (validation macro-F1 by tau %s)", cfg.run_id, tau,
                     [round(f, 3) for f in f1])
        return {"tau": tau, "fewest_validation_rows": fewest,
                **{f"val_macro_f1_tau_{t}": f for t, f in zip(DECISION_TAUS, f1, strict=True)}}

    def finish(self) -> TrainResult:
        cfg, d, contract = self.cfg, self.d, self.contract
        # every rank calibrates the model rank 0 registers: the best epoch's (averaged) weights
        best = d.broadcast(self.best.state)
        if best is not None:
            self.raw_model.load_state_dict(best)
        decision = self.calibrate()
        if not all(bool(torch.isfinite(p).all()) for p in self.raw_model.parameters()):
            raise NonFiniteLoss(f"run {cfg.run_id}: the trained weights are not finite: nothing registered")
        skipped = {k: v for m in d.gather(self.skipped) for k, v in m.items()}
        all_files = d.gather(self.rank_files)
        finished = datetime.now(UTC)
        elapsed = self.elapsed_before + time.perf_counter() - self.t_start
        acc_hours = elapsed * d.world / 3600
        lineage: dict[str, Any] = {}
        if d.rank == 0:
            gate = self.gate()
            model_file = {
                "arch": self.arch, "state_dict": self.raw_model.state_dict(), "contract": contract.id,
                "label_values": list(contract.label_values), "label_kind": contract.label.kind,
                "model_id": cfg.run_id, "model_name": cfg.model_name,
            }
            final = self.best_row()
            lineage = {
                "run_id": cfg.run_id, "flow_run_id": cfg.flow_run_id, "team": cfg.team,
                "accelerator_hours": acc_hours, "accelerators": d.world, "device": d.device.type,
                "dataset_uri": cfg.dataset_uri, "dataset_version": cfg.dataset_version, "contract": contract.id,
                "kind": contract.kind, "model_family": self.arch["family"], "code_version": registry.code_version(),
                "seed": cfg.seed, "config": cfg.model_dump(mode="json"), "metrics": self.history,
                "final": final, "best_epoch": self.best.epoch, "stopped_early": self.best.stopped_early,
                "quality_gate": gate, "decision_rule": decision, "checkpoint_share": self.ctl.report(),
                "rare_classes": rare_labels(final, contract.label_values) if final else [],
                "skipped_rows": len(skipped),
                "skipped_samples": [{"sample_id": k, "reason": v} for k, v in sorted(skipped.items())][
                    :MAX_SKIPPED_NAMED],
                "started": self.started.isoformat(), "finished": finished.isoformat(), "steps": self.step,
            }
            lineage["storage_bytes"] = self.ckpts.retained_bytes()
            lineage = registry.register_model(self.store, cfg.model_name, cfg.run_id, model_file, lineage)
            if cfg.emit_events:
                events.emit(
                    events.MODEL_READY, f"edgehaul.model.{cfg.model_name}.{cfg.run_id}",
                    {"model_id": cfg.run_id, "model_name": cfg.model_name, "model_uri": lineage["model_uri"],
                     "dataset_version": cfg.dataset_version, "team": cfg.team, "final": lineage["final"]},
                )
        result = TrainResult(
            run_id=cfg.run_id, model_id=cfg.run_id, history=self.history, steps=self.step,
            resumed_from_step=self.resumed_from, world_size=d.world, checkpoint=self.ctl.report(),
            checkpoint_failures=self.ckpts.failures,
            samples_per_s=self.samples / self.train_s if self.train_s else 0.0, accelerator_hours=acc_hours,
            lineage=lineage, rank_files=all_files,
        )
        if d.world > 1:
            dist.barrier()
        return result


def train(cfg: TrainConfig, store: ObjectStore, progress: ProgressFn | None = None) -> TrainResult:
    """Train (or resume) run `cfg.run_id`; rank 0 registers the best epoch's model and emits MODEL_READY, and
    reports each epoch and committed checkpoint to `progress` (never allowed to stop training). Raises
    `NonFiniteLoss` or `QualityGateFailed` (nothing registered) when the run has no model worth keeping."""
    run = _Run(cfg, store, progress)
    done = run.registered()
    if done is not None:
        # A retried flow whose run already registered its model: nothing to train again.
        log.info("run %s already registered model %s; not training again", cfg.run_id, done["model_uri"])
        return TrainResult(
            run_id=cfg.run_id, model_id=cfg.run_id, history=done.get("metrics", []), steps=int(done.get("steps", 0)),
            resumed_from_step=None, world_size=run.d.world, checkpoint=done.get("checkpoint_share", {}),
            checkpoint_failures=0, samples_per_s=0.0, accelerator_hours=0.0, lineage=done, rank_files=[],
        )
    run.setup()
    run.resume()
    if not run.best.stopped_early:
        for epoch in range(run.pos.epoch, cfg.epochs):
            if run.keep_best(run.epoch(epoch)):
                break
    return run.finish()
