"""Training input and checkpoint cost.

1. Samples/s streamed from object storage (Delta version on SeaweedFS, Arrow batches) into the
   trainer, against the same model and steps fed from an in-memory tensor (baseline), and the raw
   stream rate (no training) against in-memory slicing.
2. Checkpoint cost as a share of its interval with the adaptive interval (target < 5%).

Runs against a private SeaweedFS it starts itself. EDGEHAUL_BENCH_QUICK=1 (or --quick) for CI.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Iterable
from pathlib import Path

import pyarrow as pa
import torch
import torch.nn.functional as F

from edgehaul.blocks import ObjectStore
from edgehaul.contracts import load_contract
from edgehaul.training.data import DatasetRef, Position, epoch_order, open_fragments, stream, trainable
from edgehaul.training.model import LandCoverNet, labels_to_targets, pixels_to_tensor
from edgehaul.training.trainer import TrainConfig, train
from edgehaul_dev import localstack


def build(store: ObjectStore, rows: int, files: int) -> str:
    from deltalake import write_deltalake

    from tests.builders import processed_rows

    uri = store.uri("curated", "landsat_patch")
    per = rows // files
    for i in range(files):
        write_deltalake(uri, processed_rows(per, seed=i, start_seq=i * per), storage_options=store.storage_options(),
                        mode="append")
    return uri


def stream_rate(store: ObjectStore, uri: str, version: int, batch: int) -> tuple[float, float]:
    """(streamed, in-memory) samples/s of turning batches into tensors, no training: the same
    decode from object storage vs from an Arrow table already in memory (isolates the I/O)."""
    c = load_contract("landsat_patch")
    frags, cols = open_fragments(DatasetRef(uri, version, store.storage_options()), c)

    def decode(batches: Iterable[pa.RecordBatch]) -> int:
        n = 0
        for b in batches:
            rows = trainable(b, c)
            n += len(pixels_to_tensor(rows.column("pixels"), c))
            labels_to_targets(rows.column("label"), c)
        return n

    t0 = time.perf_counter()
    n = decode(b for _, b in stream(frags, epoch_order(len(frags), 0, 0), Position(0), batch, cols))
    streamed = n / (time.perf_counter() - t0)
    table = pa.Table.from_batches([b for _, b in stream(frags, list(range(len(frags))), Position(0), batch, cols)])
    t0 = time.perf_counter()
    m = decode(table.to_batches(max_chunksize=batch))
    return streamed, m / (time.perf_counter() - t0)


def in_memory_training(store: ObjectStore, uri: str, version: int, cfg: TrainConfig, steps: int) -> float:
    """Samples/s of the same model/optimiser/batch size fed from a preloaded tensor (the baseline)."""
    c = load_contract("landsat_patch")
    frags, cols = open_fragments(DatasetRef(uri, version, store.storage_options()), c)
    xs, ys = [], []
    for _, b in stream(frags, list(range(len(frags))), Position(0), cfg.batch_size, cols):
        rows = trainable(b, c)
        xs.append(pixels_to_tensor(rows.column("pixels"), c))
        ys.append(labels_to_targets(rows.column("label"), c))
    X, Y = torch.cat(xs), torch.cat(ys)
    torch.manual_seed(cfg.seed)
    model = LandCoverNet(width=cfg.width)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    n, done, t0 = 0, 0, time.perf_counter()
    while done < steps:
        for s in range(0, len(X), cfg.batch_size):
            x, y = X[s : s + cfg.batch_size], Y[s : s + cfg.batch_size]
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            n += len(x)
            done += 1
            if done >= steps:
                break
    return n / (time.perf_counter() - t0)


def main() -> None:
    quick = os.environ.get("EDGEHAUL_BENCH_QUICK") == "1" or "--quick" in sys.argv
    rows, files, epochs = (2000, 4, 3) if quick else (12000, 8, 3)
    logging.getLogger("edgehaul").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    print(f"train benchmark ({'quick' if quick else 'full'}): {rows} rows in {files} Delta files, 1 CPU thread")
    with tempfile.TemporaryDirectory(prefix="bench-train-") as d:
        root = Path(d)
        state = localstack.new_state(root, fixed_ports=False)
        state.save()
        localstack.start_s3(state)
        try:
            store = state.store("admin", f"b-{uuid.uuid4().hex[:6]}", inline_keys=True)
            uri = build(store, rows, files)
            version = files - 1
            s_rate, m_rate = stream_rate(store, uri, version, 256)
            print(f"decode only    : streamed {s_rate:10.0f} samples/s | in-memory {m_rate:10.0f} samples/s "
                  f"| ratio {s_rate / m_rate:.3f}")
            for width in (8, 32):
                cfg = TrainConfig(run_id=f"bench-w{width}", dataset_uri=uri, dataset_version=version, epochs=epochs,
                                  batch_size=64, width=width, num_threads=1, val_fraction=0.0, first_checkpoint_steps=10,
                                  emit_events=False)
                # Alternate streamed and in-memory runs, best of two each: a shared machine is noisy.
                runs, bases = [], []
                for rep in range(2):
                    runs.append(train(cfg.model_copy(update={"run_id": f"bench-w{width}-{rep}"}), store))
                    bases.append(in_memory_training(store, uri, version, cfg, runs[-1].steps))
                res = max(runs, key=lambda r: r.samples_per_s)
                base = max(bases)
                ck = res.checkpoint
                print(f"train width {width:2d}: streamed {res.samples_per_s:10.0f} samples/s | in-memory {base:10.0f} "
                      f"samples/s | ratio {res.samples_per_s / base:.3f}")
                adapted = (f"adapted mean {ck['share_mean']:.1%} max {ck['share_max']:.1%}" if ck["checkpoints"] > 1
                           else "run shorter than one adapted interval")
                print(f"  checkpoints  : {ck['checkpoints']} over {res.steps} steps, interval now {ck['interval_steps']}"
                      f" steps; share of interval: calibration ({cfg.first_checkpoint_steps} steps) "
                      f"{ck['share_first']:.1%}, {adapted} (target < 5%)")
        finally:
            localstack.down(root)


if __name__ == "__main__":
    main()
