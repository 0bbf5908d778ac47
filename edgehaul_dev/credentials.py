"""Rotate an identity's key on the local stack without losing queued data.

    infra/local/rotate_key.sh node-a [--root .edgehaul-stack] [--spool /var/lib/edgehaul/spool]

Steps: a new key pair replaces the identity's key in the stack's state.json and in SeaweedFS's
s3.json (both 0600), then SIGHUP makes SeaweedFS reload s3.json in place (no restart, no
downtime): the old key is refused from then on. The edge spool is never touched: queued bundles
stay on disk and the next uplink drain sends them with the new key (an upload cut by the switch is
retried from the spool). The new key is printed only as the name of the file that holds it, never
on stdout or in a log. A node's key is also rewritten into the node's 0600 credentials file
(`StackState.node_credentials_file`), which its ObjectStore block names: the node's next client uses it;
a central role's into the central credentials file (`StackState.central_credentials_file`), likewise.

On AWS the same operation is `aws iam create-access-key` / `update-access-key --status Inactive` /
`delete-access-key` for the node's user (see infra/iam/README.md).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import secrets
import signal
import sys
import time
from pathlib import Path

from edgehaul.platform.private_files import write_private
from edgehaul_dev import localstack
from edgehaul_dev.localstack import Credentials, StackState


class RotationError(RuntimeError):
    """The identity or the stack is not there, or the S3 server did not take the new key."""


def new_credentials() -> Credentials:
    return Credentials(f"EH{secrets.token_hex(8).upper()}", secrets.token_urlsafe(30))


def spool_digest(spool: Path) -> dict[str, str]:
    """sha256 of every file under a spool folder, by relative path (to prove rotation left it alone)."""
    return {
        str(p.relative_to(spool)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(spool.rglob("*"))
        if p.is_file()
    }


def rotate(root: Path, identity: str, *, timeout: float = 30) -> Credentials:
    """Give `identity` a new key on the stack at `root`; the old one stops working. Returns the new key."""
    state = StackState.load(root)
    if state is None:
        raise RotationError(f"no local stack at {root} (state.json missing); run 'make up' first")
    if identity not in state.identities:
        raise RotationError(f"unknown identity {identity!r}; known: {sorted(state.identities)}")
    if identity == "admin":
        raise RotationError("the admin key is rotated by recreating the stack, not here")
    old = state.identities[identity]
    new = new_credentials()
    state.identities[identity] = new
    nodes = [k for k in state.identities if k not in localstack.ROLES]
    cfg = Path(state.root) / "seaweedfs" / "s3.json"
    write_private(cfg, json.dumps(localstack.identities_config(state.identities, nodes)))
    state.save()
    if identity in nodes:
        state.write_node_credentials()
    else:  # a central role's block names the central file: its next client reads the new key
        state.write_central_credentials()
    pid = localstack._read_pid(Path(state.root), "seaweedfs")
    if pid is None:
        # not running: the new s3.json is read at the next start
        return new
    os.kill(pid, signal.SIGHUP)  # SeaweedFS reloads -s3.config on SIGHUP
    _wait_key_switched(state, old, new, timeout)
    return new


def _wait_key_switched(state: StackState, old: Credentials, new: Credentials, timeout: float) -> None:
    import boto3
    from botocore.config import Config
    from botocore.exceptions import ClientError

    def status(c: Credentials) -> str:
        s3 = boto3.client(
            "s3", endpoint_url=state.s3_endpoint, region_name="us-east-1",
            aws_access_key_id=c.access_key_id, aws_secret_access_key=c.secret_access_key,
            config=Config(retries={"max_attempts": 1}, connect_timeout=2, read_timeout=5),
        )
        try:
            s3.list_objects_v2(Bucket="edgehaul-landing", MaxKeys=1)
        except ClientError as e:
            return str(e.response["Error"]["Code"])
        return "ok"

    deadline = time.monotonic() + timeout
    seen = ("?", "?")
    while time.monotonic() < deadline:
        # A known key without list rights gives AccessDenied; an unknown key InvalidAccessKeyId.
        seen = (status(old), status(new))
        if seen[0] == "InvalidAccessKeyId" and seen[1] != "InvalidAccessKeyId":
            return
        time.sleep(0.2)
    raise RotationError(f"S3 server did not switch keys within {timeout:.0f}s (old: {seen[0]}, new: {seen[1]})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="edgehaul_dev.credentials", description="Rotate a local-stack identity's key.")
    ap.add_argument("identity", help="node id (e.g. node-a) or role (ingest, trainer, lifecycle, ...)")
    ap.add_argument("--root", type=Path, default=localstack.DEFAULT_ROOT)
    ap.add_argument("--spool", type=Path, help="the node's spool folder: checked unchanged by the rotation")
    args = ap.parse_args(argv)
    before = spool_digest(args.spool) if args.spool else None
    try:
        new = rotate(args.root, args.identity)
    except RotationError as e:
        print(f"rotation failed: {e}", file=sys.stderr)
        return 1
    msg = f"rotated {args.identity}: new access key id {new.access_key_id}; secret in {args.root / 'state.json'}"
    if before is not None:
        after = spool_digest(args.spool)
        if after != before:
            print(f"spool {args.spool} changed during rotation", file=sys.stderr)
            return 1
        msg += f"; spool untouched ({len(after)} files queued)"
    print(msg)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
