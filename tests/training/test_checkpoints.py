"""Checkpoint commit protocol: a writer killed mid-upload leaves nothing visible, corrupt state is
detected, failed writes emit CHECKPOINT_FAILED and are retried, old checkpoints are pruned."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
import torch

from edgehaul import events
from edgehaul.blocks import ObjectStore
from edgehaul.training.checkpoints import MARKER, CheckpointError, CheckpointStore, IntervalController
from edgehaul.training.launch import child_env, store_to_public
from edgehaul_dev import localstack
from tests.conftest import api_auth
from tests.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]
META = {"dataset_uri": "s3://x/y", "dataset_version": 1, "world_size": 1}

WRITER = textwrap.dedent("""
    import json, sys, time, torch
    from edgehaul.training.checkpoints import CheckpointStore
    from edgehaul.training.launch import store_from_public
    store = store_from_public(json.loads(sys.argv[1]))
    cs = CheckpointStore(store, sys.argv[2], multipart_bytes=5 * 1024 * 1024)
    cs.write({"w": torch.arange(10.0)}, 1, {"dataset_uri": "s3://x/y", "dataset_version": 1, "world_size": 1})
    sent = [0]
    def progress(n):
        sent[0] += n
        if sent[0] >= 5 * 1024 * 1024:
            print("UPLOADING", sent[0], flush=True)
            time.sleep(600)  # hold this part open: the test kills the process here
    cs.write({"w": torch.zeros(4 * 1024 * 1024)}, 2, {"dataset_uri": "s3://x/y", "dataset_version": 1,
             "world_size": 1}, progress=progress)
    print("FINISHED", flush=True)
""")


@pytest.mark.integration
def test_writer_killed_mid_upload_leaves_no_visible_checkpoint(store: ObjectStore) -> None:
    run = f"r-{uuid.uuid4().hex[:8]}"
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, json.dumps(store_to_public(store)), run],
        cwd=ROOT, env=child_env(store), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("UPLOADING"), proc.communicate(timeout=30)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL

    cs = CheckpointStore(store, run)
    s3 = store.client()
    uploads = s3.list_multipart_uploads(Bucket=cs.bucket, Prefix=cs.prefix).get("Uploads", [])
    assert [u["Key"] for u in uploads if "/000000000002/state-" in u["Key"]], "the kill was not mid-upload"
    # A complete but uncommitted state object (writer killed between upload and commit) is invisible too.
    s3.put_object(Bucket=cs.bucket, Key=f"{cs.prefix}000000000003/state-orphan.pt", Body=b"not committed")

    latest = cs.latest()
    assert latest is not None and latest.step == 1 and cs.committed_steps() == [1]
    assert torch.equal(cs.load(latest)["w"], torch.arange(10.0))

    cleaned = cs.clean_orphans()
    assert cleaned["multipart_uploads"] >= 1 and cleaned["objects"] == 1
    assert not s3.list_multipart_uploads(Bucket=cs.bucket, Prefix=cs.prefix).get("Uploads")
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=cs.bucket, Prefix=cs.prefix).get("Contents", [])]
    assert all("/000000000001/" in k for k in keys) and len(keys) == 2


@pytest.mark.integration
def test_corrupt_state_is_refused_and_old_checkpoints_pruned(store: ObjectStore) -> None:
    cs = CheckpointStore(store, "prune", keep=2)
    for step in (5, 10, 15, 20):
        ck = cs.write({"step": torch.tensor(step)}, step, META)
    assert cs.committed_steps() == [15, 20]
    assert int(cs.load(ck)["step"]) == 20
    store.client().put_object(Bucket=cs.bucket, Key=ck.state_key, Body=b"tampered")
    with pytest.raises(CheckpointError, match=r"is corrupt: 8 bytes"):
        cs.load(ck)
    # a second commit of the same step (a zombie writer) keeps the first one
    again = cs.write({"step": torch.tensor(99)}, 15, META)
    assert again.state_key == cs._read_marker(f"{cs.prefix}000000000015/{MARKER}").state_key  # type: ignore[union-attr]


def _events(api: str, name: str, resource: str) -> list[dict[str, object]]:
    r = httpx.post(f"{api}/events/filter", json={
        "filter": {"event": {"name": [name]}, "resource": {"id": [resource]}}, "limit": 50,
    }, timeout=10, auth=api_auth())
    r.raise_for_status()
    return list(r.json()["events"])


@pytest.mark.integration
def test_failed_checkpoint_write_emits_event_and_is_retried(stack: localstack.StackState, store: ObjectStore) -> None:
    bucket = f"eh-ckpt-{uuid.uuid4().hex[:8]}"
    flaky = store.model_copy(update={"checkpoints_bucket": bucket})
    run = f"flaky-{uuid.uuid4().hex[:6]}"
    cs = CheckpointStore(flaky, run, attempts=5, backoff_s=0.4)
    s3 = store.client()
    # The store is "down" for this bucket until the first attempt has failed (not a timer: on a loaded
    # machine the first attempt can start after any fixed delay, and then nothing fails).
    stop = threading.Event()

    def create_after_first_failure() -> None:
        while not stop.is_set() and cs.failures < 1:
            time.sleep(0.02)
        if not stop.is_set():
            s3.create_bucket(Bucket=bucket)

    creator = threading.Thread(target=create_after_first_failure, daemon=True)
    creator.start()
    try:
        ck = cs.write({"w": torch.ones(3)}, 7, META)
        creator.join(timeout=30)
        assert ck.step == 7 and cs.failures >= 1
        assert torch.equal(cs.load(ck)["w"], torch.ones(3))
        resource = f"edgehaul.training.run.{run}"
        def recorded() -> list[dict[str, object]]:
            found = _events(stack.prefect_api_url, events.CHECKPOINT_FAILED, resource)
            return found if len(found) >= cs.failures else []

        found = wait_for(recorded, 20, f"{cs.failures} CHECKPOINT_FAILED events", interval=0.5)
        assert len(found) == cs.failures
        payload = found[0]["payload"]
        assert isinstance(payload, dict)
        assert payload["run_id"] == run and payload["step"] == 7 and "NoSuchBucket" in str(payload["error"])
    finally:
        stop.set()
        for o in s3.list_objects_v2(Bucket=bucket).get("Contents", []):
            s3.delete_object(Bucket=bucket, Key=o["Key"])
        s3.delete_bucket(Bucket=bucket)


def test_interval_controller_adapts_to_measured_cost_and_reports_shares() -> None:
    ctl = IntervalController(target_share=0.05, interval=20)
    # 20 steps of 10 ms, then a 0.2 s checkpoint: share 50%, far over the target
    nxt = ctl.observe(0.2, 0.2, 20)
    assert nxt > 20
    # the next interval at the same costs stays under the target
    ctl.observe(0.2, nxt * 0.01, nxt)
    rep = ctl.report()
    assert rep["share_first"] == pytest.approx(0.5) and rep["share_max"] < 0.05
    fixed = IntervalController(interval=5, fixed=True)
    assert fixed.observe(10.0, 0.01, 5) == 5
