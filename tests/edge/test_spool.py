"""Durable spool and ledger: crash safety (real kill -9), cap, watermarks, full policies, TTL."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgehaul.blocks import EdgeNode
from edgehaul.bundles import BundleManifest, read_bundle
from edgehaul.edge import ledger
from edgehaul.edge.ledger import Ledger
from edgehaul.edge.spool import STAGE_RAW, Spool, SpoolError
from tests.builders import processed_rows

ROOT = Path(__file__).resolve().parents[2]


class Clock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, dict]] = []

    def __call__(self, event: str, resource_id: str, payload: dict | None = None, **labels: str) -> bool:
        self.events.append((event, resource_id, dict(payload or {})))
        return True


_BUNDLES: dict[tuple[int, int, str, float], tuple[bytes, BundleManifest]] = {}


def mk(n: int, seed: int, tier: str = "normal", value: float = 0.5) -> tuple[bytes, BundleManifest]:
    """A real bundle of n rows with every value set to `value` (cached: bundles are deterministic)."""
    key = (n, seed, tier, value)
    if key not in _BUNDLES:
        from edgehaul.bundles import write_bundle
        from edgehaul.contracts import load_contract

        t = processed_rows(n, seed=seed, start_seq=seed * 100_000, tier=tier)
        import pyarrow as pa

        t = t.set_column(t.schema.get_field_index("value"), "value", pa.array([value] * n, pa.float32()))
        _BUNDLES[key] = write_bundle(t, load_contract("landsat_patch"), tier=tier)
    return _BUNDLES[key]


def spool(root: Path, cap: int = 10_000_000, **kw: object) -> Spool:
    kw.setdefault("emit", Recorder())
    return Spool(root, cap_bytes=cap, node_id="node-a", **kw)  # type: ignore[arg-type]


def test_put_read_pending_ack(spool_dir: Path) -> None:
    s = spool(spool_dir)
    a, ma = mk(50, 1, "normal", 0.5)
    b, mb = mk(40, 2, "high", 0.9)
    c, mc = mk(30, 3, "normal", 0.7)
    for data, m in ((a, ma), (b, mb), (c, mc)):
        assert s.put(data, m) is not None
    assert s.put(a, ma) == s.get(ma.bundle_id)  # idempotent on bundle_id
    assert [e.bundle_id for e in s.pending()] == [mb.bundle_id, mc.bundle_id, ma.bundle_id]
    assert read_bundle(s.read(ma.bundle_id), ma).num_rows == 50
    side = spool_dir / "bundles" / f"{ma.bundle_id}.manifest.json"
    assert BundleManifest.from_json(side.read_bytes()) == ma
    with pytest.raises(SpoolError, match="does not match"):
        s.ack(ma.bundle_id, remote_key="k", sha256="0" * 64)
    assert s.get(ma.bundle_id) is not None
    s.ack(ma.bundle_id, remote_key="node-a/x.parquet", sha256=ma.sha256)
    s.ack(ma.bundle_id, remote_key="node-a/x.parquet", sha256=ma.sha256)  # idempotent
    assert s.get(ma.bundle_id) is None and not (spool_dir / "bundles" / f"{ma.bundle_id}.parquet").exists()
    assert s.put(a, ma) is None  # acknowledged bundles are not spooled again
    with pytest.raises(SpoolError, match="unknown bundle"):
        s.ack("nope", remote_key="k", sha256=ma.sha256)
    with pytest.raises(SpoolError, match="do not match"):
        s.put(a[:-1], ma)


def test_from_block_and_reopen_keeps_entries(spool_dir: Path) -> None:
    node = EdgeNode(node_id="node-a", spool_dir=str(spool_dir), spool_cap_bytes=5_000_000, full_policy="reject-new",
                    bundle_ttl_seconds=60)
    s = Spool.from_block(node)
    assert (s.cap_bytes, s.full_policy, s.ttl_seconds, s.node_id) == (5_000_000, "reject-new", 60, "node-a")
    data, m = mk(20, 4)
    s.put(data, m)
    s.close()
    again = Spool.from_block(node)
    assert [e.bundle_id for e in again.pending()] == [m.bundle_id]


def test_low_tier_goes_to_raw_store_and_counts_in_cap(spool_dir: Path) -> None:
    s = spool(spool_dir)
    data, m = mk(30, 5, "low", 0.1)
    e = s.put(data, m)
    assert e is not None and e.path.parent.name == "raw"
    assert s.pending() == [] and [r.bundle_id for r in s.raw_entries()] == [m.bundle_id]
    assert s.usage().used_bytes >= len(data)


def test_ttl_expiry_is_recorded(spool_dir: Path) -> None:
    clock = Clock()
    s = spool(spool_dir, ttl_seconds=100, raw_ttl_seconds=1000, clock=clock)
    old, mo = mk(25, 6)
    raw, mr = mk(10, 7, "low", 0.1)
    s.put(old, mo)
    s.put(raw, mr)
    clock.t += 50
    new, mn = mk(15, 8)
    s.put(new, mn)
    clock.t += 60
    expired = s.expire()
    assert [e.bundle_id for e in expired] == [mo.bundle_id]
    assert [e.bundle_id for e in s.pending()] == [mn.bundle_id]
    assert s.ledger.counts() == {("spool", ledger.TTL_EXPIRED): 25}
    assert s.ledger.lookup(mo.sample_ids[:2]) == {i: [("spool", ledger.TTL_EXPIRED)] for i in mo.sample_ids[:2]}
    clock.t += 1000
    s.expire()
    assert s.ledger.counts()[(STAGE_RAW, ledger.RAW_RETENTION)] == 10
    assert s.expire() == [] and s.ledger.counts()[("spool", ledger.TTL_EXPIRED)] == 40  # no double count


def test_watermarks_cleanup_alert_and_full_policies(spool_dir: Path) -> None:
    a, ma = mk(200, 10, "normal", 0.5)
    size = len(a) + len(ma.to_json())
    rec = Recorder()
    # cap fits ~4.3 bundles of this size: the 4th write crosses 85%
    s = spool(spool_dir, cap=int(size * 4.3), emit=rec, full_policy="reject-new")
    raw, mr = mk(100, 11, "low", 0.05)
    assert s.put(raw, mr) is not None
    puts = [mk(200, 20 + i, "normal", 0.5) for i in range(4)]
    assert s.put(*puts[0]) and s.put(*puts[1])
    assert s.put(*puts[2]) is not None
    # at >= 80% the raw store was cleaned up first (lowest value), recorded in the ledger
    assert s.raw_entries() == [] and s.ledger.counts()[(STAGE_RAW, ledger.RAW_EVICTED)] == 100
    assert s.put(*puts[3]) is not None
    frac = s.usage().fraction
    assert 0.85 <= frac <= 1.0
    alerts = [e for e in rec.events if e[0] == "edgehaul.spool.watermark"]
    assert len(alerts) == 1 and alerts[0][2]["level"] == 2 and alerts[0][2]["node_id"] == "node-a"
    assert alerts[0][2]["used_fraction"] >= 0.85
    # full + reject-new: the new bundle is refused, every sample counted
    extra, me = mk(200, 30, "high", 0.95)
    assert s.put(extra, me) is None
    assert s.ledger.counts()[("spool", ledger.FULL_REJECTED)] == 200
    assert s.usage().used_bytes <= s.cap_bytes
    assert len(alerts) == 1  # once per crossing, not per write
    # the same spool under drop-lowest-value: the high bundle displaces one normal bundle
    s2 = spool(spool_dir, cap=int(size * 4.3), emit=rec, full_policy="drop-lowest-value")
    assert s2.put(extra, me) is not None
    assert s2.ledger.counts()[("spool", ledger.FULL_DROPPED)] == 200
    assert s2.usage().used_bytes <= s2.cap_bytes
    # a bundle of lower value than everything waiting is refused, nothing dropped for it
    cheap, mc = mk(200, 31, "normal", 0.01)
    assert s2.put(cheap, mc) is None
    assert s2.ledger.counts()[("spool", ledger.FULL_DROPPED)] == 200
    # larger than the whole cap
    tiny = spool(spool_dir / "tiny", cap=1000)
    assert tiny.put(a, ma) is None and tiny.ledger.counts() == {("spool", ledger.TOO_LARGE): 200}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ops=st.lists(st.tuples(st.integers(0, 5), st.sampled_from(["high", "normal", "low"]), st.floats(0, 1)),
                 min_size=1, max_size=12),
    cap_factor=st.floats(1.2, 6.0),
    policy=st.sampled_from(["reject-new", "drop-lowest-value"]),
)
def test_spool_never_exceeds_cap_and_accounts_every_sample(
    tmp_path_factory: pytest.TempPathFactory, ops: list[tuple[int, str, float]], cap_factor: float, policy: str
) -> None:
    root = tmp_path_factory.mktemp("prop")
    unit = len(mk(20, 0)[0])
    s = spool(root, cap=int(unit * cap_factor), full_policy=policy)
    offered: dict[str, set[str]] = {}
    for seed, tier, value in ops:
        data, m = mk(20, 40 + seed, tier, round(value, 2))
        if m.bundle_id in {e.bundle_id for e in s.pending() + s.raw_entries()}:
            continue
        s.put(data, m)
        offered[m.bundle_id] = set(m.sample_ids)
        assert s.usage().used_bytes <= s.cap_bytes
    held = {i for e in s.pending() + s.raw_entries() for i in e.manifest.sample_ids}
    in_ledger = set(s.ledger.lookup([i for ids in offered.values() for i in ids]))
    for ids in offered.values():
        assert ids <= held | in_ledger  # every offered sample is in the spool or in the ledger


def test_open_removes_crash_leftovers(spool_dir: Path) -> None:
    s = spool(spool_dir)
    data, m = mk(10, 50)
    s.put(data, m)
    s.close()
    b = spool_dir / "bundles"
    (b / ".x.parquet.123.tmp").write_bytes(b"partial")
    (b / "orphan.parquet").write_bytes(b"no sidecar")
    other, mo = mk(12, 51)
    (b / f"{mo.bundle_id}.parquet").write_bytes(other[:100])  # truncated
    (b / f"{mo.bundle_id}.manifest.json").write_bytes(mo.to_json())
    s = spool(spool_dir)
    assert s.recovered == 3
    assert sorted(p.name for p in b.iterdir()) == sorted([f"{m.bundle_id}.parquet", f"{m.bundle_id}.manifest.json"])
    assert s.ledger.counts() == {("spool", ledger.CORRUPT): 12}


def test_ledger_counts_lookup_and_ignores_repeats(tmp_path: Path) -> None:
    lg = Ledger(tmp_path / "l.sqlite")
    assert lg.record(["a", "b"], stage="preprocess", reason="nan") == 2
    assert lg.record(["a", "c"], stage="preprocess", reason="nan") == 1
    assert lg.record(["a"], stage="spool", reason="ttl-expired", bundle_id="b1") == 1
    assert lg.counts() == {("preprocess", "nan"): 3, ("spool", "ttl-expired"): 1}
    assert lg.lookup(["a", "z"]) == {"a": [("preprocess", "nan"), ("spool", "ttl-expired")]}
    assert Ledger(tmp_path / "l.sqlite").total() == 4  # durable, readable from a second handle


WRITER = r"""
import sys
from pathlib import Path
from edgehaul.bundles import BundleManifest
from edgehaul.edge.spool import Spool
root, src, start = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
if len(sys.argv) > 4:  # a slow disk: each fsync takes 3 ms more, so most of a put's time has partial files on disk
    import os, time
    _fsync = os.fsync
    def slow_fsync(fd: int) -> None:
        time.sleep(0.003)
        _fsync(fd)
    os.fsync = slow_fsync
s = Spool(root, cap_bytes=10**9, node_id="node-a", emit=lambda *a, **k: True)
print("ready", flush=True)
sides = sorted(src.glob("*.json"))
for side in sides[start:] + sides[:start]:
    m = BundleManifest.from_json(side.read_bytes())
    if s.put(side.with_suffix(".bin").read_bytes(), m) is not None:
        # one write per line: under PYTHONUNBUFFERED print() writes "ok", " " and the id separately, so a kill
        # between them left a bare "ok " that named no bundle
        sys.stdout.write(f"ok {m.bundle_id}\n")
        sys.stdout.flush()
print("done", flush=True)
"""


def confirmed_ids(out: str) -> set[str]:
    """Bundle ids the writer confirmed: complete "ok <id>" lines only (a kill can cut the last line short)."""
    return {line.split()[1] for line in out.split("\n")[:-1] if line.startswith("ok ") and len(line.split()) == 2}


def test_kill_9_mid_write_loses_nothing_and_duplicates_nothing(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    manifests = {}
    for i in range(12):  # ~1.5 MB bundles: each write takes long enough to be hit mid-way
        data, m = mk(1000, 60 + i)
        (src / f"{i:03d}.bin").write_bytes(data)
        (src / f"{i:03d}.json").write_bytes(m.to_json())
        manifests[m.bundle_id] = m
    root = tmp_path / "spool"
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    rng = random.Random(7)
    confirmed: set[str] = set()
    acked: set[str] = set()
    kills = mid_write = attempt = 0
    while attempt < 8 or (mid_write < 2 and attempt < 24):
        # the slow disk makes "mid-write" most of a put's time: on a fast disk (CI's) a kill at a random
        # instant landed between puts in 24 of 24 attempts
        proc = subprocess.Popen([sys.executable, str(script), str(root), str(src), str(attempt % 12), "slow-disk"],
                                stdout=subprocess.PIPE, env=env, text=True)
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        for _ in range(rng.randint(0, 2)):  # let a few puts complete, then kill at a random point of the next
            confirmed |= confirmed_ids(proc.stdout.readline())
        time.sleep(rng.uniform(0.0, 0.012))
        proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate()
        kills += proc.returncode == -signal.SIGKILL
        confirmed |= confirmed_ids(out)
        s = Spool(root, cap_bytes=10**9, node_id="node-a", emit=lambda *a, **k: True)
        mid_write += s.recovered > 0
        present = [e.bundle_id for e in s.pending()]
        assert len(present) == len(set(present))  # no duplicate entry
        assert confirmed <= set(present) | acked  # nothing a put confirmed is lost
        for bid in present:  # every entry is complete and intact
            assert read_bundle(s.read(bid), manifests[bid]).num_rows == 1000
        leftovers = [p.name for p in (root / "bundles").iterdir() if not p.name.endswith((".parquet", ".manifest.json"))]
        assert leftovers == []
        for bid in present[: len(present) // 2 + 1]:  # "uplink" some, so the next writer has work to do
            s.ack(bid, remote_key=f"node-a/{bid}.parquet", sha256=manifests[bid].sha256)
            acked.add(bid)
        s.close()
        attempt += 1
    assert kills >= 8 and mid_write >= 1, (kills, mid_write)
    # the retry after the crashes completes the set, each bundle exactly once (spooled or acknowledged)
    done = subprocess.run([sys.executable, str(script), str(root), str(src), "0"], capture_output=True, text=True,
                          env=env, check=True)
    assert done.stdout.strip().endswith("done")
    s = Spool(root, cap_bytes=10**9, emit=lambda *a, **k: True)
    ids = [e.bundle_id for e in s.pending()]
    assert not set(ids) & acked and sorted(set(ids) | acked) == sorted(manifests)
    samples = [i for e in s.pending() for i in e.manifest.sample_ids]
    assert len(samples) == len(set(samples)) == 1000 * len(ids)
