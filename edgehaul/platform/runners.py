"""Task runner chosen by configuration: threads on one machine, or a Dask cluster.

Data-parallel stages (preprocessing a backlog, validating many bundles, compaction) map one task
per batch or bundle; which engine runs those tasks is deployment configuration, not code:

    EDGEHAUL_TASK_RUNNER   thread (default) | dask
    EDGEHAUL_DASK_ADDRESS  scheduler of an existing cluster, e.g. tcp://dask-scheduler:8786
                           (production); unset: a local dask.distributed cluster per flow run
    EDGEHAUL_DASK_WORKERS  workers of that local cluster (default: CPU count), one thread each
    EDGEHAUL_THREADS       threads of the thread runner (default: Prefect's default)

(fields of edgehaul.platform.settings.Settings, validated there).

Deployable flows declare `@flow(task_runner=from_environment())`: the setting is read when a flow run
starts (Prefect's engine calls `task_runner.duplicate()` once per run), in the process that runs it,
so a worker's job environment (a work pool's `env`, a deployment's `job_variables`) decides, and a
flow imported before the variables were set still follows them. `configured(my_flow)` pins a runner
for one copy of a flow instead. Tasks sent to Dask must be importable on the workers (defined in a
module, not in `__main__`), and their inputs and results picklable; the flow's own module, which a
deployment run loads from its file under a bare name, is shipped by value (edgehaul.platform.runners_dask).
Only tasks started with
`.submit()`/`.map()` go through the runner; a task called directly runs in the flow's process.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from prefect.logging import get_logger
from prefect.task_runners import TaskRunner, ThreadPoolTaskRunner

from edgehaul.platform.settings import Settings, SettingsError, get_settings, load

RunnerKind = Literal["thread", "dask"]
F = TypeVar("F")


class RunnerConfigError(SettingsError):
    """EDGEHAUL_TASK_RUNNER / EDGEHAUL_DASK_* hold a value we cannot use."""


@dataclass(frozen=True)
class RunnerConfig:
    kind: RunnerKind = "thread"
    dask_address: str | None = None
    dask_workers: int | None = None
    threads: int | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> RunnerConfig:
        """From the settings (the process environment), or from the variables in `env` alone."""
        try:
            s = get_settings() if env is None else load(Settings, env)
        except SettingsError as e:
            raise RunnerConfigError(str(e)) from None
        return cls(kind=s.task_runner, dask_address=s.dask_address, dask_workers=s.dask_workers, threads=s.threads)

    def describe(self) -> str:
        if self.kind == "thread":
            return f"thread pool ({self.threads or 'default'} threads)"
        if self.dask_address:
            return f"dask cluster at {self.dask_address}"
        return f"local dask cluster ({self.dask_workers or os.cpu_count()} workers)"


def task_runner(config: RunnerConfig | None = None) -> TaskRunner[Any]:
    """A fresh task runner for `config` (default: from the environment)."""
    cfg = config or RunnerConfig.from_env()
    if cfg.kind == "thread":
        return ThreadPoolTaskRunner(max_workers=cfg.threads) if cfg.threads else ThreadPoolTaskRunner()
    from edgehaul.platform.runners_dask import FlowShippingDaskTaskRunner as DaskRunner

    if cfg.dask_address:
        return DaskRunner(address=cfg.dask_address)
    return DaskRunner(
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
    return flow_obj.with_options(task_runner=task_runner(config))  # type: ignore[attr-defined]


class EnvironmentTaskRunner(TaskRunner[Any]):
    """Placeholder for `@flow(task_runner=...)` that becomes the configured runner when a run starts.

    Prefect never submits to a flow's declared runner: each run enters `flow.task_runner.duplicate()`.
    So `duplicate()` reads EDGEHAUL_TASK_RUNNER / EDGEHAUL_DASK_* of the running process and returns a
    fresh ThreadPoolTaskRunner or DaskTaskRunner; with no variable set that is Prefect's default runner.
    """

    @property
    def name(self) -> str:
        return "edgehaul-environment"

    def duplicate(self) -> Any:  # the concrete runner for this run, not a copy of the placeholder
        cfg = RunnerConfig.from_env()
        get_logger("edgehaul.platform.runners").info("task runner: %s", cfg.describe())
        return task_runner(cfg)

    def submit(self, task: Any, parameters: dict[str, Any], wait_for: Iterable[Any] | None = None,
               dependencies: dict[str, Any] | None = None) -> Any:
        raise RuntimeError("EnvironmentTaskRunner is resolved per flow run: submit through duplicate()'s runner")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, EnvironmentTaskRunner)

    def __hash__(self) -> int:
        return hash(EnvironmentTaskRunner)


def from_environment() -> EnvironmentTaskRunner:
    """The task runner for deployable flows: chosen by the environment of each flow run's process."""
    return EnvironmentTaskRunner()
