"""Placement: training runs on the central pool only, never on an edge pool."""

from __future__ import annotations


class PlacementError(RuntimeError):
    """The flow run is in a work pool where training must not run."""


def check_placement(work_pool: str | None, allow_local: bool, *, forbidden_prefix: str = "edge") -> str:
    """Return where training runs, or refuse: edge pools always, no pool unless `allow_local`."""
    if work_pool is None:
        if not allow_local:
            raise PlacementError(
                "training runs only from a deployment on the central work pool; this flow run has no work pool "
                "(a local call): pass allow_local=True to train in this process"
            )
        return "local"
    if work_pool.lower().startswith(forbidden_prefix):
        raise PlacementError(
            f"work pool {work_pool!r} is an edge pool: training never runs on edge pools, deploy train_model "
            "to the central-gpu pool"
        )
    return work_pool
