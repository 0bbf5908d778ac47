"""`io_map`: the parallel round trips of a batch keep input order and never leave a call running behind an error."""

from __future__ import annotations

import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgehaul.platform.io_pool import io_map


@settings(max_examples=60, deadline=None)
@given(items=st.lists(st.integers(), max_size=40), workers=st.integers(min_value=1, max_value=20))
def test_property_results_in_input_order(items: list[int], workers: int) -> None:
    def slow_square(x: int) -> int:
        time.sleep((x % 3) * 0.001)  # later items often finish first
        return x * x

    assert io_map(slow_square, items, workers) == [x * x for x in items]


def test_the_first_error_in_input_order_propagates_after_every_call_ended() -> None:
    ended: list[int] = []
    lock = threading.Lock()

    def call(x: int) -> int:
        time.sleep(0.02 if x == 1 else 0.0)
        with lock:
            ended.append(x)
        if x in (1, 5):
            raise ValueError(f"item {x}")
        return x

    with pytest.raises(ValueError, match="item 1"):
        io_map(call, list(range(8)), workers=4)
    assert sorted(ended) == list(range(8))  # nothing left running behind the caller


def test_runs_calls_at_once_up_to_workers() -> None:
    running = 0
    peak = 0
    lock = threading.Lock()

    def call(_: int) -> None:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        time.sleep(0.1)
        with lock:
            running -= 1

    io_map(call, list(range(12)), workers=4)
    assert 1 < peak <= 4  # in parallel, never past the bound
