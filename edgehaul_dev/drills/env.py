"""A drill run's environment: two private SeaweedFS servers (the store-down drill stops and restarts
the second one), the bundle pools every trial draws from, and the kill -9 workers.

Kill -9 drills fork small workers from a `forkserver` whose process imported the heavy modules
(edgehaul_dev.drill_forkserver) but never started Delta's runtime or opened a socket (fork after that is
unsafe); boto3 clients are made in the worker.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import signal
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing import forkserver
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from pydantic import SecretStr

from edgehaul.blocks import ObjectStore
from edgehaul.bundles import BundleManifest, conform, write_bundle
from edgehaul.contracts import load_contract
from edgehaul.edge.landsat import generate, table_sha256
from edgehaul.edge.preprocess import preprocess
from edgehaul.edge.scoring import NoveltyScorer
from edgehaul.edge.spool import Spool
from edgehaul_dev import localstack
from edgehaul_dev.drills.pipeline import KIND, validate_many

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolBundle:
    path: Path
    manifest: BundleManifest

    def data(self) -> bytes:
        return self.path.read_bytes()


def _rows(n: int, node: str, seed: int, start_seq: int, tier: str, value: float | None) -> pa.Table:
    contract = load_contract(KIND)
    raw = pa.concat_tables(list(generate(n, node, seed=seed, start_seq=start_seq, batch_size=max(n, 1))))
    acc = preprocess(raw, contract, node_id=node).accepted
    values = NoveltyScorer(contract).score(acc, batch_key=table_sha256(raw))
    if value is not None:
        values = np.full(acc.num_rows, value, dtype=np.float32)
    t = acc.append_column("value", pa.array(values, pa.float32()))
    t = t.append_column("tier", pa.array([tier] * acc.num_rows, pa.string()))
    t = t.append_column("is_summary", pa.array(np.zeros(acc.num_rows, dtype=bool)))
    return conform(t, contract)


def build_pool(folder: Path, specs: Sequence[tuple[int, str, float | None]], *, node: str = "node-a",
               seq_base: int = 0) -> list[PoolBundle]:
    """Real bundles (rows, tier, value or None for scored) written to `folder`; only bundles that pass
    validation are kept, so a quarantine in a drill is always the drill's doing."""
    folder.mkdir(parents=True, exist_ok=True)
    contract = load_contract(KIND)
    built = []
    seq = seq_base
    for i, (n, tier, value) in enumerate(specs):
        built.append(write_bundle(_rows(n, node, 1000 + seq_base + i, seq, tier, value), contract, tier=tier))
        seq += n + 10
    out = []
    for i, ((data, m), res) in enumerate(zip(built, validate_many(built), strict=True)):
        if not res.success:
            log.info("pool bundle %d (%d rows) fails validation (%s); skipped", i, m.row_count, res.reason)
            continue
        p = folder / f"{m.bundle_id}.parquet"
        p.write_bytes(data)
        out.append(PoolBundle(p, m))
    return out


def raw_pool(folder: Path, sizes: Sequence[int], *, node: str = "node-a", seq_base: int = 0) -> list[str]:
    """Raw batches as the edge ingest receives them (synthetic Landsat patches), one Arrow file each."""
    folder.mkdir(parents=True, exist_ok=True)
    out, seq = [], seq_base
    for i, n in enumerate(sizes):
        raw = pa.concat_tables(list(generate(n, node, seed=2000 + seq_base + i, start_seq=seq, batch_size=n)))
        path = folder / f"raw-{i}.arrow"
        with pa.ipc.new_file(str(path), raw.schema) as w:
            w.write_table(raw)
        out.append(str(path))
        seq += n + 10
    return out


# ------------------------------------------------------------------------------------------ environment


def store_dict(store: ObjectStore) -> dict[str, str]:
    key = store.access_key_id.get_secret_value() if store.access_key_id else ""
    return {"endpoint": store.endpoint_url or "", "key": key,
            "secret": store.secret_access_key.get_secret_value() if store.secret_access_key else "",
            "prefix": store.prefix}


def store_from(d: dict[str, str]) -> ObjectStore:
    return ObjectStore(endpoint_url=d["endpoint"], access_key_id=SecretStr(d["key"]),
                       secret_access_key=SecretStr(d["secret"]), prefix=d["prefix"])


class DrillEnv:
    """Two private SeaweedFS servers (one for every drill, one that the store-down drill stops and
    restarts, so it can run beside the others), a work folder, the bundle pools and a forkserver."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.states = []
        for name in ("s3", "s3-down"):
            (root / name).mkdir(parents=True, exist_ok=True)
            st = localstack.new_state(root / name, fixed_ports=False, nodes=())
            st.save()
            self.states.append(st)
        errors: list[BaseException] = []

        def start_second() -> None:
            try:
                localstack.start_s3(self.states[1])
            except BaseException as e:  # re-raised below, in the caller's thread
                errors.append(e)

        starting = threading.Thread(target=start_second, daemon=True)
        starting.start()
        localstack.start_s3(self.states[0])
        self.admin, self.down_admin = self.states[0].store(inline_keys=True), self.states[1].store(inline_keys=True)
        self.work = root / "trials"
        self.work.mkdir(exist_ok=True)
        self.ctx = mp.get_context("forkserver")
        self.ctx.set_forkserver_preload(["edgehaul_dev.drills", "edgehaul_dev.drill_forkserver", "torch"])
        # its imports (torch: ~10-30 s on a loaded machine) overlap the pool building below
        threading.Thread(target=forkserver.ensure_running, daemon=True).start()
        # One client for the core side of every trial (thread-safe; the prefix is in the keys, not the
        # client). Uplinks keep their own: a link hooks its client's requests.
        self.s3 = self.admin.client(max_pool_connections=32)
        pools = root / "pool"
        # small: 40-64 rows (~60-100 KB); raw: batches for the edge ingest (~1 MB bundles, so a spool
        # write takes long enough to be hit)
        self.small = build_pool(pools / "small", [(40 + (i % 5) * 6, "normal", None) for i in range(24)])
        self.tiered = build_pool(pools / "tiered", [(48, t, v) for t, v in
                                                    [("high", 0.9), ("normal", 0.7), ("normal", 0.3), ("normal", 0.1)] * 4],
                                 seq_base=200_000)
        self.raw = raw_pool(pools / "raw", [700] * 6, seq_base=400_000)
        self.big = build_pool(pools / "big", [(4400, "normal", None) for _ in range(2)], seq_base=600_000)
        starting.join(120)
        if errors or starting.is_alive():
            self.close()
            raise RuntimeError(f"the store-down drill's SeaweedFS did not start: {errors[:1]}")

    def store(self, name: str, *, stoppable: bool = False) -> ObjectStore:
        admin = self.down_admin if stoppable else self.admin
        return admin.model_copy(update={"prefix": f"drill-{name}-{uuid.uuid4().hex[:8]}"})

    def trial_dir(self, name: str) -> Path:
        d = self.work / f"{name}-{uuid.uuid4().hex[:8]}"
        d.mkdir(parents=True)
        return d

    def s3_stop(self, grace_s: float, which: int = 1) -> None:
        """Stop the stoppable server: SIGTERM, then SIGKILL after `grace_s` (0: a crash). The server
        is our child, so it is reaped here (an unreaped zombie still answers kill(pid, 0), and
        `localstack.down` would wait its full 20 s for it)."""
        root = Path(self.states[which].root)
        pid = localstack._read_pid(root, "seaweedfs")
        if pid is not None:
            localstack.stop_group(pid, grace_s)
        localstack.down(root)  # pid file and stale sockets

    def s3_start(self) -> None:
        localstack.start_s3(self.states[1])

    def close(self) -> None:
        for i in range(len(self.states)):
            try:
                self.s3_stop(grace_s=5.0, which=i)
            except RuntimeError as e:
                log.warning("drill SeaweedFS %d not stopped: %s", i, e)



def ids_of(bundles: Sequence[PoolBundle]) -> list[str]:
    return [i for b in bundles for i in b.manifest.sample_ids]


def spool_all(spool: Spool, bundles: Sequence[PoolBundle]) -> None:
    for b in bundles:
        spool.put(b.data(), b.manifest)



# ------------------------------------------------------------------------------------------ kill -9 workers


def spawn(env: DrillEnv, target: Callable[..., None], *args: Any) -> tuple[Any, Any]:
    ready = env.ctx.Event()
    p = env.ctx.Process(target=target, args=(*args, ready), daemon=True)
    p.start()
    if not ready.wait(30):
        p.kill()
        raise RuntimeError(f"drill worker {target.__name__} did not start")
    return p, ready


def kill(p: Any) -> bool:
    """SIGKILL the worker; returns whether it was still running (the kill struck mid-operation)."""
    alive = p.is_alive()
    with contextlib.suppress(ProcessLookupError):
        os.kill(p.pid, signal.SIGKILL)
    p.join(10)
    return alive and p.exitcode == -signal.SIGKILL



