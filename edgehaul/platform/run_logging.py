"""The product's domain loggers (`edgehaul.*`) into Prefect's run logs, with the node on every line.

Prefect sends a logger's records to the API only for the loggers it configured or those named in
`PREFECT_LOGGING_EXTRA_LOGGERS`; nothing set that here, so retries, orphan aborts and dataset messages
reached the console and never the UI. `attach()` does for `edgehaul` what that setting does (it copies
the handlers of Prefect's `prefect.extra` logger), without depending on each process's environment.
`edgehaul.tasks` and `edgehaul.flows` call it on import, so every flow run gets it.

Prefect's API handler already tags each record with its flow run and task run; `for_node` adds the
node, which the operations guide asks for on every line of a node's work.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Iterator
from contextlib import contextmanager

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


def attach(name: str = DOMAIN_LOGGER) -> logging.Logger:
    """Give `name` Prefect's run-log handlers and level (idempotent)."""
    logger = logging.getLogger(name)
    extra = logging.getLogger("prefect.extra")
    for handler in extra.handlers:
        if not any(isinstance(f, NodeTag) for f in handler.filters):
            handler.addFilter(NodeTag())
        if handler not in logger.handlers:
            logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(extra.level or logging.INFO)
    return logger


@contextmanager
def for_node(node_id: str) -> Iterator[None]:
    """Tag every `edgehaul.*` log line with the node while the block runs (threads copy the context)."""
    token = _node.set(node_id)
    try:
        yield
    finally:
        _node.reset(token)
