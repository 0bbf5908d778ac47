"""One real Prefect server and one real SeaweedFS for the whole test session.

Unit tests need neither; integration tests take the `stack` / `store` fixtures. The stack runs
on free ports in a temporary folder, so a developer's `make demo` stack is never touched.

`EDGEHAUL_TEST_S3_QUIRKS=<mode>` (a key of `tests.s3_quirk_proxy.MODES`, e.g. `other-server`, or a comma-separated
list of quirks from `tests.s3_quirk_proxy.QUIRKS`) puts the
quirk proxy in front of SeaweedFS for the whole session: every client, flow and Delta reader of the
tests then talks to a server that behaves like another S3 implementation.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from edgehaul.blocks import ObjectStore
from edgehaul_dev import configure, localstack
from tests.s3_quirk_proxy import MODES, QuirkProxy


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[localstack.StackState]:
    root = tmp_path_factory.mktemp("stack")
    try:
        state = localstack.up(root, fixed_ports=False)
    except BaseException:
        localstack.down(root)  # a start-up timeout must not leave its servers running
        raise
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
            if proxy is not None:
                proxy.stop()
            localstack.down(root)


def api_auth() -> tuple[str, str] | None:
    """httpx basic auth for raw calls to the session's (closed) Prefect API: PREFECT_API_AUTH_STRING."""
    user, sep, password = os.environ.get("PREFECT_API_AUTH_STRING", "").partition(":")
    return (user, password) if sep else None


def store_for(state: localstack.StackState, role: str = "admin", prefix: str = "") -> ObjectStore:
    """A stack identity's store, holding no key (the stack's 0600 credentials files): tests may save it."""
    return configure.store_block(state, role, prefix)


@pytest.fixture
def store(stack: localstack.StackState) -> ObjectStore:
    """Admin store under a fresh prefix, so tests never see each other's objects."""
    return store_for(stack, prefix=f"t-{uuid.uuid4().hex[:10]}")


@pytest.fixture
def spool_dir(tmp_path: Path) -> Path:
    d = tmp_path / "spool"
    d.mkdir()
    return d
