"""Uplink: goodput against the rate cap, merged bundles against one PUT per sample, and high-tier
latency under 3x oversubscription with priority against FIFO.

Everything runs in one process against one private SeaweedFS (real S3 calls; the link is the
client-side simulator), baselines measured in the same run. Prints ratios side by side.
EDGEHAUL_BENCH_QUICK=1 (or --quick) for the short CI variant.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from edgehaul.blocks import LinkProfile, ObjectStore
from edgehaul.bundles import BundleManifest, conform, write_bundle
from edgehaul.contracts import load_contract
from edgehaul.edge.landsat import generate
from edgehaul.uplink.link import SimulatedLink
from edgehaul.uplink.transfer import Drainer, Receipt, Uplink
from edgehaul_dev import localstack
from tests.doubles import MemorySource

KiB, MiB = 1024, 1024 * 1024


def _rows(n: int, seed: int, start_seq: int, tier: str = "normal") -> pa.Table:
    """Bundle-schema rows from the real-data generator (features zero: the bench moves bytes)."""
    contract = load_contract("landsat_patch")
    raw = pa.concat_tables(list(generate(n, "node-a", seed=seed, start_seq=start_seq, batch_size=max(n, 1))))
    pixels = raw.column("pixels").combine_chunks()
    cols: dict[str, Any] = {c: raw.column(c) for c in ("sample_id", "node_id", "capture_time", "seq", "label")}
    cols["content_sha256"] = pa.array([hashlib.sha256(p.as_py()).hexdigest() for p in pixels])
    cols["pixels"] = pixels
    for name in contract.bundle_schema.names:
        if name.startswith(("mean_", "std_")):
            cols[name] = pa.array([0.0] * n, pa.float32())
    cols["value"] = pc.divide(pc.cast(raw.column("seq"), pa.float64()), float(start_seq + n))
    cols["tier"] = pa.array([tier] * n)
    cols["is_summary"] = pa.array([False] * n)
    return conform(pa.table(cols), contract)


def _bundle(n: int, seed: int, start_seq: int, tier: str = "normal") -> tuple[bytes, BundleManifest]:
    return write_bundle(_rows(n, seed, start_seq, tier), load_contract("landsat_patch"), tier=tier)


def _profile(cap_bytes_per_s: float, **kw: Any) -> LinkProfile:
    kw.setdefault("chunk_bytes", 64 * KiB)
    return LinkProfile(bandwidth_bps=cap_bytes_per_s * 8 / 0.7, **kw)


def goodput(store: ObjectStore, state: Path, quick: bool) -> None:
    cap = 4 * MiB
    n_bundles = 10 if quick else 24
    items = [_bundle(1000, seed=s, start_seq=10_000 * s) for s in range(1, n_bundles + 1)]
    # warm the server up (a fresh SeaweedFS allocates volumes on its first writes)
    warm = MemorySource()
    warm.put(*_bundle(50, seed=999, start_seq=9_990_000))
    Drainer(Uplink(store, SimulatedLink(_profile(64 * MiB), emit_events=False), state / "warm"), warm,
            emit_events=False).run()
    print(f"[goodput] {n_bundles} merged bundles of ~{items[0][1].nbytes / MiB:.1f} MiB, cap {cap / MiB:.0f} MiB/s")
    for label, active in (("1 transfer at a time", 1), ("2 concurrent (default)", 2)):
        sub = store.model_copy(update={"prefix": f"{store.prefix}/goodput-{active}"})
        link = SimulatedLink(_profile(cap), emit_events=False)
        src = MemorySource()
        for d, m in items:
            src.put(d, m)
        rep = Drainer(Uplink(sub, link, state / f"g{active}"), src, max_active=active, emit_events=False).run()
        use = rep.goodput_bps / 8 / cap
        data_only = rep.bytes_landed / rep.seconds / cap
        print(f"  {label:<24} goodput {rep.goodput_bps / 8 / MiB:5.2f} MiB/s = {use:6.1%} of cap "
              f"(bundles only {data_only:6.1%}, manifests the rest)  "
              f"shaper {link.snapshot()['shaped_bytes_per_s'] / cap:6.1%} of cap  requests {link.stats.requests}")


def merged_vs_per_sample(store: ObjectStore, state: Path, quick: bool) -> None:
    n = 2_000 if quick else 10_000
    per_bundle = 1000
    rows = _rows(n, seed=5, start_seq=500_000)
    print(f"[small files] {n} samples of {rows.column('pixels')[0].as_py().__len__()} bytes: "
          f"one PUT per sample vs {n // per_bundle} merged bundles (latency 0: pure request cost on localhost)")
    cap = 64 * MiB  # not the bottleneck here: the question is requests
    # baseline: each sample its own object, 8 uploads in flight
    link = SimulatedLink(_profile(cap), emit_events=False)
    sub = store.model_copy(update={"prefix": f"{store.prefix}/per-sample"})
    up = Uplink(sub, link, state / "ps")
    s3, bucket = up.client, sub.bucket("landing")
    ids = rows.column("sample_id").to_pylist()
    pix = rows.column("pixels").to_pylist()
    t0 = time.perf_counter()

    def put(i: int) -> None:
        import base64

        body = pix[i]
        s3.put_object(Bucket=bucket, Key=sub.key("landing", f"node-a/samples/{ids[i]}.bin"), Body=link.body(body),
                      ChecksumSHA256=base64.b64encode(hashlib.sha256(body).digest()).decode())

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(put, range(n)))
    t_base, req_base = time.perf_counter() - t0, link.stats.requests
    # merged: bundles of 1000 samples through the drain
    t0 = time.perf_counter()
    src = MemorySource()
    for i in range(0, n, per_bundle):
        src.put(*write_bundle(rows.slice(i, per_bundle), load_contract("landsat_patch"), tier="normal"))
    t_pack = time.perf_counter() - t0
    link2 = SimulatedLink(_profile(cap), emit_events=False)
    sub2 = store.model_copy(update={"prefix": f"{store.prefix}/merged"})
    rep = Drainer(Uplink(sub2, link2, state / "mg"), src, max_active=2, emit_events=False).run()
    t_merged = time.perf_counter() - t0
    req_merged = link2.stats.requests
    print(f"  {'':<22}{'requests':>10}{'wall s':>10}")
    print(f"  {'one PUT per sample':<22}{req_base:>10}{t_base:>10.2f}")
    print(f"  {'merged bundles':<22}{req_merged:>10}{t_merged:>10.2f}   (bundling {t_pack:.2f} s included, "
          f"{len(rep.landed)} bundles)")
    print(f"  ratio: {req_base / req_merged:.0f}x fewer requests, {t_base / t_merged:.1f}x less wall time; at a "
          f"600 ms satellite round trip the per-sample way needs >= {req_base * 0.6 / 8 / 60:.0f} min of round trips "
          f"with 8 in flight, the merged way {req_merged * 0.6 / 2:.0f} s")


def _p99(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(0.99 * (len(s) - 1) + 0.5))]


def oversubscribed(store: ObjectStore, state: Path, quick: bool) -> None:
    """Normal tier flushed every `flush_s` at 3x the cap; high tier "sent at once": its samples are
    bundled for at most `urgent_s` (a tenth of the flush interval). Capture times are spread evenly
    over each bundle's batching interval; p99 is over high-tier samples (not landed by the end of the
    run: counted at the time they had waited so far, shown with '>')."""
    cap = 1 * MiB
    flush_s, urgent_s = 0.5, 0.05
    duration = 6.0 if quick else 12.0
    grace = 2.0
    n_flush = int(duration / flush_s)
    per_flush = int(flush_s / urgent_s)
    per_normal = int(3 * cap * flush_s / 1370)  # ~3x the cap in normal-tier bytes, every flush
    per_high = 2
    normal = [_bundle(per_normal, seed=100 + i, start_seq=1_000_000 + i * 10_000) for i in range(n_flush)]
    high = [_bundle(per_high, seed=300 + i, start_seq=3_000_000 + i * 10, tier="high") for i in range(n_flush * per_flush)]
    chunk_s = 64 * KiB / cap
    produced = sum(m.nbytes for _, m in normal + high) / duration
    bound = flush_s + chunk_s
    print(f"[3x oversubscription] {produced / MiB:.2f} MiB/s produced into a {cap / MiB:.0f} MiB/s cap "
          f"for {duration:.0f} s; "
          f"normal flushed every {flush_s} s, high every {urgent_s} s ({high[0][1].nbytes // 1024} KiB); "
          f"one chunk = {chunk_s * 1000:.0f} ms at the cap")
    for policy in ("priority", "fifo"):
        sub = store.model_copy(update={"prefix": f"{store.prefix}/over-{policy}"})
        link = SimulatedLink(_profile(cap), emit_events=False)
        src = MemorySource()
        flushed: dict[str, tuple[float, float]] = {}  # bundle -> (first capture, last capture)
        landed: dict[str, float] = {}

        def on_landed(r: Receipt, _e: Any, out: dict[str, float] = landed) -> None:
            out.setdefault(r.bundle_id, time.time())

        drainer = Drainer(Uplink(sub, link, state / f"o-{policy}"), src, max_active=2, policy=policy,  # type: ignore[arg-type]
                          emit_events=False, poll_s=0.005, refresh_s=0.01, on_landed=on_landed)
        th = threading.Thread(target=drainer.run, kwargs={"max_seconds": duration + grace, "until_empty": False})
        t_start = time.time()
        th.start()
        for tick in range(n_flush * per_flush):
            time.sleep(max(0.0, t_start + (tick + 1) * urgent_s - time.time()))
            now = time.time()
            d, m = high[tick]
            flushed[m.bundle_id] = (now - urgent_s, now)
            src.put(d, m)
            if (tick + 1) % per_flush == 0:
                d, m = normal[tick // per_flush]
                flushed[m.bundle_id] = (now - flush_s, now)
                src.put(d, m)
        time.sleep(max(0.0, t_start + duration + grace - time.time()))
        drainer.stop()
        th.join()
        end = time.time()
        lat: list[float] = []
        waiting = 0
        for _, m in high:
            first, last = flushed[m.bundle_id]
            done = landed.get(m.bundle_id)
            waiting += done is None
            for k in range(m.row_count):
                cap_t = first + (k + 0.5) * (last - first) / m.row_count
                lat.append((done if done is not None else end) - cap_t)
        p99 = _p99(lat)
        flag = ">" if waiting else " "
        n_norm = sum(1 for _, m in normal if m.bundle_id in landed)
        print(f"  {policy:<9} high-tier p99 capture-to-landed {flag}{p99:6.2f} s   bound flush + one chunk {bound:.2f} s: "
              f"{'within' if not waiting and p99 <= bound else 'OVER'};  "
              f"high bundles landed {len(high) - waiting}/{len(high)}, normal {n_norm}/{len(normal)}")


def main() -> None:
    quick = os.environ.get("EDGEHAUL_BENCH_QUICK") == "1" or "--quick" in sys.argv
    with tempfile.TemporaryDirectory(prefix="bench-uplink-") as d:
        root = Path(d)
        st = localstack.new_state(root / "stack", fixed_ports=False)
        (root / "stack").mkdir()
        st.save()
        localstack.start_s3(st)  # only S3: the bench needs no Prefect server
        try:
            store = st.store("admin", "bench", inline_keys=True)
            goodput(store, root / "state", quick)
            merged_vs_per_sample(store, root / "state", quick)
            oversubscribed(store, root / "state", quick)
        finally:
            localstack.down(root / "stack")


if __name__ == "__main__":
    main()
