"""Uplink drills: kill -9 of the drain mid multipart upload, the object store stopped and restarted
while pipelines drain and ingest, and a link outage longer than the retry queue's patience. The
uplink is the product's `Drainer` over `Uplink` (and `RetryQueue`), as the uplink_drain flow runs it."""

from __future__ import annotations

import contextlib
import random
import threading
import time
from pathlib import Path
from typing import Any

from edgehaul.blocks import LinkProfile
from edgehaul.uplink.link import Link, SimulatedLink
from edgehaul.uplink.retry_queue import RETRY_EXPIRED, STAGE_UPLINK
from edgehaul.uplink.transfer import Drainer, Uplink
from edgehaul_dev.drills.accounting import account
from edgehaul_dev.drills.env import DrillEnv, ids_of, kill, spawn, spool_all, store_dict, store_from
from edgehaul_dev.drills.pipeline import MiB, drain, fast_profile, ingest_landed, open_spool, retry_queue
from edgehaul_dev.drills.report import TrialResult


def _w_drain(store_d: dict[str, str], root: str, profile: dict[str, Any], ready: Any) -> None:
    store = store_from(store_d)
    sp = open_spool(Path(root))
    link = Link(LinkProfile(**profile), emit_events=False)
    up = Uplink(store, link, Path(root) / "uplink")
    ready.set()
    Drainer(up, sp, attempts=1, emit_events=False, poll_s=0.005).run(max_seconds=60)
    sp.close()



def drill_uplink_kill(env: DrillEnv, rng: random.Random) -> TrialResult:
    """kill -9 of the uplink drain while a multipart upload is in flight; the next drain resumes it."""
    d, store = env.trial_dir("uplink"), env.store("uplink")
    picks = [rng.choice(env.big), *rng.sample(env.small, rng.randint(0, 2))]
    sp = open_spool(d / "spool")
    spool_all(sp, picks)
    sp.close()
    # ~25 MB/s cap: the 6 MB bundle takes ~0.25 s in 2 parts of 5 MiB + 1 MiB
    prof = fast_profile(bandwidth_bps=25 * MiB * 8 / 0.7, multipart_threshold_bytes=5 * MiB, part_bytes=5 * MiB)
    fields = prof.model_dump(include=set(LinkProfile.model_fields))
    p, _ = spawn(env, _w_drain, store_dict(store), str(d / "spool"), fields)
    deadline = time.monotonic() + 20  # the kill lands at a random point after the multipart upload began
    while p.is_alive() and time.monotonic() < deadline and not any((d / "spool" / "uplink").glob("*.mpu.json")):
        time.sleep(0.005)
    time.sleep(rng.uniform(0.0, 0.2))
    killed = kill(p)
    sp = open_spool(d / "spool")
    s3 = env.s3
    mid_multipart = any(Path(d / "spool" / "uplink").glob("*.mpu.json"))
    drain(store, sp, d / "spool" / "uplink", link=Link(prof, emit_events=False))
    ingest_landed(store, s3)
    a = account(store, ids_of(picks), [sp], s3)
    left = s3.list_multipart_uploads(Bucket=store.bucket("landing"), Prefix=store.key("landing", "")).get("Uploads", [])
    problems = [f"{len(left)} multipart uploads left open"] if left else []
    sp.close()
    return a.result(killed and mid_multipart, problems)



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
        spool_all(sp, picks)
        clean_at = None  # when this trial first had everything committed
        for attempt in range(400):
            with contextlib.suppress(Exception):
                drain(store, sp, d / "uplink", rq=rq, attempts=2, max_seconds=5, uplink=up)
            try:
                ingest_landed(store, s3)
                if not sp.pending():
                    clean_at = clean_at or time.monotonic()
                    if up_event.is_set():
                        break
            except Exception:
                pass
            time.sleep(0.2 if attempt < 200 else 1.0)
        with contextlib.suppress(Exception):  # after the store is back: a final clean pass
            drain(store, sp, d / "uplink", rq=rq, uplink=up)
            ingest_landed(store)
        a = account(store, ids_of(picks), [sp])
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
    spool_all(sp, picks)
    # ~4 MB/s: a 70 KB bundle takes ~20 ms; the outage starts somewhere inside the drain
    prof = fast_profile(bandwidth_bps=4 * MiB * 8 / 0.7, chunk_bytes=64 * 1024)
    link = SimulatedLink(prof, outages=[(rng.uniform(0.0, 0.02 * len(picks)), 1e9)], emit_events=False)
    drain(store, sp, d / "uplink", link=link, rq=rq, attempts=1, max_seconds=10)
    queued = {e.bundle_id for e in rq.entries()}
    now[0] += 601.0
    expired = set(rq.expire())
    ingest_landed(store, env.s3)
    a = account(store, ids_of(picks), [sp], env.s3)
    problems = []
    if expired != queued:
        problems.append(f"expired {len(expired)} of {len(queued)} queued bundles")
    look = sp.ledger.lookup([i for b in picks if b.manifest.bundle_id in expired for i in b.manifest.sample_ids])
    if any((STAGE_UPLINK, RETRY_EXPIRED) not in v for v in look.values()) or \
            len(look) != sum(b.manifest.row_count for b in picks if b.manifest.bundle_id in expired):
        problems.append("expired samples without a retry-expired ledger row")
    sp.close()
    return a.result(bool(expired), problems)

