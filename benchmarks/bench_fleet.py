"""Fleet: N simulated edge nodes against one real central stack, coalesced ingest against one run per bundle.

One central stack as in production: a Prefect server on PostgreSQL, the local SeaweedFS S3 server, the
webhook gateway, and `core_ingest` served with the `bundle_landed` trigger of deployments/prefect.yaml
(flow runs in their own processes, as a process worker starts them). One process plays the fleet: each
simulated node has its own S3 identity (its own prefix only), its own gateway sender key and its own
in-memory spool, and lands its bundles through the product's uplink (`Uplink` + `Drainer` over a shaped
`Link`), then announces each with a signed `bundle-uploaded` hook; the gateway coalesces them into
`edgehaul.landing.batch` events, one core_ingest run each.

Load: the capacity model's 20 bundles per node and hour (docs/CAPACITY.md) for a steady stretch, then a
burst: every node comes into contact at once with a backlog. Compression: the full run keeps the model's
rate (5.56 bundles/s at 1,000 nodes) and shortens the steady stretch to 60 s; the quick variant also
compresses the rate, 18x (10 nodes make the load of 180). Every node has its own identity: no mapping
of nodes onto shared identities. The baseline, measured in the same run on
the same stack: today's per-bundle trigger (each `edgehaul.bundle.landed` event -> one core_ingest run).

Measured: bundles landed vs committed over time (backlog), landed -> committed latency (landing ack to
the Delta commit's own timestamp), flow and task runs per minute and Prefect API errors (from
PostgreSQL and the server's and runner's logs), S3 requests per second (SeaweedFS's own metrics), CPU
of the central processes; at the end every landed bundle is checked in the dataset exactly once.

    python -m benchmarks fleet                      # 100 and 1,000 nodes + baseline (~12 min here)
    EDGEHAUL_BENCH_QUICK=1 python -m benchmarks fleet  # 10 nodes, compressed rate (CI; ~3 min here)
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

import httpx
import psutil
import pyarrow as pa
import yaml

from edgehaul.blocks import LinkProfile, ObjectStore
from edgehaul.bundles import BundleManifest, write_bundle
from edgehaul.contracts import load_contract
from edgehaul.core.datasets import DatasetError, open_table
from edgehaul.services import gateway
from edgehaul.uplink.link import Link
from edgehaul.uplink.transfer import Drainer, Receipt, Uplink
from edgehaul_dev import localstack, postgres
from edgehaul_dev.deploy import PREFECT_FILE
from tests.doubles import MemorySource

KIND = "landsat_patch"
INGEST_BLOCK = "fleet-ingest"
# The capacity model's load per node (docs/CAPACITY.md): 12 normal flushes + ~8 urgent an hour.
BUNDLES_PER_NODE_H = 20.0
WINDOW_S = 5.0  # the gateway's coalescing window (EDGEHAUL_GATEWAY_BATCH_WINDOW_S, its default)
LINK_BPS = 8e6  # the model's example link: 8 Mbit/s, 70% of it for data
Mode = Literal["coalesced", "per-bundle"]
Serving = Literal["process", "warm"]  # a fresh process per flow run (Prefect's runner), or runs in one warm process


@dataclass
class Phase:
    """One measured run: `nodes` at `rate_scale` x the model's rate for `steady_s`, then the burst."""

    mode: Mode
    nodes: int
    steady_s: float
    backlog_per_node: int  # bundles each node holds when the burst's contact opens
    rate_scale: float = 1.0  # >1 compresses time: the quick variant's 10 nodes make a fleet's rate
    drain_timeout_s: float = 240.0  # after the burst: how long the backlog may take to empty
    settle_s: float = 180.0  # then how long the runs still queued (with nothing left to do) may take to end
    rows: int = 10  # rows per bundle: the bench measures the control plane, not bytes
    serving: Serving = "process"


@dataclass
class Result:
    phase: Phase
    landed: dict[str, float] = field(default_factory=dict)  # bundle id -> wall time its landing was acked
    rows: dict[str, int] = field(default_factory=dict)  # bundle id -> rows in its manifest
    committed: dict[str, float] = field(default_factory=dict)  # bundle id -> its Delta commit's timestamp
    t0: float = 0.0
    burst_at: float = 0.0
    burst_landed_at: float = 0.0
    end: float = 0.0
    samples: list[dict[str, float]] = field(default_factory=list)  # sampler rows (time, cpu, s3 requests)
    flow_runs: list[tuple[float, str]] = field(default_factory=list)  # (start wall time, state type)
    run_seconds: list[float] = field(default_factory=list)  # each finished run: start -> end
    run_lag: list[float] = field(default_factory=list)  # each started run: created (by the trigger) -> started
    failed_runs: int = 0  # runs that failed or crashed before the phase ended (not those its shutdown stopped)
    covered_runs: int = 0  # completed without starting: an earlier run took their bundles (core_ingest catch_up)
    stopped_runs: int = 0  # cancelled by the phase's own shutdown, after every bundle was committed
    task_runs: list[float] = field(default_factory=list)
    validation_tasks: int = 0  # core-validate task runs (a chunk of up to validate_batch bundles each)
    api_errors: dict[str, int] = field(default_factory=dict)
    hook_errors: int = 0
    landing_failures: int = 0
    duplicates: int = 0  # sample ids in the table more than once
    wrong_rows: list[str] = field(default_factory=list)  # bundles whose committed rows differ from the manifest
    extra_bundles: int = 0  # bundles in the table that were never landed by this phase
    commits: int = 0  # dataset versions this phase made (= dataset.committed events = training triggers)

    # -- derived -------------------------------------------------------------------------------------
    def backlog(self, t: float) -> int:
        return sum(1 for x in self.landed.values() if x <= t) - sum(1 for x in self.committed.values() if x <= t)

    def latencies(self, start: float, end: float) -> list[float]:
        return sorted(self.committed[b] - t for b, t in self.landed.items() if start <= t < end and b in self.committed)

    def steady_backlog_max(self) -> int:
        grid = _grid(self.t0, self.burst_at)
        return max((self.backlog(t) for t in grid), default=0)

    def recovery_s(self) -> float | None:
        """Seconds from the burst's contact until the backlog is back at the steady stretch's maximum."""
        level = self.steady_backlog_max()
        peak_passed = False
        # up to the last commit: one that came after the wait for commits gave up still ends the recovery
        for t in _grid(self.burst_at, max([self.end, *self.committed.values()]), 0.5):
            b = self.backlog(t)
            if t >= self.burst_landed_at:
                peak_passed = True
            if peak_passed and b <= level:
                return t - self.burst_at
        return None

    def per_minute(self, times: list[float]) -> tuple[float, int]:
        """(mean per minute over the phase, busiest 60 s window)."""
        span = max(self.end - self.t0, 1e-9)
        ts = sorted(times)
        peak, j = 0, 0
        for i, t in enumerate(ts):
            while ts[j] < t - 60:
                j += 1
            peak = max(peak, i - j + 1)
        return len(ts) * 60 / span, peak

    def cpu_s(self, key: str, start: float, end: float) -> float:
        rows = [s for s in self.samples if start <= s["t"] <= end]
        return rows[-1][key] - rows[0][key] if len(rows) >= 2 else float("nan")

    def s3_rps(self, start: float, end: float) -> float:
        rows = [s for s in self.samples if start <= s["t"] <= end]
        if len(rows) < 2 or rows[0]["s3"] < 0:
            return float("nan")
        return (rows[-1]["s3"] - rows[0]["s3"]) / max(rows[-1]["t"] - rows[0]["t"], 1e-9)


def _grid(a: float, b: float, step: float = 1.0) -> list[float]:
    """a, a + step, ... and b itself: a last commit in the final step before `b` is not missed."""
    pts = [a + i * step for i in range(int(max(b - a, 0) / step) + 1)]
    return [*pts, b] if b > pts[-1] else pts


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


# ---- the central stack -----------------------------------------------------------------------------

@dataclass
class Central:
    state: localstack.StackState
    pg_url: str
    gateway_url: str
    sender_keys: dict[str, str]  # node -> its gateway sender key (sender id = node id)
    admin: ObjectStore


def node_ids(n: int) -> list[str]:
    return [f"n{i:05d}" for i in range(n)]


@contextlib.contextmanager
def central_stack(root: Path, nodes: list[str], *, window_s: float) -> Iterator[Central]:
    """PostgreSQL + Prefect + SeaweedFS (one S3 identity per node) + the gateway (one sender per node)."""
    with postgres.running(max_connections=200) as pg_url, localstack.environ({
        "EDGEHAUL_PREFECT_DB_URL": pg_url, "EDGEHAUL_GATEWAY_BATCH_WINDOW_S": str(window_s),
    }):
        state = localstack.new_state(root, nodes=tuple(nodes), fixed_ports=False)
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        state.save()
        try:
            state = localstack.up(root, fixed_ports=False)
            keys = {n: gateway.new_secret() for n in nodes}
            senders: dict[str, dict[str, Any]] = {n: {"keys": [k], "nodes": [n], "hooks": ["bundle-uploaded"]}
                                                  for n, k in keys.items()}
            # the stack's own sender (localstack.gateway_sender expects it), unused here
            senders[localstack.GATEWAY_SENDER] = {"keys": [gateway.new_secret()], "nodes": ["*"],
                                                  "hooks": sorted(gateway.HOOKS)}
            (root / "gateway").mkdir(mode=0o700, exist_ok=True)
            gateway.write_senders(root / "gateway" / "senders.json", senders)
            with localstack.environ(state.env()):
                url = localstack.start_gateway(state)
                yield Central(state, pg_url, url, keys, state.store("admin"))
        finally:
            localstack.down(root)


def s3_requests(state: localstack.StackState) -> float:
    """Requests SeaweedFS's S3 gateway has served (its Prometheus counter); -1 when it is not exposed."""
    port = state.weed_ports.get("s3_metrics")
    if not port:
        return -1.0
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    except httpx.HTTPError:
        return -1.0
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("SeaweedFS_s3_request_total"))


def _tree_cpu(pid: int | None) -> float:
    """CPU seconds of `pid` and its descendants, live and reaped."""
    if not pid:
        return 0.0
    try:
        p = psutil.Process(pid)
        procs = [p, *p.children(recursive=True)]
    except psutil.Error:
        return 0.0
    total = 0.0
    for q in procs:
        with contextlib.suppress(psutil.Error):
            c = q.cpu_times()
            total += c.user + c.system + c.children_user + c.children_system
    return total


def _pid(root: Path, name: str) -> int | None:
    p = root / "pids" / f"{name}.pid"
    return int(p.read_text()) if p.exists() else None


def _postmaster(pg_url: str) -> int | None:
    port = pg_url.rsplit(":", 1)[1].split("/")[0]
    for p in psutil.process_iter(["name", "cmdline"]):
        cmd = p.info.get("cmdline") or []
        if p.info.get("name") == "postgres" and f"-p {port}" in " ".join(cmd):
            return int(p.pid)
    return None


# ---- the core side: core_ingest served with a trigger ----------------------------------------------

def trigger_spec(mode: Mode) -> dict[str, Any]:
    """The trigger of `mode`: prefect.yaml's `bundle_landed` (coalesced), or one run per landed bundle."""
    spec = yaml.safe_load(PREFECT_FILE.read_text())["definitions"]["triggers"]["bundle_landed"]
    spec = copy.deepcopy(spec)
    spec["parameters"]["params"].update(store_block=INGEST_BLOCK, result_storage="")
    if mode == "per-bundle":  # today's trigger before coalescing: every bundle.landed event is a run
        spec.update(name="fleet baseline: bundle landed -> core_ingest", match={"prefect.resource.id": "edgehaul.bundle.*"},
                    expect=["edgehaul.bundle.landed"])
        spec["parameters"]["params"]["bundle_keys"]["value"]["template"] = "{{ [event.payload.key] | tojson }}"
    return dict(spec)


def serve(mode: Mode, limit: int, name: str, serving: Serving = "process") -> None:
    """Entry of the served core (its own process): core_ingest with `mode`'s trigger, at most `limit` runs at once,
    each in a fresh process (Prefect's runner) or in this one (`edgehaul.services.warm`)."""
    from prefect.events import DeploymentEventTrigger

    from edgehaul.flows.core_ingest import core_ingest

    spec = trigger_spec(mode)
    trig = DeploymentEventTrigger(name=spec["name"], enabled=True, match=spec["match"], expect=set(spec["expect"]),
                                  parameters=spec["parameters"])
    if serving == "process":
        core_ingest.serve(name=name, triggers=[trig], limit=limit, print_starting_message=False)
        return
    from prefect.deployments.runner import RunnerDeployment

    from edgehaul.services.warm import serve_warm

    dep_id = cast(RunnerDeployment, core_ingest.to_deployment(name=name, triggers=[trig])).apply()  # sync here
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())  # stop_core: finish the runs, flush their events
    serve_warm(core_ingest, str(dep_id), limit=limit, poll_s=0.5, stop=stop, grace_s=15)


def start_core(c: Central, mode: Mode, limit: int, name: str, log: Path,
               serving: Serving = "process") -> tuple[subprocess.Popen[bytes], str]:
    """Serve core_ingest as deployment `name` (one per phase: runs a phase left scheduled stay with it);
    return the process and the deployment id once its trigger exists."""
    from prefect.client.orchestration import get_client

    env = {**os.environ, **c.state.env(), "PREFECT_RUNNER_POLL_FREQUENCY": "1", "PREFECT_LOGGING_LEVEL": "INFO",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])}
    out = open(log, "ab")  # noqa: SIM115 (the child writes to it until stopped)
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.bench_fleet", "--serve", mode, str(limit), name, serving],
                            env=env, stdout=out, stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parents[1],
                            start_new_session=True)
    deadline = time.monotonic() + 180
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"core_ingest serve ({mode}) exited {proc.returncode}; see {log}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"core_ingest serve ({mode}): deployment or trigger not there after 180 s; see {log}")
        time.sleep(1)
        with get_client(sync_client=True) as client:
            try:
                dep = client.read_deployment_by_name(f"core_ingest/{name}")
            except Exception:
                continue
            if client.read_resource_related_automations(f"prefect.deployment.{dep.id}"):
                return proc, str(dep.id)


def stop_core(proc: subprocess.Popen[bytes], dep_id: str) -> None:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:  # its trigger must not start runs for the next phase
        for a in client.read_resource_related_automations(f"prefect.deployment.{dep_id}"):
            client.pause_automation(a.id)
    localstack.stop_group(proc.pid, grace_s=20)


# ---- the simulated fleet ---------------------------------------------------------------------------

class BundleFactory:
    """Valid bundles for any node, cheaply: rows through the real preprocessing once, then re-labelled
    per bundle (node id, sample ids, seq), so generating thousands does not load the cores under test."""

    def __init__(self, rows: int) -> None:
        from tests.builders import processed_rows

        self.rows = rows
        self.contract = load_contract(KIND)
        self.base = processed_rows(rows, "n00000", seed=7)
        self.seq: dict[str, int] = {}
        self.lock = threading.Lock()

    def make(self, node: str) -> tuple[bytes, BundleManifest]:
        with self.lock:
            start = self.seq.get(node, 0)
            self.seq[node] = start + self.rows
        seq = list(range(start, start + self.rows))
        t = self.base
        t = t.set_column(t.schema.get_field_index("node_id"), "node_id", pa.array([node] * self.rows, pa.string()))
        t = t.set_column(t.schema.get_field_index("sample_id"), "sample_id",
                         pa.array([f"{node}-{s:012d}" for s in seq], pa.string()))
        t = t.set_column(t.schema.get_field_index("seq"), "seq", pa.array(seq, t.schema.field("seq").type))
        return write_bundle(t.cast(self.contract.bundle_schema), self.contract, tier="normal")


class Fleet:
    """`nodes` edge nodes in one process: own S3 identity and prefix, own spool, own gateway key."""

    def __init__(self, c: Central, nodes: list[str], mode: Mode, result: Result, factory: BundleFactory,
                 state_dir: Path) -> None:
        self.c, self.mode, self.result, self.factory = c, mode, result, factory
        self.sources = {n: MemorySource() for n in nodes}
        self.locks = {n: threading.Lock() for n in nodes}
        self.state_dir = state_dir
        self.uplinks: dict[str, Uplink] = {}
        self.http = httpx.Client(timeout=30)
        self.pool = ThreadPoolExecutor(max_workers=24, thread_name_prefix="fleet")
        self.futures: list[Future[None]] = []
        self.mu = threading.Lock()
        profile = LinkProfile(bandwidth_bps=LINK_BPS, chunk_bytes=64 * 1024)
        for n in nodes:  # set up before the clock: a node's client and link exist before its contact
            store = c.state.store(n)  # the node's own identity: it may write <node>/* only
            self.uplinks[n] = Uplink(store, Link(profile, emit_events=False), state_dir / n / "uplink")

    def add(self, node: str) -> None:
        data, m = self.factory.make(node)
        with self.mu:
            self.result.rows[m.bundle_id] = m.row_count
        self.sources[node].put(data, m)

    def contact(self, node: str) -> None:
        # in the caller's context: Prefect's settings (API URL, auth) are a context variable, and the
        # Drainer's events (the baseline's trigger) must reach this stack, not an ephemeral server
        self.futures.append(self.pool.submit(contextvars.copy_context().run, self._drain, node))

    def _drain(self, node: str) -> None:
        if not self.locks[node].acquire(blocking=False):
            return  # a drain of this node is running: it re-reads the spool and takes the new bundle
        try:
            rep = Drainer(self.uplinks[node], self.sources[node], emit_events=self.mode == "per-bundle",
                          on_landed=self._landed, backoff_s=(0.5, 1.0, 2.0)).run(max_seconds=300)
            if rep.failed:
                with self.mu:
                    self.result.landing_failures += len(rep.failed)
        finally:
            self.locks[node].release()

    def _landed(self, r: Receipt, e: Any) -> None:
        with self.mu:
            self.result.landed[r.bundle_id] = time.time()
        if self.mode != "coalesced":
            return  # the Drainer emitted edgehaul.bundle.landed itself: that event is the baseline's trigger
        m: BundleManifest = e.manifest
        body = json.dumps({"node_id": m.node_id, "bundle_id": m.bundle_id, "object_key": m.object_key,
                           "manifest_key": m.manifest_key, "sha256": m.sha256, "row_count": m.row_count,
                           "contract": m.contract, "tier": m.tier, "nbytes": m.nbytes}).encode()
        for attempt in range(5):
            try:
                resp = self.http.post(f"{self.c.gateway_url}/hooks/{m.node_id}/bundle-uploaded", content=body,
                                      headers=gateway.signed_headers(self.c.sender_keys[m.node_id], body))
                if resp.status_code == 202:
                    return
            except httpx.HTTPError:
                pass
            with self.mu:
                self.result.hook_errors += 1
            time.sleep(0.5 * (attempt + 1))

    def settle(self) -> None:
        """Wait for every drain submitted so far; contact nodes still holding bundles (a drain that ended
        just before its bundle arrived) until every spool is empty."""
        while True:
            while self.futures:
                self.futures.pop().result()
            left = [n for n, s in self.sources.items() if len(s)]
            if not left:
                return
            for n in left:
                self.contact(n)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.http.close()


# ---- one phase ---------------------------------------------------------------------------------------

class Sampler(threading.Thread):
    def __init__(self, c: Central, core: subprocess.Popen[bytes], result: Result, every_s: float = 2.0) -> None:
        super().__init__(daemon=True, name="fleet-sampler")
        self.c, self.core, self.result, self.every_s = c, core, result, every_s
        self.stopped = threading.Event()
        root = Path(c.state.root)
        self.pids = {"prefect": _pid(root, "prefect"), "gateway": _pid(root, "gateway"),
                     "postgres": _postmaster(c.pg_url), "s3_server": _pid(root, "seaweedfs")}

    def sample(self) -> None:
        row = {"t": time.time(), "s3": s3_requests(self.c.state), "runner": _tree_cpu(self.core.pid),
               "fleet": _tree_cpu(os.getpid())}
        row.update({k: _tree_cpu(p) for k, p in self.pids.items()})
        row["core"] = row["prefect"] + row["gateway"] + row["postgres"] + row["runner"]
        self.result.samples.append(row)

    def run(self) -> None:
        while not self.stopped.wait(self.every_s):
            self.sample()


def _committed(admin: ObjectStore, wanted: set[str]) -> dict[str, float]:
    """Bundle id -> wall time of the Delta commit that added it (the commit's own timestamp)."""
    try:
        dt = open_table(admin, KIND)
    except Exception:
        return {}
    out: dict[str, float] = {}
    for h in dt.history():
        for b in json.loads(h.get("edgehaul.bundles") or "[]"):
            if b["bundle_id"] in wanted:
                out.setdefault(b["bundle_id"], int(h["timestamp"]) / 1000)
    return out


def _open_runs(pg_url: str, dep_id: str) -> int:
    """The deployment's runs not in a final state (scheduled, pending, running)."""
    import psycopg2

    with psycopg2.connect(postgres.dsn(pg_url)) as conn, conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM flow_run WHERE deployment_id = %s AND state_type IN "
                    "('SCHEDULED', 'PENDING', 'RUNNING', 'PAUSED', 'CANCELLING')", (dep_id,))
        return int(cur.fetchone()[0])  # type: ignore[index]


def _db_runs(pg_url: str, dep_id: str, res: Result) -> tuple[list[tuple[float, str]], list[float]]:
    import psycopg2

    with psycopg2.connect(postgres.dsn(pg_url)) as conn, conn.cursor() as cur:
        cur.execute("SELECT extract(epoch from end_time - start_time), extract(epoch from start_time - created), "
                    "extract(epoch from end_time), state_type FROM flow_run WHERE deployment_id = %s "
                    "AND start_time IS NOT NULL", (dep_id,))
        for dur, lag, ended, state in cur.fetchall():
            res.run_lag.append(float(lag))
            if dur is not None:
                res.run_seconds.append(float(dur))
            if state in ("FAILED", "CRASHED") and ended is not None and float(ended) < res.end:
                res.failed_runs += 1
        # A run's process outlives its final state (it flushes logs and events): stopping the runner then
        # marks it Cancelled. That is the bench's shutdown, not a failure of the run.
        cur.execute("SELECT count(*) FROM flow_run WHERE deployment_id = %s AND state_type = 'CANCELLED' "
                    "AND extract(epoch from state_timestamp) >= %s", (dep_id, res.end))
        res.stopped_runs = int(cur.fetchone()[0])  # type: ignore[index]
        cur.execute("SELECT count(*) FROM flow_run WHERE deployment_id = %s AND start_time IS NULL "
                    "AND state_type = 'COMPLETED'", (dep_id,))
        res.covered_runs = int(cur.fetchone()[0])  # type: ignore[index]
        cur.execute("SELECT extract(epoch from coalesce(start_time, expected_start_time)), state_type "
                    "FROM flow_run WHERE deployment_id = %s", (dep_id,))
        flows = [(float(t), str(s)) for t, s in cur.fetchall() if t is not None]
        cur.execute("SELECT extract(epoch from tr.start_time) FROM task_run tr JOIN flow_run fr ON tr.flow_run_id = fr.id "
                    "WHERE fr.deployment_id = %s AND tr.start_time IS NOT NULL", (dep_id,))
        tasks = [float(t) for (t,) in cur.fetchall()]
        cur.execute("SELECT count(*) FROM task_run tr JOIN flow_run fr ON tr.flow_run_id = fr.id "
                    "WHERE fr.deployment_id = %s AND tr.task_key LIKE 'validate_bundles_task%%'", (dep_id,))
        res.validation_tasks = int(cur.fetchone()[0])  # type: ignore[index]
    return flows, tasks


_SERVER_ERR = re.compile(r"\bERROR\b|Traceback|database is locked|deadlock detected|500 Internal Server Error")
_CLIENT_ERR = re.compile(r"HTTPStatusError|ReadTimeout|ConnectTimeout|ConnectError|PoolTimeout|RemoteProtocolError|"
                         r"5\d\d (Internal|Service|Bad Gateway)|database is locked")


def _count(path: Path, pattern: re.Pattern[str], offset: int = 0) -> int:
    if not path.exists():
        return 0
    with open(path, "rb") as f:
        f.seek(offset)
        return sum(1 for line in f.read().decode(errors="replace").splitlines() if pattern.search(line))


def run_phase(c: Central, phase: Phase, factory: BundleFactory, work: Path, *, limit: int = 4,
              say: Any = print) -> Result:
    """Run `phase` on the central stack `c`; the served core is stopped (and its trigger paused) at the end."""
    res = Result(phase)
    nodes = node_ids(phase.nodes)
    server_log = Path(c.state.root) / "logs" / "prefect.log"
    server_off = server_log.stat().st_size if server_log.exists() else 0
    runner_log = work / f"serve-{phase.mode}-{phase.nodes}-{phase.serving}.log"
    core, dep_id = start_core(c, phase.mode, limit, f"fleet-{phase.mode}-{phase.nodes}-{phase.serving}", runner_log,
                              phase.serving)
    fleet = Fleet(c, nodes, phase.mode, res, factory, work / f"edge-{phase.mode}-{phase.nodes}")
    sampler = Sampler(c, core, res)
    rng = random.Random(phase.nodes)
    try:
        sampler.sample()
        rate = phase.nodes * BUNDLES_PER_NODE_H / 3600 * phase.rate_scale
        n_steady = max(1, round(rate * phase.steady_s))
        say(f"[{phase.mode} {phase.nodes} nodes, {phase.serving}] steady: {rate:.2f} bundles/s for {phase.steady_s:.0f} s "
            f"({n_steady} bundles), then a burst of {phase.nodes} x {phase.backlog_per_node}")
        res.t0 = time.time()
        sampler.start()
        for i in range(n_steady):  # arrivals at the fleet's rate, each one node's flush + contact
            wait = res.t0 + i / rate - time.time()
            if wait > 0:
                time.sleep(wait)
            node = rng.choice(nodes)
            fleet.add(node)
            fleet.contact(node)
        left = res.t0 + phase.steady_s - time.time()
        if left > 0:
            time.sleep(left)
        for node in nodes:  # the backlog accumulates out of contact ...
            for _ in range(phase.backlog_per_node):
                fleet.add(node)
        res.burst_at = time.time()
        for node in nodes:  # ... then every node's contact opens at once
            fleet.contact(node)
        fleet.settle()
        res.burst_landed_at = time.time()
        say(f"[{phase.mode} {phase.nodes} nodes] {len(res.landed)} landed "
            f"(burst landed in {res.burst_landed_at - res.burst_at:.1f} s); waiting for commits")
        wanted = set(res.landed)
        deadline = res.burst_landed_at + phase.drain_timeout_s
        while time.time() < deadline:
            res.committed = _committed(c.admin, wanted)
            if len(res.committed) >= len(wanted):
                break
            time.sleep(2)
        res.end = time.time()
        sampler.stopped.set()
        sampler.join()
        sampler.sample()
        # Runs still queued or running when the last bundle is committed (a trigger's batch that a
        # catching-up run took after the run itself had started) end with nothing to do: let them, so the
        # runs' states are final ones and not what stopping the runner makes of them (`stopped_runs`).
        settle = time.time() + phase.settle_s
        while (still := _open_runs(c.pg_url, dep_id)) and time.time() < settle:
            time.sleep(2)
        if still:
            say(f"[{phase.mode} {phase.nodes} nodes] {still} core_ingest runs not ended {phase.settle_s:.0f} s "
                "after the last commit")
    finally:
        fleet.close()
        stop_core(core, dep_id)
    res.committed = _committed(c.admin, set(res.landed))
    res.flow_runs, res.task_runs = _db_runs(c.pg_url, dep_id, res)
    _check_dataset(c.admin, res)
    res.api_errors = {
        "server log": _count(server_log, _SERVER_ERR, server_off),
        "runner/flow-run clients": _count(runner_log, _CLIENT_ERR),
        "failed/crashed runs": res.failed_runs,
    }
    return res


def _check_dataset(admin: ObjectStore, res: Result) -> None:
    """Every landed bundle in the dataset exactly once, with its manifest's rows; no sample id twice."""
    try:
        table = open_table(admin, KIND).to_pyarrow_table(columns=["bundle_id", "sample_id"])
    except DatasetError:  # nothing committed at all
        table = pa.table({"bundle_id": pa.array([], pa.string()), "sample_id": pa.array([], pa.string())})
    mine = set(res.rows)
    counts: dict[str, int] = {}
    ids: set[str] = set()
    for b, s in zip(table.column("bundle_id").to_pylist(), table.column("sample_id").to_pylist(), strict=True):
        if b not in mine:
            continue
        counts[b] = counts.get(b, 0) + 1
        if s in ids:
            res.duplicates += 1
        ids.add(s)
    # committed with other rows than its manifest's (a bundle not committed yet is backlog, not wrong)
    res.wrong_rows = sorted(b for b in counts if b in res.landed and counts[b] != res.rows[b])
    res.extra_bundles = len(set(counts) - set(res.landed))
    res.commits = len({t for b, t in res.committed.items()})


# ---- report ------------------------------------------------------------------------------------------

def summary(res: Result) -> dict[str, Any]:
    p = res.phase
    steady_lat = res.latencies(res.t0, res.burst_at)
    burst_lat = res.latencies(res.burst_at, res.end)
    flows_mean, flows_peak = res.per_minute([t for t, _ in res.flow_runs])
    tasks_mean, tasks_peak = res.per_minute(res.task_runs)
    return {
        "mode": p.mode, "nodes": p.nodes, "serving": p.serving, "landed": len(res.landed), "committed": len(res.committed),
        "steady_backlog_max": res.steady_backlog_max(), "final_backlog": len(res.landed) - len(res.committed),
        "steady_p50_s": _pct(steady_lat, 0.5), "steady_p99_s": _pct(steady_lat, 0.99),
        "burst_p50_s": _pct(burst_lat, 0.5), "burst_p99_s": _pct(burst_lat, 0.99),
        "burst_landing_s": res.burst_landed_at - res.burst_at, "recovery_s": res.recovery_s(),
        "flow_runs": len(res.flow_runs), "flow_runs_per_min": flows_mean, "flow_runs_peak_min": flows_peak,
        "run_s_p50": _pct(sorted(res.run_seconds), 0.5), "run_lag_p50": _pct(sorted(res.run_lag), 0.5),
        "runs_unstarted": sum(1 for _, st in res.flow_runs if st in ("SCHEDULED", "PENDING")),
        "runs_covered": res.covered_runs, "runs_started": len(res.run_lag), "validation_tasks": res.validation_tasks,
        "task_runs": len(res.task_runs), "task_runs_per_min": tasks_mean, "task_runs_peak_min": tasks_peak,
        "api_errors": sum(res.api_errors.values()), "api_error_sources": res.api_errors,
        "hook_errors": res.hook_errors, "landing_failures": res.landing_failures,
        "s3_rps_steady": res.s3_rps(res.t0, res.burst_at), "s3_rps_burst": res.s3_rps(res.burst_at, res.end),
        "core_cpu_steady": res.cpu_s("core", res.t0, res.burst_at) / max(res.burst_at - res.t0, 1e-9),
        "core_cpu_burst": res.cpu_s("core", res.burst_at, res.end) / max(res.end - res.burst_at, 1e-9),
        "s3_server_cpu_steady": res.cpu_s("s3_server", res.t0, res.burst_at) / max(res.burst_at - res.t0, 1e-9),
        "fleet_cpu_steady": res.cpu_s("fleet", res.t0, res.burst_at) / max(res.burst_at - res.t0, 1e-9),
        "commits": res.commits, "duplicates": res.duplicates, "wrong_rows": len(res.wrong_rows),
        "extra_bundles": res.extra_bundles,
    }


def backlog_series(res: Result, step: float = 10.0) -> str:
    return " ".join(f"{t - res.t0:.0f}s:{res.backlog(t)}" for t in _grid(res.t0, res.end, step))


_ROWS = [
    ("bundles landed / committed", lambda s: f"{s['landed']} / {s['committed']}"),
    ("backlog: steady max / at the end", lambda s: f"{s['steady_backlog_max']} / {s['final_backlog']}"),
    ("landed -> committed p50 / p99, steady", lambda s: f"{s['steady_p50_s']:.1f} / {s['steady_p99_s']:.1f} s"),
    ("landed -> committed p50 / p99, burst", lambda s: f"{s['burst_p50_s']:.1f} / {s['burst_p99_s']:.1f} s"),
    ("burst: landing took / backlog back to steady", lambda s: f"{s['burst_landing_s']:.0f} / "
     + (f"{s['recovery_s']:.0f} s" if s["recovery_s"] is not None else "not within the run")),
    ("core_ingest flow runs (per min mean / peak)", lambda s: f"{s['flow_runs']} ({s['flow_runs_per_min']:.1f} / "
     f"{s['flow_runs_peak_min']})"),
    ("  of which covered (completed, never started)", lambda s: f"{s.get('runs_covered', 0)}"),
    ("run length p50 / trigger -> start p50 / unstarted", lambda s: f"{s['run_s_p50']:.0f} s / {s['run_lag_p50']:.0f} s"
     f" / {s['runs_unstarted']}"),
    ("task runs (per min mean / peak)", lambda s: f"{s['task_runs']} ({s['task_runs_per_min']:.0f} / "
     f"{s['task_runs_peak_min']})"),
    ("  of which validation chunks", lambda s: f"{s.get('validation_tasks', 0)}"),
    ("Prefect API errors", lambda s: f"{s['api_errors']} {s['api_error_sources']}"),
    ("gateway hook retries / landing failures", lambda s: f"{s['hook_errors']} / {s['landing_failures']}"),
    ("S3 requests/s steady / burst", lambda s: f"{s['s3_rps_steady']:.1f} / {s['s3_rps_burst']:.1f}"),
    ("core CPU (cores) steady / burst", lambda s: f"{s['core_cpu_steady']:.2f} / {s['core_cpu_burst']:.2f}"),
    ("S3 server / fleet CPU (cores), steady", lambda s: f"{s['s3_server_cpu_steady']:.2f} / {s['fleet_cpu_steady']:.2f}"),
    ("dataset versions (training triggers)", lambda s: f"{s['commits']}"),
    ("exactly once: duplicate ids / wrong rows / extra", lambda s: f"{s['duplicates']} / {s['wrong_rows']} / "
     f"{s['extra_bundles']}"),
]


def print_side_by_side(sums: list[dict[str, Any]]) -> None:
    heads = [f"{s['mode']} {s['nodes']} {s['serving']}" for s in sums]
    print(f"{'':50s}" + "".join(f"{h:>26s}" for h in heads))
    for label, fn in _ROWS:
        print(f"{label:50s}" + "".join(f"{fn(s):>26s}" for s in sums))


def fleet(phases: list[Phase], *, window_s: float = WINDOW_S, limit: int = 4, work: Path | None = None) -> list[Result]:
    """Run `phases` in turn on one central stack (the largest fleet's identities); `work` (kept) holds the
    stack's and the runner's logs, else a temporary folder."""
    n = max(p.nodes for p in phases)
    with tempfile.TemporaryDirectory(prefix="eh-fleet-") as tmp:
        work = work or Path(tmp)
        t = time.perf_counter()
        with central_stack(work / "stack", node_ids(n), window_s=window_s) as c:
            print(f"central stack up with {n} node identities and gateway senders in {time.perf_counter() - t:.0f} s "
                  f"(Prefect on PostgreSQL, gateway window {window_s:.0f} s, runner limit {limit})", flush=True)
            with localstack.environ(c.state.env()):
                from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

                with temporary_settings(updates={PREFECT_API_URL: c.state.prefect_api_url,
                                                 PREFECT_API_AUTH_STRING: c.state.api_auth_string}):
                    c.state.store("ingest").save(INGEST_BLOCK, overwrite=True)
                    factory = BundleFactory(phases[0].rows)
                    results = []
                    for p in phases:
                        r = run_phase(c, p, factory, work, limit=limit, say=lambda m: print(m, flush=True))
                        print(f"  backlog over time: {backlog_series(r)}", flush=True)
                        results.append(r)
    return results


# The bound docs/MEASURED.md states: after the burst, the backlog is back at its
# steady level within this many seconds of the burst's contact, at 1,000 nodes x 1 bundle.
BURST_RECOVERY_BOUND_S = 180.0


def main() -> None:
    quick = os.environ.get("EDGEHAUL_BENCH_QUICK") == "1" or "--quick" in sys.argv
    if quick:  # 10 nodes at 18x the model's rate (1 bundle/s, the load of a 180-node fleet), 20 s steady
        phases = [Phase("coalesced", 10, 20, 2, rate_scale=18, drain_timeout_s=120, serving="warm"),
                  Phase("per-bundle", 10, 20, 2, rate_scale=18, drain_timeout_s=60)]
    else:  # the model's hourly rate, for a steady stretch of 1-2 minutes instead of hours
        # coalesced core_ingest served warm (docs/CAPACITY.md: 2-10x lower p99 than a process per run)
        phases = [Phase("coalesced", 100, 60, 2, drain_timeout_s=120, serving="warm"),
                  Phase("coalesced", 1000, 60, 1, drain_timeout_s=150, serving="warm"),
                  # no burst for the baseline: its steady stretch alone outruns it (and the shared cores)
                  Phase("per-bundle", 1000, 60, 0, drain_timeout_s=60)]
    results = fleet(phases)
    sums = [summary(r) for r in results]
    print_side_by_side(sums)
    for s in sums:
        if s["mode"] == "coalesced":
            rec = s["recovery_s"]
            ok = (s["final_backlog"] == 0 and s["api_errors"] == 0 and s["steady_p99_s"] <= 2 * WINDOW_S
                  and s["duplicates"] == 0 and s["wrong_rows"] == 0 and rec is not None
                  and rec <= BURST_RECOVERY_BOUND_S)
            print(f"[{s['mode']} {s['nodes']}] drained {'yes' if s['final_backlog'] == 0 else 'NO'}; p99 "
                  f"{s['steady_p99_s']:.1f} s vs 2 x window = {2 * WINDOW_S:.0f} s; burst recovery "
                  f"{rec if rec is None else round(rec)} s vs bound {BURST_RECOVERY_BOUND_S:.0f} s; "
                  f"{'ok' if ok else 'NOT MET'}")


if __name__ == "__main__":
    if len(sys.argv) >= 5 and sys.argv[1] == "--serve":
        serve(sys.argv[2], int(sys.argv[3]), sys.argv[4], *sys.argv[5:6])  # type: ignore[arg-type]
    else:
        main()
