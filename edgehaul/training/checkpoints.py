"""Checkpoints in object storage, written so a half-written one is never visible.

Layout under `store.key("checkpoints", "<run_id>/")`:

    <step:012d>/state-<uuid>.pt   the torch-serialised state (uploaded first, multipart when large)
    <step:012d>/COMMIT.json       the commit marker, a conditional PUT (If-None-Match: *) written only
                                  after the state upload completed; it names the state object and its
                                  sha256 and size, and is the only thing readers look for.

A writer killed mid-upload leaves at most an incomplete multipart upload or an uncommitted state
object: neither has a marker, so `latest()` never returns it, and `clean_orphans()` removes it.
A failed write emits CHECKPOINT_FAILED (run_id, step, error) and is retried with backoff.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import torch
from botocore.exceptions import BotoCoreError, ClientError

from edgehaul import events
from edgehaul.blocks import ObjectStore
from edgehaul.platform.s3_errors import error_code

log = logging.getLogger(__name__)

MARKER = "COMMIT.json"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or a committed one could not be read back intact."""


class DataVersionMismatch(ValueError):
    """Resuming would continue on a different dataset version than the checkpoint was trained on."""


@dataclass(frozen=True)
class CommittedCheckpoint:
    run_id: str
    step: int
    marker_key: str
    state_key: str
    sha256: str
    size: int
    meta: dict[str, Any]


class CheckpointStore:
    """Commit-protocol reader/writer of one run's checkpoints."""

    def __init__(
        self, store: ObjectStore, run_id: str, *, keep: int = 3, attempts: int = 4, backoff_s: float = 0.5,
        multipart_bytes: int = 8 * 1024 * 1024, emit_events: bool = True,
    ) -> None:
        if not run_id or "/" in run_id:
            raise ValueError(f"run_id must be a non-empty name without '/', got {run_id!r}")
        self.store = store
        self.run_id = run_id
        self.keep = keep
        self.attempts = attempts
        self.backoff_s = backoff_s
        self.multipart_bytes = multipart_bytes
        self.emit_events = emit_events
        self.bucket = store.bucket("checkpoints")
        self.prefix = store.key("checkpoints", f"{run_id}/")
        self._s3 = store.client()
        self.failures = 0

    def _step_prefix(self, step: int) -> str:
        return f"{self.prefix}{step:012d}/"

    # -- writing -------------------------------------------------------------------------------
    def write(
        self, state: dict[str, Any], step: int, meta: dict[str, Any],
        progress: Callable[[int], None] | None = None,
    ) -> CommittedCheckpoint:
        """Serialise, upload and commit `state` as step `step`; retried, events on each failure."""
        buf = io.BytesIO()
        torch.save(state, buf)
        data = buf.getvalue()
        last: Exception | None = None
        for attempt in range(1, self.attempts + 1):
            try:
                ck = self._write_once(data, step, meta, progress)
                self._prune()
                return ck
            except (ClientError, BotoCoreError, OSError) as e:
                last = e
                self.failures += 1
                log.warning("checkpoint %s step %d attempt %d/%d failed: %s", self.run_id, step, attempt,
                            self.attempts, e)
                if self.emit_events:
                    events.emit(
                        events.CHECKPOINT_FAILED, f"edgehaul.training.run.{self.run_id}",
                        {"run_id": self.run_id, "step": step, "error": f"{type(e).__name__}: {e}", "attempt": attempt},
                    )
                if attempt < self.attempts:
                    time.sleep(self.backoff_s * 2 ** (attempt - 1))
        raise CheckpointError(
            f"checkpoint of run {self.run_id} step {step} failed after {self.attempts} attempts: {last}"
        ) from last

    def _write_once(
        self, data: bytes, step: int, meta: dict[str, Any], progress: Callable[[int], None] | None
    ) -> CommittedCheckpoint:
        from boto3.s3.transfer import TransferConfig

        sha = hashlib.sha256(data).hexdigest()
        state_key = f"{self._step_prefix(step)}state-{uuid.uuid4().hex}.pt"
        cfg = TransferConfig(multipart_threshold=self.multipart_bytes, multipart_chunksize=self.multipart_bytes)
        self._s3.upload_fileobj(
            io.BytesIO(data), self.bucket, state_key, Config=cfg, Callback=progress,
            ExtraArgs={"Metadata": {"sha256": sha, "run-id": self.run_id, "step": str(step)}},
        )
        head = self._s3.head_object(Bucket=self.bucket, Key=state_key)
        if int(head["ContentLength"]) != len(data):
            raise CheckpointError(f"{state_key}: stored {head['ContentLength']} bytes, wrote {len(data)}")
        marker = {
            "run_id": self.run_id, "step": step, "state_key": state_key, "sha256": sha, "size": len(data),
            "committed": datetime.now(UTC).isoformat(), **meta,
        }
        marker_key = f"{self._step_prefix(step)}{MARKER}"
        try:
            self._s3.put_object(
                Bucket=self.bucket, Key=marker_key, Body=json.dumps(marker).encode(), IfNoneMatch="*",
                ContentType="application/json",
            )
        except ClientError as e:
            if error_code(e) not in ("PreconditionFailed", "412"):
                raise
            # Another attempt (or a zombie of a killed worker) committed this step first; keep theirs.
            self._s3.delete_object(Bucket=self.bucket, Key=state_key)
            existing = self._read_marker(marker_key)
            if existing is None:
                raise CheckpointError(f"{marker_key} exists but cannot be read") from e
            return existing
        return CommittedCheckpoint(self.run_id, step, marker_key, state_key, sha, len(data), marker)

    def _prune(self) -> None:
        """Keep the newest `keep` committed steps; older step folders (and their orphans) go."""
        steps = self.committed_steps()
        if len(steps) <= self.keep:
            return
        cutoff = steps[-self.keep]
        doomed = [o["Key"] for o in self._list() if self._step_of(o["Key"]) is not None
                  and (self._step_of(o["Key"]) or 0) < cutoff]
        for i in range(0, len(doomed), 1000):
            self._s3.delete_objects(
                Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in doomed[i : i + 1000]], "Quiet": True}
            )

    # -- reading -------------------------------------------------------------------------------
    def _list(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for page in self._s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix):
            out.extend(page.get("Contents", []))
        return out

    def _step_of(self, key: str) -> int | None:
        head = key[len(self.prefix):].split("/", 1)[0]
        return int(head) if head.isdigit() else None

    def committed_steps(self) -> list[int]:
        return sorted(
            s for o in self._list() if o["Key"].endswith("/" + MARKER) and (s := self._step_of(o["Key"])) is not None
        )

    def _read_marker(self, key: str) -> CommittedCheckpoint | None:
        try:
            body = self._s3.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        except ClientError as e:
            if error_code(e) in ("NoSuchKey", "404"):
                return None
            raise
        m = json.loads(body)
        return CommittedCheckpoint(m["run_id"], int(m["step"]), key, m["state_key"], m["sha256"], int(m["size"]), m)

    def latest(self) -> CommittedCheckpoint | None:
        steps = self.committed_steps()
        if not steps:
            return None
        return self._read_marker(f"{self._step_prefix(steps[-1])}{MARKER}")

    def load(self, ck: CommittedCheckpoint) -> dict[str, Any]:
        data = self._s3.get_object(Bucket=self.bucket, Key=ck.state_key)["Body"].read()
        if len(data) != ck.size or hashlib.sha256(data).hexdigest() != ck.sha256:
            raise CheckpointError(
                f"checkpoint {ck.state_key} is corrupt: {len(data)} bytes sha256 {hashlib.sha256(data).hexdigest()[:12]}, "
                f"marker says {ck.size} bytes sha256 {ck.sha256[:12]}"
            )
        state: dict[str, Any] = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        return state

    def retained_bytes(self) -> int:
        return sum(int(o["Size"]) for o in self._list())

    def clean_orphans(self) -> dict[str, int]:
        """Remove what killed writers left: uncommitted state objects and incomplete multipart uploads.

        Call only when no other writer of this run is alive (at the start of a resumed run)."""
        committed = set(self.committed_steps())
        orphans = [o["Key"] for o in self._list()
                   if (s := self._step_of(o["Key"])) is not None and s not in committed]
        for k in orphans:
            self._s3.delete_object(Bucket=self.bucket, Key=k)
        aborted = 0
        resp = self._s3.list_multipart_uploads(Bucket=self.bucket, Prefix=self.prefix)
        for up in resp.get("Uploads", []):
            self._s3.abort_multipart_upload(Bucket=self.bucket, Key=up["Key"], UploadId=up["UploadId"])
            aborted += 1
        return {"objects": len(orphans), "multipart_uploads": aborted}


def check_resumable(meta: dict[str, Any], dataset_uri: str, dataset_version: int, world_size: int) -> None:
    """Refuse, naming both sides, to continue a checkpoint on other data or another world size."""
    if meta.get("dataset_uri") != dataset_uri or int(meta.get("dataset_version", -1)) != dataset_version:
        raise DataVersionMismatch(
            f"run {meta.get('run_id')}: checkpoint at step {meta.get('step')} was trained on "
            f"{meta.get('dataset_uri')} version {meta.get('dataset_version')}, this run asks for {dataset_uri} "
            f"version {dataset_version}; resume with that version or start a new run_id"
        )
    if int(meta.get("world_size", 1)) != world_size:
        raise CheckpointError(
            f"run {meta.get('run_id')}: checkpoint at step {meta.get('step')} has {meta.get('world_size')} ranks, "
            f"this run has {world_size}; the data shards differ, so resume with the same number of processes"
        )


@dataclass
class IntervalController:
    """Picks the checkpoint interval (in steps) so one checkpoint costs under `target_share` of it.

    share = checkpoint seconds / (training seconds of the interval + checkpoint seconds). After each
    checkpoint the interval is re-derived from the measured checkpoint and step times, aiming at 80%
    of the target to leave room for jitter. A fixed interval (tests) disables adaptation.
    """

    target_share: float = 0.05
    interval: int = 20
    fixed: bool = False
    max_interval: int = 1_000_000
    shares: list[float] | None = None
    costs: list[float] | None = None

    def __post_init__(self) -> None:
        if not 0 < self.target_share < 1:
            raise ValueError(f"target_share must be in (0, 1), got {self.target_share}")
        if self.interval < 1:
            raise ValueError(f"interval must be >= 1 step, got {self.interval}")
        self.shares = self.shares or []
        self.costs = self.costs or []

    def observe(self, checkpoint_s: float, train_s: float, steps: int) -> int:
        """Record one interval (its training time and steps, then the checkpoint) and return the next interval."""
        assert self.shares is not None and self.costs is not None
        total = train_s + checkpoint_s
        self.shares.append(checkpoint_s / total if total > 0 else 0.0)
        self.costs.append(checkpoint_s)
        if not self.fixed and steps > 0:
            # The slowest of the last few checkpoints: object-store latency is bursty.
            self.interval = next_interval(max(self.costs[-3:]), train_s / steps, self.target_share, self.max_interval)
        return self.interval

    def report(self) -> dict[str, float | int]:
        s = self.shares or []
        # The first interval is the calibration guess; judge adaptation on the ones after it
        # (a fixed interval has no calibration: all count). NaN when no such interval completed.
        tail = s if self.fixed else s[1:]
        return {
            "checkpoints": len(s), "interval_steps": self.interval,
            "share_mean": sum(tail) / len(tail) if tail else math.nan, "share_max": max(tail) if tail else math.nan,
            "share_first": s[0] if s else 0.0,
        }


def next_interval(checkpoint_s: float, step_s: float, target_share: float, max_interval: int = 1_000_000) -> int:
    """Smallest step count whose checkpoint share c / (n*t + c) stays under 80% of the target."""
    aim = 0.8 * target_share
    if checkpoint_s <= 0:
        return 1
    if step_s <= 0:
        return max_interval
    n = math.ceil(checkpoint_s * (1 - aim) / (aim * step_s))
    return int(min(max(n, 1), max_interval))
