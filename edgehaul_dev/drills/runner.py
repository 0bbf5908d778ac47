"""The drill runner: every drill's trials in seeded chains side by side, the text table and the report.

    python -m edgehaul_dev drills [--trials N] [--only NAME ...] [--markdown docs/DRILLS.md]
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from edgehaul_dev.drills.control_plane import drill_control_plane_down
from edgehaul_dev.drills.core import (
    drill_commit_kill,
    drill_concurrent_ingest,
    drill_corrupt_landed,
    drill_duplicate_delivery,
)
from edgehaul_dev.drills.edge import drill_disk_full, drill_edge_kill
from edgehaul_dev.drills.env import DrillEnv
from edgehaul_dev.drills.hostile import drill_hostile_node
from edgehaul_dev.drills.pipeline import memo_size
from edgehaul_dev.drills.report import DrillResult, TrialResult, render_markdown, table_text, with_notes
from edgehaul_dev.drills.training import drill_trainer_kill, training_dataset
from edgehaul_dev.drills.uplink import drill_link_outage, drill_store_down, drill_uplink_kill
from edgehaul_dev.settings import dev_settings

log = logging.getLogger(__name__)

DEFAULT_TRIALS = 50

DRILLS: dict[str, str] = {
    "edge_ingest_kill": "kill -9 of the edge ingest mid batch",
    "uplink_kill": "kill -9 of the uplink mid multipart upload",
    "ingest_commit_kill": "kill -9 of the core ingest mid dataset commit",
    "trainer_checkpoint_kill": "kill -9 of the trainer mid run (checkpoints every 1-4 steps)",
    "store_down": "object store stopped, then restarted",
    "link_outage": "link down longer than the retry queue's patience",
    "disk_full": "spool cap far below the offered data",
    "corrupt_landed": "corrupted landed objects (before or after validation)",
    "duplicate_delivery": "the same bundle delivered twice",
    "concurrent_ingest": "two ingest runs committing at once",
    "control_plane_down": "central API and gateway unreachable for 2-48 simulated hours",
    "hostile_node": "a node lands 2-5 objects shaped to break the core (deep or huge JSON, bombs, bad zstd, "
                    "wrong magic, inclusion_p 1e-40) beside honest bundles",
}


# Rough seconds per trial on an idle 2-core machine (ordering only: the longest drills start first).
_COST = {"store_down": 3.0, "concurrent_ingest": 3.0, "ingest_commit_kill": 2.5, "uplink_kill": 2.0,
         "trainer_checkpoint_kill": 3.0, "duplicate_delivery": 1.5, "corrupt_landed": 1.2, "edge_ingest_kill": 1.2,
         "disk_full": 1.0, "link_outage": 0.3, "control_plane_down": 1.0, "hostile_node": 1.5}


def run_drills(trials: int = DEFAULT_TRIALS, *, only: Sequence[str] = (), seed: int = 20261203,
               root: Path | None = None, progress: Callable[[str], None] | None = None,
               parallel: int = dev_settings().drill_parallel,
               streams: int = 2) -> list[DrillResult]:
    names = [n for n in DRILLS if not only or n in only]
    unknown = set(only) - set(DRILLS)
    if unknown:
        raise ValueError(f"unknown drills {sorted(unknown)}; known: {sorted(DRILLS)}")
    say = progress or (lambda s: log.info("%s", s))
    tmp = Path(tempfile.mkdtemp(prefix="edgehaul-drills-", dir=root))
    t0 = time.monotonic()
    env = DrillEnv(tmp)
    data = training_dataset(env) if "trainer_checkpoint_kill" in names else None
    say(f"drills set up in {time.monotonic() - t0:.0f} s (two SeaweedFS, {memo_size()} pool bundles validated)")
    fns: dict[str, Callable[[DrillEnv, random.Random], TrialResult]] = {
        "edge_ingest_kill": drill_edge_kill, "uplink_kill": drill_uplink_kill,
        "ingest_commit_kill": drill_commit_kill, "link_outage": drill_link_outage,
        "disk_full": drill_disk_full, "corrupt_landed": drill_corrupt_landed,
        "duplicate_delivery": drill_duplicate_delivery, "concurrent_ingest": drill_concurrent_ingest,
        "control_plane_down": drill_control_plane_down, "hostile_node": drill_hostile_node,
        "trainer_checkpoint_kill": lambda e, r: drill_trainer_kill(e, r, data),  # type: ignore[arg-type]
    }

    # A drill's trials run in `streams` independent chains (own seeded rng each) so the slow kill -9
    # drills do not bound the run; the store-down drill is one chain (it stops its server per batch).
    chains = [(n, c) for n in names for c in range(1 if n == "store_down" else max(1, min(streams, trials)))]
    per_chain = {(n, c): trials // sum(1 for m, _ in chains if m == n) + (c < trials % sum(1 for m, _ in chains if m == n))
                 for n, c in chains}
    started: dict[str, float] = {}
    finished: dict[str, float] = {}
    results: dict[str, DrillResult] = {n: DrillResult(n, DRILLS[n]) for n in names}
    lock = threading.Lock()

    def chain(key: tuple[str, int]) -> None:
        name, c = key
        rng = random.Random(f"{seed}-{name}-{c}")
        with lock:
            started.setdefault(name, time.monotonic())
        out: list[TrialResult] = []
        if name == "store_down":
            while len(out) < per_chain[key]:
                out.extend(drill_store_down(env, rng, min(10, per_chain[key] - len(out))))
        else:
            for _ in range(per_chain[key]):
                try:
                    out.append(fns[name](env, rng))
                except Exception as e:  # one broken trial is a finding, not the end of the run
                    log.exception("drill %s: trial crashed", name)
                    out.append(TrialResult(0, 0, 0, 0, False, [f"trial crashed: {type(e).__name__}: {str(e)[:200]}"]))
        with lock:
            res = results[name]
            res.trials.extend(out)
            finished[name] = time.monotonic()
            res.seconds = finished[name] - started[name]
            if len(res.trials) == trials:
                w = res.row
                say(f"drill {name}: {w['trials']} trials, {w['samples_in']} samples, lost {w['lost']}, "
                    f"duplicated {w['duplicated']}, {w['seconds']} s"
                    + "".join(f", {k} {v}" for k, v in res.counts.items()))

    try:
        # Trials wait on the store, on fsync and on their workers far more than they compute: run the
        # chains side by side, the longest first (the store-down drill stops only its own server).
        order = sorted(chains, key=lambda k: -_COST.get(k[0], 1.0) * per_chain[k])
        with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
            list(pool.map(chain, order))
    finally:
        env.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return [results[n] for n in names]



def _sample_load(out: list[float], stop: threading.Event) -> None:
    while not stop.wait(10.0):
        out.append(os.getloadavg()[0])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="edgehaul_dev.drills",
                                 description="Fault drills: inject a fault at many points, then account for every sample.")
    ap.add_argument("--trials", type=int, default=dev_settings().drill_trials or DEFAULT_TRIALS)
    ap.add_argument("--only", nargs="*", default=[])
    ap.add_argument("--markdown", type=Path, default=None, help="write the report (e.g. docs/DRILLS.md)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    load = [os.getloadavg()[0]]
    stop = threading.Event()
    threading.Thread(target=_sample_load, args=(load, stop), daemon=True).start()
    t0 = time.monotonic()
    results = run_drills(args.trials, only=args.only, progress=lambda s: print(s, file=sys.stderr, flush=True))
    wall = time.monotonic() - t0
    stop.set()
    print(table_text(results))
    print(f"{wall:.0f} s wall clock; load average {min(load):.1f}-{max(load):.1f} on {os.cpu_count()} cores")
    for r in results:
        for p in r.problems[:5]:
            print(f"  {r.name}: {p}")
    if args.markdown:
        previous = args.markdown.read_text() if args.markdown.exists() else None
        args.markdown.write_text(with_notes(render_markdown(results, args.trials, wall_s=wall, load=load), previous))
    bad = any(r.row["lost"] or r.row["duplicated"] or r.problems for r in results)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
