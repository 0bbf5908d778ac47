"""`make health` (python -m edgehaul_dev stack health): a real S3 write/read/delete, failing on S3 errors."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

from edgehaul_dev import localstack
from edgehaul_dev.localstack import Credentials, StackState

HEALTH = [sys.executable, "-m", "edgehaul_dev", "stack", "health", "--root"]


def _copy(stack: StackState, root: Path, **changes: object) -> Path:
    """The stack's state under `root`, with `changes` (same servers, other keys or ports)."""
    dataclasses.replace(stack, root=str(root), **changes).save()  # type: ignore[arg-type]
    return root


def test_health_passes_on_a_working_store_and_leaves_nothing_behind(stack: StackState) -> None:
    before = set(_health_keys(stack))
    live = subprocess.run([*HEALTH, stack.root], capture_output=True, text=True, timeout=60)
    assert live.returncode == 0 and json.loads(live.stdout) == {"prefect": True, "s3": True}, live.stderr
    assert set(_health_keys(stack)) == before  # the probe object was deleted


def test_health_fails_on_an_s3_error_and_says_which_request(stack: StackState, tmp_path: Path) -> None:
    admin = stack.identities["admin"]
    wrong = {**stack.identities, "admin": Credentials(admin.access_key_id, admin.secret_access_key[::-1])}
    root = _copy(stack, tmp_path, identities=wrong)
    r = subprocess.run([*HEALTH, str(root)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and json.loads(r.stdout) == {"prefect": True, "s3": False}
    assert "S3 put s3://edgehaul-ops/_health/" in r.stderr and "SignatureDoesNotMatch" in r.stderr, r.stderr


def test_an_answering_port_without_a_store_is_not_healthy(stack: StackState, tmp_path: Path) -> None:
    # The Prefect port answers HTTP (the old check's bar for S3) but is no S3 store.
    errors: dict[str, str] = {}
    root = _copy(stack, tmp_path, s3_port=stack.prefect_port)
    assert localstack.health(root, errors) == {"prefect": True, "s3": False}
    assert errors["s3"].startswith("S3 put"), errors


def _health_keys(stack: StackState) -> list[str]:
    import boto3

    admin = stack.identities["admin"]
    s3 = boto3.client("s3", endpoint_url=stack.s3_endpoint, region_name="us-east-1",
                      aws_access_key_id=admin.access_key_id, aws_secret_access_key=admin.secret_access_key)
    return [o["Key"] for o in s3.list_objects_v2(Bucket="edgehaul-ops", Prefix="_health/").get("Contents", [])]
