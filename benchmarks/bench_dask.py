"""Dask speed-up from 1 to 2 workers on a CPU-bound stage, and the object store's PUT rate.

1. The stage: preprocess a raw Landsat batch and write it as a zstd bundle (edgehaul.edge.preprocess +
   edgehaul.bundles), one task per batch, on a local dask.distributed cluster of 1 and then 2
   single-threaded worker processes (what EDGEHAUL_TASK_RUNNER=dask starts). Results are checked
   identical; the figure is the 1-worker time over the 2-worker time.
2. The same stage as Prefect tasks: one `@task` per batch, mapped inside a flow whose runner is
   edgehaul.platform.runners' DaskTaskRunner (EDGEHAUL_TASK_RUNNER=dask, EDGEHAUL_DASK_ADDRESS = a cluster of 1
   and then 2 workers, warmed like the plain one), against a temporary Prefect server. Results are
   checked identical to the plain run; printed side by side with it, with the flow run's wall time.
3. Object-store request rate (for docs/CAPACITY.md): small PUTs (one bundle manifest each) against a
   private SeaweedFS, from 1 and from 8 client threads.

    python -m benchmarks.bench_dask            # EDGEHAUL_BENCH_QUICK=1 for a short run
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
from prefect import flow, task, unmapped

QUICK = os.environ.get("EDGEHAUL_BENCH_QUICK") == "1"


def stage(seed: int, rows: int) -> tuple[str, str]:
    """CPU-bound: generate + preprocess + bundle one batch (zstd level 9); returns (bundle id, sha256)."""
    import pyarrow.compute as pc

    from edgehaul.bundles import write_bundle
    from edgehaul.contracts import load_contract
    from edgehaul.edge.landsat import generate
    from edgehaul.edge.preprocess import preprocess

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


def _warm() -> None:
    import prefect.task_engine  # noqa: F401  (what a Prefect task run imports on a worker)

    stage(998, 50)


@task(name="bench-stage")
def stage_task(seed: int, rows: int) -> tuple[str, str]:
    return stage(seed, rows)


@flow(name="bench-dask-stage")
def stage_flow(batches: int, rows: int) -> tuple[float, list[tuple[str, str]]]:
    """One task run per batch on the flow's runner; returns the mapped stage's own seconds and results."""
    t0 = time.perf_counter()
    futures = stage_task.map(range(batches), rows=unmapped(rows))
    out = [f.result() for f in futures]
    return time.perf_counter() - t0, out


@contextmanager
def prefect_server() -> Iterator[str]:
    """A private Prefect server (SQLite) for the run; PREFECT_API_URL set for this process and its children."""
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    from edgehaul_dev import localstack

    root = Path(tempfile.mkdtemp(prefix="eh-bench-prefect-"))
    state = localstack.new_state(root, fixed_ports=False)
    state.save()
    try:
        localstack.start_prefect(state)
        with localstack.environ({**state.env(), "PREFECT_LOGGING_LEVEL": "WARNING"}), \
                temporary_settings(updates={PREFECT_API_URL: state.prefect_api_url,
                                            PREFECT_API_AUTH_STRING: state.api_auth_string}):
            yield state.prefect_api_url
    finally:
        localstack.down(root)


def run_prefect_dask(workers: int, batches: int, rows: int) -> tuple[float, float, list[tuple[str, str]]]:
    """(stage seconds, flow run wall seconds, results) of stage_flow on a warmed cluster of `workers`."""
    from distributed import Client, LocalCluster

    from edgehaul.platform.runners import RunnerConfig, configured

    with LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        client.run(_warm)
        run = configured(stage_flow, RunnerConfig(kind="dask", dask_address=cluster.scheduler_address))
        run(workers * 2, 50)  # warm the Prefect path (task engine, API client) on the workers
        t0 = time.perf_counter()
        stage_s, out = run(batches, rows)
        return stage_s, time.perf_counter() - t0, out


def put_rate(threads: int, n: int) -> float:
    from edgehaul_dev import localstack
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
    import distributed  # noqa: F401  (configures its loggers on import: set the levels after it)

    for name in ("distributed", "prefect"):  # per-run INFO lines would bury the table
        logging.getLogger(name).setLevel(logging.WARNING)
    load0 = os.getloadavg()
    t1, r1 = run_dask(1, batches, rows)
    t2, r2 = run_dask(2, batches, rows)
    assert r1 == r2, "1-worker and 2-worker runs gave different bundles"
    with prefect_server():
        p1, w1, q1 = run_prefect_dask(1, batches, rows)
        p2, w2, q2 = run_prefect_dask(2, batches, rows)
    assert q1 == q2 == r1, "Prefect Dask runs gave different bundles from the plain Dask run"
    load1 = os.getloadavg()
    print(f"dask stage (preprocess + zstd-9 bundle), {batches} batches x {rows} rows, cores={os.cpu_count()}, "
          f"load avg {load0[0]:.1f} -> {load1[0]:.1f} (1 min)")
    print(f"{'engine':<26} {'workers':>7} {'seconds':>8} {'batches/s':>10} {'speed-up':>9} {'flow run s':>11}")
    print(f"{'dask.distributed':<26} {1:>7} {t1:>8.2f} {batches / t1:>10.2f} {1.0:>9.2f} {'':>11}")
    print(f"{'dask.distributed':<26} {2:>7} {t2:>8.2f} {batches / t2:>10.2f} {t1 / t2:>9.2f} {'':>11}")
    print(f"{'prefect + DaskTaskRunner':<26} {1:>7} {p1:>8.2f} {batches / p1:>10.2f} {1.0:>9.2f} {w1:>11.2f}")
    print(f"{'prefect + DaskTaskRunner':<26} {2:>7} {p2:>8.2f} {batches / p2:>10.2f} {p1 / p2:>9.2f} {w2:>11.2f}")
    print(f"Prefect's cost on the stage: {p1 / t1:.2f}x plain Dask time with 1 worker, {p2 / t2:.2f}x with 2 "
          f"({batches} task runs each)")
    n = 200 if QUICK else 1000
    p1, p8 = put_rate(1, n), put_rate(8, n)
    print(f"\nS3 PUT rate (1.5 KB objects, local SeaweedFS, {n} PUTs)")
    print(f"{'clients':>8} {'PUT/s':>8} {'vs 1':>6}")
    print(f"{1:>8} {p1:>8.0f} {1.0:>6.2f}")
    print(f"{8:>8} {p8:>8.0f} {p8 / p1:>6.2f}")


if __name__ == "__main__":
    main()
