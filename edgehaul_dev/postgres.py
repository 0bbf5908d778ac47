"""A private PostgreSQL for a Prefect server, as in production (tests/platform/test_postgres.py, benchmarks/bench_fleet.py).

Debian's server binaries: initdb + pg_ctl into a temporary folder, on a free port, fsync off (a throwaway
database); as the `postgres` user when run as root, since initdb refuses root.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from edgehaul_dev import localstack


def pg_bin(name: str) -> str:
    on_path = shutil.which(name)
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}")) or ([on_path] if on_path else [])
    if not found:
        raise RuntimeError(f"PostgreSQL server binary {name!r} not found: apt-get install postgresql (.ci/run does)")
    return str(found[-1])


def _as_db_user() -> tuple[Callable[[list[str]], list[str]], int | None]:
    if os.geteuid() != 0:
        return (lambda cmd: cmd), None
    uid = pwd.getpwnam("postgres").pw_uid
    return (lambda cmd: ["runuser", "-u", "postgres", "--", *cmd]), uid


@contextlib.contextmanager
def running(*, max_connections: int = 100) -> Iterator[str]:
    """Start a throwaway PostgreSQL with a `prefect` database; yield its asyncpg URL; stop and delete it on exit."""
    wrap, uid = _as_db_user()
    root = Path(tempfile.mkdtemp(prefix="eh-pg-"))
    if uid is not None:
        os.chown(root, uid, -1)
    data, port = root / "data", localstack.free_port()
    run = dict(check=True, capture_output=True, text=True, timeout=120)
    subprocess.run(wrap([pg_bin("initdb"), "-D", str(data), "-U", "prefect", "-A", "trust", "-E", "UTF8"]), **run)  # type: ignore[call-overload]
    opts = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections={max_connections}"
    subprocess.run(
        wrap([pg_bin("pg_ctl"), "-D", str(data), "-o", opts, "-l", str(root / "pg.log"), "-w", "-t", "60", "start"]), **run
    )  # type: ignore[call-overload]
    try:
        subprocess.run(wrap([pg_bin("createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "prefect", "prefect"]), **run)  # type: ignore[call-overload]
        yield f"postgresql+asyncpg://prefect@127.0.0.1:{port}/prefect"
    finally:
        stop = [pg_bin("pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop"]
        subprocess.run(wrap(stop), capture_output=True, timeout=60)
        shutil.rmtree(root, ignore_errors=True)


def dsn(url: str) -> str:
    """The libpq (psycopg2) form of an asyncpg URL from `running`."""
    return url.replace("postgresql+asyncpg://", "postgresql://")
