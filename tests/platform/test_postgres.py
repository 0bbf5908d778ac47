"""The production configuration: a Prefect server on a real PostgreSQL, running core_ingest end to end.

A private PostgreSQL (Debian's server binaries: initdb + pg_ctl into a temporary folder, on a free
port; as the `postgres` user when the tests run as root, since initdb refuses root) backs a second
Prefect server. core_ingest then validates and commits real bundles from the session's SeaweedFS,
and the flow run is read back from PostgreSQL itself.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from edgehaul_dev import localstack, postgres
from tests.conftest import store_for
from tests.waiting import wait_for

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def postgres_url() -> Iterator[str]:
    with postgres.running() as url:
        yield url


@pytest.fixture(scope="module")
def pg_prefect(postgres_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[localstack.StackState]:
    """A separate local stack whose Prefect server runs on PostgreSQL (not the session's SQLite one)."""
    root = tmp_path_factory.mktemp("pg-stack")
    old = os.environ.get("EDGEHAUL_PREFECT_DB_URL")
    os.environ["EDGEHAUL_PREFECT_DB_URL"] = postgres_url
    try:
        yield localstack.up(root, fixed_ports=False)
    finally:
        if old is None:
            os.environ.pop("EDGEHAUL_PREFECT_DB_URL", None)
        else:
            os.environ["EDGEHAUL_PREFECT_DB_URL"] = old
        localstack.down(root)


def test_core_ingest_runs_on_a_postgres_backed_prefect_server(pg_prefect: localstack.StackState, postgres_url: str) -> None:
    import psycopg2
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    from edgehaul.bundles import BundleManifest
    from edgehaul.core.datasets import open_table
    from edgehaul.flows.core_ingest import CoreIngestParams, core_ingest
    from tests.builders import bundle

    store = store_for(pg_prefect, "admin", prefix=f"pg-{uuid.uuid4().hex[:8]}")
    s3 = store.client()

    def put(data: bytes, m: BundleManifest) -> None:
        s3.put_object(Bucket=store.bucket("landing"), Key=store.key("landing", m.object_key), Body=data)
        s3.put_object(Bucket=store.bucket("landing"), Key=store.key("landing", m.manifest_key), Body=m.to_json())

    good = [bundle(40, "node-a", seed=i, start_seq=i * 40) for i in range(2)]
    for data, m in good:
        put(data, m)
    bad_data, bad_m = bundle(10, "node-b", seed=9)
    put(bad_data[:-100], bad_m)  # truncated in transit: must be quarantined, not committed

    with temporary_settings(updates={PREFECT_API_URL: pg_prefect.prefect_api_url,
                                     PREFECT_API_AUTH_STRING: pg_prefect.api_auth_string}):
        block = f"pg-{uuid.uuid4().hex[:8]}"
        store.save(block, overwrite=True)
        state = core_ingest(CoreIngestParams(store_block=block), return_state=True)
        assert state.is_completed(), state
        run_id = state.state_details.flow_run_id

    table = open_table(store, "landsat_patch").to_pyarrow_table()
    committed = set(table.column("sample_id").to_pylist())
    assert committed == {s for _, m in good for s in m.sample_ids}
    assert not committed & set(bad_m.sample_ids)
    quarantined = s3.list_objects_v2(Bucket=store.bucket("quarantine"), Prefix=store.key("quarantine", "node-b/"))
    assert quarantined.get("KeyCount", 0) > 0

    # the run is recorded in PostgreSQL itself, not in some SQLite file
    dsn = postgres.dsn(postgres_url)
    # Flow-run states are written through the API by the client itself (task runs travel as events
    # through a process-wide events client, which in a long test session may be bound to another server).
    def recorded() -> tuple[tuple[str] | None, int]:
        with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
            cur.execute("SELECT state_type FROM flow_run WHERE id = %s", (str(run_id),))
            flow_state = cur.fetchone()
            cur.execute("SELECT count(*) FROM flow_run_state WHERE flow_run_id = %s", (str(run_id),))
            return flow_state, cur.fetchone()[0]  # type: ignore[index]

    def completed() -> bool:  # pending, running, completed: every transition went through PostgreSQL
        flow_state, states = recorded()
        return flow_state == ("COMPLETED",) and states >= 3

    wait_for(completed, 60, lambda: f"run {run_id} completed in PostgreSQL, 3 states or more; got {recorded()}")
    assert not list((Path(pg_prefect.root) / "prefect").rglob("*.db"))
