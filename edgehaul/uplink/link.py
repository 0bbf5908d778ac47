"""The uplink's client side: a priority token-bucket shaper and a link simulator around real S3 calls.

Shaping happens in the client, per chunk of request body: a transfer's body stream asks the
`Shaper` for the tokens of its next chunk, and the shaper always serves the highest-priority
waiter first, so an urgent bundle overtakes a normal one between two chunks. The rate is the
profile's cap (default 70% of bandwidth); the other 30% stays free for control-plane traffic
(Prefect API calls, heartbeats), which never goes through the shaper. The node's forwarded events
(`edgehaul.uplink.forwarder`) do: they are paced at the same cap, ahead of every bundle.

`Link` is what production uses (shaping + known contact windows). `SimulatedLink` adds what a
real constrained link does to the same calls, on the client side of a real S3 server: latency per
request, chunk loss (the chunk is re-sent and counted as retransmission), bit corruption (the
server rejects the part with BadDigest), random and scheduled outages (calls fail with a
retryable connection error). It is seeded and uses an injectable clock, for tests, demo and
benchmarks.
"""

from __future__ import annotations

import bisect
import heapq
import io
import itertools
import math
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from botocore.exceptions import EndpointConnectionError

from edgehaul import events
from edgehaul.contracts import tier_rank

if TYPE_CHECKING:
    from edgehaul.blocks.policies import LinkProfile

Priority = tuple[Any, ...]


def priority_key(tier: str, max_value: float, created_at: str) -> Priority:
    """Lower sorts first: tier (high, normal, low), then highest value, then oldest."""
    return (tier_rank(tier), -float(max_value), created_at)


class LinkDown(EndpointConnectionError):
    """The link is down (outage, or outside a contact window): safe to retry later."""

    retryable = True  # read by edgehaul.platform.s3_errors.is_retryable

    fmt = "Could not connect to the endpoint URL: {endpoint_url} (link down: {why})"


class TokenBucket:
    """Bytes per second on a monotonic clock, with a small burst.

    It starts empty, so the bytes granted by time t never exceed rate * t + burst: the long-run
    rate is exact, and a window of W seconds is off by at most burst / (rate * W).
    Not thread-safe on its own; `Shaper` holds the lock.
    """

    def __init__(self, rate: float, burst: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        if rate <= 0 or burst <= 0:
            raise ValueError(f"token bucket needs rate > 0 and burst > 0, got rate={rate} burst={burst}")
        self.rate = float(rate)
        self.burst = float(burst)
        self._clock = clock
        self._level = 0.0
        self._t = clock()

    def _refill(self) -> None:
        now = self._clock()
        self._level = min(self.burst, self._level + (now - self._t) * self.rate)
        self._t = now

    def take(self, n: float) -> float:
        """Take n tokens if available and return 0, else return the seconds to wait before retrying.

        A request larger than the burst is granted once the bucket is full and leaves it in debt,
        so big chunks are paced too, never refused."""
        self._refill()
        need = min(float(n), self.burst)
        if self._level >= need - 1e-6:  # float dust must not cause a zero-length wait loop
            self._level -= n
            return 0.0
        return (need - self._level) / self.rate


class Shaper:
    """A token bucket shared by all transfers of a node, served in priority order.

    `acquire(n, priority)` blocks until it is the highest-priority waiter and the bucket has n
    tokens. Priorities are tuples (lower first); ties go to the earlier caller (FIFO).
    """

    def __init__(self, rate_bytes_per_s: float, *, burst_bytes: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.bucket = TokenBucket(rate_bytes_per_s, burst_bytes, clock=clock)
        self._cond = threading.Condition()
        self._waiters: list[tuple[Priority, int]] = []
        self._seq = itertools.count()
        self.granted_bytes = 0
        self.first_grant: float | None = None
        self.first_grant_bytes = 0
        self.last_grant: float | None = None
        self._clock = clock

    @property
    def rate(self) -> float:
        return self.bucket.rate

    def acquire(self, n: int, priority: Priority = ()) -> None:
        me = (priority, next(self._seq))
        with self._cond:
            heapq.heappush(self._waiters, me)
            try:
                while True:
                    if self._waiters[0] == me:
                        wait = self.bucket.take(n)
                        if wait == 0:
                            heapq.heappop(self._waiters)
                            now = self._clock()
                            if self.first_grant is None:
                                self.first_grant, self.first_grant_bytes = now, n
                            self.last_grant = now
                            self.granted_bytes += n
                            self._cond.notify_all()
                            return
                        self._cond.wait(timeout=wait)
                    else:
                        self._cond.wait(timeout=1.0)
            except BaseException:
                if me in self._waiters:
                    self._waiters.remove(me)
                    heapq.heapify(self._waiters)
                    self._cond.notify_all()
                raise

    def waiting(self) -> int:
        with self._cond:
            return len(self._waiters)


@dataclass
class LinkStats:
    """Counters of one link since it was made (bytes are request-body bytes)."""

    bytes_sent: int = 0  # every byte put on the wire, re-sends included
    bytes_resent: int = 0  # lost chunks sent again
    chunks: int = 0
    chunks_lost: int = 0
    chunks_corrupted: int = 0
    requests: int = 0
    requests_failed_down: int = 0
    contact_waits: int = 0
    control_bytes: int = 0
    started: float = field(default_factory=time.monotonic)

    @property
    def retransmission_rate(self) -> float:
        return self.bytes_resent / self.bytes_sent if self.bytes_sent else 0.0


class Link:
    """The production link: shaping at the rate cap, in priority order, and known contact windows."""

    def __init__(
        self,
        profile: LinkProfile,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        epoch: float | None = None,
        resource_id: str = "edgehaul.link",
        emit_events: bool = True,
    ) -> None:
        self.profile = profile
        self.chunk_bytes = int(profile.chunk_bytes)
        self.cap_bytes_per_s = float(profile.rate_cap_bytes_per_s)
        # Burst: one chunk, or 0.1 s of the cap if more, so a scheduling hiccup between two chunks does
        # not waste capacity; small enough that any window of W seconds is within 0.1/W of the cap.
        self.shaper = Shaper(
            self.cap_bytes_per_s, burst_bytes=max(self.chunk_bytes, 0.1 * self.cap_bytes_per_s), clock=clock
        )
        self.clock = clock
        self.sleep = sleep
        self.epoch = clock() if epoch is None else epoch
        self.stats = LinkStats(started=self.clock())
        self.resource_id = resource_id
        self.emit_events = emit_events
        self._lock = threading.Lock()

    # -- availability ------------------------------------------------------------------------
    def in_contact(self, now: float | None = None) -> bool:
        p, d = self.profile.contact_period_s, self.profile.contact_duration_s
        if not p or not d:
            return True
        t = (self.clock() if now is None else now) - self.epoch
        return (t % p) < d

    def next_contact(self, now: float | None = None) -> float:
        """Clock time at which the link is next in contact (now if it is)."""
        now = self.clock() if now is None else now
        p, d = self.profile.contact_period_s, self.profile.contact_duration_s
        if not p or not d or self.in_contact(now):
            return now
        t = now - self.epoch
        return self.epoch + (math.floor(t / p) + 1) * p

    def is_up(self, now: float | None = None) -> bool:
        return self.in_contact(now)

    def down_reason(self, now: float | None = None) -> str:
        return "" if self.in_contact(now) else "outside contact window"

    def next_up(self, now: float | None = None) -> float:
        return self.next_contact(now)

    def wait_until_up(self, max_wait_s: float) -> bool:
        """Sleep until the link is up (a contact window opens), at most max_wait_s. Returns whether it is up."""
        start = self.clock()
        waited = False
        while not self.is_up():
            remaining = max_wait_s - (self.clock() - start)
            if remaining <= 0:
                return False
            waited = True
            self.sleep(min(remaining, max(0.01, self.next_up() - self.clock()), 1.0))
        if waited:
            with self._lock:
                self.stats.contact_waits += 1
            if self.emit_events:
                events.emit(events.CONTACT_OPENED, self.resource_id, {"waited_s": round(self.clock() - start, 3)})
        return True

    # -- requests -------------------------------------------------------------------------------
    def attach(self, client: Any) -> Any:
        """Hook every HTTP request of a boto3 client (including the ones botocore retries itself)."""
        client.meta.events.register("before-send.s3", self._before_send)
        return client

    def _before_send(self, request: Any, **_: Any) -> None:
        with self._lock:
            self.stats.requests += 1
        if not self.is_up():
            with self._lock:
                self.stats.requests_failed_down += 1
            raise LinkDown(endpoint_url=getattr(request, "url", "?"), why=self.down_reason())
        return None

    def body(self, data: bytes | memoryview, priority: Priority = ()) -> ShapedBody:
        return ShapedBody(self, data, priority)

    def control(self, nbytes: int) -> None:
        """Account control-plane bytes (API calls, events): they use the share the cap leaves free."""
        with self._lock:
            self.stats.control_bytes += nbytes

    # -- per chunk (overridden by the simulator) -------------------------------------------------
    def send_chunk(self, chunk: bytes, priority: Priority) -> bytes:
        """Pace one chunk through the shaper; returns the bytes that go on the wire."""
        if not self.is_up():
            raise LinkDown(endpoint_url="(body)", why=self.down_reason())
        self.shaper.acquire(len(chunk), priority)
        with self._lock:
            self.stats.bytes_sent += len(chunk)
            self.stats.chunks += 1
        return chunk

    def snapshot(self) -> dict[str, float]:
        """Counters plus the shaper's observed rate against the cap."""
        s = self.stats
        sh = self.shaper
        span = (sh.last_grant - sh.first_grant) if sh.first_grant is not None and sh.last_grant is not None else 0.0
        # The first chunk is granted at t0 once the bucket filled: count the bytes after it over the span.
        observed = (sh.granted_bytes - sh.first_grant_bytes) / span if span > 0 else 0.0
        return {
            "bytes_sent": s.bytes_sent,
            "bytes_resent": s.bytes_resent,
            "retransmission_rate": round(s.retransmission_rate, 5),
            "chunks": s.chunks,
            "chunks_lost": s.chunks_lost,
            "chunks_corrupted": s.chunks_corrupted,
            "requests": s.requests,
            "requests_failed_down": s.requests_failed_down,
            "contact_waits": s.contact_waits,
            "cap_bytes_per_s": self.cap_bytes_per_s,
            "shaped_bytes_per_s": round(observed, 1),
        }


class ShapedBody(io.RawIOBase):
    """A request body that releases its bytes chunk by chunk through the link.

    botocore reads it once to send (payload signing must be off, or it would be read twice);
    seeking back (a re-send) re-paces the bytes, which is what a real link would charge."""

    def __init__(self, link: Link, data: bytes | memoryview, priority: Priority) -> None:
        super().__init__()
        self._link = link
        self._data = memoryview(data)
        self._pos = 0
        self._released = 0  # bytes [0, _released) have passed the link
        self._wire = b""  # the current chunk as it went on the wire (maybe corrupted)
        self._wire_start = 0
        self.priority = priority

    def __len__(self) -> int:
        return len(self._data)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._data)}[whence]
        self._pos = max(0, min(len(self._data), base + offset))
        if self._pos < self._released:
            self._released = self._wire_start = self._pos
            self._wire = b""
        return self._pos

    def read(self, size: int | None = -1) -> bytes:
        if self._pos >= len(self._data):
            return b""
        if self._pos >= self._released:
            end = min(len(self._data), self._pos + self._link.chunk_bytes)
            self._wire = self._link.send_chunk(bytes(self._data[self._pos : end]), self.priority)
            self._wire_start, self._released = self._pos, end
        n = self._released - self._pos if size is None or size < 0 else min(size, self._released - self._pos)
        off = self._pos - self._wire_start
        out = self._wire[off : off + n]
        self._pos += n
        return out

    def readinto(self, b: Any) -> int:
        chunk = self.read(len(b))
        b[: len(chunk)] = chunk
        return len(chunk)


class SimulatedLink(Link):
    """A `Link` that also behaves like a constrained, unreliable link (client side of real S3 calls).

    - latency: each request waits 2 x latency_ms (request and response);
    - loss: each chunk is lost with probability loss_rate and re-sent (costs tokens, counted);
    - corruption: each chunk is corrupted with probability corrupt_rate (one bit flipped on the
      wire; the S3 server's checksum check rejects the request), or exactly the chunks whose
      ordinal numbers are in corrupt_chunks;
    - outages: random (profile.outage_rate_per_hour, outage_mean_s) plus `outages`, a list of
      (start, end) seconds after the epoch; requests and body chunks fail with `LinkDown`;
    - contact windows from the profile (inherited).
    """

    def __init__(
        self,
        profile: LinkProfile,
        *,
        seed: int = 0,
        outages: Sequence[tuple[float, float]] = (),
        corrupt_rate: float = 0.0,
        corrupt_chunks: Sequence[int] = (),
        horizon_s: float = 7 * 86400,
        **kw: Any,
    ) -> None:
        super().__init__(profile, **kw)
        self.rng = random.Random(seed)
        self.corrupt_rate = corrupt_rate
        self.corrupt_chunks = set(corrupt_chunks)
        self._chunk_no = 0
        windows = [(float(a), float(b)) for a, b in outages]
        rate = profile.outage_rate_per_hour / 3600.0
        if rate > 0:
            orng = random.Random(seed + 1)
            t = orng.expovariate(rate)
            while t < horizon_s:
                length = orng.expovariate(1.0 / profile.outage_mean_s) if profile.outage_mean_s > 0 else 0.0
                windows.append((t, t + length))
                t += length + orng.expovariate(rate)
        windows.sort()
        self.outages = windows
        self._starts = [a for a, _ in windows]

    def in_outage(self, now: float | None = None) -> bool:
        t = (self.clock() if now is None else now) - self.epoch
        i = bisect.bisect_right(self._starts, t) - 1
        return any(a <= t < b for a, b in self.outages[max(0, i - 3) : i + 1])

    def is_up(self, now: float | None = None) -> bool:
        return self.in_contact(now) and not self.in_outage(now)

    def down_reason(self, now: float | None = None) -> str:
        if self.in_outage(now):
            return "outage"
        return super().down_reason(now)

    def next_up(self, now: float | None = None) -> float:
        t = self.clock() if now is None else now
        for _ in range(1000):
            if self.is_up(t):
                return t
            rel = t - self.epoch
            ends = [b for a, b in self.outages if a <= rel < b]
            t = self.epoch + max(ends) if ends else self.next_contact(t)
        return t

    def _before_send(self, request: Any, **kw: Any) -> None:
        super()._before_send(request, **kw)
        if self.profile.latency_ms > 0:
            self.sleep(2 * self.profile.latency_ms / 1000.0)
        return None

    def send_chunk(self, chunk: bytes, priority: Priority) -> bytes:
        out = super().send_chunk(chunk, priority)
        with self._lock:
            self._chunk_no += 1
            no = self._chunk_no
            lost = self.rng.random() < self.profile.loss_rate
            corrupt = no in self.corrupt_chunks or (self.corrupt_rate > 0 and self.rng.random() < self.corrupt_rate)
        while lost:
            # A lost chunk costs its bytes again, like a retransmission on a real link.
            self.shaper.acquire(len(chunk), priority)
            with self._lock:
                self.stats.bytes_sent += len(chunk)
                self.stats.bytes_resent += len(chunk)
                self.stats.chunks_lost += 1
                lost = self.rng.random() < self.profile.loss_rate
            if not self.is_up():
                raise LinkDown(endpoint_url="(body)", why=self.down_reason())
        if corrupt and out:
            with self._lock:
                self.stats.chunks_corrupted += 1
            i = len(out) // 2
            out = out[:i] + bytes([out[i] ^ 0x01]) + out[i + 1 :]
        return out
