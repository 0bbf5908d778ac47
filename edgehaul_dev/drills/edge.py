"""Edge drills: kill -9 of the edge ingest (the product's `edgehaul.edge.batch.ingest_batch`, the body
of the edge task: preprocess, score, tier, bundle, spool) while it runs, and a spool far smaller than
the data offered to it."""

from __future__ import annotations

import random
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from edgehaul.blocks import TieringPolicy
from edgehaul.contracts import load_contract
from edgehaul.edge.batch import ingest_batch
from edgehaul.edge.preprocess import batch_key
from edgehaul.edge.scoring import NoveltyScorer
from edgehaul.edge.spool import Spool
from edgehaul_dev.drills.accounting import account
from edgehaul_dev.drills.env import DrillEnv, ids_of, kill, spawn
from edgehaul_dev.drills.pipeline import KIND, drain, ingest_landed, open_spool
from edgehaul_dev.drills.report import TrialResult

# No low tier: a low-tier sample is by design both a summary row (uplinked) and a full row in the
# node's raw store, which the accounting would count twice; the disk-full drill spools tiered bundles.
EDGE_POLICY = TieringPolicy(low_threshold=0.0)


def read_raw(path: str) -> pa.Table:
    with pa.ipc.open_file(path) as f:
        return f.read_all()


def edge_ingest(spool: Spool, paths: Sequence[str], before_batch: Callable[[int], None] | None = None) -> None:
    """What the edge flow runs per raw batch (tasks/edge.py `ingest_batch`'s body), over each batch
    in order with a fresh novelty state, as a rerun after a crash does (its state was not saved)."""
    contract = load_contract(KIND)
    scorer = NoveltyScorer(contract)
    for i, path in enumerate(paths):
        if before_batch is not None:
            before_batch(i)
        raw = read_raw(path)
        key, hashes = batch_key(raw)
        ingest_batch(raw, contract, EDGE_POLICY, spool, scorer, key=key, hashes=hashes, node_id="node-a")


def _w_edge_ingest(root: str, paths: list[str], at: int, started: Any, ready: Any) -> None:
    sp = open_spool(Path(root))
    ready.set()
    edge_ingest(sp, paths, lambda i: started.set() if i == at else None)
    sp.close()


def raw_ids(paths: Sequence[str]) -> list[str]:
    return [i for p in paths for i in read_raw(p).column("sample_id").to_pylist()]


def drill_edge_kill(env: DrillEnv, rng: random.Random) -> TrialResult:
    """kill -9 of the edge ingest while it runs (preprocessing, scoring, bundling or writing its spool);
    the rerun ingests the same raw batches again (bundle ids are content-derived: idempotent)."""
    d, store = env.trial_dir("edge"), env.store("edge")
    paths = rng.sample(env.raw, rng.randint(2, 4))
    # Kill while batch `at` (random) is in flight, the batches before it spooled. A fixed sleep from the
    # start struck after the work in ~4 of 5 trials (a batch takes ~0.1-0.3 s here) and a 4-trial suite
    # run could see no kill mid-operation at all; a delay timed in this (thread-busy) parent is no
    # better, so the worker says when batch `at` starts and the kill follows within 50 ms.
    at, started = rng.randrange(len(paths)), env.ctx.Event()
    p, _ = spawn(env, _w_edge_ingest, str(d / "spool"), paths, at, started)
    started.wait(60)
    time.sleep(rng.uniform(0.0, 0.05))
    killed = kill(p)
    sp = open_spool(d / "spool")  # recovery at open
    problems = [] if all(sp.read(e.bundle_id) for e in sp.pending()) else ["unreadable spool entry after the kill"]
    edge_ingest(sp, paths)  # the rerun of the edge ingest
    drain(store, sp, d / "uplink")
    ingest_landed(store, env.s3)
    a = account(store, raw_ids(paths), [sp], env.s3)
    sp.close()
    return a.result(killed, problems)


def drill_disk_full(env: DrillEnv, rng: random.Random) -> TrialResult:
    """A spool far smaller than the offered data: the cap holds before the disk fills, every refused or
    displaced sample is in the ledger, and the spool's byte count is the bytes on disk."""
    d, store = env.trial_dir("full"), env.store("full")
    avg = int(np.mean([b.path.stat().st_size for b in env.tiered]))
    cap = int(avg * rng.uniform(1.5, 5.0))
    policy = rng.choice(["reject-new", "drop-lowest-value"])
    sp = open_spool(d / "spool", cap=cap, policy=policy)
    offered = rng.sample(env.tiered, rng.randint(6, 12))
    problems = []
    refused = 0
    for b in offered:
        refused += sp.put(b.data(), b.manifest) is None
        u = sp.usage()
        on_disk = sum(f.stat().st_size for sub in ("bundles", "raw", "staging") for f in (sp.root / sub).iterdir())
        if u.used_bytes > cap or on_disk > cap:
            problems.append(f"spool at {u.used_bytes} (disk {on_disk}) bytes > cap {cap}")
        if on_disk != u.used_bytes:
            problems.append(f"spool counts {u.used_bytes} bytes, disk holds {on_disk}")
        free = shutil.disk_usage(sp.root).free
        if free < cap:
            problems.append(f"filesystem has {free} bytes free < spool cap {cap}")
        if rng.random() < 0.25:
            drain(store, sp, d / "uplink")
    drain(store, sp, d / "uplink")
    ingest_landed(store, env.s3)
    a = account(store, ids_of(offered), [sp], env.s3)
    sp.close()
    return a.result(refused > 0, problems)

