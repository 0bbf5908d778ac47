"""Dask speed-up from 1 to 2 workers on a CPU-bound stage, and the object store's PUT rate.

1. The stage: preprocess a raw Landsat batch and write it as a zstd bundle (edgehaul.preprocess +
   edgehaul.bundles), one task per batch, on a local dask.distributed cluster of 1 and then 2
   single-threaded worker processes (what EDGEHAUL_TASK_RUNNER=dask starts). Results are checked
   identical; the figure is the 1-worker time over the 2-worker time.
2. Object-store request rate (for docs/CAPACITY.md): small PUTs (one bundle manifest each) against a
   private SeaweedFS, from 1 and from 8 client threads.

    python -m benchmarks.bench_dask            # EDGEHAUL_BENCH_QUICK=1 for a short run
"""

from __future__ import annotations

import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow as pa

QUICK = os.environ.get("EDGEHAUL_BENCH_QUICK") == "1"


def stage(seed: int, rows: int) -> tuple[str, str]:
    """CPU-bound: generate + preprocess + bundle one batch (zstd level 9); returns (bundle id, sha256)."""
    import pyarrow.compute as pc

    from edgehaul.bundles import write_bundle
    from edgehaul.contracts import load_contract
    from edgehaul.landsat import generate
    from edgehaul.preprocess import preprocess

    contract = load_contract("landsat_patch")
    raw = next(generate(rows, "node-a", seed=seed, start_seq=seed * rows, batch_size=rows))
    acc = preprocess(raw, contract).accepted
    value = pc.cast(acc.column("mean_b4_nir"), pa.float32())
    acc = acc.append_column("value", value).append_column("tier", pa.array(["normal"] * acc.num_rows))
    acc = acc.append_column("is_summary", pa.array([False] * acc.num_rows))
    _, m = write_bundle(acc, contract, tier="normal", zstd_level=9)
    return m.bundle_id, m.sha256


def run_dask(workers: int, batches: int, rows: int) -> tuple[float, list[tuple[str, str]]]:
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        client.submit(stage, 999, 50).result()  # warm: imports and contract load on every worker
        client.run(lambda: stage(998, 50))
        t0 = time.perf_counter()
        out = client.gather(client.map(stage, range(batches), rows=rows))
        return time.perf_counter() - t0, list(out)


def put_rate(threads: int, n: int) -> float:
    from edgehaul import localstack
    from tests.conftest import store_for

    root = Path(tempfile.mkdtemp(prefix="eh-bench-s3-"))
    state = localstack.new_state(root, fixed_ports=False)
    state.save()
    try:
        localstack.start_s3(state)
        s3 = store_for(state, "node-a").client(max_pool_connections=max(10, threads))
        body = b"{" + b"x" * 1500 + b"}"  # about one manifest

        def put(i: int) -> None:
            s3.put_object(Bucket="edgehaul-landing", Key=f"node-a/bench/{threads}/{i}.json", Body=body)

        put(-1)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(put, range(n)))
        return n / (time.perf_counter() - t0)
    finally:
        localstack.down(root)


def main() -> None:
    batches, rows = (8, 1500) if QUICK else (16, 3000)
    t1, r1 = run_dask(1, batches, rows)
    t2, r2 = run_dask(2, batches, rows)
    assert r1 == r2, "1-worker and 2-worker runs gave different bundles"
    print(f"dask stage (preprocess + zstd-9 bundle), {batches} batches x {rows} rows, cores={os.cpu_count()}")
    print(f"{'workers':>8} {'seconds':>8} {'batches/s':>10} {'speed-up':>9}")
    print(f"{1:>8} {t1:>8.2f} {batches / t1:>10.2f} {1.0:>9.2f}")
    print(f"{2:>8} {t2:>8.2f} {batches / t2:>10.2f} {t1 / t2:>9.2f}")
    n = 200 if QUICK else 1000
    p1, p8 = put_rate(1, n), put_rate(8, n)
    print(f"\nS3 PUT rate (1.5 KB objects, local SeaweedFS, {n} PUTs)")
    print(f"{'clients':>8} {'PUT/s':>8} {'vs 1':>6}")
    print(f"{1:>8} {p1:>8.0f} {1.0:>6.2f}")
    print(f"{8:>8} {p8:>8.0f} {p8 / p1:>6.2f}")


if __name__ == "__main__":
    main()
