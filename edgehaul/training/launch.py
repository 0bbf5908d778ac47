"""Launching a training run: in this process, or as `torchrun` processes (same code, no changes).

Multi-node: torchrun reads its rendezvous settings from PET_* variables (PET_NNODES, PET_NODE_RANK,
PET_RDZV_ENDPOINT, PET_RDZV_ID, PET_RDZV_BACKEND), which a Kubernetes job template sets per pod;
without PET_RDZV_ENDPOINT a single-node `--standalone` rendezvous is used.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from edgehaul.blocks import ObjectStore
from edgehaul.platform.settings import get_settings, torchrun_env
from edgehaul.training.trainer import ProgressFn, TrainConfig, TrainResult, train

SECRET_FIELDS = ("access_key_id", "secret_access_key")


class LaunchError(RuntimeError):
    """The training processes failed; the message carries the tail of their output. A re-run resumes
    from the last committed checkpoint, so it is worth a retry (`s3_errors.is_retryable` reads this)."""

    retryable = True


def store_to_public(store: ObjectStore) -> dict[str, Any]:
    return store.model_dump(mode="json", exclude=set(SECRET_FIELDS))


def store_from_public(fields: dict[str, Any]) -> ObjectStore:
    # the keys travel in the child's environment (child_env), never in the config file
    extra: dict[str, Any] = {}
    names_its_keys = fields.get("credentials_file") or fields.get("credentials_from_environment")
    if not names_its_keys and (creds := get_settings().aws_credentials()):
        extra = {"access_key_id": creds[0], "secret_access_key": creds[1]}
    return ObjectStore(**{k: v for k, v in fields.items() if k not in SECRET_FIELDS}, **extra)


def child_env(store: ObjectStore) -> dict[str, str]:
    env = dict(os.environ)
    if store.access_key_id and store.secret_access_key:
        env["AWS_ACCESS_KEY_ID"] = store.access_key_id.get_secret_value()
        env["AWS_SECRET_ACCESS_KEY"] = store.secret_access_key.get_secret_value()
    # Make `-m edgehaul.training` importable whatever the child's working directory is.
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def torchrun_command(nproc_per_node: int, config_path: Path, result_path: Path) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc_per_node)]
    if not torchrun_env().pet_rdzv_endpoint:
        cmd.append("--standalone")
    return [*cmd, "-m", "edgehaul.training", "--config", str(config_path), "--result", str(result_path)]


def run_torchrun(cfg: TrainConfig, store: ObjectStore, nproc_per_node: int, timeout_s: float | None = None
                 ) -> TrainResult:
    with tempfile.TemporaryDirectory(prefix="edgehaul-train-") as tmp:
        cfg_path, res_path = Path(tmp) / "run.json", Path(tmp) / "result.json"
        cfg_path.write_text(json.dumps({"config": cfg.model_dump(mode="json"), "store": store_to_public(store)}))
        proc = subprocess.run(
            torchrun_command(nproc_per_node, cfg_path, res_path), env=child_env(store), capture_output=True,
            text=True, timeout=timeout_s,
        )
        if proc.returncode != 0 or not res_path.exists():
            tail = (proc.stdout + proc.stderr)[-4000:]
            raise LaunchError(f"torchrun ({nproc_per_node} processes) of run {cfg.run_id} exited {proc.returncode}:\n{tail}")
        return TrainResult(**json.loads(res_path.read_text()))


def run(cfg: TrainConfig, store: ObjectStore, nproc_per_node: int = 1, progress: ProgressFn | None = None
        ) -> TrainResult:
    """One process: in this one. More: torchrun children (rank 0's result is returned; `progress` is
    reported in-process only: the children's epoch lines come back in LaunchError's tail, not live)."""
    if nproc_per_node == 1 and not torchrun_env().pet_rdzv_endpoint:
        return train(cfg, store, progress)
    return run_torchrun(cfg, store, nproc_per_node)
