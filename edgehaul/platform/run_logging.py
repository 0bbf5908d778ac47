"""The product's domain loggers (`edgehaul.*`) into Prefect's run logs, with the node on every line.

Prefect sends a logger's records to the API only for the loggers it configured or those named in
`PREFECT_LOGGING_EXTRA_LOGGERS`; nothing set that here, so retries, orphan aborts and dataset messages
reached the console and never the UI. `attach()` does for `edgehaul` what that setting does (Prefect's
API log handler at Prefect's log level), without depending on each process's environment.
`edgehaul.tasks` and `edgehaul.flows` call it on import, so every flow run gets it.

Prefect's API handler already tags each record with its flow run and task run; `for_node` adds the
node, so every line of a node's work can be traced to that node.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Iterator
from contextlib import contextmanager

from prefect.logging.handlers import APILogHandler

DOMAIN_LOGGER = "edgehaul"
_node: contextvars.ContextVar[str | None] = contextvars.ContextVar("edgehaul_node", default=None)


class NodeTag(logging.Filter):
    """Prefix a record with `[node=<id>]` while a node's work runs (no-op otherwise). A handler filter:
    a logger's own filters do not see the records its children propagate to it."""

    def filter(self, record: logging.LogRecord) -> bool:
        node = _node.get()
        if node and not getattr(record, "edgehaul_node", None):
            record.edgehaul_node = node
            record.msg = f"[node={node}] {record.msg}"
        return True


class InRun(logging.Filter):
    """Only records made inside a flow or task run go to the API: the same loggers also run in plain
    processes (drills, CLI, benchmarks), where Prefect's handler would warn on every line."""

    def filter(self, record: logging.LogRecord) -> bool:
        from prefect.context import FlowRunContext, TaskRunContext

        return FlowRunContext.get() is not None or TaskRunContext.get() is not None


class DomainRunLogHandler(APILogHandler):
    """Prefect's API log handler for the `edgehaul` logger, with the filters above."""

    def __init__(self) -> None:
        super().__init__()
        self.addFilter(InRun())
        self.addFilter(NodeTag())


def attach(name: str = DOMAIN_LOGGER) -> logging.Logger:
    """Send `name`'s records (and its children's) to the run logs, at Prefect's log level (idempotent)."""
    logger = logging.getLogger(name)
    if not any(isinstance(h, DomainRunLogHandler) for h in logger.handlers):
        logger.addHandler(DomainRunLogHandler())
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.getLogger("prefect.extra").level or logging.INFO)
    return logger


@contextmanager
def for_node(node_id: str) -> Iterator[None]:
    """Tag every `edgehaul.*` log line with the node while the block runs (threads copy the context)."""
    token = _node.set(node_id)
    try:
        yield
    finally:
        _node.reset(token)
