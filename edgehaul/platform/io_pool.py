"""Parallel object-store round trips over a batch, so a core run's pace is not set by latency.

A core ingest run's per-bundle reads and writes (a manifest, a HEAD, the bundle's bytes, a cache record)
are latency-bound: milliseconds of server work behind a round trip each. Done one after another they
set a run's pace at ~8 round trips per bundle; done `IO_WORKERS` at a time they overlap. boto3 clients
are thread-safe; make the client with `max_pool_connections=IO_WORKERS` so the threads do not queue for
connections.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

IO_WORKERS = 16  # round trips in flight per batch: well under a server's connection limits, past the latency


def io_map(fn: Callable[[T], R], items: Sequence[T], workers: int = IO_WORKERS) -> list[R]:
    """`[fn(x) for x in items]`, up to `workers` at a time, results in input order; the first exception
    (in input order) propagates once every call has ended, so nothing is left running behind the caller."""
    if len(items) <= 1 or workers <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(max_workers=min(workers, len(items)), thread_name_prefix="io") as pool:
        futures = [pool.submit(fn, x) for x in items]
    return [f.result() for f in futures]
