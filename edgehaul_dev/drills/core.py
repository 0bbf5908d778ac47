"""Core drills: kill -9 of the core ingest mid dataset commit, corrupted landed objects, the same
bundle delivered twice, two ingest runs committing at once. Every validation, quarantine and commit
is the product's (`edgehaul.core.ingest`, through `edgehaul_dev.drills.pipeline`)."""

from __future__ import annotations

import contextlib
import random
import threading
import time
from typing import Any

from edgehaul.contracts import load_contract
from edgehaul.core import datasets, ingest, landed, quarantine
from edgehaul.core.validation import ValidationResult
from edgehaul_dev.drills.accounting import account, quarantined_ids
from edgehaul_dev.drills.env import DrillEnv, ids_of, kill, spool_all, store_dict, store_from
from edgehaul_dev.drills.pipeline import KIND, by_contract, commit_passed, drain, ingest_landed, open_spool, validate_landed
from edgehaul_dev.drills.report import TrialResult

COMMIT_LEASE_S = 0.3  # claims of a killed committer are taken over after this (drills only; prod: 900 s)


def _w_commit(store_d: dict[str, str], passed: dict[str, ValidationResult], run_id: str, lease_s: float, ready: Any,
              go: Any, out: Any) -> None:
    """A core ingest's commit step in its own process: the commit task's body (`ingest.commit_validated`:
    fetch the validated bundles again, check their bytes, commit), once per contract."""
    store = store_from(store_d)
    s3 = store.client()
    ready.set()
    go.wait(10)
    try:
        results = [ingest.commit_validated(store, contract_id, items, run_id, lease_s, s3=s3)
                   for contract_id, items in sorted(by_contract(passed).items())]
        out.put({"version": results[-1].version if results else None,
                 "deferred": [b for r in results for b in r.deferred], "error": ""})
    except Exception as e:  # reported to the parent, which recovers with its own pass
        out.put({"version": None, "deferred": [], "error": f"{type(e).__name__}: {e}"[:300]})


def drill_commit_kill(env: DrillEnv, rng: random.Random) -> TrialResult:
    """kill -9 of the core ingest during its dataset commit; the next run takes over the stale claims."""
    d, store = env.trial_dir("commit"), env.store("commit")
    s3 = env.s3
    picks = rng.sample(env.small, rng.randint(2, 6))
    sp = open_spool(d / "spool")
    spool_all(sp, picks)
    drain(store, sp, d / "uplink")
    if rng.random() < 0.5:  # half the trials commit into an existing table (the common case)
        datasets.ensure_table(store, load_contract(KIND))
    good = validate_landed(store, s3)
    out = env.ctx.Queue()
    go = env.ctx.Event()
    ready = env.ctx.Event()
    p = env.ctx.Process(target=_w_commit, args=(store_dict(store), good, "killed-run", COMMIT_LEASE_S, ready, go, out),
                        daemon=True)
    p.start()
    ready.wait(30)
    go.set()
    time.sleep(rng.uniform(0.0, 0.35))
    killed = kill(p)
    # mid-operation only if the kill left part of the commit undone (not after its last bundle landed)
    with contextlib.suppress(datasets.DatasetError):
        ids = [(r.node_id, r.bundle_id) for r in good.values()]
        killed = killed and len(datasets.committed_bundle_ids(store, KIND, ids)) < len(ids)
    time.sleep(COMMIT_LEASE_S + 0.05)
    problems = []
    try:
        ingest_landed(store, s3, lease_s=COMMIT_LEASE_S)
    except Exception as e:  # the next run fails the same way: what it leaves behind is counted below
        problems.append(f"recovery ingest failed: {type(e).__name__}: {str(e)[:200]}")
    a = account(store, ids_of(picks), [sp], s3)
    sp.close()
    return a.result(killed, problems)



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
    bytes, garbled manifest) before the core reads them, or after validation and before the commit
    step: the commit step leaves changed bundles out (and commits the others), the next run
    quarantines them, with every sample id, and commits the rest."""
    d, store = env.trial_dir("corrupt"), env.store("corrupt")
    s3 = env.s3
    picks = rng.sample(env.small, rng.randint(2, 6))
    sp = open_spool(d / "spool")
    spool_all(sp, picks)
    drain(store, sp, d / "uplink")
    keys = landed.complete_bundles(store, s3=s3)
    bad = rng.sample(keys, rng.randint(1, len(keys)))
    datas = {k: s3.get_object(Bucket=store.bucket("landing"), Key=k)["Body"].read() for k in keys}
    after_validation = rng.random() < 0.5
    passed = validate_landed(store, s3) if after_validation else {}
    for k in bad:
        other = datas[rng.choice([x for x in keys if x != k] or [k])]
        _corrupt(s3, store.bucket("landing"), k, datas[k], rng.choice(["flip", "truncate", "zeros", "swap", "manifest"]),
                 rng, other if other != datas[k] else datas[k][:-1])
    problems = []
    if after_validation:
        committed = {b for c in commit_passed(store, s3, passed) for b in c.bundles}
        changed = committed & {quarantine.ids_from_key(k)[1] for k in bad}
        if changed:
            problems.append(f"the commit step committed {len(changed)} bundles changed since their validation")
    ingest_landed(store, s3)
    a = account(store, ids_of(picks), [sp], s3)
    q = quarantined_ids(store, s3)
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
    spool_all(sa, shared + own_a)
    spool_all(sb, shared + own_b)
    ta = threading.Thread(target=drain, args=(store, sa, d / "a-up"))
    tb = threading.Thread(target=drain, args=(store, sb, d / "b-up"))
    ta.start()
    tb.start()
    ta.join()
    tb.join()
    good = validate_landed(store, s3)
    if rng.random() < 0.5:
        commit_passed(store, s3, good)  # commit, then the duplicates arrive
        late = open_spool(d / "late")
        spool_all(late, shared)
        drain(store, late, d / "late-up")
        spools = [sa, sb, late]
    else:  # one commit step that is handed some bundles twice
        validated = list(good.items())
        ingest.commit_validated(store, load_contract(KIND).id, validated + validated[: rng.randint(1, len(validated))],
                                "", datasets.DEFAULT_LEASE_S, s3=s3)
        spools = [sa, sb]
    ingest_landed(store, s3)
    ingest_landed(store, s3)  # the same landed bundles ingested again: a no-op
    ids = ids_of(shared + own_a + own_b)
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
    spool_all(sp, picks)
    drain(store, sp, d / "uplink")
    if rng.random() < 0.5:
        datasets.ensure_table(store, load_contract(KIND))
    good = validate_landed(store, s3)
    keys = list(good)
    sets = [dict(rng.sample(list(good.items()), rng.randint(1, len(keys)))) for _ in range(2)]
    go = env.ctx.Event()
    out = env.ctx.Queue()
    procs, readies = [], []
    for i, part in enumerate(sets):
        ready = env.ctx.Event()
        p = env.ctx.Process(target=_w_commit, args=(store_dict(store), part, f"run-{i}", datasets.DEFAULT_LEASE_S,
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
    ingest_landed(store, s3)  # the next scheduled run commits what the racers deferred or failed
    a = account(store, ids_of(picks), [sp], s3)
    both = sum(1 for r in reports if r["version"] is not None) == 2
    sp.close()
    # A racer may fail (an optimistic commit conflict) or defer: both are outcomes of the race, not
    # findings; what the recovery run leaves behind is what the accounting checks.
    return a.result(both or any(r["deferred"] for r in reports) or any(r["error"] for r in reports))
