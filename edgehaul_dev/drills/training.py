"""Trainer drill: kill -9 of the product's trainer (`edgehaul.training.launch.run`, which runs
`edgehaul.training.trainer.train` in-process for one accelerator, as the train_model flow does) at a
random batch of its run, then a second attempt of the same run id resumes from the latest committed
checkpoint. Every sample of the dataset version must be read exactly once per epoch by the run as a
whole: the killed attempt's batches up to its last committed checkpoint, then the resumed attempt's.

The batches are observed, not re-implemented: in each worker process `trainer.stream` (the data
stream the trainer reads) is wrapped to append each batch's position and sample ids to a file before
handing the batch on unchanged. The trainer's own per-epoch counts (`history`) are checked too.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa

from edgehaul.blocks import ObjectStore
from edgehaul.contracts import load_contract
from edgehaul.core import datasets
from edgehaul.training import registry
from edgehaul.training.checkpoints import CheckpointStore
from edgehaul.training.data import trainable
from edgehaul_dev.drills.accounting import Accounting, dataset_ids
from edgehaul_dev.drills.env import DrillEnv, kill, spawn, spool_all, store_dict, store_from
from edgehaul_dev.drills.pipeline import KIND, drain, ingest_landed, open_spool
from edgehaul_dev.drills.report import TrialResult

BATCH = 8


def training_dataset(env: DrillEnv) -> ObjectStore:
    """A small curated dataset (three commits of real bundles, through the product's ingest) to train on."""
    store = env.store("train-data")
    s3 = store.client()
    sp = open_spool(env.trial_dir("train-data") / "spool")
    for chunk in (env.small[0:1], env.small[1:2], env.small[2:3]):
        spool_all(sp, chunk)
        drain(store, sp, sp.root / "uplink")
        ingest_landed(store, s3)
    sp.close()
    return store


def _w_train(store_d: dict[str, str], cfg: dict[str, Any], record: str, out: Any, ready: Any) -> None:
    import torch

    from edgehaul.training import launch, trainer
    from edgehaul.training.data import Position

    torch.set_num_threads(1)
    fd = os.open(record, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    read = trainer.stream

    def observed(fragments: Any, files: list[int], start: Position, batch_size: int, columns: list[str],
                 shuffle_seed: int | None = None) -> Iterator[tuple[Position, pa.RecordBatch]]:
        for pos, batch in read(fragments, files, start, batch_size, columns, shuffle_seed=shuffle_seed):
            # one write(2) per batch: it survives the kill -9 (a torn last line is ignored)
            os.write(fd, json.dumps({"pos": pos.to_dict(), "ids": batch.column("sample_id").to_pylist()}).encode() + b"\n")
            yield pos, batch

    trainer.stream = observed  # observation only: the batches pass unchanged
    ready.set()
    res = launch.run(trainer.TrainConfig(**cfg), store_from(store_d))
    if out is not None:
        out.put({"resumed_from_step": res.resumed_from_step, "steps": res.steps, "history": res.history})


def _records(path: Path) -> list[dict[str, Any]]:
    out = []
    with contextlib.suppress(FileNotFoundError):
        for line in path.read_bytes().split(b"\n"):
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
    return out


def _lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def drill_trainer_kill(env: DrillEnv, rng: random.Random, data: ObjectStore) -> TrialResult:
    """kill -9 of the trainer at a random batch (often inside a checkpoint write: one every 1-4 steps);
    the resumed attempt continues from the latest committed checkpoint."""
    run_id = f"drill-{uuid.uuid4().hex[:8]}"
    ck_store = data.model_copy(update={"prefix": data.prefix + "-ck"})
    version = datasets.open_table(data, KIND).version()
    epochs = rng.choice([1, 2])
    cfg = {"run_id": run_id, "dataset_uri": datasets.table_uri(data, KIND), "dataset_version": version,
           "epochs": epochs, "batch_size": BATCH, "width": 8, "seed": rng.randrange(1000),
           "checkpoint_every_steps": rng.randint(1, 4), "keep_checkpoints": 2, "device": "cpu", "num_threads": 1,
           "emit_events": False, "quality_gate": False, "patience": 0,
           "calibrate": False}  # kills and resumes, not learning: each epoch's reads are what it counts
    ds = dataset_ids(data)
    d = env.trial_dir("train")
    killed_log, resumed_log = d / "killed.jsonl", d / "resumed.jsonl"
    p, _ = spawn(env, _w_train, store_dict(ck_store), cfg, str(killed_log), None)
    at = rng.randint(0, epochs * (len(ds) // BATCH + 3))  # batches read before the kill (beyond the run: none)
    deadline = time.monotonic() + 120
    while p.is_alive() and _lines(killed_log) < at and time.monotonic() < deadline:
        time.sleep(0.002)
    time.sleep(rng.uniform(0.0, 0.02))
    killed = kill(p)

    ck = CheckpointStore(ck_store, run_id, emit_events=False)
    latest = ck.latest()
    problems = []
    ck_step = 0
    if latest is not None:
        try:
            state = ck.load(latest)  # the latest committed checkpoint is intact (sha256 and size checked)
            ck_step = int(state["step"])
        except Exception as e:
            problems.append(f"latest checkpoint unreadable: {e}")
    finished = registry.read_lineage(ck_store, "landcover", run_id) is not None
    out = env.ctx.Queue()
    p2, _ = spawn(env, _w_train, store_dict(ck_store), cfg, str(resumed_log), out)
    res = out.get(timeout=300)
    p2.join(30)

    first = _records(killed_log)
    if finished:  # the kill came after the run registered its model: the second attempt trains nothing
        trained = first
    else:
        trained = first[:ck_step] + _records(resumed_log)
        if res["resumed_from_step"] != (latest.step if latest else None):
            problems.append(f"resumed from step {res['resumed_from_step']}, latest committed {latest}")
        if ck_step and first[ck_step - 1]["pos"] != state["ranks"][0]["position"]:
            problems.append(f"checkpoint position {state['ranks'][0]['position']} is not batch {ck_step}'s")
    # the trainer's own counts: every trainable row once per epoch (accumulators restored on resume)
    table = datasets.read_version(data, KIND, version=version, columns=["sample_id", "label", "pixels", "is_summary"])
    contract = load_contract(KIND)
    n_trainable = sum(trainable(b, contract).num_rows for b in table.to_batches())
    for row in res["history"]:
        if row["train_samples"] + row["val_samples"] != n_trainable:
            problems.append(f"epoch {row['epoch']}: the trainer counted {row['train_samples'] + row['val_samples']} "
                            f"rows, the version has {n_trainable} trainable")
    if len(res["history"]) != epochs:
        problems.append(f"{len(res['history'])} epochs in the trainer's history, {epochs} configured")

    reads = Counter((int(r["pos"]["epoch"]), i) for r in trained for i in r["ids"])
    ids = list(ds)
    lost = [i for i in ids if any(reads[(e, i)] == 0 for e in range(epochs))]
    dup = [i for i in ids if ds[i] > 1 or any(reads[(e, i)] > 1 for e in range(epochs))]
    dup += sorted({i for _, i in reads if i not in ds})  # a row the version does not hold
    a = Accounting(len(ids), len(ids), 0, 0, 0, lost, dup)
    return a.result(killed and not finished, problems)
