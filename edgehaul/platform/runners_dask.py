"""prefect-dask's DaskTaskRunner, able to run tasks of a flow that a worker loaded from its file.

A deployment run loads `flows/core_ingest.py:core_ingest` as a module named `core_ingest` (Prefect's
script loader), which exists only in that process. Every task sent to Dask carries the flow run's
context, flow included, pickled by reference to that module, so the scheduler and the workers fail
with "No module named 'core_ingest'" (PrefectHQ/prefect#16419 and #17956). Before submitting, this runner
tells cloudpickle to ship such a flow module by value; its imports (`tasks.*`, `edgehaul.*`) still
travel by reference, so workers need the same installed code (the `core` image), as always.
Kept apart from edgehaul.platform.runners so that importing a flow does not import dask.distributed.
"""

from __future__ import annotations

import sys
from typing import Any

import cloudpickle
from prefect.context import FlowRunContext
from prefect_dask import DaskTaskRunner


def ship_flow_module_by_value(flow_obj: Any) -> str | None:
    """Register the module of `flow_obj` for pickling by value if other processes may lack it.

    A dotted name (`flows.core_ingest`) is a package module that workers import themselves; a bare
    name (a script loaded by its stem, or `__prefect_loader_<hash>__`) is shipped. Returns the module
    name registered, or None.
    """
    name = getattr(getattr(flow_obj, "fn", None), "__module__", None)
    module = sys.modules.get(name) if name else None
    if module is None or "." in module.__name__ or module.__name__ == "__main__":  # __main__ goes by value anyway
        return None
    cloudpickle.register_pickle_by_value(module)
    return module.__name__


class FlowShippingDaskTaskRunner(DaskTaskRunner):
    """DaskTaskRunner that ships a script-loaded flow module with the tasks (see module docstring)."""

    def submit(self, task: Any, parameters: dict[str, Any], wait_for: Any = None, dependencies: Any = None) -> Any:
        ctx = FlowRunContext.get()
        if ctx is not None:
            ship_flow_module_by_value(ctx.flow)
        return super().submit(task, parameters, wait_for=wait_for, dependencies=dependencies)
