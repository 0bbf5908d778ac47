"""Polling for state that real servers reach asynchronously (workers, events, automations)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(pred: Callable[[], T], timeout: float, what: str) -> T:
    """`pred()`'s first truthy value, polled each second; fails the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(1)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
