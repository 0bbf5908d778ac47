"""An edge node that runs on its own: its own Prefect server, blocks, contract and schedules.

    edgehaul node init --config node.yaml     write the node's state dir and save its blocks locally
    edgehaul node run --state-dir DIR         start the node's Prefect server and serve its deployments

The node keeps doing its whole local job with the central Prefect API out of reach (docs/ARCHITECTURE.md,
"Node autonomy"): everything it needs lives under its state dir, and its
deployments (edge_ingest on a drop folder, uplink_drain) are scheduled by a node-local Prefect server
(SQLite) and run by a runner (`serve`) in the same process. The centre is needed only for S3 (data)
and the gateway (events); neither is needed to keep ingesting, tiering and spooling.

State dir layout:
    node.json            the validated config (what `run` reads)
    node.env             0600: PREFECT_HOME / PREFECT_API_URL / auth string of the local server, contracts dir
    prefect/             PREFECT_HOME of the local server (prefect.db, SQLite)
    spool/               the durable spool (ledger, retry queue, outbox.sqlite, prefect-results/)
    s3-credentials       0600: the node's own S3 keys (profile = node id), named by its ObjectStore block
    contracts/           copy of the data contracts the node reads (EDGEHAUL_CONTRACTS_DIR of its runs)
    drop/ -> done/       raw Parquet files arrive in drop/; each ingest run moves what it read to done/
    logs/                the local server's log

Imports flows (it serves them), so it sits beside `edgehaul.cli`, above `edgehaul.flows`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import Field, SecretStr, ValidationError

from edgehaul.blocks import EdgeNode, LinkProfile, ObjectStore, TieringPolicy
from edgehaul.blocks.object_store import write_credentials_file
from edgehaul.platform.fields import Name, Strict
from edgehaul.platform.private_files import write_private
from edgehaul.platform.roles import DEFAULT_POLICY, node_store
from edgehaul.platform.settings import get_settings
from edgehaul.services.block_setup import Keys, StoreSpec

CONFIG_FILE = "node.json"
ENV_FILE = "node.env"
EDGE_FIELDS = ("team", "spool_cap_bytes", "cleanup_watermark", "alert_watermark", "full_policy",
               "bundle_ttl_seconds", "retry_queue_cap", "retry_expiry_seconds", "pass_schedule")


class NodeError(RuntimeError):
    """The node's config or state dir is unusable, or its local server would not start; says which and where."""


class Schedules(Strict):
    ingest_every_s: float = Field(default=600, gt=0, description="edge_ingest of the drop folder, every N seconds.")
    drain_every_s: float = Field(default=600, gt=0, description="uplink_drain attempts, every N seconds.")
    poll_s: float = Field(default=10, gt=0, description="How often the node's runner looks for runs that are due.")


class GatewayConfig(Strict):
    url: str = Field(min_length=1, description="The central webhook gateway, e.g. https://gw.example/ .")
    key: SecretStr | None = Field(default=None, description="The node's own gateway key ('whsec_...'), written to "
                                  "<state>/gateway-key (0600) and never into a block; None: the file is provisioned.")
    sender_id: str | None = Field(default=None, description="Sender id of that key at the gateway; None: node id.")


class NodeConfig(Strict):
    node_id: Name
    state_dir: str = Field(description="The node's persistent folder: everything it needs lives here.")
    store: StoreSpec = Field(default_factory=StoreSpec)
    keys: Keys | None = Field(default=None, description="The node's own S3 keys, written to <state>/s3-credentials "
                              "(0600) and never into a block; None: the file is provisioned on the node.")
    edge: dict[str, Any] = Field(default_factory=dict, description=f"EdgeNode fields: {', '.join(EDGE_FIELDS)}.")
    link: dict[str, Any] = Field(default_factory=lambda: {"bandwidth_bps": 50e6}, description="LinkProfile fields.")
    tiering: dict[str, Any] = Field(default_factory=dict, description="TieringPolicy fields; empty: its defaults.")
    contract: str = "landsat_patch.v1"
    batch_size: int = Field(default=50_000, ge=100, le=200_000)
    schedules: Schedules = Field(default_factory=Schedules)
    drain: dict[str, Any] = Field(default_factory=dict, description="Further uplink_drain parameters "
                                  "(max_seconds, max_active, backup_link_profile, ...).")
    gateway: GatewayConfig | None = Field(default=None, description="Where the node forwards its outbox (alerts, "
                                          "run summaries, link statistics) when in contact; None: it keeps them.")
    downlink: bool = Field(default=True, description="Fetch and apply what the core publishes for this node "
                                                     "(models, policies, contracts) when in contact.")
    prefect_port: int = Field(default=4210, ge=0, le=65535, description="Port of the node-local Prefect server "
                              "(bound to 127.0.0.1 only).")

    def root(self) -> Path:
        return Path(self.state_dir).expanduser().resolve()


class NodeLayout:
    """Paths of a node's state dir."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.config = self.root / CONFIG_FILE
        self.env_file = self.root / ENV_FILE
        self.prefect_home = self.root / "prefect"
        self.spool = self.root / "spool"
        self.credentials = self.root / "s3-credentials"
        self.contracts = self.root / "contracts"
        self.drop = self.root / "drop"
        self.done = self.root / "done"
        self.logs = self.root / "logs"
        self.gateway_key = self.root / "gateway-key"

    def load(self) -> NodeConfig:
        try:
            return NodeConfig.model_validate_json(self.config.read_text())
        except FileNotFoundError:
            raise NodeError(f"{self.root}: no {CONFIG_FILE}; run `edgehaul node init --config <file>` first") from None
        except ValidationError as e:
            raise NodeError(f"{self.config}: {_where(e)}") from None

    def env(self) -> dict[str, str]:
        """The local server's and the node's runs' environment (node.env)."""
        try:
            return json.loads(self.env_file.read_text())
        except FileNotFoundError:
            raise NodeError(f"{self.root}: no {ENV_FILE}; run `edgehaul node init` first") from None


def _where(e: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(x) for x in err['loc']) or '(file)'}: {err['msg']}" for err in e.errors())


def load_config(path: Path) -> NodeConfig:
    import yaml

    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise NodeError(f"{path}: cannot read ({e})") from e
    try:
        cfg = NodeConfig.model_validate(raw)
    except ValidationError as e:
        raise NodeError(f"{path}: {_where(e)}") from None
    if bad := sorted(set(cfg.edge) - set(EDGE_FIELDS)):
        raise NodeError(f"{path}: edge.{bad[0]}: not an EdgeNode field the node sets ({', '.join(EDGE_FIELDS)})")
    return cfg


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def node_blocks(cfg: NodeConfig, layout: NodeLayout) -> dict[str, Any]:
    """Block name -> block the node's flows load, all saved on its own server (the store holds no key)."""
    store = ObjectStore(**cfg.store.model_dump(exclude_none=True), credentials_file=str(layout.credentials),
                        profile=cfg.node_id)
    edge = EdgeNode(node_id=cfg.node_id, node_group="node-local", spool_dir=str(layout.spool), **cfg.edge)
    return {f"edgehaul-edge-node/{cfg.node_id}": edge, f"edgehaul-object-store/{node_store(cfg.node_id)}": store,
            f"edgehaul-link-profile/{DEFAULT_POLICY}": LinkProfile(**cfg.link),
            f"edgehaul-tiering-policy/{DEFAULT_POLICY}": TieringPolicy(**cfg.tiering)}


def owner_only(root: Path, *, umask: bool = False) -> None:
    """The node's files are its owner's alone: what an earlier version left readable under `root` is made
    0700/0600, and with `umask` everything this process (and its children: the local server, flow runs)
    creates from now on is too (umask 077: the node process's own setting, for its lifetime)."""
    if umask:
        os.umask(0o077)
    if not root.exists():
        return
    for p in [root, *root.rglob("*")]:
        if not p.is_symlink():
            p.chmod(0o700 if p.is_dir() else p.stat().st_mode & 0o700)


def init(cfg: NodeConfig) -> NodeLayout:
    """Write the node's state dir, start its server long enough to save its blocks, and stop it."""
    layout = NodeLayout(cfg.root())
    owner_only(layout.root)
    for d in (layout.root, layout.spool, layout.contracts, layout.drop, layout.done, layout.logs):
        d.mkdir(mode=0o700, parents=True, exist_ok=True)  # inside a 0700 root: what init writes is the owner's
    layout.prefect_home.mkdir(mode=0o700, exist_ok=True)
    try:
        blocks = node_blocks(cfg, layout)  # validated before anything is written
    except ValidationError as e:
        raise NodeError(f"node {cfg.node_id}: {_where(e)}") from None
    if cfg.keys:
        write_credentials_file(layout.credentials, cfg.node_id, cfg.keys.access_key_id.get_secret_value(),
                               cfg.keys.secret_access_key.get_secret_value())
    elif not layout.credentials.exists():
        raise NodeError(f"node {cfg.node_id}: no keys in the config and no credentials file {layout.credentials}")
    if cfg.gateway and cfg.gateway.key:
        write_private(layout.gateway_key, cfg.gateway.key.get_secret_value() + "\n")
    elif cfg.gateway and not layout.gateway_key.exists():
        raise NodeError(f"node {cfg.node_id}: gateway.key not given and no key file {layout.gateway_key}")
    kind = cfg.contract.rsplit(".v", 1)[0]
    src = get_settings().contracts_dir
    copied = [shutil.copy2(p, layout.contracts / p.name) for p in src.glob(f"{kind}.v*.yaml")]
    if not any(Path(p).stem == cfg.contract for p in copied):
        raise NodeError(f"node {cfg.node_id}: contract {cfg.contract} not in {src}")
    if cfg.prefect_port == 0:
        cfg = cfg.model_copy(update={"prefect_port": _free_port()})
    old = json.loads(layout.env_file.read_text()) if layout.env_file.exists() else {}
    api = f"http://127.0.0.1:{cfg.prefect_port}/api"
    env = {
        "PREFECT_HOME": str(layout.prefect_home),
        "PREFECT_API_URL": api,
        # bound to 127.0.0.1 and closed all the same: no other local user starts runs as the node
        "PREFECT_API_AUTH_STRING": old.get("PREFECT_API_AUTH_STRING") or f"node:{secrets.token_urlsafe(24)}",
        "EDGEHAUL_CONTRACTS_DIR": str(layout.contracts),
    }
    write_private(layout.env_file, json.dumps(env, indent=1))
    layout.config.write_text(cfg.model_dump_json(indent=1, exclude={"keys": True, "gateway": {"key"}}))
    with local_server(layout), node_settings(layout):
        for slug, block in blocks.items():
            block.save(slug.split("/", 1)[1], overwrite=True)
    return layout


def _server_env(layout: NodeLayout) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    node = layout.env()
    env.update(
        PREFECT_HOME=node["PREFECT_HOME"],
        PREFECT_API_DATABASE_CONNECTION_URL=f"sqlite+aiosqlite:///{layout.prefect_home / 'prefect.db'}",
        PREFECT_SERVER_API_AUTH_STRING=node["PREFECT_API_AUTH_STRING"],
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_UI_ENABLED="false",
        PREFECT_LOGGING_LEVEL="WARNING",
        # a node's schedules are minutes apart, not the hour the scheduler looks ahead by default
        PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS="5",
    )
    return env


def _healthy(api: str) -> bool:
    try:
        with urllib.request.urlopen(f"{api}/health", timeout=2) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError):
        return False


@contextlib.contextmanager
def local_server(layout: NodeLayout, timeout_s: float = 180) -> Iterator[str]:
    """The node's own Prefect server (SQLite in its state dir) for the duration of the block; yields its API."""
    api = layout.env()["PREFECT_API_URL"]
    if _healthy(api):
        raise NodeError(f"node {layout.root}: something already answers on {api}; another `node run`?")
    port = api.rsplit(":", 1)[1].split("/")[0]
    log = open(layout.logs / "prefect-server.log", "ab")  # noqa: SIM115  # closed in finally
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", port],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=_server_env(layout),
        start_new_session=True, cwd=layout.root, umask=0o077)
    try:
        deadline = time.monotonic() + timeout_s
        while not _healthy(api):
            if proc.poll() is not None:
                raise NodeError(f"node-local Prefect server exited ({proc.returncode}); see "
                                f"{layout.logs / 'prefect-server.log'}")
            if time.monotonic() > deadline:
                raise NodeError(f"node-local Prefect server not healthy at {api} after {timeout_s:.0f} s")
            time.sleep(0.3)
        yield api
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


@contextlib.contextmanager
def node_settings(layout: NodeLayout) -> Iterator[dict[str, str]]:
    """This process and the runs it starts talk to the node's own server, whatever PREFECT_API_URL was."""
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    env = layout.env()
    saved = dict(os.environ)
    os.environ.update(env)  # flow-run subprocesses inherit it
    try:
        with temporary_settings(updates={PREFECT_API_URL: env["PREFECT_API_URL"],
                                         PREFECT_API_AUTH_STRING: env["PREFECT_API_AUTH_STRING"]}):
            yield env
    finally:
        os.environ.clear()
        os.environ.update(saved)


def deployments(cfg: NodeConfig, layout: NodeLayout) -> list[Any]:
    """The node's edge deployments with their interval schedules (served by `run`)."""
    from prefect.types.entrypoint import EntrypointType

    from edgehaul.flows.edge_ingest import edge_ingest
    from edgehaul.flows.uplink_drain import uplink_drain

    ingest = {"edge_node": cfg.node_id, "tiering_policy": DEFAULT_POLICY, "contract": cfg.contract,
              "source": "drop", "source_path": str(layout.drop), "done_path": str(layout.done),
              "batch_size": cfg.batch_size}
    drain: dict[str, Any] = {"edge_node": cfg.node_id, "link_profile": DEFAULT_POLICY, "route_events_to_outbox": True,
                             "downlink": cfg.downlink, **cfg.drain}
    ingest["route_events_to_outbox"] = True
    if cfg.gateway:
        drain.update(gateway_url=cfg.gateway.url, gateway_key_file=str(layout.gateway_key),
                     gateway_sender=cfg.gateway.sender_id)
    return [
        edge_ingest.to_deployment(name=cfg.node_id, interval=cfg.schedules.ingest_every_s,
                                  parameters={"params": ingest}, tags=["edgehaul", "node-local"],
                                  entrypoint_type=EntrypointType.MODULE_PATH),  # any cwd, wheel or checkout
        uplink_drain.to_deployment(name=cfg.node_id, interval=cfg.schedules.drain_every_s,
                                   parameters={"params": drain}, tags=["edgehaul", "node-local"],
                                   entrypoint_type=EntrypointType.MODULE_PATH),
    ]


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def run(layout: NodeLayout) -> None:
    """Start the node's server and serve its deployments until SIGTERM / Ctrl-C."""
    from prefect import serve

    owner_only(layout.root, umask=True)
    cfg = layout.load()
    signal.signal(signal.SIGTERM, _interrupt)  # the server is stopped on the way out, not orphaned
    with local_server(layout) as api, node_settings(layout):
        print(f"node {cfg.node_id}: local Prefect API {api}; ingest every {cfg.schedules.ingest_every_s:g} s from "
              f"{layout.drop}, drain every {cfg.schedules.drain_every_s:g} s", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            # one run at a time: a node's runs share its spool and its CPU; a late run waits its turn
            serve(*deployments(cfg, layout), limit=1, query_seconds=cfg.schedules.poll_s)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="edgehaul node", description="Run an edge node on its own.")
    sub = ap.add_subparsers(dest="verb", required=True)
    i = sub.add_parser("init", help="write the node's state dir and save its blocks on its own server")
    i.add_argument("--config", type=Path, required=True, help="node YAML (README: 'One edge node')")
    r = sub.add_parser("run", help="start the node's Prefect server and serve its deployments")
    r.add_argument("--state-dir", type=Path, required=True)
    a = ap.parse_args(argv)
    try:
        if a.verb == "init":
            layout = init(load_config(a.config))
            print(f"node state in {layout.root}; start it with `edgehaul node run --state-dir {layout.root}`")
        else:
            run(NodeLayout(a.state_dir.expanduser().resolve()))
    except NodeError as e:
        print(f"edgehaul node {a.verb}: {e}", file=sys.stderr)
        return 1
    return 0
