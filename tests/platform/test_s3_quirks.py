"""The product against S3 servers that are not SeaweedFS: the quirk proxy in front of the session's server.

Each test either passes in every mode or fails loudly; none may lose a bundle. The whole uplink,
dataset, registry and lifecycle files also run through one mode with `EDGEHAUL_TEST_S3_QUIRKS=<mode>`.
"""

from __future__ import annotations

import hashlib
import logging
import random
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from botocore.exceptions import ClientError

from edgehaul.blocks import LinkProfile, ObjectStore
from edgehaul.bundles import read_bundle
from edgehaul.contracts import load_contract
from edgehaul.core.datasets import claim_bundles, ensure_table
from edgehaul.ops.lifecycle import Action, run_batch
from edgehaul.platform import s3compat
from edgehaul.training import registry
from edgehaul.uplink.link import Link, SimulatedLink
from edgehaul.uplink.transfer import PROOFS, Drainer, Uplink
from edgehaul_dev import localstack
from tests.builders import bundle
from tests.doubles import MemorySource
from tests.s3_quirk_proxy import MODES, QuirkProxy

MiB = 1024 * 1024
KiB = 1024
CONTRACT = load_contract("landsat_patch")


def prof(cap_bytes_per_s: float, **kw: object) -> LinkProfile:
    kw.setdefault("chunk_bytes", 64 * KiB)
    return LinkProfile(bandwidth_bps=cap_bytes_per_s * 8 / 0.7, **kw)  # type: ignore[arg-type]


@pytest.fixture(params=sorted(MODES))
def quirky(request: pytest.FixtureRequest, stack: localstack.StackState) -> Iterator[tuple[QuirkProxy, ObjectStore]]:
    """(proxy, admin store through it under a fresh prefix), once per mode."""
    s3compat.forget_all()  # what one mode's server taught must not carry over to the next
    px = QuirkProxy(stack.s3_endpoint, {c.access_key_id: c.secret_access_key for c in stack.identities.values()},
                    MODES[request.param]).start()
    store = stack.store("admin", f"q-{uuid.uuid4().hex[:10]}", inline_keys=True, endpoint=px.url)
    try:
        yield px, store
    finally:
        px.stop()
        s3compat.forget_all()


def _landed(store: ObjectStore, key: str) -> bytes:
    return store.client().get_object(Bucket=store.bucket("landing"), Key=key)["Body"].read()


@pytest.mark.integration
def test_bit_flipping_link_loses_nothing_whatever_the_server_checks(
    quirky: tuple[QuirkProxy, ObjectStore], tmp_path: Path
) -> None:
    px, store = quirky
    items = [bundle(300, seed=s, start_seq=1000 * s) for s in range(201, 205)]  # single PUTs
    items += [bundle(8000, seed=s, start_seq=10_000 * s) for s in (206, 207)]  # multipart, 3 parts of 5 MiB
    p = prof(40 * MiB, chunk_bytes=256 * KiB, multipart_threshold_bytes=5 * MiB, part_bytes=5 * MiB)
    link = SimulatedLink(p, corrupt_rate=0.03, seed=7, emit_events=False)
    up = Uplink(store, link, tmp_path / "state", max_digest_resends=8)
    src = MemorySource()
    for d, m in items:
        src.put(d, m)
    rep = Drainer(up, src, max_active=2, attempts=4, backoff_s=(0.1,), emit_events=False).run(max_seconds=240)
    sent = sum(m.row_count for _, m in items)
    assert not rep.failed and len(src) == 0, rep.failed
    landed_rows = 0
    for _, m in items:
        got = _landed(store, up.key_of(m))
        assert hashlib.sha256(got).hexdigest() == m.sha256  # the landed bytes are the spooled ones
        landed_rows += read_bundle(got, m).num_rows
    assert landed_rows == sent
    assert link.stats.chunks_corrupted > 0 and all(r.verified_by in PROOFS for r in rep.landed)
    if "ignore-content-md5" in px.quirks:
        # Nothing was refused by the server: the ETag comparison caught every flipped bit.
        assert px.stats["Content-MD5 ignored"] > 0 and rep.metrics(1.0)["digest_resends"] > 0
    print(f"\nmode {sorted(px.quirks)}: bundles {len(items)} sent / {len(rep.landed)} landed, samples {sent} sent / "
          f"{landed_rows} landed / {sent - landed_rows} lost; chunks corrupted {link.stats.chunks_corrupted}, "
          f"re-sends {rep.metrics(1.0)['digest_resends']}, proofs {rep.metrics(1.0)['proofs']}")


@pytest.mark.integration
def test_an_object_that_landed_corrupt_earlier_is_replaced_not_acknowledged(
    quirky: tuple[QuirkProxy, ObjectStore], tmp_path: Path
) -> None:
    _, store = quirky
    d, m = bundle(200, seed=211, start_seq=211_000)
    up = Uplink(store, Link(prof(20 * MiB)), tmp_path / "s")
    bad = bytearray(d)
    bad[len(bad) // 2] ^= 1
    # what a checksum-ignoring server kept after an earlier uplink acknowledged it on size + metadata
    store.client().put_object(Bucket=up.bucket, Key=up.key_of(m), Body=bytes(bad), Metadata=up._metadata(m))
    r = up.send(d, m)
    assert not r.already_present and r.verified_by == "etag-md5"
    assert _landed(store, r.key) == d


@pytest.mark.integration
def test_read_back_proves_a_multipart_object_of_another_part_size(
    quirky: tuple[QuirkProxy, ObjectStore], tmp_path: Path
) -> None:
    _, store = quirky
    d, m = bundle(8000, seed=221, start_seq=221_000)
    first = Uplink(store, Link(prof(40 * MiB, multipart_threshold_bytes=5 * MiB, part_bytes=5 * MiB)), tmp_path / "a")
    assert first.send(d, m).verified_by == "etag-multipart"
    # another sender (another link profile) cannot rebuild the ETag: it reads the object back, metered
    other = Uplink(store, Link(prof(40 * MiB, multipart_threshold_bytes=5 * MiB, part_bytes=6 * MiB)), tmp_path / "b")
    r = other.send(d, m)
    assert r.already_present and r.verified_by == "read-back" and r.readback_bytes == len(d)


@pytest.mark.integration
def test_a_node_identity_that_gets_403_on_head_of_a_missing_key_still_lands(
    stack: localstack.StackState, tmp_path: Path
) -> None:
    px = QuirkProxy(stack.s3_endpoint, {c.access_key_id: c.secret_access_key for c in stack.identities.values()},
                    {"head-403"}).start()
    try:
        node = stack.store("node-a", inline_keys=True, endpoint=px.url)
        d, m = bundle(8000, seed=231, start_seq=231_000, node_id="node-a")
        up = Uplink(node, Link(prof(40 * MiB, multipart_threshold_bytes=5 * MiB, part_bytes=5 * MiB)), tmp_path / "s")
        r = up.send(d, m)
        assert r.verified_by == "etag-multipart" and px.stats["HEAD 404 -> 403"] >= 1
        assert up.send(d, m).already_present  # and the second send finds it
    finally:
        px.stop()


@pytest.mark.integration
def test_a_stale_claim_is_taken_over_whatever_the_if_match_form(quirky: tuple[QuirkProxy, ObjectStore]) -> None:
    _, store = quirky
    dt = ensure_table(store, CONTRACT)
    b1 = ("node-a", "b-1")
    assert claim_bundles(store, dt, CONTRACT.kind, [b1], "run-dead").claimed == [b1]
    time.sleep(0.2)
    assert claim_bundles(store, dt, CONTRACT.kind, [b1], "run-live", lease_s=600).deferred == [b1]
    assert claim_bundles(store, dt, CONTRACT.kind, [b1], "run-next", lease_s=0.1).claimed == [b1]


@pytest.mark.integration
def test_the_model_pointer_swaps_and_still_refuses_a_lost_race(quirky: tuple[QuirkProxy, ObjectStore]) -> None:
    _, store = quirky
    for mid in ("m1", "m2", "m3"):
        registry.register_model(store, "quirk", mid, {"x": 1}, {"team": "geo"})
    assert registry.publish(store, "quirk", "m1")["previous"] is None
    assert registry.publish(store, "quirk", "m2")["previous"] == "m1"
    s3 = store.client()
    bucket, key = registry.parse_s3_uri(registry.latest_uri(store, "quirk"))
    _, etag = registry.read_json(store, registry.latest_uri(store, "quirk"))
    s3.put_object(Bucket=bucket, Key=key, Body=b'{"model_id": "m2", "model_uri": "x"}')  # someone else wrote
    with pytest.raises(ClientError) as e:
        s3compat.if_match(store.endpoint_url, etag, lambda et: s3.put_object(Bucket=bucket, Key=key, Body=b"{}",
                                                                               IfMatch=et))
    assert s3compat.is_precondition_failed(e.value)  # a real change is still refused in every form
    assert registry.publish(store, "quirk", "m3")["previous"] == "m2"


def _move(store: ObjectStore, key: str, etag: str, size: int, cls: str) -> Action:
    src_bucket = store.bucket("landing")
    return Action("move", src_bucket, key, store.bucket("cold"), store.key("cold", f"{src_bucket}/{key}"), size, etag,
                  cls, "raw", "2026-01-01T00:00:00+00:00", "test")


@pytest.mark.integration
def test_lifecycle_moves_name_the_refused_class_and_never_copy_a_changed_source(
    quirky: tuple[QuirkProxy, ObjectStore],
) -> None:
    px, store = quirky
    s3 = store.client()
    bucket = store.bucket("landing")
    key = store.key("landing", "node-a/2026-01-01/x.parquet")
    r = s3.put_object(Bucket=bucket, Key=key, Body=b"a" * 1000)
    now = datetime.now(UTC)
    res = run_batch(store, [_move(store, key, s3compat.unquoted(r["ETag"]), 1000, "GLACIER_IR")], now)
    if "standard-class-only" in px.quirks:
        assert len(res.errors) == 1 and "GLACIER_IR" in res.errors[0] and key in res.errors[0]
        assert s3.head_object(Bucket=bucket, Key=key)["ContentLength"] == 1000  # nothing lost
    else:
        assert res.done["moved"] == 1 and not res.errors
    # planned at one version, the source changed before the copy: never moved, whatever the server does
    # with CopySourceIfMatch
    r1 = s3.put_object(Bucket=bucket, Key=key + "2", Body=b"b" * 1000)
    s3.put_object(Bucket=bucket, Key=key + "2", Body=b"c" * 1000)
    res = run_batch(store, [_move(store, key + "2", s3compat.unquoted(r1["ETag"]), 1000, "STANDARD")], now)
    assert res.done["skipped: changed since planned"] == 1 and not res.errors, (res.done, res.errors)
    assert s3.get_object(Bucket=bucket, Key=key + "2")["Body"].read() == b"c" * 1000


@pytest.mark.integration
def test_a_source_rewritten_while_it_moves_never_leaves_a_stale_cold_copy(
    quirky: tuple[QuirkProxy, ObjectStore],
) -> None:
    # A writer keeps rewriting the sources while the mover copies them; on a server that ignores
    # CopySourceIfMatch only the check after the copy stands between a changed source and the cold tier.
    _, store = quirky
    s3, writer = store.client(), store.client()
    bucket = store.bucket("landing")
    keys = [store.key("landing", f"node-a/2026-01-01/r{i}.parquet") for i in range(12)]
    planned = {k: s3compat.unquoted(s3.put_object(Bucket=bucket, Key=k, Body=b"v1" * 600)["ETag"]) for k in keys}
    stop = threading.Event()

    def rewrite() -> None:
        n = 0
        while not stop.is_set():
            for k in keys:
                writer.put_object(Bucket=bucket, Key=k, Body=f"v2-{n:04d}".encode() * 120)
                n += 1

    t = threading.Thread(target=rewrite)
    t.start()
    try:
        res = run_batch(store, [_move(store, k, planned[k], 1200, "STANDARD") for k in keys], datetime.now(UTC))
    finally:
        stop.set()
        t.join()
    assert not res.errors and sum(res.done.values()) == len(keys), (res.done, res.errors)
    for k in keys:
        a = _move(store, k, planned[k], 1200, "STANDARD")
        try:
            got = s3.get_object(Bucket=a.dst_bucket, Key=a.dst_key)["Body"].read()
        except ClientError as e:
            assert s3compat.is_missing(e)
            continue
        assert got == b"v1" * 600  # a cold copy is always of the planned version


@pytest.mark.integration
def test_fifty_rewrite_races_leave_no_cold_copy_that_differs_from_its_recorded_source(
    stack: localstack.StackState, caplog: pytest.LogCaptureFixture,
) -> None:
    # On a server that ignores every copy condition, each key is rewritten once (new bytes, at the same
    # size or another) at a random moment while the mover copies it. Whatever the interleaving, every cold
    # copy left must hold the bytes of the ETag it records (`eh-source-etag`), which is the planned one.
    s3compat.forget_all()
    px = QuirkProxy(stack.s3_endpoint, {c.access_key_id: c.secret_access_key for c in stack.identities.values()},
                    MODES["ignores-copy-conditions"]).start()
    store = stack.store("admin", f"r-{uuid.uuid4().hex[:10]}", inline_keys=True, endpoint=px.url)
    s3, writer = store.client(), store.client()
    bucket = store.bucket("landing")
    rng = random.Random(32)
    outcomes: Counter[str] = Counter()
    caplog.set_level(logging.WARNING, logger="edgehaul.ops.lifecycle")
    try:
        for rnd in range(50):
            keys = [store.key("landing", f"node-a/2026-01-01/race{rnd:02d}-{i}.parquet") for i in range(8)]
            v1 = {k: f"v1-{rnd:02d}-{i}|".encode().ljust(1200, b"a") for i, k in enumerate(keys)}
            planned = {k: s3compat.unquoted(s3.put_object(Bucket=bucket, Key=k, Body=v1[k])["ETag"]) for k in keys}
            when = sorted((rng.uniform(0, 0.25), k, rng.choice((1200, 840))) for k in keys)

            def rewrite(when: list[tuple[float, str, int]] = when, rnd: int = rnd) -> None:
                t0 = time.monotonic()
                for at, k, size in when:
                    time.sleep(max(0.0, at - (time.monotonic() - t0)))
                    writer.put_object(Bucket=bucket, Key=k, Body=f"v2-{rnd:02d}|".encode().ljust(size, b"b"))

            t = threading.Thread(target=rewrite)
            t.start()
            try:
                res = run_batch(store, [_move(store, k, planned[k], 1200, "STANDARD") for k in keys], datetime.now(UTC))
            finally:
                t.join()
            assert not res.errors and sum(res.done.values()) == len(keys), (rnd, res.done, res.errors)
            outcomes.update(res.done)
            for k in keys:
                a = _move(store, k, planned[k], 1200, "STANDARD")
                try:
                    got = s3.get_object(Bucket=a.dst_bucket, Key=a.dst_key)
                except ClientError as e:
                    assert s3compat.is_missing(e)
                    continue
                data = got["Body"].read()
                assert hashlib.md5(data).hexdigest() == got["Metadata"]["eh-source-etag"] == planned[k], (rnd, k)
                assert data == v1[k]
        dropped = px.stats["copy condition ignored"]
    finally:
        px.stop()
        s3compat.forget_all()
    removed = sum("copy removed" in r.getMessage() for r in caplog.records)
    print(f"\n50 races x 8 keys: {dict(outcomes)}; wrong copies made and removed: {removed}; "
          f"copy conditions dropped by the server: {dropped}")
    assert dropped > 0 and outcomes["moved"] > 0 and outcomes["skipped: changed since planned"] > 0
