"""Lifecycle moves: server-side copy+delete (the mover) against a client-side get+put+delete baseline.

Both run in the same process against the same private SeaweedFS, on the same objects' sizes.
Prints time per object, client bytes and the ratio. EDGEHAUL_BENCH_QUICK=1 (or --quick) for CI.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from edgehaul.blocks import ObjectStore, RetentionPolicy, RetentionRule
from edgehaul.ops import lifecycle as lc
from edgehaul_dev import localstack


def _seed(store: ObjectStore, n: int, size: int, sub: str) -> list[str]:
    s3 = store.client()
    keys = []
    body = os.urandom(size)
    for i in range(n):
        key = store.key("landing", f"node-a/2026-01-01/{sub}-{i:04d}.parquet")
        s3.put_object(Bucket=store.bucket("landing"), Key=key, Body=body)
        keys.append(key)
    return keys


def main() -> None:
    quick = os.environ.get("EDGEHAUL_BENCH_QUICK") == "1" or "--quick" in sys.argv
    n, size = (16, 1 << 20) if quick else (48, 4 << 20)
    with tempfile.TemporaryDirectory(prefix="bench-lc-") as d:
        root = Path(d)
        state = localstack.new_state(root, fixed_ports=False)
        state.save()
        localstack.start_s3(state)
        try:
            store = state.store("admin", "bench", inline_keys=True)
            s3 = store.client()
            # baseline: what a naive mover does, every byte through the client
            keys = _seed(store, n, size, "base")
            t0 = time.perf_counter()
            for k in keys:
                body = s3.get_object(Bucket=store.bucket("landing"), Key=k)["Body"].read()
                s3.put_object(Bucket=store.bucket("cold"), Key=lc.cold_key(store, store.bucket("landing"), k),
                              Body=body, StorageClass="STANDARD_IA")
                s3.delete_object(Bucket=store.bucket("landing"), Key=k)
            t_base = time.perf_counter() - t0
            # the mover: plan + journalled server-side copy + verify + delete
            for k in keys:
                s3.delete_object(Bucket=store.bucket("cold"), Key=lc.cold_key(store, store.bucket("landing"), k))
            _seed(store, n, size, "mover")
            policy = RetentionPolicy(rules=[RetentionRule(data_class="raw", cold_after_days=30)])
            now = datetime.now(UTC) + timedelta(days=31)
            t0 = time.perf_counter()
            plan = lc.plan(store, policy, now, s3=s3)
            t_plan = time.perf_counter() - t0
            for batch in plan.batches(16):
                res = lc.run_batch(store, batch, now, s3=s3)
                assert not res.errors, res.errors
            t_mover = time.perf_counter() - t0
            assert len(plan.actions) == n
        finally:
            localstack.down(root)
    mb = n * size / 2**20
    print(f"objects {n} x {size >> 20} MiB ({mb:.0f} MiB)")
    print(f"{'':28}{'ms/object':>12}{'client MiB':>12}")
    print(f"{'client get+put+delete':28}{t_base / n * 1e3:12.1f}{2 * mb:12.0f}")
    print(f"{'mover (plan+journal+copy)':28}{t_mover / n * 1e3:12.1f}{0:12.0f}")
    print(f"  of which plan: {t_plan / n * 1e3:.1f} ms/object")
    print(f"speed-up mover/baseline: {t_base / t_mover:.2f}x")


if __name__ == "__main__":
    main()
