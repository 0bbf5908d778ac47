"""The training loop: streamed batches, DDP when launched by torchrun, committed checkpoints, resume.

One code path for every launch: `train(cfg, store)` in-process on CPU, or the same function in each
process of `torchrun --nproc_per_node N -m edgehaul.training ...` (rank, world size and the
rendezvous come from the environment torchrun sets; gloo on CPU, nccl on CUDA).

Exactness under DDP: every step all ranks agree on the global count of training rows, and each
rank's loss is sum(w * CE)/global_weight * world, so DDP's gradient average equals the weighted mean
over the global batch even when a rank's shard ran dry (it then steps with an empty batch) or rows
were filtered out. The epoch ends when every rank's shard is exhausted.

What is trained follows the contract (`cfg.contract_id`): the model family of its training section,
inputs decoded by `edgehaul.decode`, the label column it names; each row's loss weighs
1/inclusion_p (`data.sample_weights`). Each epoch records, besides loss and accuracy, per-class
validation metrics (recall per class, macro-F1, recall of the rarest classes; `metrics.class_metrics`).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
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
from edgehaul.platform.settings import torchrun_env
from edgehaul.training import registry
from edgehaul.training.checkpoints import CheckpointError, CheckpointStore, IntervalController, check_resumable
from edgehaul.training.data import (
    DatasetRef,
    Position,
    epoch_order,
    is_validation,
    open_fragments,
    sample_weights,
    shard,
    stream,
    trainable,
)
from edgehaul.training.metrics import class_metrics, rare_labels
from edgehaul.training.model import (
    arch_for,
    build_model,
    empty_inputs,
    input_statistics,
    inputs,
    labels_to_targets,
)

log = logging.getLogger(__name__)


class TrainConfig(BaseModel):
    """Everything that defines a training run (recorded in checkpoints and lineage)."""

    run_id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$", description="Checkpoint folder and model id.")
    dataset_uri: str = Field(description="Delta table URI (s3://...).")
    dataset_version: int = Field(ge=0, description="Delta version to train on.")
    team: str = Field(default="default", description="Team billed for accelerator hours.")
    model_name: str = Field(default="landcover", pattern=r"^[a-z0-9][a-z0-9-]{0,62}$")
    contract_id: str = Field(default="landsat_patch.v1")
    seed: int = Field(default=0, ge=0)
    epochs: int = Field(default=3, ge=1, le=10_000)
    batch_size: int = Field(default=64, ge=1, le=65_536)
    lr: float = Field(default=2e-3, gt=0, le=1)
    weight_decay: float = Field(default=1e-4, ge=0, le=1)
    width: int = Field(default=32, ge=4, le=512)
    augment: bool = Field(default=True, description="Random flips/rotations per batch (seeded; cnn2d only).")
    val_fraction: float = Field(default=0.1, ge=0, lt=1, description="Held-out share by sample-id hash.")
    checkpoint_every_steps: int | None = Field(default=None, ge=1, description="Fixed interval; None adapts.")
    max_checkpoint_share: float = Field(default=0.05, gt=0, lt=1, description="Checkpoint cost cap per interval.")
    first_checkpoint_steps: int = Field(default=20, ge=1, description="Calibration interval when adapting.")
    keep_checkpoints: int = Field(default=3, ge=1, le=100)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    num_threads: int | None = Field(default=None, ge=1, le=256)
    flow_run_id: str | None = None
    emit_events: bool = Field(default=True, description="Emit Prefect events (off where no API is reachable).")


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

    @classmethod
    def restore(cls, d: dict[str, Any], n_classes: int) -> _Acc:
        acc = cls(**d)
        if "wsum" not in d:  # a checkpoint of an unweighted (pre-weights) run: every weight was 1
            acc.wsum = acc.n
        if not acc.val_confusion:
            acc.val_confusion = [0.0] * n_classes * n_classes
        return acc

    def as_list(self) -> list[float]:
        return [self.loss, self.correct, self.n, self.val_loss, self.val_correct, self.val_n, self.wsum,
                *self.val_confusion]


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


@dataclass
class _Part:
    """One side (training or validation) of a batch, on the device."""

    x: torch.Tensor
    y: torch.Tensor
    w: torch.Tensor  # per-row loss weight (1/inclusion_p)


def _part(rows: pa.RecordBatch, contract: Contract, arch: dict[str, Any], device: torch.device) -> _Part:
    assert contract.label_column is not None
    return _Part(inputs(rows, contract, arch).to(device),
                 labels_to_targets(rows.column(contract.label_column), contract).to(device),
                 torch.from_numpy(sample_weights(rows).astype(np.float32)).to(device))


def _prepare(batch: pa.RecordBatch, contract: Contract, arch: dict[str, Any], val_fraction: float,
             device: torch.device) -> tuple[_Part, _Part]:
    rows = trainable(batch, contract)
    val = is_validation(rows.column("sample_id"), val_fraction)
    tr, va = rows.take(pa.array(np.flatnonzero(~val))), rows.take(pa.array(np.flatnonzero(val)))
    return _part(tr, contract, arch, device), _part(va, contract, arch, device)


def _empty(contract: Contract, arch: dict[str, Any], device: torch.device) -> _Part:
    return _Part(empty_inputs(contract, arch).to(device), torch.zeros(0, dtype=torch.long, device=device),
                 torch.zeros(0, device=device))


def weighted_loss_sum(logits: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sum_i w_i * CE_i: with every weight 1, the plain summed cross-entropy."""
    return (F.cross_entropy(logits, y, reduction="none") * w).sum()


# Families whose inputs are standardised by statistics measured on the data (images are already in [0, 1];
# Landsat's model stays as it was).
STANDARDISED_FAMILIES = ("mlp", "cnn1d")


def _input_statistics(fragments: list[Any], columns: list[str], contract: Contract, arch: dict[str, Any],
                      max_rows: int = 8192) -> dict[str, list[float]]:
    """Input mean/std from the trainable rows of the first data file (sorted by path, so every rank and a
    resumed run measure the same), for `model.standardise`."""
    parts: list[np.ndarray] = []
    n = 0
    have = fragments[0].physical_schema.names  # a file from before a column was added lacks it
    for batch in fragments[0].to_batches(columns=[c for c in columns if c in have], batch_size=2048):
        rows = trainable(batch, contract)
        if rows.num_rows:
            parts.append(inputs(rows, contract, arch).numpy())
            n += rows.num_rows
        if n >= max_rows:
            break
    if not parts:
        return {}
    return input_statistics(np.concatenate(parts)[:max_rows])


def _class_weights(fragments: list[Any], columns: list[str], contract: Contract, n_classes: int,
                   max_rows: int = 65_536) -> torch.Tensor:
    """Inverse population share per class (weighted by 1/inclusion_p), from the first data file, scaled so
    the commonest class weighs 1; a class absent there weighs as much as the rarest present."""
    assert contract.label_column is not None
    counts = np.zeros(n_classes, dtype=np.float64)
    n = 0
    have = fragments[0].physical_schema.names
    for batch in fragments[0].to_batches(columns=[c for c in columns if c in have], batch_size=8192):
        rows = trainable(batch, contract)
        y = labels_to_targets(rows.column(contract.label_column), contract).numpy()
        np.add.at(counts, y, sample_weights(rows))
        n += rows.num_rows
        if n >= max_rows:
            break
    present = counts > 0
    w = np.ones(n_classes, dtype=np.float64)
    if present.any():
        w[present] = counts[present].max() / counts[present]
        w[~present] = w[present].max()
    log.info("class weights %s", [round(float(v), 3) for v in w])
    return torch.from_numpy(w.astype(np.float32))


ProgressFn = Callable[[float, str], None]
"""Rank 0's progress: (percent of the run's epochs done, what just happened), e.g. for a progress artifact."""


def train(cfg: TrainConfig, store: ObjectStore, progress: ProgressFn | None = None) -> TrainResult:
    """Train (or resume) run `cfg.run_id`; rank 0 registers the model and emits MODEL_READY, and reports
    each epoch and committed checkpoint to `progress` (never allowed to stop training)."""
    started = datetime.now(UTC)
    t_start = time.perf_counter()
    d = DistContext.from_env(cfg.device)
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    contract = contract_by_id(cfg.contract_id)
    arch = arch_for(contract, cfg.width)
    n_classes = int(arch["n_classes"])
    augment = cfg.augment and arch["family"] == "cnn2d"  # flips/rotations only make sense for images
    done = d.broadcast(registry.read_lineage(store, cfg.model_name, cfg.run_id) if d.rank == 0 else None)
    if done is not None:
        # A retried flow whose run already registered its model: nothing to train again.
        log.info("run %s already registered model %s; not training again", cfg.run_id, done["model_uri"])
        return TrainResult(
            run_id=cfg.run_id, model_id=cfg.run_id, history=done.get("metrics", []), steps=int(done.get("steps", 0)),
            resumed_from_step=None, world_size=d.world, checkpoint=done.get("checkpoint_share", {}),
            checkpoint_failures=0, samples_per_s=0.0, accelerator_hours=0.0, lineage=done, rank_files=[],
        )

    # Same seed on every rank for the initial weights; then a per-rank stream for augmentation/dropout.
    torch.manual_seed(cfg.seed)
    raw_model = build_model(arch).to(d.device)
    model: torch.nn.Module = raw_model
    if d.world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(raw_model, device_ids=[d.local_rank] if d.device.type == "cuda" else None)
    opt = torch.optim.AdamW(raw_model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    rank_seed = cfg.seed * 1000 + d.rank + 1
    torch.manual_seed(rank_seed)
    np.random.seed(rank_seed)
    random.seed(rank_seed)

    ckpts = CheckpointStore(store, cfg.run_id, keep=cfg.keep_checkpoints, emit_events=cfg.emit_events)
    ref = DatasetRef(cfg.dataset_uri, cfg.dataset_version, store.storage_options())
    fragments, columns = open_fragments(ref, contract)
    if arch["family"] in STANDARDISED_FAMILIES:  # every rank reads the same first file: the same statistics
        arch.update(_input_statistics(fragments, columns, contract, arch))
    class_w = _class_weights(fragments, columns, contract, n_classes) if (
        contract.training is not None and contract.training.balance_classes) else None
    ctl = IntervalController(
        target_share=cfg.max_checkpoint_share,
        interval=cfg.checkpoint_every_steps or cfg.first_checkpoint_steps,
        fixed=cfg.checkpoint_every_steps is not None,
    )

    latest = d.broadcast(ckpts.latest() if d.rank == 0 else None)
    step, pos, acc, history = 0, Position(), _Acc.restore({}, n_classes), []
    elapsed_before = 0.0
    resumed_from: int | None = None
    if latest is not None:
        check_resumable(latest.meta, cfg.dataset_uri, cfg.dataset_version, d.world)
        state = ckpts.load(latest)
        raw_model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        mine = state["ranks"][d.rank]
        _set_rng_state(mine["rng"], d.device)
        pos = Position.from_dict(mine["position"])
        acc = _Acc.restore(mine["acc"], n_classes)
        step = int(state["step"])
        history = list(state["history"])
        elapsed_before = float(state["elapsed_s"])
        if not ctl.fixed:
            ctl.interval = int(state["interval"])
        resumed_from = step
        log.info("run %s rank %d resumes at step %d epoch %d file %d batch %d", cfg.run_id, d.rank, step,
                 pos.epoch, pos.file, pos.batch)
    if d.rank == 0:
        cleaned = ckpts.clean_orphans()
        if any(cleaned.values()):
            log.info("run %s: removed orphans of killed writers %s", cfg.run_id, cleaned)

    def report(pct: float, what: str) -> None:
        if progress is not None and d.rank == 0:
            try:
                progress(pct, what)
            except Exception as e:  # a progress display is worth less than the training it shows
                log.warning("run %s: progress not reported: %s", cfg.run_id, e)

    if resumed_from is not None:
        report(100.0 * pos.epoch / cfg.epochs, f"resumed at step {step}, epoch {pos.epoch + 1}/{cfg.epochs}")
    meta = {"dataset_uri": cfg.dataset_uri, "dataset_version": cfg.dataset_version, "world_size": d.world,
            "seed": cfg.seed, "config": cfg.model_dump(mode="json")}
    since_steps, since_train_s = 0, 0.0
    samples = 0
    rank_files: dict[str, list[str]] = {}
    train_s = 0.0

    def checkpoint() -> None:
        nonlocal since_steps, since_train_s
        t0 = time.perf_counter()
        mine = {"rng": _rng_state(d.device), "position": pos.to_dict(), "acc": acc.__dict__.copy()}
        ranks = d.gather(mine)
        interval = ctl.interval
        if d.rank == 0:
            state = {
                "model": raw_model.state_dict(), "optimizer": opt.state_dict(), "ranks": ranks, "step": step,
                "history": history, "interval": ctl.interval,
                "elapsed_s": elapsed_before + time.perf_counter() - t_start,
            }
            try:
                ckpts.write(state, step, {**meta, "epoch": pos.epoch})
                committed = True
            except CheckpointError as e:
                # Training goes on; the next interval tries again (each failure already emitted an event).
                log.error("%s", e)
                committed = False
            interval = ctl.observe(time.perf_counter() - t0, since_train_s, since_steps)
            if committed:
                log.info("checkpoint committed run=%s step=%d interval=%d", cfg.run_id, step, interval)
                report(100.0 * pos.epoch / cfg.epochs,
                       f"epoch {pos.epoch + 1}/{cfg.epochs}, checkpoint committed at step {step}")
        ctl.interval = int(d.broadcast(interval))
        since_steps, since_train_s = 0, 0.0

    for epoch in range(pos.epoch, cfg.epochs):
        files = shard(epoch_order(len(fragments), cfg.seed, epoch), d.rank, d.world)
        rank_files[str(epoch)] = [fragments[i].path for i in files]
        it = stream(fragments, files, pos if pos.epoch == epoch else Position(epoch), cfg.batch_size, columns)
        while True:
            t0 = time.perf_counter()
            nxt = next(it, None)
            tr = va = _empty(contract, arch, d.device)
            if nxt is not None:
                pos, batch = nxt
                tr, va = _prepare(batch, contract, arch, cfg.val_fraction, d.device)
                if class_w is not None:  # the loss only: validation metrics stay weighted to the population
                    tr.w = tr.w * class_w.to(d.device)[tr.y]
            has_batch, global_n, global_w = d.all_sum([float(nxt is not None), float(len(tr.y)), float(tr.w.sum())])
            if has_batch == 0:
                break
            if len(va.y):
                raw_model.eval()
                with torch.no_grad():
                    lv = raw_model(va.x)
                    pred = lv.argmax(1)
                    acc.val_loss += float(F.cross_entropy(lv, va.y, reduction="sum"))
                    acc.val_correct += float((pred == va.y).sum())
                    acc.val_n += len(va.y)
                    cm = torch.zeros(n_classes * n_classes, dtype=torch.float64)
                    cm.index_add_(0, (va.y * n_classes + pred).cpu(), va.w.double().cpu())
                    acc.val_confusion = [a + b for a, b in zip(acc.val_confusion, cm.tolist(), strict=True)]
                raw_model.train()
            if global_n > 0:
                x = _augment(tr.x) if augment and len(tr.y) else tr.x
                logits = model(x)
                loss_sum = weighted_loss_sum(logits, tr.y, tr.w)
                loss = loss_sum * (d.world / global_w)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                acc.loss += float(loss_sum.detach())
                acc.wsum += float(tr.w.sum())
                acc.correct += float((logits.detach().argmax(1) == tr.y).sum())
                acc.n += len(tr.y)
                samples += len(tr.y)
            step += 1
            acc.steps += 1
            dt = time.perf_counter() - t0
            since_steps += 1
            since_train_s += dt
            train_s += dt
            if since_steps >= ctl.interval:
                checkpoint()
        s = d.all_sum(acc.as_list())
        row = {
            "epoch": epoch, "step": step,
            "train_loss": s[0] / s[6] if s[6] else float("nan"), "train_acc": s[1] / s[2] if s[2] else float("nan"),
            "val_loss": s[3] / s[5] if s[5] else float("nan"), "val_acc": s[4] / s[5] if s[5] else float("nan"),
            "train_samples": s[2], "val_samples": s[5],
            **class_metrics(np.asarray(s[7:]).reshape(n_classes, n_classes), contract.label_values),
        }
        history.append(row)
        if d.rank == 0:
            log.info("run %s epoch %d: loss %.4f acc %.3f val_loss %.4f val_acc %.3f macro_f1 %.3f rare_recall %.3f "
                     "(%d samples)", cfg.run_id, epoch, row["train_loss"], row["train_acc"], row["val_loss"],
                     row["val_acc"], row["val_macro_f1"], row["val_rare_recall"], int(s[2]))
            report(100.0 * (epoch + 1) / cfg.epochs, f"epoch {epoch + 1}/{cfg.epochs}: loss {row['train_loss']:.4f}, "
                   f"val_loss {row['val_loss']:.4f}, val_acc {row['val_acc']:.3f} (step {step})")
        acc = _Acc.restore({}, n_classes)
        pos = Position(epoch + 1)

    all_files = d.gather(rank_files)
    finished = datetime.now(UTC)
    elapsed = elapsed_before + time.perf_counter() - t_start
    acc_hours = elapsed * d.world / 3600
    lineage: dict[str, Any] = {}
    if d.rank == 0:
        model_file = {
            "arch": arch, "state_dict": raw_model.state_dict(), "contract": contract.id,
            "label_values": list(contract.label_values), "label_kind": contract.label.kind,
            "model_id": cfg.run_id, "model_name": cfg.model_name,
        }
        lineage = {
            "run_id": cfg.run_id, "flow_run_id": cfg.flow_run_id, "team": cfg.team, "accelerator_hours": acc_hours,
            "accelerators": d.world, "device": d.device.type, "dataset_uri": cfg.dataset_uri,
            "dataset_version": cfg.dataset_version, "contract": contract.id, "kind": contract.kind,
            "model_family": arch["family"], "code_version": registry.code_version(),
            "seed": cfg.seed, "config": cfg.model_dump(mode="json"), "metrics": history,
            "final": history[-1] if history else {}, "checkpoint_share": ctl.report(),
            "rare_classes": rare_labels(history[-1], contract.label_values) if history else [],
            "started": started.isoformat(), "finished": finished.isoformat(), "steps": step,
        }
        lineage["storage_bytes"] = ckpts.retained_bytes()
        lineage = registry.register_model(store, cfg.model_name, cfg.run_id, model_file, lineage)
        if cfg.emit_events:
            events.emit(
                events.MODEL_READY, f"edgehaul.model.{cfg.model_name}.{cfg.run_id}",
                {"model_id": cfg.run_id, "model_name": cfg.model_name, "model_uri": lineage["model_uri"],
                 "dataset_version": cfg.dataset_version, "team": cfg.team, "final": lineage["final"]},
            )
    result = TrainResult(
        run_id=cfg.run_id, model_id=cfg.run_id, history=history, steps=step, resumed_from_step=resumed_from,
        world_size=d.world, checkpoint=ctl.report(), checkpoint_failures=ckpts.failures,
        samples_per_s=samples / train_s if train_s else 0.0, accelerator_hours=acc_hours, lineage=lineage,
        rank_files=all_files,
    )
    if d.world > 1:
        dist.barrier()
    return result
