"""Polling for state that real servers reach asynchronously (workers, events, automations)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(pred: Callable[[], T], timeout: float, what: str | Callable[[], str], interval: float = 1.0) -> T:
    """`pred()`'s first truthy value, polled every `interval` seconds; fails the test after `timeout` seconds.

    `what` names the awaited state in the failure; a callable is called then, so the message can show what
    was seen last (e.g. the notifications received so far)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what() if callable(what) else what}")


def run_log_lines(flow_run_id: object, needle: str, timeout: float = 90) -> list[str]:
    """The flow run's log lines (`logger: message`) once one contains `needle` (the API handler ships
    logs in the background every ~2 s); fails the test if none does within `timeout`."""
    import uuid

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    def lines() -> list[str]:
        with get_client(sync_client=True) as client:
            logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[uuid.UUID(str(flow_run_id))])))
        out = [f"{lg.name}: {lg.message}" for lg in logs]
        return out if any(needle in line for line in out) else []

    return wait_for(lines, timeout, f"a log line with {needle!r} in flow run {flow_run_id}")
