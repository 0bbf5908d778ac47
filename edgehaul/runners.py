"""Task runner chosen by configuration: threads on one machine, or a Dask cluster.

Data-parallel stages (preprocessing a backlog, validating many bundles, compaction) map one task
per batch or bundle; which engine runs those tasks is deployment configuration, not code:

    EDGEHAUL_TASK_RUNNER   thread (default) | dask
    EDGEHAUL_DASK_ADDRESS  scheduler of an existing cluster, e.g. tcp://dask-scheduler:8786
                           (production); unset: a local dask.distributed cluster per flow run
    EDGEHAUL_DASK_WORKERS  workers of that local cluster (default: CPU count), one thread each
    EDGEHAUL_THREADS       threads of the thread runner (default: Prefect's default)

A flow opts in with `configured(my_flow)` (a copy of the flow with the configured runner) or passes
`task_runner()` to `@flow(task_runner=...)` at import time. Tasks sent to Dask must be importable
on the workers (defined in a module, not in `__main__`), and their inputs and results picklable.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from prefect.task_runners import TaskRunner, ThreadPoolTaskRunner

RunnerKind = Literal["thread", "dask"]
F = TypeVar("F")


class RunnerConfigError(ValueError):
    """EDGEHAUL_TASK_RUNNER / EDGEHAUL_DASK_* hold a value we cannot use."""


@dataclass(frozen=True)
class RunnerConfig:
    kind: RunnerKind = "thread"
    dask_address: str | None = None
    dask_workers: int | None = None
    threads: int | None = None

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> RunnerConfig:
        env = dict(os.environ if env is None else env)
        kind = env.get("EDGEHAUL_TASK_RUNNER", "thread").strip().lower() or "thread"
        if kind not in ("thread", "dask"):
            raise RunnerConfigError(f"EDGEHAUL_TASK_RUNNER must be 'thread' or 'dask', got {kind!r}")
        address = env.get("EDGEHAUL_DASK_ADDRESS", "").strip() or None
        if address and "://" not in address:
            raise RunnerConfigError(
                f"EDGEHAUL_DASK_ADDRESS must be a scheduler URL like tcp://host:8786, got {address!r}"
            )
        return cls(
            kind=kind,  # type: ignore[arg-type]
            dask_address=address,
            dask_workers=_positive_int(env, "EDGEHAUL_DASK_WORKERS"),
            threads=_positive_int(env, "EDGEHAUL_THREADS"),
        )

    def describe(self) -> str:
        if self.kind == "thread":
            return f"thread pool ({self.threads or 'default'} threads)"
        if self.dask_address:
            return f"dask cluster at {self.dask_address}"
        return f"local dask cluster ({self.dask_workers or os.cpu_count()} workers)"


def _positive_int(env: dict[str, str], name: str) -> int | None:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise RunnerConfigError(f"{name} must be a positive integer, got {raw!r}") from None
    if value < 1:
        raise RunnerConfigError(f"{name} must be a positive integer, got {raw!r}")
    return value


def task_runner(config: RunnerConfig | None = None) -> TaskRunner[Any]:
    """A fresh task runner for `config` (default: from the environment)."""
    cfg = config or RunnerConfig.from_env()
    if cfg.kind == "thread":
        return ThreadPoolTaskRunner(max_workers=cfg.threads) if cfg.threads else ThreadPoolTaskRunner()
    from prefect_dask import DaskTaskRunner

    if cfg.dask_address:
        return DaskTaskRunner(address=cfg.dask_address)
    return DaskTaskRunner(
        cluster_class="distributed.LocalCluster",
        cluster_kwargs={
            "n_workers": cfg.dask_workers or os.cpu_count() or 1,
            # One thread per worker process: CPU-bound numpy/pyarrow work scales by processes.
            "threads_per_worker": 1,
            "processes": True,
            "dashboard_address": None,
        },
    )


def configured(flow_obj: F, config: RunnerConfig | None = None) -> F:
    """A copy of a Prefect flow whose tasks run on the configured runner."""
    return flow_obj.with_options(task_runner=task_runner(config))  # type: ignore[attr-defined,no-any-return]
