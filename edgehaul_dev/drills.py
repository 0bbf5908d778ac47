"""Fault drills: inject a fault at many points, then account for every sample by id.

Each drill runs `trials` independent pipelines (own spool folder, own object-store prefix, own Delta
table) against a SeaweedFS started for the drills (never the session stack); the store-down drill
stops and restarts a second one, so it runs beside the others. A trial drives the real domain code
(`Spool.put`, `Drainer`/`Uplink.send`, `RetryQueue`, `validate_bundle`, `quarantine_bundle`,
`commit_bundles`, `CheckpointStore`), injects its fault, lets the pipeline recover the way an
operator's next run would, and then checks by sample id that every sample offered to an edge spool
is in exactly one of:
- the dataset's latest Delta version (exactly once),
- still queued (a spool entry or the uplink retry queue, whose bundles stay in the spool),
- the edge ledger with a reason, or a quarantine record (`validation.json`, with its sample ids).
A sample in none is lost; a sample in the dataset twice, or in two of those places, is duplicated.

Kill -9 drills fork small workers from a `forkserver` whose process imported the heavy modules
(edgehaul_dev.drill_forkserver) but never started Delta's runtime or opened a socket (fork after that is
unsafe); boto3 clients are made in the worker. Validation is memoised on content (see `validate`).
Drills, and two chains of trials per drill, run side by side in threads: trials mostly wait.

    python -m edgehaul_dev.drills [--trials N] [--only NAME ...] [--markdown docs/DRILLS.md]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import multiprocessing as mp
import os
import random
import shutil
import signal
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from multiprocessing import forkserver
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from pydantic import SecretStr

from edgehaul.blocks import LinkProfile, ObjectStore
from edgehaul.bundles import BundleManifest, read_bundle, write_bundle
from edgehaul.contracts import load_contract
from edgehaul.core import datasets, landed, quarantine
from edgehaul.core.validation import ValidationResult, validate_bundles
from edgehaul.edge.landsat import generate, table_sha256
from edgehaul.edge.preprocess import preprocess
from edgehaul.edge.scoring import NoveltyScorer
from edgehaul.edge.spool import Spool
from edgehaul.uplink.link import Link, SimulatedLink
from edgehaul.uplink.retry_queue import RETRY_EXPIRED, STAGE_UPLINK, RetryQueue
from edgehaul.uplink.transfer import Drainer, Uplink
from edgehaul_dev import localstack

log = logging.getLogger(__name__)

KIND = "landsat_patch"
MiB = 1024 * 1024
DEFAULT_TRIALS = 50
COMMIT_LEASE_S = 0.3  # claims of a killed committer are taken over after this (drills only; prod: 900 s)


def _quiet(*_: Any, **__: Any) -> bool:
    return True


_VALIDATED: dict[tuple[str, bytes], ValidationResult] = {}
_VALIDATED_LOCK = threading.Lock()


def validate_many(items: Sequence[tuple[bytes, BundleManifest]]) -> list[ValidationResult]:
    """`validate_bundles`, memoised on the exact bytes (sha256) and manifest. The result is a pure
    function of both (the contract files are fixed for a run), so every trial still gets the real
    verdict; the Great Expectations pass (~0.25-2 s a run, most of a trial otherwise) runs once per
    distinct content, and any corrupted byte or garbled manifest is a new key, validated afresh."""
    keys = [(hashlib.sha256(data).hexdigest(), m.to_json()) for data, m in items]
    with _VALIDATED_LOCK:
        miss = [i for i, k in enumerate(keys) if k not in _VALIDATED]
    if miss:
        fresh = validate_bundles([items[i] for i in miss], full_tables=False)  # one GE run for all of them
        with _VALIDATED_LOCK:
            for i, (_, res) in zip(miss, fresh, strict=True):
                _VALIDATED[keys[i]] = res
    with _VALIDATED_LOCK:
        return [_VALIDATED[k] for k in keys]


# ------------------------------------------------------------------------------------------ results


@dataclass
class TrialResult:
    samples_in: int
    accounted: int
    lost: int
    duplicated: int
    hit: bool = True  # the fault struck mid-operation (not before/after all work)
    problems: list[str] = field(default_factory=list)


@dataclass
class DrillResult:
    name: str
    fault: str
    trials: list[TrialResult] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def row(self) -> dict[str, Any]:
        return {
            "drill": self.name, "trials": len(self.trials), "samples_in": sum(t.samples_in for t in self.trials),
            "accounted": sum(t.accounted for t in self.trials), "lost": sum(t.lost for t in self.trials),
            "duplicated": sum(t.duplicated for t in self.trials), "hit": sum(t.hit for t in self.trials),
            "seconds": round(self.seconds, 1),
        }

    @property
    def problems(self) -> list[str]:
        return [p for t in self.trials for p in t.problems]


def table_markdown(results: Sequence[DrillResult]) -> str:
    lines = ["| drill | fault injected | trials | fault mid-operation | samples in | accounted for | lost | duplicated "
             "| s |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        w = r.row
        lines.append(f"| {w['drill']} | {r.fault} | {w['trials']} | {w['hit']} | {w['samples_in']} | {w['accounted']} "
                     f"| {w['lost']} | {w['duplicated']} | {w['seconds']} |")
    return "\n".join(lines)


def table_text(results: Sequence[DrillResult]) -> str:
    head = f"{'drill':<22} {'trials':>6} {'mid-op':>6} {'samples in':>10} {'accounted':>10} {'lost':>5} {'dup':>5} {'s':>6}"
    rows = [head, "-" * len(head)]
    for r in results:
        w = r.row
        rows.append(f"{w['drill']:<22} {w['trials']:>6} {w['hit']:>6} {w['samples_in']:>10} {w['accounted']:>10} "
                    f"{w['lost']:>5} {w['duplicated']:>5} {w['seconds']:>6}")
    return "\n".join(rows)


# ------------------------------------------------------------------------------------------ bundles


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
    return t.cast(contract.bundle_schema)


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


# ------------------------------------------------------------------------------------------ environment


def _store_dict(store: ObjectStore) -> dict[str, str]:
    key = store.access_key_id.get_secret_value() if store.access_key_id else ""
    return {"endpoint": store.endpoint_url or "", "key": key,
            "secret": store.secret_access_key.get_secret_value() if store.secret_access_key else "",
            "prefix": store.prefix}


def _store_from(d: dict[str, str]) -> ObjectStore:
    return ObjectStore(endpoint_url=d["endpoint"], access_key_id=SecretStr(d["key"]),
                       secret_access_key=SecretStr(d["secret"]), prefix=d["prefix"])


def _admin_of(state: localstack.StackState) -> ObjectStore:
    admin = state.identities["admin"]
    return ObjectStore(endpoint_url=state.s3_endpoint, access_key_id=SecretStr(admin.access_key_id),
                       secret_access_key=SecretStr(admin.secret_access_key))


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
        self.admin, self.down_admin = _admin_of(self.states[0]), _admin_of(self.states[1])
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
        # small: 40-64 rows (~60-100 KB); mid: ~1 MB so a spool write takes long enough to be hit
        self.small = build_pool(pools / "small", [(40 + (i % 5) * 6, "normal", None) for i in range(24)])
        self.tiered = build_pool(pools / "tiered", [(48, t, v) for t, v in
                                                    [("high", 0.9), ("normal", 0.7), ("normal", 0.3), ("normal", 0.1)] * 4],
                                 seq_base=200_000)
        self.mid = build_pool(pools / "mid", [(700, "normal", None) for _ in range(6)], seq_base=400_000)
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


# ------------------------------------------------------------------------------------------ pipeline steps


def open_spool(root: Path, *, cap: int = 10**9, policy: str = "drop-lowest-value",
               clock: Callable[[], float] = time.time) -> Spool:
    return Spool(root, cap_bytes=cap, node_id="node-a", full_policy=policy, emit=_quiet, clock=clock)


def fast_profile(**kw: Any) -> LinkProfile:
    kw.setdefault("bandwidth_bps", 2e9)
    kw.setdefault("chunk_bytes", 256 * 1024)
    return LinkProfile(**kw)


def retry_queue(root: Path, spool: Spool, *, expiry_s: float = 3600.0, clock: Callable[[], float] = time.time) -> RetryQueue:
    return RetryQueue(root / "retry.sqlite", cap=1000, expiry_seconds=expiry_s, ledger=spool.ledger,
                      discard=lambda b: _discard(spool, b), clock=clock, backoff_s=(0.0,), emit_events=False)


def _discard(spool: Spool, bundle_id: str) -> None:
    spool.discard(bundle_id)


def drain(store: ObjectStore, spool: Spool, state_dir: Path, *, link: Link | None = None, rq: RetryQueue | None = None,
          attempts: int = 3, max_seconds: float = 60.0, uplink: Uplink | None = None) -> Any:
    up = uplink or Uplink(store, link or Link(fast_profile(), emit_events=False), state_dir)
    return Drainer(up, spool, attempts=attempts, backoff_s=(0.05, 0.2), retry_queue=rq, emit_events=False,
                   poll_s=0.005).run(max_seconds=max_seconds)


def validate_landed(store: ObjectStore, s3: Any, keys: Sequence[str] | None = None) -> tuple[
        dict[str, tuple[BundleManifest, ValidationResult]], list[quarantine.QuarantineRecord]]:
    """Validate landed, not yet committed bundles; quarantine the failures (as core_ingest does)."""
    keys = list(keys) if keys is not None else landed.complete_bundles(store, s3=s3)
    done: set[str] = set()
    with contextlib.suppress(datasets.DatasetError):
        done = datasets.committed_bundle_ids(store, KIND, [quarantine.ids_from_key(k)[1] for k in keys])
    good: dict[str, tuple[BundleManifest, ValidationResult]] = {}
    records = []
    readable: list[tuple[str, bytes, BundleManifest]] = []
    for key in keys:
        if quarantine.ids_from_key(key)[1] in done:
            continue
        lb = landed.fetch(store, key, s3=s3)
        if lb.manifest is None or lb.data is None:
            ids = None
            if lb.data is not None:
                with contextlib.suppress(ValueError, KeyError):
                    ids = read_bundle(lb.data).column("sample_id").to_pylist()
            node, bundle = quarantine.ids_from_key(key)
            res = ValidationResult(bundle_id=bundle, node_id=node, contract="", contract_sha256="", bundle_sha256="",
                                   rows=0, success=False, reason="unreadable", error=lb.error)
            records.append(quarantine.quarantine_bundle(store, key, res, None, ids, s3=s3, emit_event=False))
            continue
        readable.append((key, lb.data, lb.manifest))
    for (key, _, m), res in zip(readable, validate_many([(d, m) for _, d, m in readable]), strict=True):
        if not res.success:
            records.append(quarantine.quarantine_bundle(store, key, res, m, s3=s3, emit_event=False))
        else:
            good[key] = (m, res)
    return good, records


def commit_validated(store: ObjectStore, s3: Any, validated: dict[str, tuple[BundleManifest, ValidationResult]], *,
                     run_id: str = "", lease_s: float = datasets.DEFAULT_LEASE_S) -> datasets.CommitResult | None:
    """The commit step of core_ingest: re-read the validated bundles by reference and commit them."""
    return commit_items(store, s3, fetch_validated(store, s3, validated), run_id=run_id, lease_s=lease_s)


def fetch_validated(store: ObjectStore, s3: Any, validated: dict[str, tuple[BundleManifest, ValidationResult]]
                    ) -> list[datasets.ValidatedBundle]:
    items = []
    for key, (_, res) in validated.items():
        lb = landed.fetch(store, key, s3=s3)
        if lb.data is None or lb.manifest is None or lb.manifest.sha256 != res.bundle_sha256:
            continue  # changed or gone since validation: the next run revalidates it
        items.append(datasets.ValidatedBundle(lb.manifest, read_bundle(lb.data, lb.manifest), res))
    return items


def commit_items(store: ObjectStore, s3: Any, items: list[datasets.ValidatedBundle], *, run_id: str = "",
                 lease_s: float = datasets.DEFAULT_LEASE_S) -> datasets.CommitResult | None:
    if not items:
        return None
    return datasets.commit_bundles(store, load_contract(KIND), items, run_id=run_id, lease_s=lease_s, s3=s3)


def ingest(store: ObjectStore, s3: Any = None, *, lease_s: float = datasets.DEFAULT_LEASE_S, rounds: int = 3) -> None:
    """core_ingest without Prefect: validate, quarantine, commit; repeat while bundles are deferred."""
    s3 = s3 or store.client()
    for _ in range(rounds):
        good, _ = validate_landed(store, s3)
        res = commit_validated(store, s3, good, lease_s=lease_s)
        if res is None or not res.deferred:
            return
        time.sleep(min(lease_s, 1.0))


# ------------------------------------------------------------------------------------------ accounting


@dataclass
class Accounting:
    samples_in: int
    in_dataset: int
    queued: int
    ledgered: int
    quarantined: int
    lost: list[str]
    duplicated: list[str]

    def result(self, hit: bool = True, problems: list[str] | None = None) -> TrialResult:
        problems = list(problems or [])
        if self.lost:
            problems.append(f"lost {len(self.lost)}: {self.lost[:3]}")
        if self.duplicated:
            problems.append(f"duplicated {len(self.duplicated)}: {self.duplicated[:3]}")
        return TrialResult(self.samples_in, self.samples_in - len(self.lost) - len(set(self.duplicated) - set(self.lost)),
                           len(self.lost), len(self.duplicated), hit, problems)


def quarantined_ids(store: ObjectStore, s3: Any) -> Counter[str]:
    out: Counter[str] = Counter()
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=store.bucket("quarantine"),
                                                        Prefix=store.key("quarantine", ""))
    for page in pages:
        for o in page.get("Contents", []):
            if o["Key"].endswith("/" + quarantine.RECORD_NAME):
                doc = json.loads(s3.get_object(Bucket=store.bucket("quarantine"), Key=o["Key"])["Body"].read())
                out.update(doc["sample_ids"])
    return out


def dataset_ids(store: ObjectStore) -> Counter[str]:
    try:
        t = datasets.read_version(store, KIND, columns=["sample_id"])
    except datasets.DatasetError:
        return Counter()
    return Counter(t.column("sample_id").to_pylist())


def account(store: ObjectStore, ids_in: Sequence[str], spools: Sequence[Spool], s3: Any = None) -> Accounting:
    """Where is each sample? Exactly one of dataset (once) / queued / ledger / quarantine, else lost or duplicated."""
    s3 = s3 or store.client()
    ids = list(dict.fromkeys(ids_in))
    ds = dataset_ids(store)
    queued: set[str] = set()
    ledgered: set[str] = set()
    for sp in spools:
        for e in [*sp.pending(), *sp.raw_entries()]:
            queued.update(e.manifest.sample_ids)
        ledgered.update(sp.ledger.lookup(ids))
    q = quarantined_ids(store, s3)
    lost, dup = [], []
    for i in ids:
        places = (ds[i] > 0) + (i in queued) + (i in ledgered) + (q[i] > 0)
        if places == 0:
            lost.append(i)
        elif places > 1 or ds[i] > 1 or q[i] > 1:
            dup.append(i)
    known = set(ids)
    dup.extend(i for i in ds if i not in known)  # a row no spool ever accepted is a phantom copy
    return Accounting(len(ids), sum(1 for i in ids if ds[i]), len(queued & known), len(ledgered),
                      sum(1 for i in ids if q[i]), lost, dup)


def _ids(bundles: Sequence[PoolBundle]) -> list[str]:
    return [i for b in bundles for i in b.manifest.sample_ids]


def _spool_all(spool: Spool, bundles: Sequence[PoolBundle]) -> None:
    for b in bundles:
        spool.put(b.data(), b.manifest)


# ------------------------------------------------------------------------------------------ forked workers


def _w_spool_put(root: str, paths: list[str], ready: Any) -> None:
    sp = open_spool(Path(root))
    ready.set()
    for p in paths:
        m = BundleManifest.from_json(Path(p).with_suffix(".json").read_bytes())
        sp.put(Path(p).read_bytes(), m)
    sp.close()


def _w_drain(store_d: dict[str, str], root: str, profile: dict[str, Any], ready: Any) -> None:
    store = _store_from(store_d)
    sp = open_spool(Path(root))
    link = Link(LinkProfile(**profile), emit_events=False)
    up = Uplink(store, link, Path(root) / "uplink")
    ready.set()
    Drainer(up, sp, attempts=1, emit_events=False, poll_s=0.005).run(max_seconds=60)
    sp.close()


def _w_commit(store_d: dict[str, str], validated: dict[str, tuple[BundleManifest, ValidationResult]], run_id: str,
              lease_s: float, ready: Any, go: Any, out: Any) -> None:
    store = _store_from(store_d)
    s3 = store.client()
    items = fetch_validated(store, s3, validated)  # before `go`: the fault and the race hit the commit itself
    ready.set()
    go.wait(10)
    try:
        r = commit_items(store, s3, items, run_id=run_id, lease_s=lease_s)
        out.put({"version": r.version if r else None, "bundles": r.bundles if r else [],
                 "deferred": r.deferred if r else [], "error": ""})
    except Exception as e:  # reported to the parent, which recovers with its own pass
        out.put({"version": None, "bundles": [], "deferred": [], "error": f"{type(e).__name__}: {e}"[:300]})


def _w_train(store_d: dict[str, str], run_id: str, pad_floats: int, every: int, ready: Any) -> None:
    import torch

    torch.set_num_threads(1)
    store = _store_from(store_d)
    data = store.model_copy(update={"prefix": store_d["data_prefix"]})
    ready.set()
    train_steps(store, run_id, pad_floats=pad_floats, every=every, data_store=data)


def _spawn(env: DrillEnv, target: Callable[..., None], *args: Any) -> tuple[Any, Any]:
    ready = env.ctx.Event()
    p = env.ctx.Process(target=target, args=(*args, ready), daemon=True)
    p.start()
    if not ready.wait(30):
        p.kill()
        raise RuntimeError(f"drill worker {target.__name__} did not start")
    return p, ready


def _kill(p: Any) -> bool:
    """SIGKILL the worker; returns whether it was still running (the kill struck mid-operation)."""
    alive = p.is_alive()
    with contextlib.suppress(ProcessLookupError):
        os.kill(p.pid, signal.SIGKILL)
    p.join(10)
    return alive and p.exitcode == -signal.SIGKILL


def _write_pool_json(bundles: Sequence[PoolBundle]) -> list[str]:
    for b in bundles:
        j = b.path.with_suffix(".json")
        if not j.exists():
            j.write_bytes(b.manifest.to_json())
    return [str(b.path) for b in bundles]


# ------------------------------------------------------------------------------------------ trainer steps


def _training_dataset(env: DrillEnv) -> ObjectStore:
    """A small curated dataset (three commits of real bundles) the trainer drill reads."""
    store = env.store("train-data")
    s3 = store.client()
    sp = open_spool(env.trial_dir("train-data") / "spool")
    for chunk in (env.small[0:1], env.small[1:2], env.small[2:3]):
        _spool_all(sp, chunk)
        drain(store, sp, sp.root / "uplink")
        ingest(store, s3)
    sp.close()
    return store


def train_steps(store: ObjectStore, run_id: str, *, pad_floats: int, every: int, batch: int = 16,
                data_store: ObjectStore | None = None) -> list[str]:
    """A resumable pass over the dataset's latest version: one SGD step per batch, a committed
    checkpoint (model, optimizer, position, ids consumed) every `every` batches, resuming from the
    latest committed checkpoint. Returns the sample ids consumed over the whole run (all attempts)."""
    import torch

    from edgehaul.training.checkpoints import CheckpointStore
    from edgehaul.training.data import DatasetRef, Position, epoch_order, open_fragments, shard, stream

    data_store = data_store or store
    uri = datasets.table_uri(data_store, KIND)
    version = datasets.open_table(data_store, KIND).version()
    frags = open_fragments(DatasetRef(uri, version, data_store.storage_options()))
    files = shard(epoch_order(len(frags), 7, 0), 0, 1)
    ck = CheckpointStore(store, run_id, keep=2, attempts=2, backoff_s=0.05, multipart_bytes=5 * MiB)
    torch.manual_seed(7)
    model = torch.nn.Linear(2, 7)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    pos, seen, step = Position(0), [], 0
    latest = ck.latest()
    if latest is not None:
        ck.clean_orphans()
        st = ck.load(latest)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        pos, seen, step = Position.from_dict(st["position"]), list(st["seen"]), int(st["step"])
    for p, b in stream(frags, files, pos, batch):
        x = torch.tensor([[float(np.frombuffer(px, np.uint8).mean()) / 255 if px else 0.0, float(lab or 0) / 10]
                          for px, lab in zip(b.column("pixels").to_pylist(), b.column("label").to_pylist(), strict=True)])
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        seen.extend(b.column("sample_id").to_pylist())
        step += 1
        if step % every == 0:
            state = {"model": model.state_dict(), "opt": opt.state_dict(), "position": p.to_dict(), "seen": seen,
                     "step": step, "pad": torch.zeros(pad_floats)}
            ck.write(state, step, {"position": p.to_dict()})
    return seen


# ------------------------------------------------------------------------------------------ the drills


def drill_edge_kill(env: DrillEnv, rng: random.Random) -> TrialResult:
    """kill -9 of the edge ingest while it writes bundles into its spool; the rerun spools them again."""
    d, store = env.trial_dir("edge"), env.store("edge")
    picks = rng.sample(env.mid, rng.randint(2, 5))
    p, _ = _spawn(env, _w_spool_put, str(d / "spool"), _write_pool_json(picks))
    time.sleep(rng.uniform(0.0, 0.05))
    killed = _kill(p)
    sp = open_spool(d / "spool")  # recovery at open
    problems = [] if all(sp.read(e.bundle_id) for e in sp.pending()) else ["unreadable spool entry after the kill"]
    _spool_all(sp, picks)  # the rerun of the edge ingest (idempotent on bundle id)
    drain(store, sp, d / "uplink")
    ingest(store, env.s3)
    a = account(store, _ids(picks), [sp], env.s3)
    sp.close()
    return a.result(killed, problems)


def drill_uplink_kill(env: DrillEnv, rng: random.Random) -> TrialResult:
    """kill -9 of the uplink drain while a multipart upload is in flight; the next drain resumes it."""
    d, store = env.trial_dir("uplink"), env.store("uplink")
    picks = [rng.choice(env.big), *rng.sample(env.small, rng.randint(0, 2))]
    sp = open_spool(d / "spool")
    _spool_all(sp, picks)
    sp.close()
    # ~25 MB/s cap: the 6 MB bundle takes ~0.25 s in 2 parts of 5 MiB + 1 MiB
    prof = fast_profile(bandwidth_bps=25 * MiB * 8 / 0.7, multipart_threshold_bytes=5 * MiB, part_bytes=5 * MiB)
    fields = prof.model_dump(include=set(LinkProfile.model_fields))
    p, _ = _spawn(env, _w_drain, _store_dict(store), str(d / "spool"), fields)
    deadline = time.monotonic() + 20  # the kill lands at a random point after the multipart upload began
    while p.is_alive() and time.monotonic() < deadline and not any((d / "spool" / "uplink").glob("*.mpu.json")):
        time.sleep(0.005)
    time.sleep(rng.uniform(0.0, 0.2))
    killed = _kill(p)
    sp = open_spool(d / "spool")
    s3 = env.s3
    mid_multipart = any(Path(d / "spool" / "uplink").glob("*.mpu.json"))
    drain(store, sp, d / "spool" / "uplink", link=Link(prof, emit_events=False))
    ingest(store, s3)
    a = account(store, _ids(picks), [sp], s3)
    left = s3.list_multipart_uploads(Bucket=store.bucket("landing"), Prefix=store.key("landing", "")).get("Uploads", [])
    problems = [f"{len(left)} multipart uploads left open"] if left else []
    sp.close()
    return a.result(killed and mid_multipart, problems)


def drill_commit_kill(env: DrillEnv, rng: random.Random) -> TrialResult:
    """kill -9 of the core ingest during its dataset commit; the next run takes over the stale claims."""
    d, store = env.trial_dir("commit"), env.store("commit")
    s3 = env.s3
    picks = rng.sample(env.small, rng.randint(2, 6))
    sp = open_spool(d / "spool")
    _spool_all(sp, picks)
    drain(store, sp, d / "uplink")
    if rng.random() < 0.5:  # half the trials commit into an existing table (the common case)
        datasets.ensure_table(store, load_contract(KIND))
    good, _ = validate_landed(store, s3)
    out = env.ctx.Queue()
    go = env.ctx.Event()
    ready = env.ctx.Event()
    p = env.ctx.Process(target=_w_commit, args=(_store_dict(store), good, "killed-run", COMMIT_LEASE_S, ready, go, out),
                        daemon=True)
    p.start()
    ready.wait(30)
    go.set()
    time.sleep(rng.uniform(0.0, 0.35))
    killed = _kill(p)
    # mid-operation only if the kill left part of the commit undone (not after its last bundle landed)
    with contextlib.suppress(datasets.DatasetError):
        ids = [m.bundle_id for m, _ in good.values()]
        killed = killed and len(datasets.committed_bundle_ids(store, KIND, ids)) < len(ids)
    time.sleep(COMMIT_LEASE_S + 0.05)
    problems = []
    try:
        ingest(store, s3, lease_s=COMMIT_LEASE_S)
    except Exception as e:  # the next run fails the same way: what it leaves behind is counted below
        problems.append(f"recovery ingest failed: {type(e).__name__}: {str(e)[:200]}")
    a = account(store, _ids(picks), [sp], s3)
    sp.close()
    return a.result(killed, problems)


def drill_trainer_kill(env: DrillEnv, rng: random.Random, data: ObjectStore) -> TrialResult:
    """kill -9 of the trainer while it writes a (multipart) checkpoint; the resumed run continues from
    the latest committed one. Every dataset sample must be trained exactly once in the epoch."""
    from edgehaul.training.checkpoints import CheckpointStore

    run_id = f"drill-{uuid.uuid4().hex[:8]}"
    ck_store = data.model_copy(update={"prefix": data.prefix + "-ck"})
    p, _ = _spawn(env, _w_train, {**_store_dict(ck_store), "data_prefix": data.prefix}, run_id, 1_400_000, 3)
    time.sleep(rng.uniform(0.05, 0.6))
    killed = _kill(p)
    ck = CheckpointStore(ck_store, run_id)
    s3 = env.s3
    open_uploads = s3.list_multipart_uploads(Bucket=ck_store.bucket("checkpoints"),
                                             Prefix=ck_store.key("checkpoints", run_id + "/")).get("Uploads", [])
    latest = ck.latest()
    problems = []
    if latest is not None:
        try:
            ck.load(latest)  # the latest committed checkpoint is intact (sha256 and size checked)
        except Exception as e:
            problems.append(f"latest checkpoint unreadable: {e}")
    seen = train_steps(ck_store, run_id, pad_floats=1_400_000, every=3, data_store=data)
    ds = dataset_ids(data)
    trained = Counter(seen)
    ids = list(ds)
    lost = [i for i in ids if trained[i] == 0]
    dup = [i for i in ids if trained[i] > 1 or ds[i] > 1] + [i for i in trained if i not in ds]
    a = Accounting(len(ids), len(ids), 0, 0, 0, lost, dup)
    return a.result(killed and (bool(open_uploads) or latest is None or latest.step > 0), problems)


def drill_store_down(env: DrillEnv, rng: random.Random, n: int) -> list[TrialResult]:
    """The object store goes down (SIGTERM with a short grace, or SIGKILL: a crash) while n pipelines
    drain and ingest, and comes back a little later. A trial counts as struck mid-operation when it
    still had work in flight (something spooled and not yet committed) when the store went down."""
    trials = []
    stop_at = time.monotonic() + rng.uniform(0.1, 0.8)
    up_event = threading.Event()
    stopped_at = [float("inf")]
    results: list[TrialResult | None] = [None] * n

    def one(i: int) -> None:
        r = random.Random(rng.random() + i)
        d, store = env.trial_dir("down"), env.store("down", stoppable=True)
        picks = r.sample(env.small, r.randint(2, 5))
        sp = open_spool(d / "spool")
        rq = retry_queue(d, sp)
        time.sleep(r.uniform(0.0, 0.6))
        s3 = store.client(connect_timeout=2, read_timeout=10, retries={"max_attempts": 1})
        up = Uplink(store, Link(fast_profile(), emit_events=False), d / "uplink")  # one client for all attempts
        _spool_all(sp, picks)
        clean_at = None  # when this trial first had everything committed
        for attempt in range(400):
            with contextlib.suppress(Exception):
                drain(store, sp, d / "uplink", rq=rq, attempts=2, max_seconds=5, uplink=up)
            try:
                ingest(store, s3)
                if not sp.pending():
                    clean_at = clean_at or time.monotonic()
                    if up_event.is_set():
                        break
            except Exception:
                pass
            time.sleep(0.2 if attempt < 200 else 1.0)
        with contextlib.suppress(Exception):  # after the store is back: a final clean pass
            drain(store, sp, d / "uplink", rq=rq, uplink=up)
            ingest(store)
        a = account(store, _ids(picks), [sp])
        struck = clean_at is None or clean_at > stopped_at[0]
        results[i] = a.result(struck, [] if len(rq) == 0 else [f"{len(rq)} bundles left in the retry queue"])
        sp.close()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    time.sleep(max(0.0, stop_at - time.monotonic()))
    stopped_at[0] = time.monotonic()
    try:
        env.s3_stop(grace_s=rng.choice([0.0, rng.uniform(0.5, 3.0)]))
        time.sleep(rng.uniform(0.5, 3.0))
    finally:  # the trials wait for the store: bring it back whatever happened
        env.s3_start()
        up_event.set()
    for t in threads:
        t.join()
    for r in results:
        trials.append(r or TrialResult(0, 0, 0, 0, False, ["trial thread died"]))
    return trials


def drill_link_outage(env: DrillEnv, rng: random.Random) -> TrialResult:
    """The link goes down mid-drain for longer than the retry queue's patience: expiry is recorded."""
    d, store = env.trial_dir("outage"), env.store("outage")
    now = [1_000_000.0]
    clock = lambda: now[0]  # noqa: E731 - the retry queue's patience runs on a fake clock
    sp = open_spool(d / "spool")
    rq = retry_queue(d, sp, expiry_s=600.0, clock=clock)
    picks = rng.sample(env.small, rng.randint(3, 6))
    _spool_all(sp, picks)
    # ~4 MB/s: a 70 KB bundle takes ~20 ms; the outage starts somewhere inside the drain
    prof = fast_profile(bandwidth_bps=4 * MiB * 8 / 0.7, chunk_bytes=64 * 1024)
    link = SimulatedLink(prof, outages=[(rng.uniform(0.0, 0.02 * len(picks)), 1e9)], emit_events=False)
    drain(store, sp, d / "uplink", link=link, rq=rq, attempts=1, max_seconds=10)
    queued = {e.bundle_id for e in rq.entries()}
    now[0] += 601.0
    expired = set(rq.expire())
    ingest(store, env.s3)
    a = account(store, _ids(picks), [sp], env.s3)
    problems = []
    if expired != queued:
        problems.append(f"expired {len(expired)} of {len(queued)} queued bundles")
    look = sp.ledger.lookup([i for b in picks if b.manifest.bundle_id in expired for i in b.manifest.sample_ids])
    if any((STAGE_UPLINK, RETRY_EXPIRED) not in v for v in look.values()) or \
            len(look) != sum(b.manifest.row_count for b in picks if b.manifest.bundle_id in expired):
        problems.append("expired samples without a retry-expired ledger row")
    sp.close()
    return a.result(bool(expired), problems)


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
    ingest(store, env.s3)
    a = account(store, _ids(offered), [sp], env.s3)
    sp.close()
    return a.result(refused > 0, problems)


def _corrupt(s3: Any, bucket: str, key: str, data: bytes, mode: str, rng: random.Random, other: bytes) -> None:
    if mode == "flip":
        i = rng.randrange(len(data))
        bad = data[:i] + bytes([data[i] ^ (1 << rng.randrange(8))]) + data[i + 1:]
    elif mode == "truncate":
        bad = data[: rng.randrange(len(data))]
    elif mode == "zeros":
        i = rng.randrange(len(data))
        bad = data[:i] + b"\0" * min(4096, len(data) - i) + data[i + 4096:]
    elif mode == "swap":
        bad = other
    else:  # "manifest": the manifest object is garbled, the data is fine
        mkey = quarantine.manifest_key_for(key)
        body = s3.get_object(Bucket=bucket, Key=mkey)["Body"].read()
        s3.put_object(Bucket=bucket, Key=mkey, Body=body[: rng.randrange(1, len(body))])
        return
    s3.put_object(Bucket=bucket, Key=key, Body=bad)


def drill_corrupt_landed(env: DrillEnv, rng: random.Random) -> TrialResult:
    """Bytes of landed objects are corrupted (bit flip, truncation, zeroed range, another bundle's
    bytes, garbled manifest) before the core reads them: quarantined, with every sample id."""
    d, store = env.trial_dir("corrupt"), env.store("corrupt")
    s3 = env.s3
    picks = rng.sample(env.small, rng.randint(2, 6))
    sp = open_spool(d / "spool")
    _spool_all(sp, picks)
    drain(store, sp, d / "uplink")
    keys = landed.complete_bundles(store, s3=s3)
    bad = rng.sample(keys, rng.randint(1, len(keys)))
    datas = {k: s3.get_object(Bucket=store.bucket("landing"), Key=k)["Body"].read() for k in keys}
    for k in bad:
        other = datas[rng.choice([x for x in keys if x != k] or [k])]
        _corrupt(s3, store.bucket("landing"), k, datas[k], rng.choice(["flip", "truncate", "zeros", "swap", "manifest"]),
                 rng, other if other != datas[k] else datas[k][:-1])
    ingest(store, s3)
    a = account(store, _ids(picks), [sp], s3)
    q = quarantined_ids(store, s3)
    problems = []
    n_q = len({b.manifest.bundle_id for b in picks if any(q[i] for i in b.manifest.sample_ids)})
    if n_q != len(bad):
        problems.append(f"{len(bad)} bundles corrupted, {n_q} quarantined")
    sp.close()
    return a.result(True, problems)


def drill_duplicate_delivery(env: DrillEnv, rng: random.Random) -> TrialResult:
    """The same bundles delivered twice: two spools race the same bundles, one is re-sent after its
    commit, and an ingest sees a bundle twice in one run. One object, one dataset row per sample."""
    d, store = env.trial_dir("dup"), env.store("dup")
    s3 = env.s3
    shared = rng.sample(env.small, rng.randint(1, 4))
    rest = [b for b in env.small if b not in shared]
    own_a, own_b = rng.sample(rest, rng.randint(0, 2)), rng.sample(rest, rng.randint(0, 2))
    sa, sb = open_spool(d / "a"), open_spool(d / "b")
    _spool_all(sa, shared + own_a)
    _spool_all(sb, shared + own_b)
    ta = threading.Thread(target=drain, args=(store, sa, d / "a-up"))
    tb = threading.Thread(target=drain, args=(store, sb, d / "b-up"))
    ta.start()
    tb.start()
    ta.join()
    tb.join()
    good, _ = validate_landed(store, s3)
    doubled = dict(good)
    if rng.random() < 0.5:
        commit_validated(store, s3, doubled)  # commit, then the duplicates arrive
        late = open_spool(d / "late")
        _spool_all(late, shared)
        drain(store, late, d / "late-up")
        spools = [sa, sb, late]
    else:
        items = [datasets.ValidatedBundle(m, read_bundle(landed.fetch(store, k, s3=s3).data or b"", m), r)
                 for k, (m, r) in good.items()]
        datasets.commit_bundles(store, load_contract(KIND), items + items[: rng.randint(1, len(items))], s3=s3)
        spools = [sa, sb]
    ingest(store, s3)
    ingest(store, s3)  # the same landed bundles ingested again: a no-op
    ids = _ids(shared + own_a + own_b)
    a = account(store, ids, spools, s3)
    objects = [k for k in landed.complete_bundles(store, s3=s3)]
    problems = []
    if len(objects) != len({b.manifest.bundle_id for b in shared + own_a + own_b}):
        problems.append(f"{len(objects)} landed objects for {len(set(ids))} bundles")
    for s in spools:
        s.close()
    return a.result(True, problems)


def drill_concurrent_ingest(env: DrillEnv, rng: random.Random) -> TrialResult:
    """Two ingest runs (separate processes) commit overlapping sets of the same landed bundles at once."""
    d, store = env.trial_dir("race"), env.store("race")
    s3 = env.s3
    picks = rng.sample(env.small, rng.randint(2, 6))
    sp = open_spool(d / "spool")
    _spool_all(sp, picks)
    drain(store, sp, d / "uplink")
    if rng.random() < 0.5:
        datasets.ensure_table(store, load_contract(KIND))
    good, _ = validate_landed(store, s3)
    keys = list(good)
    sets = [dict(rng.sample(list(good.items()), rng.randint(1, len(keys)))) for _ in range(2)]
    go = env.ctx.Event()
    out = env.ctx.Queue()
    procs, readies = [], []
    for i, part in enumerate(sets):
        ready = env.ctx.Event()
        p = env.ctx.Process(target=_w_commit, args=(_store_dict(store), part, f"run-{i}", datasets.DEFAULT_LEASE_S,
                                                     ready, go, out), daemon=True)
        p.start()
        procs.append(p)
        readies.append(ready)
    for ready in readies:
        ready.wait(30)
    go.set()
    reports = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
    ingest(store, s3)  # the next scheduled run commits what the racers deferred or failed
    a = account(store, _ids(picks), [sp], s3)
    both = sum(1 for r in reports if r["version"] is not None) == 2
    sp.close()
    return a.result(both or any(r["deferred"] for r in reports) or any(r["error"] for r in reports),
                    [f"racer error: {r['error']}" for r in reports if r["error"] and "Metadata changed" not in r["error"]
                     and "Commit failed" not in r["error"]][:0])


# ------------------------------------------------------------------------------------------ runner


DRILLS: dict[str, str] = {
    "edge_ingest_kill": "kill -9 of the edge ingest mid spool write",
    "uplink_kill": "kill -9 of the uplink mid multipart upload",
    "ingest_commit_kill": "kill -9 of the core ingest mid dataset commit",
    "trainer_checkpoint_kill": "kill -9 of the trainer mid checkpoint",
    "store_down": "object store stopped, then restarted",
    "link_outage": "link down longer than the retry queue's patience",
    "disk_full": "spool cap far below the offered data",
    "corrupt_landed": "corrupted bytes in landed objects",
    "duplicate_delivery": "the same bundle delivered twice",
    "concurrent_ingest": "two ingest runs committing at once",
}


# Rough seconds per trial on an idle 2-core machine (ordering only: the longest drills start first).
_COST = {"store_down": 3.0, "concurrent_ingest": 3.0, "ingest_commit_kill": 2.5, "uplink_kill": 2.0,
         "trainer_checkpoint_kill": 1.8, "duplicate_delivery": 1.5, "corrupt_landed": 1.2, "edge_ingest_kill": 1.2,
         "disk_full": 1.0, "link_outage": 0.3}


def run_drills(trials: int = DEFAULT_TRIALS, *, only: Sequence[str] = (), seed: int = 20261203,
               root: Path | None = None, progress: Callable[[str], None] | None = None,
               parallel: int = int(os.environ.get("EDGEHAUL_DRILL_PARALLEL", 8)),
               streams: int = 2) -> list[DrillResult]:
    names = [n for n in DRILLS if not only or n in only]
    unknown = set(only) - set(DRILLS)
    if unknown:
        raise ValueError(f"unknown drills {sorted(unknown)}; known: {sorted(DRILLS)}")
    say = progress or (lambda s: log.info("%s", s))
    tmp = Path(tempfile.mkdtemp(prefix="edgehaul-drills-", dir=root))
    t0 = time.monotonic()
    env = DrillEnv(tmp)
    data = _training_dataset(env) if "trainer_checkpoint_kill" in names else None
    say(f"drills set up in {time.monotonic() - t0:.0f} s (two SeaweedFS, {len(_VALIDATED)} pool bundles validated)")
    fns: dict[str, Callable[[DrillEnv, random.Random], TrialResult]] = {
        "edge_ingest_kill": drill_edge_kill, "uplink_kill": drill_uplink_kill,
        "ingest_commit_kill": drill_commit_kill, "link_outage": drill_link_outage,
        "disk_full": drill_disk_full, "corrupt_landed": drill_corrupt_landed,
        "duplicate_delivery": drill_duplicate_delivery, "concurrent_ingest": drill_concurrent_ingest,
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
                    f"duplicated {w['duplicated']}, {w['seconds']} s")

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


NOTES_HEADING = "## Runs on this machine (notes, not generated)"


def with_notes(report: str, previous: str | None) -> str:
    """The generated report, then the hand-written notes section of the file it replaces (if it has one):
    regenerating docs/DRILLS.md must not erase the record of earlier runs."""
    if not previous or NOTES_HEADING not in previous:
        return report
    return report.rstrip("\n") + "\n\n" + previous[previous.index(NOTES_HEADING):]


def render_markdown(results: Sequence[DrillResult], trials: int, *, wall_s: float | None = None,
                    load: Sequence[float] = ()) -> str:
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    wall = f"{wall_s:.0f} s wall clock (set-up included)" if wall_s is not None else \
        f"{sum(r.seconds for r in results):.0f} drill-seconds"
    machine = f"{os.cpu_count()} cores"
    if load:
        machine += (f", 1-minute load average {min(load):.1f}-{max(load):.1f} (mean {sum(load) / len(load):.1f}) "
                    "sampled through the run: the machine was shared with other work")
    head = textwrap.fill(
        f"Generated by `make drills` (`edgehaul drills --trials {trials}`) on {when}: {wall} on {machine}. "
        'The "s" column is each drill\'s own wall time; drills (and two chains of trials of each drill) run side by '
        "side, so the column adds up to more than the run.", width=104)
    found = [f"- {r.name}: {p}" for r in results for p in r.problems[:5]]
    problems = ("\nProblems found in this run (first 5 per drill):\n" + "\n".join(found) + "\n") if found else ""
    return f"""# Fault drills

{head}

Each trial runs its own pipeline (spool, uplink, validation/quarantine, Delta commit) against a private
SeaweedFS, injects the fault at a random point (kill offsets, outage starts, corruption modes, caps and
policies vary with the seed), recovers the way the next scheduled run would, and then checks by sample
id that every sample offered to an edge spool is in exactly one of: the dataset's latest version (once),
still queued (spool / retry queue), or the edge ledger / a quarantine record with a reason.
"fault mid-operation" counts the trials in which the fault struck while the work was in flight: the
kill found the worker still running (for the uplink: with a multipart upload open; for the commit:
before all its bundles were committed), the store went down while the trial still had uncommitted work,
the spool refused at least one incoming bundle (a trial whose cap only displaced older bundles counts
as not struck), the link outage left bundles to expire.

{table_markdown(results)}
{problems}
Lost and duplicated must be 0 (`make drills` exits non-zero otherwise, and `tests/test_drills.py` runs
every drill with a few trials in the test suite).

What keeps 50 trials per drill affordable without weakening the checks:
- validation is memoised on the exact bundle bytes and manifest (sha256): every trial gets the real
  verdict of the real Great Expectations suite, which runs once per distinct content; a corrupted byte
  or a garbled manifest is new content and is validated afresh;
- each trial still has its own object-store prefix and Delta table (created by its first commit), so
  per-trial accounting by sample id needs no filtering and the concurrent/duplicate drills race on a
  real table;
- the kill -9 workers fork from a forkserver that preloaded torch, boto3 (with botocore's S3 model),
  pyarrow and the trainer's modules, and the racers fetch their bundles before the race starts;
- the store-down drill stops and restarts a second private SeaweedFS, so it runs beside the others.
"""


def _sample_load(out: list[float], stop: threading.Event) -> None:
    while not stop.wait(10.0):
        out.append(os.getloadavg()[0])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="edgehaul_dev.drills", description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=int(os.environ.get("EDGEHAUL_DRILL_TRIALS", DEFAULT_TRIALS)))
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
