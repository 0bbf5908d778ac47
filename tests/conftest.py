"""One real Prefect server and one real SeaweedFS for the whole test session.

Unit tests need neither; integration tests take the `stack` / `store` fixtures. The stack runs
on free ports in a temporary folder, so a developer's `make demo` stack is never touched.

`EDGEHAUL_TEST_S3_QUIRKS=<mode>` (a key of `tests.s3_quirk_proxy.MODES`, e.g. `other-server`, or a comma-separated
list of quirks from `tests.s3_quirk_proxy.QUIRKS`) puts the
quirk proxy in front of SeaweedFS for the whole session: every client, flow and Delta reader of the
tests then talks to a server that behaves like another S3 implementation.

`EDGEHAUL_TEST_S3_ENDPOINT=<url>` runs the session against any S3 server instead (SeaweedFS still starts, unused):
`EDGEHAUL_TEST_S3_ACCESS_KEY_ID` / `EDGEHAUL_TEST_S3_SECRET_ACCESS_KEY` are its admin keys (they create the five
`edgehaul-*` buckets when missing), and `EDGEHAUL_TEST_S3_ADMIN_HOOK=<module>:<function>` creates the other
identities: called as `fn(endpoint, admin: Credentials, names: list[str]) -> dict[str, Credentials]` with the
roles and nodes of `edgehaul_dev.localstack` (attach the `infra/iam` policies there). Without a hook every
identity is the admin, so least-privilege tests fail by design. Tests that assert what a server can do ask
the probe (`edgehaul.ops.store_probe`); the few that are about SeaweedFS itself take the `local_seaweedfs`
fixture, which skips them. The quirk proxy needs a plain-http, path-style endpoint.
"""

from __future__ import annotations

import importlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from edgehaul.blocks import ObjectStore
from edgehaul_dev import localstack
from tests.s3_quirk_proxy import MODES, QuirkProxy

EXTERNAL_S3 = os.environ.get("EDGEHAUL_TEST_S3_ENDPOINT", "")


def use_external_s3(state: localstack.StackState, endpoint: str) -> None:
    """Point the stack at another S3 server: its admin keys, identities from the admin hook, the five buckets."""
    import boto3
    from botocore.exceptions import ClientError

    try:
        admin = localstack.Credentials(os.environ["EDGEHAUL_TEST_S3_ACCESS_KEY_ID"],
                                       os.environ["EDGEHAUL_TEST_S3_SECRET_ACCESS_KEY"])
    except KeyError as e:
        raise RuntimeError(f"EDGEHAUL_TEST_S3_ENDPOINT is set but {e.args[0]} is not (the server's admin keys)") from None
    names = [n for n in state.identities if n != "admin"]
    made = {n: admin for n in names}
    if hook := os.environ.get("EDGEHAUL_TEST_S3_ADMIN_HOOK"):
        module, _, fn = hook.partition(":")
        made = getattr(importlib.import_module(module), fn)(endpoint, admin, names)
        if missing := sorted(set(names) - set(made)):
            raise RuntimeError(f"EDGEHAUL_TEST_S3_ADMIN_HOOK {hook} made no identity for {missing}")
    s3 = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=admin.access_key_id,
                      aws_secret_access_key=admin.secret_access_key, region_name="us-east-1")
    for bucket in localstack.BUCKETS:
        try:
            s3.head_bucket(Bucket=bucket)
        except ClientError:
            s3.create_bucket(Bucket=bucket)
    state.identities = {"admin": admin, **{n: made[n] for n in names}}
    state.s3_endpoint_override = endpoint
    state.write_central_credentials()
    state.write_node_credentials()
    state.save()  # processes that load the stack's state (workers, `make` entry points) see the same server


@pytest.fixture
def local_seaweedfs(stack: localstack.StackState) -> localstack.StackState:
    """For the tests about SeaweedFS itself (its identities file, its exact answers): skipped on another server."""
    if EXTERNAL_S3:
        pytest.skip("about the local SeaweedFS; the session runs against EDGEHAUL_TEST_S3_ENDPOINT")
    return stack


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[localstack.StackState]:
    root = tmp_path_factory.mktemp("stack")
    try:
        state = localstack.up(root, fixed_ports=False)
    except BaseException:
        localstack.down(root)  # a start-up timeout must not leave its servers running
        raise
    if EXTERNAL_S3:
        use_external_s3(state, EXTERNAL_S3)
    mode = os.environ.get("EDGEHAUL_TEST_S3_QUIRKS", "")
    proxy = None
    if mode:
        proxy = QuirkProxy(state.s3_endpoint, {c.access_key_id: c.secret_access_key for c in state.identities.values()},
                           MODES.get(mode) or mode.split(",")).start()
        state.s3_port = int(proxy.url.rsplit(":", 1)[1])  # in memory only: `down` reads the saved state
    with localstack.environ(state.env()):
        from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

        try:
            # the server is closed (localstack: API auth on): every client of the session sends the string
            with temporary_settings(updates={PREFECT_API_URL: state.prefect_api_url,
                                             PREFECT_API_AUTH_STRING: state.api_auth_string}):
                yield state
        finally:
            _drain_prefect_clients()
            if proxy is not None:
                proxy.stop()
            localstack.down(root)


def _drain_prefect_clients() -> None:
    """Send the logs and events still queued in this process while the server is up: drained at exit instead,
    they met a stopped server ("--- Error logging to API --- All connection attempts failed" after the run)."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        worker.drain_all(timeout=30)


def api_auth() -> tuple[str, str] | None:
    """httpx basic auth for raw calls to the session's (closed) Prefect API: PREFECT_API_AUTH_STRING."""
    user, sep, password = os.environ.get("PREFECT_API_AUTH_STRING", "").partition(":")
    return (user, password) if sep else None


def store_for(state: localstack.StackState, role: str = "admin", prefix: str = "") -> ObjectStore:
    """A stack identity's store, holding no key (the stack's 0600 credentials files): tests may save it."""
    return state.store(role, prefix)


@pytest.fixture
def store(stack: localstack.StackState) -> ObjectStore:
    """Admin store under a fresh prefix, so tests never see each other's objects."""
    return store_for(stack, prefix=f"t-{uuid.uuid4().hex[:10]}")


@pytest.fixture
def spool_dir(tmp_path: Path) -> Path:
    d = tmp_path / "spool"
    d.mkdir()
    return d
