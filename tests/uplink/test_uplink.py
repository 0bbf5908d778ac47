"""Uplink transfer and drain against the session's real SeaweedFS (client-side link simulator).

Bandwidths are small so each shaped transfer takes a few seconds; nothing asserts wall time except
the shaper's rate against its own cap.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from botocore.exceptions import ClientError

from edgehaul.blocks import LinkProfile, ObjectStore
from edgehaul.bundles import BundleManifest, write_bundle
from edgehaul.contracts import load_contract
from edgehaul.edge.ledger import Ledger
from edgehaul.edge.spool import Spool
from edgehaul.tasks.uplink import spool_discard
from edgehaul.uplink.link import Link, SimulatedLink
from edgehaul.uplink.retry_queue import RETRY_EXPIRED, RETRY_OVERFLOW, STAGE_UPLINK, RetryQueue
from edgehaul.uplink.transfer import Drainer, Uplink, UplinkError
from edgehaul_dev import localstack
from tests.builders import bundle, processed_rows
from tests.conftest import store_for
from tests.doubles import MemorySource
from tests.waiting import wait_for

MiB = 1024 * 1024
KiB = 1024


def prof(cap_bytes_per_s: float, **kw: object) -> LinkProfile:
    kw.setdefault("chunk_bytes", 64 * KiB)
    return LinkProfile(bandwidth_bps=cap_bytes_per_s * 8 / 0.7, **kw)  # type: ignore[arg-type]


def urgent(n: int, seed: int) -> tuple[bytes, BundleManifest]:
    return write_bundle(processed_rows(n, seed=seed, start_seq=10_000 * seed, tier="high"), load_contract("landsat_patch"),
                        tier="high")


def landed_sha(store: ObjectStore, key: str) -> str:
    body = store.client().get_object(Bucket=store.bucket("landing"), Key=key)["Body"].read()
    return hashlib.sha256(body).hexdigest()


def keys_under(store: ObjectStore, prefix: str) -> list[str]:
    resp = store.client().list_objects_v2(Bucket=store.bucket("landing"), Prefix=store.key("landing", prefix))
    return sorted(o["Key"] for o in resp.get("Contents", []))


# --- retry queue (no servers) ----------------------------------------------------------------------

def test_retry_queue_cap_and_expiry_are_recorded_in_the_ledger_by_sample_id(tmp_path: Path) -> None:
    clock = [1000.0]
    spool = Spool(tmp_path / "spool", cap_bytes=50 * MiB, node_id="node-a", clock=lambda: clock[0],
                  emit=lambda *a, **k: True)
    bundles = [bundle(20, seed=s, start_seq=100 * s) for s in range(3)]
    for d, m in bundles:
        spool.put(d, m)
    q = RetryQueue(tmp_path / "spool" / "retry.sqlite", cap=2, expiry_seconds=100, ledger=spool.ledger,
                   discard=lambda b: spool_discard(spool, b), clock=lambda: clock[0], emit_events=False)
    by_value = sorted((m for _, m in bundles), key=lambda m: m.max_value)
    for m in by_value[::-1]:  # highest value first; the third add overflows the cap
        q.add(m, error="ConnectionError")
        clock[0] += 1
    evicted = by_value[0]
    assert len(q) == 2 and {e.bundle_id for e in q.entries()} == {m.bundle_id for m in by_value[1:]}
    assert spool.get(evicted.bundle_id) is None  # its bytes left the spool...
    found = spool.ledger.lookup(evicted.sample_ids)
    assert set(found) == set(evicted.sample_ids)  # ...and every sample is in the ledger
    assert all(v == [(STAGE_UPLINK, RETRY_OVERFLOW)] for v in found.values())
    # a re-failure keeps the first failure time: expiry is from the first failure
    q.add(by_value[2], error="again")
    assert [e.attempts for e in q.entries() if e.bundle_id == by_value[2].bundle_id] == [2]
    assert q.blocked_ids() == {m.bundle_id for m in by_value[1:]}  # backoff: not due yet
    clock[0] += 100
    expired = q.expire()
    assert sorted(expired) == sorted(m.bundle_id for m in by_value[1:]) and len(q) == 0
    counts = spool.ledger.counts()
    assert counts[(STAGE_UPLINK, RETRY_OVERFLOW)] == evicted.row_count
    assert counts[(STAGE_UPLINK, RETRY_EXPIRED)] == sum(m.row_count for m in by_value[1:])
    assert spool.pending() == []
    # survives a restart: a fresh queue on the same file sees the same (empty) state, and a
    # re-add after reopening still counts against the cap
    q2 = RetryQueue(tmp_path / "spool" / "retry.sqlite", cap=2, expiry_seconds=100, ledger=Ledger(tmp_path / "l2.sqlite"),
                    clock=lambda: clock[0], emit_events=False)
    assert len(q2) == 0


# --- transfer ----------------------------------------------------------------------------------------

@pytest.mark.integration
def test_rate_held_within_5pct_of_cap_and_control_plane_stays_responsive(
    stack: localstack.StackState, store: ObjectStore, tmp_path: Path
) -> None:
    cap = 400_000.0
    link = SimulatedLink(prof(cap), emit_events=False)
    up = Uplink(store, link, tmp_path / "state")
    src = MemorySource()
    items = [bundle(400, seed=s, start_seq=1000 * s) for s in range(1, 4)]
    for d, m in items:
        src.put(d, m)
    out: dict[str, object] = {}
    t = threading.Thread(target=lambda: out.setdefault("rep", Drainer(up, src, max_active=2, emit_events=False).run()))
    t.start()
    # Control plane during the saturated transfer: Prefect API round trips never queue behind data.
    lat = []
    while t.is_alive():
        t0 = time.monotonic()
        with urllib.request.urlopen(f"{stack.prefect_api_url}/health", timeout=5) as r:
            assert r.status == 200
        link.control(512)
        lat.append(time.monotonic() - t0)
        time.sleep(0.1)
    t.join()
    rep = out["rep"]
    snap = link.snapshot()
    assert len(src) == 0 and len(rep.landed) == 3  # type: ignore[attr-defined]
    assert abs(snap["shaped_bytes_per_s"] / cap - 1) <= 0.05, snap
    goodput = rep.bytes_landed / rep.seconds  # type: ignore[attr-defined]
    assert 0.8 * cap < goodput <= 1.05 * cap
    # the cap leaves 30% of the bandwidth to the control plane
    assert link.cap_bytes_per_s == pytest.approx(0.7 * link.profile.bandwidth_bps / 8)
    assert len(lat) >= 10 and max(lat) < 1.0
    for _, m in items:
        assert landed_sha(store, up.key_of(m)) == m.sha256


@pytest.mark.integration
def test_urgent_bundle_preempts_a_normal_one_mid_transfer(store: ObjectStore, tmp_path: Path) -> None:
    cap = 500_000.0
    link = SimulatedLink(prof(cap), emit_events=False)
    up = Uplink(store, link, tmp_path / "state")
    src = MemorySource()
    normal = bundle(1000, seed=11, start_seq=11_000)  # ~1.4 MB: ~2.7 s at the cap
    src.put(*normal)
    landed: dict[str, float] = {}
    drainer = Drainer(up, src, max_active=1, emit_events=False,
                      on_landed=lambda r, e: landed.setdefault(r.bundle_id, time.monotonic()))
    t = threading.Thread(target=drainer.run)
    t.start()
    time.sleep(0.6)
    assert normal[1].bundle_id not in landed
    d, m = urgent(40, seed=12)  # ~55 KB
    put_at = time.monotonic()
    src.put(d, m)
    t.join()
    assert landed[m.bundle_id] < landed[normal[1].bundle_id]
    # the urgent bundle went through between the normal bundle's chunks, not after it
    assert landed[normal[1].bundle_id] - landed[m.bundle_id] > 0.5
    assert landed[m.bundle_id] - put_at < 0.5 * (landed[normal[1].bundle_id] - put_at)
    assert landed_sha(store, up.key_of(m)) == m.sha256
    assert landed_sha(store, up.key_of(normal[1])) == normal[1].sha256


_CHILD = """
import json, sys
from pathlib import Path
from pydantic import SecretStr
from edgehaul.blocks import LinkProfile, ObjectStore
from edgehaul.bundles import BundleManifest
from edgehaul.uplink.link import SimulatedLink
from edgehaul.uplink.transfer import Uplink
a = json.loads(sys.argv[1])
store = ObjectStore(endpoint_url=a["endpoint"], access_key_id=SecretStr(a["key"]), secret_access_key=SecretStr(a["secret"]),
                    prefix=a["prefix"])
p = LinkProfile(**a["profile"])
m = BundleManifest.from_json(Path(a["manifest"]).read_bytes())
Uplink(store, SimulatedLink(p, emit_events=False), Path(a["state"])).send(Path(a["data"]).read_bytes(), m)
print("finished")
"""


@pytest.mark.integration
def test_kill_9_during_multipart_resumes_without_resending_finished_parts(
    stack: localstack.StackState, store: ObjectStore, tmp_path: Path
) -> None:
    d, m = bundle(8000, seed=21, start_seq=21_000)  # ~10.9 MB: 3 parts of 5 MiB
    (tmp_path / "b.parquet").write_bytes(d)
    (tmp_path / "b.manifest.json").write_bytes(m.to_json())
    profile = prof(5 * MiB, chunk_bytes=256 * KiB, multipart_threshold_bytes=5 * MiB, part_bytes=5 * MiB)
    state = tmp_path / "state"
    admin = stack.identities["admin"]
    args = {"endpoint": stack.s3_endpoint, "key": admin.access_key_id, "secret": admin.secret_access_key,
            "prefix": store.prefix, "profile": profile.model_dump(mode="json", include=set(LinkProfile.model_fields)),
            "manifest": str(tmp_path / "b.manifest.json"), "data": str(tmp_path / "b.parquet"), "state": str(state)}
    child = subprocess.Popen([sys.executable, "-c", _CHILD, json.dumps(args)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    state_file = state / f"{m.bundle_id}.mpu.json"
    def a_part_recorded() -> bool:
        if state_file.exists() and json.loads(state_file.read_text())["parts"]:
            return True
        assert child.poll() is None, child.communicate()
        return False

    wait_for(a_part_recorded, 60, "the child's first recorded multipart part", interval=0.02)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    st = json.loads(state_file.read_text())
    s3 = store.client()
    bucket, key = store.bucket("landing"), st["key"]
    before = {p["PartNumber"] for p in s3.list_parts(Bucket=bucket, Key=key, UploadId=st["upload_id"]).get("Parts", [])}
    assert 1 <= len(before) < 3, before
    with pytest.raises(ClientError):
        s3.head_object(Bucket=bucket, Key=key)  # not landed: the kill came mid-upload

    link = SimulatedLink(prof(50 * MiB, chunk_bytes=256 * KiB, multipart_threshold_bytes=5 * MiB, part_bytes=5 * MiB),
                         emit_events=False)
    r = Uplink(store, link, state).send(d, m)
    assert r.multipart and r.parts_total == 3
    assert r.parts_skipped == len(before) and r.parts_sent == 3 - len(before)
    sent_parts = [n for n in (1, 2, 3) if n not in before]
    expected = sum(len(d[(n - 1) * 5 * MiB : n * 5 * MiB]) for n in sent_parts) + len(m.to_json())
    assert link.stats.bytes_sent == expected  # only the missing parts (and the manifest) crossed the link
    assert landed_sha(store, key) == m.sha256
    assert not state_file.exists()
    assert s3.list_multipart_uploads(Bucket=bucket, Prefix=key).get("Uploads", []) == []


@pytest.mark.integration
def test_duplicate_and_racing_sends_leave_one_object(store: ObjectStore, tmp_path: Path) -> None:
    d, m = bundle(200, seed=31, start_seq=31_000)
    up = Uplink(store, Link(prof(20 * MiB)), tmp_path / "s1")
    first = up.send(d, m)
    again = up.send(d, m)
    assert not first.already_present and again.already_present
    # two senders (e.g. a retried flow run and the original) racing on a new bundle
    d2, m2 = bundle(600, seed=32, start_seq=32_000)
    ups = [Uplink(store, Link(prof(2 * MiB)), tmp_path / f"r{i}") for i in range(2)]
    receipts: list[object] = []
    threads = [threading.Thread(target=lambda u=u: receipts.append(u.send(d2, m2))) for u in ups]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(receipts) == 2
    # an urgent bundle skips the HEAD round trip; IfNoneMatch still stops the duplicate
    d3, m3 = urgent(20, seed=33)
    u1, u2 = up.send(d3, m3), up.send(d3, m3)
    assert (u1.already_present, u1.verified_by) == (False, "etag-md5")
    assert (u2.already_present, u2.verified_by) == (True, "etag-md5")
    keys = keys_under(store, f"{m.node_id}/")
    expect = [up.key_of(x) for x in (m, m2, m3)] + [up.key_of(x).replace(".parquet", ".manifest.json") for x in (m, m2, m3)]
    assert keys == sorted(expect)
    assert landed_sha(store, up.key_of(m2)) == m2.sha256


@pytest.mark.integration
def test_corrupted_upload_is_detected_and_resent(store: ObjectStore, tmp_path: Path) -> None:
    # single PUT: chunk 2 is corrupted on the wire; the server's SHA-256 check rejects it
    d, m = bundle(200, seed=41, start_seq=41_000)
    link = SimulatedLink(prof(20 * MiB), corrupt_chunks=[2], emit_events=False)
    r = Uplink(store, link, tmp_path / "s").send(d, m)
    assert r.digest_resends == 1 and link.stats.chunks_corrupted == 1
    assert landed_sha(store, r.key) == m.sha256
    # multipart: only the corrupted part is sent again
    d2, m2 = bundle(8000, seed=42, start_seq=42_000)
    p = prof(40 * MiB, chunk_bytes=1 * MiB, multipart_threshold_bytes=5 * MiB, part_bytes=5 * MiB)
    link2 = SimulatedLink(p, corrupt_chunks=[7], emit_events=False)  # chunk 7 lies in part 2
    r2 = Uplink(store, link2, tmp_path / "s").send(d2, m2)
    assert r2.multipart and r2.digest_resends == 1 and r2.parts_sent == 3
    assert link2.stats.bytes_sent == len(d2) + 5 * MiB + len(m2.to_json())
    assert landed_sha(store, r2.key) == m2.sha256
    # corruption every time: a clear, non-retryable error after N re-sends, and nothing landed
    d3, m3 = bundle(50, seed=43, start_seq=43_000)
    bad = SimulatedLink(prof(20 * MiB), corrupt_rate=1.0, emit_events=False)
    with pytest.raises(UplinkError, match="checksum rejected 3 times") as e:
        Uplink(store, bad, tmp_path / "s", max_digest_resends=2).send(d3, m3)
    assert not e.value.retryable
    assert keys_under(store, f"{m3.node_id}/") == sorted([r.key, r.manifest_key, r2.key, r2.manifest_key])


@pytest.mark.integration
def test_outage_windows_pause_and_resume_with_nothing_lost(store: ObjectStore, tmp_path: Path) -> None:
    link = SimulatedLink(prof(1 * MiB), outages=[(0.4, 1.4)], emit_events=False)
    up = Uplink(store, link, tmp_path / "state")
    src = MemorySource()
    items = [bundle(250, seed=s, start_seq=1000 * s) for s in range(51, 55)]
    for d, m in items:
        src.put(d, m)
    rep = Drainer(up, src, max_active=2, attempts=5, backoff_s=(0.2,), emit_events=False).run(max_seconds=60)
    assert rep.attempts > len(items)  # the outage failed some attempts...
    assert not rep.failed and len(src) == 0 and set(src.acked) == {m.bundle_id for _, m in items}  # ...none lost
    for _, m in items:
        assert landed_sha(store, up.key_of(m)) == m.sha256


@pytest.mark.integration
def test_transfer_waits_for_the_contact_window(store: ObjectStore, tmp_path: Path) -> None:
    p = prof(2 * MiB, contact_period_s=3.0, contact_duration_s=1.5)
    link = SimulatedLink(p, epoch=time.monotonic() - 1.6, emit_events=False)  # just out of contact: 1.4 s to go
    d, m = bundle(100, seed=61, start_seq=61_000)
    t0 = time.monotonic()
    r = Uplink(store, link, tmp_path / "s", contact_wait_s=10).send(d, m)
    assert time.monotonic() - t0 >= 1.2 and link.stats.contact_waits == 1
    assert landed_sha(store, r.key) == m.sha256


@pytest.mark.integration
def test_access_denied_is_not_retried_and_goes_to_the_retry_queue(stack: localstack.StackState, tmp_path: Path) -> None:
    node_b = store_for(stack, "node-b")  # node-b may only write under landing/node-b/
    d, m = bundle(30, seed=71, start_seq=71_000, node_id="node-a")
    src = MemorySource()
    src.put(d, m)
    ledger = Ledger(tmp_path / "ledger.sqlite")
    q = RetryQueue(tmp_path / "retry.sqlite", cap=10, expiry_seconds=3600, ledger=ledger, emit_events=False)
    rep = Drainer(Uplink(node_b, Link(prof(2 * MiB)), tmp_path / "s"), src, attempts=3, backoff_s=(0.1,),
                  retry_queue=q, emit_events=False).run(max_seconds=30)
    # HEAD of a key outside its prefix is 403 (treated as absent); the conditional PUT is then denied
    assert rep.attempts == 1 and m.bundle_id in rep.failed and "AccessDenied" in rep.failed[m.bundle_id]
    assert [e.bundle_id for e in q.entries()] == [m.bundle_id] and len(src) == 1  # still in the source, not lost


@pytest.mark.integration
def test_a_bundle_corrupt_on_disk_is_ledgered_once_and_never_queued_for_retry(
        store: ObjectStore, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A spooled bundle the disk changed went to the retry queue, was read corrupt again at each retry and expired
    as retry-expired, the cause lost. The drain's read now drops it (its samples ledgered as corrupt-on-disk, an
    error naming it) and the drain lands the rest without queueing it; a bundle gone from the spool between the
    listing and the read is not queued either."""
    clock = [1000.0]
    spool = Spool(tmp_path / "spool", cap_bytes=50 * MiB, node_id="node-a", emit=lambda *a, **k: True)
    made = [bundle(20, seed=s, start_seq=1000 * s + 81_000) for s in range(3)]
    for d, m in made:
        spool.put(d, m)
    bad = made[1][1]
    path = spool.get(bad.bundle_id).path  # type: ignore[union-attr]
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # the size still matches: only the digest tells
    path.write_bytes(bytes(raw))
    q = RetryQueue(tmp_path / "spool" / "retry.sqlite", cap=10, expiry_seconds=100, ledger=spool.ledger,
                   discard=lambda b: spool_discard(spool, b), clock=lambda: clock[0], emit_events=False)
    with caplog.at_level(logging.ERROR, logger="edgehaul"):
        rep = Drainer(Uplink(store, Link(prof(4 * MiB)), tmp_path / "s"), spool, attempts=3, backoff_s=(0.1,),
                      retry_queue=q, emit_events=False).run(max_seconds=60)
    assert rep.gone == [bad.bundle_id] and "corrupt on disk" in rep.failed[bad.bundle_id]
    assert f"bundle {bad.bundle_id} corrupt on disk" in caplog.text
    assert rep.attempts == 3 and {r.bundle_id for r in rep.landed} == {m.bundle_id for _, m in made} - {bad.bundle_id}
    assert len(q) == 0 and rep.queued_for_retry == [] and spool.pending() == []
    found = spool.ledger.lookup(bad.sample_ids)
    assert set(found) == set(bad.sample_ids) and all(v == [("spool", "corrupt-on-disk")] for v in found.values())
    clock[0] += 1000
    assert q.expire() == [] and spool.ledger.counts() == {("spool", "corrupt-on-disk"): bad.row_count}
    assert rep.metrics(4 * MiB)["bundles_gone"] == 1
    # listed, then gone before its read (sent by another drain, thinned): not retried, not queued, nothing ledgered
    d, m = bundle(20, seed=9, start_seq=89_000)
    spool.put(d, m)
    listed = spool.pending()
    spool.ack(m.bundle_id, remote_key="elsewhere", sha256=m.sha256)

    class Stale:
        pending = staticmethod(lambda: listed)
        read = spool.read
        ack = spool.ack

    rep = Drainer(Uplink(store, Link(prof(4 * MiB)), tmp_path / "s"), Stale(), attempts=3, backoff_s=(0.1,),
                  retry_queue=q, emit_events=False).run(max_seconds=5)
    assert rep.gone == [m.bundle_id] and rep.attempts == 1 and len(q) == 0
    assert spool.ledger.lookup(m.sample_ids) == {}


@pytest.mark.integration
def test_orphaned_multipart_uploads_are_aborted_but_resumable_ones_kept(store: ObjectStore, tmp_path: Path) -> None:
    s3 = store.client()
    bucket = store.bucket("landing")
    orphan = s3.create_multipart_upload(Bucket=bucket, Key=store.key("landing", "node-a/2026-01-01/orphan.parquet"))
    mine = s3.create_multipart_upload(Bucket=bucket, Key=store.key("landing", "node-a/2026-01-01/mine.parquet"))
    other_node = s3.create_multipart_upload(Bucket=bucket, Key=store.key("landing", "node-b/2026-01-01/x.parquet"))
    up = Uplink(store, Link(prof(1 * MiB)), tmp_path / "state")
    (tmp_path / "state" / "mine.mpu.json").write_text(json.dumps({"upload_id": mine["UploadId"]}))
    assert up.abort_orphans("node-a", older_than_s=3600) == []  # too young
    aborted = up.abort_orphans("node-a", older_than_s=0)
    assert [u for _, u in aborted] == [orphan["UploadId"]]
    uploads = s3.list_multipart_uploads(Bucket=bucket, Prefix=store.key("landing", "")).get("Uploads", [])
    left = {u["UploadId"] for u in uploads}
    assert left == {mine["UploadId"], other_node["UploadId"]}
    # once its bundle has left the spool, a resume state no longer protects its upload
    (tmp_path / "state" / "mine.mpu.json").unlink()
    (tmp_path / "state" / "gone.mpu.json").write_text(json.dumps({"upload_id": mine["UploadId"], "bundle_id": "gone"}))
    assert [u for _, u in up.abort_orphans("node-a", older_than_s=0, live_bundles={"other"})] == [mine["UploadId"]]
    assert not (tmp_path / "state" / "gone.mpu.json").exists()
