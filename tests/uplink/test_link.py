"""Link: token bucket, priority shaper, shaped body streams and the link simulator (no servers)."""

from __future__ import annotations

import hashlib
import threading
import time

import pytest
from botocore.exceptions import ClientError
from hypothesis import given, settings
from hypothesis import strategies as st

from edgehaul.blocks import LinkProfile
from edgehaul.uplink.link import Link, LinkDown, Shaper, SimulatedLink, TokenBucket, priority_key
from edgehaul.uplink.transfer import UplinkError, is_retryable

KiB = 1024


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += max(s, 0.0)


def profile(cap_bytes_per_s: float, **kw: object) -> LinkProfile:
    return LinkProfile(bandwidth_bps=cap_bytes_per_s * 8 / 0.7, chunk_bytes=64 * KiB, **kw)


@settings(max_examples=60, deadline=None)
@given(
    rate=st.floats(1e3, 1e7),
    steps=st.lists(st.tuples(st.floats(0, 2.0), st.integers(1, 64 * KiB)), min_size=1, max_size=80),
)
def test_bucket_never_grants_more_than_rate_times_time_plus_burst(rate: float, steps: list[tuple[float, int]]) -> None:
    clock = FakeClock()
    burst = 64 * KiB
    b = TokenBucket(rate, burst, clock=clock)
    t0, granted = clock.t, 0
    for dt, n in steps:
        clock.t += dt
        wait = b.take(n)
        if wait == 0:
            granted += n
        else:
            clock.t += wait  # waiting as told always gets the tokens
            assert b.take(n) == 0
            granted += n
        # debt from requests above the burst is allowed only up to one request
        assert granted <= rate * (clock.t - t0) + burst + n + 1e-6


def test_bucket_holds_rate_over_a_window_with_fake_clock() -> None:
    clock = FakeClock()
    b = TokenBucket(100_000, 16 * KiB, clock=clock)
    t0, granted = clock.t, 0
    while clock.t - t0 < 10:
        w = b.take(16 * KiB)
        if w:
            clock.sleep(w)
        else:
            granted += 16 * KiB
    rate = granted / (clock.t - t0)
    assert abs(rate / 100_000 - 1) < 0.02


def test_shaper_serves_urgent_before_a_normal_waiter_and_ties_in_arrival_order() -> None:
    sh = Shaper(200_000, burst_bytes=20_000)
    sh.acquire(20_000)  # bucket empty from here: every later grant waits 0.1 s
    order: list[str] = []
    lock = threading.Lock()

    def take(name: str, prio: tuple[int, ...]) -> None:
        sh.acquire(20_000, prio)
        with lock:
            order.append(name)

    normal = [threading.Thread(target=take, args=(f"n{i}", priority_key("normal", 0.5, "a"))) for i in range(2)]
    urgent = [threading.Thread(target=take, args=(f"u{i}", priority_key("high", 0.9, "b"))) for i in range(2)]
    for t in normal:
        t.start()
        time.sleep(0.01)
    time.sleep(0.02)
    for t in urgent:
        t.start()
        time.sleep(0.01)
    for t in normal + urgent:
        t.join(5)
    # n0 may already hold the head with its timer running; both urgent ones still beat n1,
    # and equal priorities go in arrival order.
    assert order.index("u0") < order.index("n1") and order.index("u1") < order.index("n1")
    assert order.index("u0") < order.index("u1") and order.index("n0") < order.index("n1")


def test_shaped_body_paces_chunks_and_rewind_resends() -> None:
    link = Link(profile(10_000_000))
    data = bytes(range(256)) * 1000  # 256 000 bytes = 4 chunks of 64 KiB
    body = link.body(data)
    assert len(body) == len(data)
    out = b"".join(iter(lambda: body.read(10_000), b""))
    assert out == data
    assert link.stats.chunks == 4 and link.stats.bytes_sent == len(data)
    body.seek(0)
    assert body.read() == data[: 64 * KiB]  # read() without size gives the current chunk
    assert link.stats.bytes_sent == len(data) + 64 * KiB


def test_corruption_flips_one_byte_of_the_chosen_chunk_only() -> None:
    link = SimulatedLink(profile(10_000_000), corrupt_chunks=[2], emit_events=False)
    data = b"\x00" * (200 * KiB)
    body = link.body(data)
    out = b"".join(iter(lambda: body.read(128 * KiB), b""))
    diff = [i for i, (a, b) in enumerate(zip(out, data, strict=True)) if a != b]
    assert len(diff) == 1 and 64 * KiB <= diff[0] < 128 * KiB
    assert link.stats.chunks_corrupted == 1


def test_loss_is_resent_and_counted_as_retransmission() -> None:
    link = SimulatedLink(profile(50_000_000, loss_rate=0.2), seed=7, emit_events=False)
    data = hashlib.sha256(b"x").digest() * (64 * KiB * 200 // 32)
    body = link.body(data)
    out = b"".join(iter(lambda: body.read(64 * KiB), b""))
    assert out == data  # a lost chunk is re-sent, never missing
    s = link.stats
    assert s.chunks == 200 and s.chunks_lost > 0
    assert s.bytes_sent == len(data) + s.bytes_resent
    assert 0.12 < s.retransmission_rate < 0.28


def test_outages_are_seeded_and_fail_requests_with_a_retryable_error() -> None:
    clock = FakeClock()
    prof = profile(1_000_000, outage_rate_per_hour=60, outage_mean_s=20)
    a = SimulatedLink(prof, seed=3, clock=clock, sleep=clock.sleep, outages=[(5, 8)], emit_events=False)
    b = SimulatedLink(prof, seed=3, clock=clock, sleep=clock.sleep, emit_events=False)
    c = SimulatedLink(prof, seed=4, clock=clock, sleep=clock.sleep, emit_events=False)
    assert [w for w in a.outages if w != (5.0, 8.0)] == b.outages and b.outages != c.outages
    assert len(b.outages) > 100  # one a minute over the default one-week horizon
    clock.t = a.epoch + 6
    assert not a.is_up() and a.down_reason() == "outage"
    assert a.next_up() >= a.epoch + 8
    with pytest.raises(LinkDown) as e:
        a._before_send(type("R", (), {"url": "http://s3"})())
    assert is_retryable(e.value)
    with pytest.raises(LinkDown):
        a.body(b"x" * 10).read()


def test_contact_windows_wait_for_the_next_pass() -> None:
    clock = FakeClock()
    prof = profile(1_000_000, contact_period_s=100, contact_duration_s=10)
    link = Link(prof, clock=clock, sleep=clock.sleep, epoch=clock.t - 30, emit_events=False)
    assert not link.in_contact()
    assert link.next_contact() == pytest.approx(link.epoch + 100)
    assert not link.wait_until_up(20)  # the pass is 70 s away
    assert link.wait_until_up(100)
    assert link.in_contact() and clock.t == pytest.approx(link.epoch + 100, abs=1.0)
    assert link.stats.contact_waits == 1


def _client_error(code: str, status: int) -> ClientError:
    resp = {"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}}
    return ClientError(resp, "PutObject")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("exc", "retry"),
    [
        (_client_error("AccessDenied", 403), False),
        (_client_error("NoSuchBucket", 404), False),
        (_client_error("BadDigest", 400), False),
        (_client_error("SlowDown", 503), True),
        (_client_error("InternalError", 500), True),
        (_client_error("Whatever", 502), True),
        (UplinkError("checksum rejected 4 times", retryable=False), False),
        (ConnectionResetError("reset"), True),
        (ValueError("bug"), False),
    ],
)
def test_only_safe_errors_are_retryable(exc: BaseException, retry: bool) -> None:
    assert is_retryable(exc) is retry
