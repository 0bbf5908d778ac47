"""An edge node runs a whole (compressed) day on its own: own Prefect server, no central API, link down.

Compressed clock: one hour is `HOUR` seconds of wall time, and every duration of the node's config
(schedules, bundle TTL) is scaled by the same factor; the spool, the ledger and Prefect's schedules run
on the real clock. The node is started with the two README commands (`edgehaul node init`, `edgehaul
node run`) in subprocesses whose PREFECT_API_URL points nowhere; its S3 endpoint is a relay that does
not listen (link down) until the test reconnects it to the session's SeaweedFS.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import yaml

from edgehaul import downlink, events
from edgehaul.blocks import EdgeNode
from edgehaul.bundles import BundleManifest
from edgehaul.edge import ledger
from edgehaul.edge.landsat import generate
from edgehaul.edge.outbox import node_outbox
from edgehaul.edge.spool import STAGE_RAW, Spool
from edgehaul.node import NodeError, NodeLayout, load_config, node_settings
from edgehaul.tasks.uplink import probe_contact
from edgehaul_dev import localstack
from tests.conftest import store_for
from tests.edge.test_spool import mk
from tests.prefect_cleanup import delete_deployments_named
from tests.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]
HOUR = 8.0  # wall seconds per simulated hour
CAP = 9_000_000  # the node's spool cap in the day test
DAY_H = 24
NODE = "node-a"  # a stack identity: its keys may write landing/node-a/ only
SAMPLES_PER_HOUR = 1000
INGEST_H, DRAIN_H = 3, 6  # schedules, in simulated hours: a run takes 5-25 s of wall time on a busy 2-core host


class Relay:
    """The node's link to S3: a TCP relay that listens on `port` only while the link is up."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.port = localstack.free_port()
        self._srv: socket.socket | None = None

    def up(self) -> None:
        srv = socket.create_server(("127.0.0.1", self.port))
        self._srv = srv
        threading.Thread(target=self._accept, args=(srv,), daemon=True).start()

    def down(self) -> None:
        if self._srv is not None:
            self._srv.close()
            self._srv = None

    def _accept(self, srv: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = srv.accept()
                upstream = socket.create_connection(self.target)
                for a, b in ((conn, upstream), (upstream, conn)):
                    threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    # the central API is out of reach for the node: anything that tried it would fail
    env.update(PYTHONPATH=str(ROOT), PREFECT_API_URL=f"http://127.0.0.1:{localstack.free_port()}/api",
               PREFECT_LOGGING_LEVEL="INFO")
    return env


def _drop(folder: Path, hour: int) -> list[str]:
    """One hour of raw observations, written beside and renamed in (a reader never sees half a file)."""
    table = next(iter(generate(SAMPLES_PER_HOUR, NODE, seed=hour, start_seq=hour * SAMPLES_PER_HOUR,
                               batch_size=SAMPLES_PER_HOUR)))
    tmp = folder / f".h{hour:03d}.tmp"
    pq.write_table(table, tmp)
    tmp.replace(folder / f"h{hour:03d}.parquet")
    return table.column("sample_id").to_pylist()


def _stop_group(proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """SIGTERM to the process group (a node or a served flow and its children), SIGKILL if it outlives `timeout_s`."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextlib.contextmanager
def _node_running(layout: NodeLayout, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "edgehaul.cli", "node", "run", "--state-dir", str(layout.root)],
                                env=_env(), cwd=layout.root, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        yield proc
    finally:
        _stop_group(proc, 60)


async def _run_states(layout: NodeLayout) -> dict[str, list[str]]:
    """Flow name -> state names of the finished runs on the node's own server."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType
    from prefect.client.schemas.objects import StateType

    out: dict[str, list[str]] = {}
    async with get_client() as client:
        flows = {f.id: f.name for f in await client.read_flows()}
        done = FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(
            any_=[StateType.COMPLETED, StateType.FAILED, StateType.CRASHED])))
        for r in await client.read_flow_runs(flow_run_filter=done, limit=200):
            out.setdefault(flows[r.flow_id], []).append(r.state_name or "")
    return out


def _node_runs(layout: NodeLayout) -> dict[str, list[str]]:
    import asyncio

    with node_settings(layout):
        return asyncio.run(_run_states(layout))


def _out_of_contact(log: Path) -> int:
    return log.read_text().count(f"node {NODE}: store out of reach, nothing sent")


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_node_runs_a_day_on_its_own_and_drains_after_reconnection(
        stack: localstack.StackState, tmp_path: Path) -> None:
    host, port = stack.s3_endpoint.removeprefix("http://").split(":")
    relay = Relay((host, int(port)))  # down: nothing listens on the node's S3 endpoint
    gw_host, gw_port = localstack.start_gateway(stack).removeprefix("http://").rstrip("/").split(":")
    gw_relay = Relay((gw_host, int(gw_port)))  # the central gateway, out of reach with the rest of the centre
    sender, gw_key = localstack.gateway_sender(stack)
    keys = stack.identities[NODE]
    state = tmp_path / "node"
    cfg = {
        "node_id": NODE, "state_dir": str(state),
        "store": {"endpoint_url": f"http://127.0.0.1:{relay.port}"},
        "keys": {"access_key_id": keys.access_key_id, "secret_access_key": keys.secret_access_key},
        # ~1.1 MB of bundles (+ raw store) per simulated hour, kept up to 10 h: bundles alone outgrow the cap, so
        # the 85% alert fires whatever the phase of the schedules and however late a loaded host runs them
        "edge": {"spool_cap_bytes": CAP, "bundle_ttl_seconds": int(10 * HOUR)},
        # the Landsat labels steer the tiers (as before unlabelled scoring was the default): the bundle volume the
        # cap is sized for; this test is about autonomy, not value
        "tiering": {"use_labels": True},
        "link": {"bandwidth_bps": 100e6},
        "batch_size": SAMPLES_PER_HOUR,
        "schedules": {"ingest_every_s": INGEST_H * HOUR, "drain_every_s": DRAIN_H * HOUR, "poll_s": 1},
        "drain": {"max_seconds": 120},
        "gateway": {"url": f"http://127.0.0.1:{gw_relay.port}", "key": gw_key, "sender_id": sender},
        "prefect_port": 0,
    }
    (tmp_path / "node.yaml").write_text(yaml.safe_dump(cfg))
    log = tmp_path / "node.log"
    init = subprocess.run([sys.executable, "-m", "edgehaul.cli", "node", "init", "--config", str(tmp_path / "node.yaml")],
                          env=_env(), cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert init.returncode == 0, init.stderr[-3000:]
    layout = NodeLayout(state)
    assert oct(layout.credentials.stat().st_mode & 0o777) == "0o600"
    assert keys.secret_access_key not in layout.config.read_text()  # keys only in the node's 0600 file
    assert gw_key not in layout.config.read_text() and oct(layout.gateway_key.stat().st_mode & 0o777) == "0o600"
    # the core publishes a policy for the node while it is out of contact: it arrives with the contact
    version = f"day-{uuid.uuid4().hex[:8]}"
    update = downlink.publish_update(store_for(stack, "ingest"), NODE, [
        ("tiering", "policy", version, json.dumps({"version": version}).encode())])
    since = datetime.now(UTC)

    sample_ids: list[str] = []
    with _node_running(layout, log) as proc:
        t0 = time.monotonic()
        for hour in range(DAY_H):  # data keeps arriving, an hour's worth per simulated hour
            sample_ids += _drop(layout.drop, hour)
            time.sleep(max(0.0, t0 + (hour + 1) * HOUR - time.monotonic()))
            assert proc.poll() is None, log.read_text()[-3000:]
        # a busy host runs late (runs wait their turn, an ingest run reads every file that waited): let it catch up
        wait_for(lambda: not any(layout.drop.glob("*.parquet")), 20 * HOUR, "the last drop to be ingested")
        wait_for(lambda: _out_of_contact(log) >= 2, 20 * HOUR, "two drain attempts out of contact")
        day = _node_runs(layout)

        box = node_outbox(layout.spool, NODE)
        try:  # what the node raised out of contact, before the contact forwards (and removes) it
            history = box.peek(10_000)
        finally:
            box.close()
        relay.up()  # contact: the next scheduled drain sends what waited
        gw_relay.up()
        try:
            spool = Spool.from_block(EdgeNode(node_id=NODE, spool_dir=str(layout.spool), spool_cap_bytes=CAP))
            try:
                waiting = {e.bundle_id for e in spool.pending()}
                wait_for(lambda: not spool.pending(), 12 * HOUR + 120, "the spool to drain after reconnection")
                wait_for(lambda: _outbox_empty(layout), 12 * HOUR + 120, "the outbox to be forwarded")
                # a drain puts its link stats in the outbox as it ends, after forwarding what was there: the
                # next scheduled drain forwards them, while the contact is still up
                wait_for(lambda: events.LINK_STATS in {e["event"] for e in _central_node_events(stack, since)},
                         12 * HOUR + 120, "the node's link stats at the central server")
                counts = spool.ledger.counts()
                # the ledger is bounded like the spool: past its bound its oldest rows go, counted but no longer named
                spool_evicted = sum(n for (stage, _), n in spool.ledger.evicted().items() if stage == ledger.STAGE_SPOOL)
                acked = {b for b in waiting if spool.is_acked(b)}
                assert not spool.pending()
                with contextlib.closing(sqlite3.connect(layout.spool / "ledger.sqlite")) as db:
                    dropped = {b for (b,) in db.execute("SELECT DISTINCT bundle_id FROM ledger")}
                    spool_dropped = {i for (i,) in db.execute("SELECT sample_id FROM ledger WHERE stage = ?",
                                                              (ledger.STAGE_SPOOL,))}
            finally:
                spool.close()
        finally:
            relay.down()
            gw_relay.down()

    text = log.read_text()
    ingested = [int(m) for m in re.findall(rf"node {NODE}: (\d+) samples in \d+ batches", text)]
    out_of_contact = _out_of_contact(log)
    print(f"day: runs { {k: len(v) for k, v in day.items()} }, {out_of_contact} drains out of contact; ledger {counts}; "
          f"{len(waiting)} bundles waiting at reconnection, {len(acked)} acked")
    # schedules fired on the node's own server, with no central API
    # (how many depends on the host: on an idle one every schedule fires on time, 8 ingests and 4 drains)
    assert day.get("edge_ingest", []).count("Completed") >= 2, day
    assert day.get("uplink_drain", []).count("Completed") >= 2, day
    assert set(day.get("edge_ingest", [])) == set(day.get("uplink_drain", [])) == {"Completed"}, day
    assert sum(ingested) == len(sample_ids) == DAY_H * SAMPLES_PER_HOUR  # every dropped file read once
    # the spool reached its watermarks: clean-up evicted raw samples; bundles expired (TTL) or were dropped
    assert counts.get((STAGE_RAW, ledger.RAW_EVICTED), 0) > 0, counts
    assert counts.get((ledger.STAGE_SPOOL, ledger.TTL_EXPIRED), 0) + counts.get(
        (ledger.STAGE_SPOOL, ledger.FULL_DROPPED), 0) > 0, counts
    # ...and alerted locally: level-2 alerts in the node's outbox, in order, each at >= 85%
    alerts = [e for e in history if e.event == events.SPOOL_WATERMARK]
    assert alerts, "no spool alert in the outbox"
    assert [a.seq for a in alerts] == sorted(a.seq for a in alerts)
    assert [a.occurred for a in alerts] == sorted(a.occurred for a in alerts)
    assert all(a.payload["used_fraction"] >= 0.85 and a.payload["level"] == 2 for a in alerts)
    # after reconnection the bundles that waited left the spool: landed and acked, or in the ledger
    assert waiting and acked, (len(waiting), len(acked))
    assert waiting - acked <= dropped, waiting - acked - dropped
    store = store_for(stack)
    s3 = store.client()
    manifests = [BundleManifest.from_json(s3.get_object(Bucket=store.bucket("landing"), Key=o["Key"])["Body"].read())
                 for page in s3.get_paginator("list_objects_v2").paginate(Bucket=store.bucket("landing"),
                                                                           Prefix=f"{NODE}/")
                 for o in page.get("Contents", [])
                 # this node's day only: earlier tests of the session land node-a bundles too
                 if o["Key"].endswith(".manifest.json") and o["LastModified"] >= since]
    landed = {m.bundle_id: m for m in manifests}
    assert acked <= landed.keys(), acked - landed.keys()
    # every sample accounted for once: landed in a bundle (low tier: its summary row) or in the ledger with the
    # reason its bundle left the spool (TTL, displaced, refused), by id or, past the ledger's bound, by count
    in_bundles = [i for m in landed.values() for i in m.sample_ids]
    assert len(in_bundles) == len(set(in_bundles)), "a sample landed twice"
    assert not set(in_bundles) & spool_dropped, "a sample both landed and dropped"
    assert set(in_bundles) | spool_dropped <= set(sample_ids)
    unnamed = set(sample_ids) - set(in_bundles) - spool_dropped
    assert len(unnamed) == spool_evicted, (len(unnamed), spool_evicted)  # each dropped sample counted, none lost
    # nothing of the node's runs reached the central Prefect server...
    assert not _central_runs_tagged("node-local")
    # ...but its history did, through the gateway after reconnection: in order, each event once
    central = _central_node_events(stack, since)
    seqs = [int(e["payload"]["seq"]) for e in central]
    assert seqs == sorted(seqs) and len(seqs) == len(set(seqs)), seqs
    by_seq = {int(e["payload"]["seq"]): e for e in central}
    assert [a.seq for a in alerts] == [q for q in seqs if by_seq[q]["event"] == events.SPOOL_WATERMARK]
    assert {e.seq for e in history} <= set(by_seq)  # everything raised out of contact, none lost
    kinds = {e["event"] for e in central}
    assert {events.SPOOL_WATERMARK, events.NODE_RUN_SUMMARY, events.LEDGER_COUNTS, events.LINK_STATS} <= kinds, kinds
    # ...and the policy the core published meanwhile was applied at the contact, and reported back
    assert downlink.current_generation(layout.spool) >= update.generation
    assert any(e["event"] == downlink.APPLIED_EVENT for e in central), kinds


def _outbox_empty(layout: NodeLayout) -> bool:
    box = node_outbox(layout.spool, NODE)
    try:
        return len(box) == 0
    finally:
        box.close()


def _central_node_events(stack: localstack.StackState, since: datetime) -> list[dict[str, object]]:
    """The central Prefect's events of the node (resource edgehaul.node.<id>), oldest first, every page."""
    import httpx

    from tests.conftest import api_auth

    api = stack.prefect_api_url
    body = {"filter": {"resource": {"id": [f"edgehaul.node.{NODE}"]}, "occurred": {"since": since.isoformat()},
                       "order": "ASC"}, "limit": 50}
    r = httpx.post(f"{api}/events/filter", json=body, auth=api_auth(), timeout=30)
    r.raise_for_status()
    page = r.json()
    out = list(page["events"])
    while page.get("next_page"):
        r = httpx.get(page["next_page"], auth=api_auth(), timeout=30)
        r.raise_for_status()
        page = r.json()
        out += page["events"]
    return out


def _central_runs_tagged(tag: str) -> int:
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

    async def count() -> int:
        async with get_client() as client:
            return len(await client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[tag]))))

    return asyncio.run(count())


def test_spool_alerts_land_in_the_node_outbox_in_order(tmp_path: Path) -> None:
    data, m = mk(200, 10)
    size = len(data) + len(m.to_json())
    node = EdgeNode(node_id=NODE, spool_dir=str(tmp_path / "spool"), spool_cap_bytes=int(size * 4.3))
    spool = Spool.from_block(node)
    try:
        spool._emit = lambda *a, **k: False  # the central API is out of reach: only the outbox keeps the alert
        bundles = [mk(200, 20 + i) for i in range(6)]
        for b in bundles[:4]:
            assert spool.put(*b) is not None  # the 4th crosses 85%
        other = Spool.from_block(node)  # another process's view (a batch task, a drain): same crossing, no alert
        try:
            other._emit = spool._emit
            assert other.check_watermarks().fraction >= 0.85 and other.alerts == []
        finally:
            other.close()
        for _, mb in bundles[:2]:  # contact: two land, the spool falls below the watermarks
            spool.ack(mb.bundle_id, remote_key=mb.object_key, sha256=mb.sha256)
        for b in bundles[4:]:
            assert spool.put(*b) is not None  # ...and crosses 85% again
        assert len(spool.alerts) == 2
    finally:
        spool.close()
    box = node_outbox(node.spool_dir, NODE)
    try:
        kept = box.peek(100)
    finally:
        box.close()
    assert [e.event for e in kept] == [events.SPOOL_WATERMARK] * 2
    assert kept[0].seq < kept[1].seq and kept[0].occurred <= kept[1].occurred
    assert all(e.node_id == NODE and e.priority == 2 and e.payload["used_fraction"] >= 0.85 for e in kept)
    assert [e.payload for e in kept] == spool.alerts


@pytest.mark.parametrize(("change", "where"), [
    ({"node_id": "Node_A"}, "node_id"),
    ({"edge": {"spool_cap": 1}}, "edge.spool_cap"),
    ({"schedules": {"ingest_every_s": 0}}, "schedules.ingest_every_s"),
    ({"colour": "red"}, "colour"),
])
def test_node_config_errors_name_the_field(tmp_path: Path, change: dict[str, object], where: str) -> None:
    cfg = {"node_id": NODE, "state_dir": str(tmp_path / "state"), **change}
    (tmp_path / "node.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(NodeError, match=rf"node.yaml: {re.escape(where)}"):
        load_config(tmp_path / "node.yaml")


@pytest.mark.integration
def test_probe_contact_tells_a_dead_link_from_a_refusal(stack: localstack.StackState) -> None:
    node_store = store_for(stack, NODE)
    assert probe_contact.fn(node_store) is None  # reachable (a prefix-scoped identity may get 403: still contact)
    dead = node_store.model_copy(update={"endpoint_url": f"http://127.0.0.1:{localstack.free_port()}"})
    t = time.monotonic()
    why = probe_contact.fn(dead)
    assert why is not None and "EndpointConnectionError" in why and dead.endpoint_url in why
    assert time.monotonic() - t < 5  # one request, no retries


def test_a_routed_spool_alert_is_kept_once(tmp_path: Path) -> None:
    """Flows that route `events.emit` into the node's outbox (the forwarder's way) get one row per alert."""
    data, m = mk(200, 10)
    node = EdgeNode(node_id=NODE, spool_dir=str(tmp_path / "spool"),
                    spool_cap_bytes=int((len(data) + len(m.to_json())) * 4.3))
    spool = Spool.from_block(node)
    box = node_outbox(node.spool_dir, NODE)
    try:
        with events.routed(box.sink()):
            for b in [mk(200, 20 + i) for i in range(4)]:
                assert spool.put(*b) is not None
        kept = box.peek(100)
    finally:
        spool.close()
        box.close()
    assert len(spool.alerts) == 1
    assert [e.event for e in kept] == [events.SPOOL_WATERMARK] and kept[0].payload["used_fraction"] >= 0.85


# ---- node to dataset with no person in between: the node-local node against the central stack ----

COMMIT_BOUND_S = 240.0  # landed -> committed centrally: gateway window (5 s) + a core_ingest run on a busy host

_CENTRE = textwrap.dedent(
    """
    import sys
    from prefect import serve
    from prefect.events import DeploymentEventTrigger
    from prefect.types.entrypoint import EntrypointType

    from edgehaul.flows.core_ingest import core_ingest
    from edgehaul_dev import deploy

    uid, sweep_s = sys.argv[1], float(sys.argv[2])
    spec = {d["name"]: d for d in deploy.load_spec()["deployments"] if d["entrypoint"].endswith(":core_ingest")}
    landed, sweep = spec["on-bundle-landed"], spec["landing-sweep"]
    deps = [core_ingest.to_deployment(  # the shipped trigger and parameters, under a name of this test
        name=f"on-bundle-landed-{uid}", triggers=[DeploymentEventTrigger(**t) for t in landed["triggers"]],
        parameters=landed["parameters"], entrypoint_type=EntrypointType.MODULE_PATH)]
    if sweep_s:
        deps.append(core_ingest.to_deployment(name=f"landing-sweep-{uid}", interval=sweep_s,
                                              parameters=sweep["parameters"], entrypoint_type=EntrypointType.MODULE_PATH))
    serve(*deps, limit=2)
    """
)


@contextlib.contextmanager
def _centre(stack: localstack.StackState, tmp_path: Path, sweep_s: float = 0) -> Iterator[str]:
    """The central side of the product for a node: blocks, the gateway, and core_ingest served with the shipped
    `bundle_landed` trigger (and, with `sweep_s`, the landing sweep on that interval). Yields the gateway URL."""
    from prefect.client.orchestration import get_client

    from edgehaul_dev import configure

    configure.register_block_types()
    configure.save_blocks(stack)
    localstack.start_gateway(stack)
    uid = uuid.uuid4().hex[:8]
    script = tmp_path / "centre.py"
    script.write_text(_CENTRE)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PREFECT_RUNNER_POLL_FREQUENCY": "1",
           "PREFECT_LOGGING_LEVEL": "INFO"}
    with open(tmp_path / "centre.log", "ab") as out:
        proc = subprocess.Popen([sys.executable, str(script), uid, str(sweep_s)], env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def ready() -> bool:
            assert proc.poll() is None, (tmp_path / "centre.log").read_text()[-3000:]
            with get_client(sync_client=True) as client:
                try:
                    dep = client.read_deployment_by_name(f"core_ingest/on-bundle-landed-{uid}")
                except Exception:
                    return False
                return bool(client.read_resource_related_automations(f"prefect.deployment.{dep.id}"))

        wait_for(ready, 120, "core_ingest served with its trigger")
        time.sleep(2)  # the triggers service loads the new automation
        yield uid
    finally:
        _stop_group(proc, 30)
        # its trigger would otherwise go on making core_ingest runs nobody serves from later tests' landings
        delete_deployments_named([f"core_ingest/on-bundle-landed-{uid}", f"core_ingest/landing-sweep-{uid}"])


def _node_config(stack: localstack.StackState, state: Path, relay: Relay, gw_relay: Relay,
                 every_s: float) -> dict[str, object]:
    keys = stack.identities[NODE]
    _, gw_key = localstack.gateway_sender(stack)
    return {
        "node_id": NODE, "state_dir": str(state),
        "store": {"endpoint_url": f"http://127.0.0.1:{relay.port}"},
        "keys": {"access_key_id": keys.access_key_id, "secret_access_key": keys.secret_access_key},
        "link": {"bandwidth_bps": 100e6}, "batch_size": SAMPLES_PER_HOUR,
        "schedules": {"ingest_every_s": every_s, "drain_every_s": every_s, "poll_s": 1},
        "drain": {"max_seconds": 60},
        "gateway": {"url": f"http://127.0.0.1:{gw_relay.port}", "key": gw_key, "sender_id": localstack.GATEWAY_SENDER},
        "prefect_port": 0,
    }


def _init_node(cfg: dict[str, object], tmp_path: Path) -> NodeLayout:
    (tmp_path / "node.yaml").write_text(yaml.safe_dump(cfg))
    init = subprocess.run([sys.executable, "-m", "edgehaul.cli", "node", "init", "--config", str(tmp_path / "node.yaml")],
                          env=_env(), cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert init.returncode == 0, init.stderr[-3000:]
    return NodeLayout(Path(str(cfg["state_dir"])))


def _landed_since(stack: localstack.StackState, since: datetime) -> dict[str, BundleManifest]:
    """bundle id -> manifest of the node's bundles landed since `since` (earlier tests land node-a bundles too)."""
    store = store_for(stack)
    s3 = store.client()
    return {m.bundle_id: m for m in (
        BundleManifest.from_json(s3.get_object(Bucket=store.bucket("landing"), Key=o["Key"])["Body"].read())
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=store.bucket("landing"), Prefix=f"{NODE}/")
        for o in page.get("Contents", [])
        if o["Key"].endswith(".manifest.json") and o["LastModified"] >= since)}


def _committed(stack: localstack.StackState, ids: set[str]) -> set[str]:
    """Which of the node's bundle ids its dataset holds (bundle ids are scoped by node)."""
    from edgehaul.core.datasets import DatasetError, committed_bundle_ids

    try:
        refs = committed_bundle_ids(store_for(stack, "ingest"), "landsat_patch", sorted((NODE, b) for b in ids))
    except DatasetError:
        return set()
    return {b for _, b in refs}


def _spool_empty(layout: NodeLayout) -> bool:
    spool = Spool.from_block(EdgeNode(node_id=NODE, spool_dir=str(layout.spool)))
    try:
        return not spool.pending()
    finally:
        spool.close()


def _announcements(layout: NodeLayout) -> list[str]:
    box = node_outbox(layout.spool, NODE)
    try:
        return [e.payload["bundle_id"] for e in box.peek(10_000) if e.event == events.BUNDLE_LANDED]
    finally:
        box.close()


def _all_committed(stack: localstack.StackState, since: datetime, layout: NodeLayout, what: str,
                   dropped: str = "h*.parquet") -> set[str]:
    """Waits until the node has read the `dropped` files, its spool is empty, and every bundle it landed since
    `since` is committed centrally within COMMIT_BOUND_S of the spool emptying; returns their ids."""
    wait_for(lambda: not any(layout.drop.glob(dropped)) and _spool_empty(layout), 300, f"{what}: the node to land")
    t = time.monotonic()
    landed: set[str] = set()

    def done() -> bool:
        nonlocal landed
        landed = set(_landed_since(stack, since))
        return bool(landed) and _committed(stack, landed) == landed

    wait_for(done, COMMIT_BOUND_S, f"{what}: every landed bundle committed centrally")
    print(f"{what}: {len(landed)} bundles committed {time.monotonic() - t:.0f} s after the spool emptied")
    return landed


def _core_runs(uid: str) -> list[Any]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

    with get_client(sync_client=True) as client:
        return client.read_flow_runs(deployment_filter=DeploymentFilter(
            name=DeploymentFilterName(any_=[f"on-bundle-landed-{uid}"])))


def _node_landing_batches(layout: NodeLayout) -> int:
    """LANDING_BATCH events on the node's own Prefect server (where no trigger listens): must stay 0."""
    import httpx

    env = layout.env()
    user, _, password = env["PREFECT_API_AUTH_STRING"].partition(":")
    r = httpx.post(f"{env['PREFECT_API_URL']}/events/filter", auth=(user, password), timeout=30,
                   json={"filter": {"event": {"name": [events.LANDING_BATCH]}}, "limit": 50})
    r.raise_for_status()
    return len(r.json()["events"])


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_every_bundle_a_node_local_node_sends_is_committed_centrally_before_and_after_an_outage(
        stack: localstack.StackState, tmp_path: Path) -> None:
    host, port = stack.s3_endpoint.removeprefix("http://").split(":")
    relay = Relay((host, int(port)))
    with _centre(stack, tmp_path) as uid:  # no sweep: what is committed here was announced by the node
        gw_host, gw_port = localstack.start_gateway(stack).removeprefix("http://").rstrip("/").split(":")
        gw_relay = Relay((gw_host, int(gw_port)))
        layout = _init_node(_node_config(stack, tmp_path / "node", relay, gw_relay, every_s=10), tmp_path)
        relay.up()
        gw_relay.up()
        since = datetime.now(UTC)
        try:
            with _node_running(layout, tmp_path / "node.log") as proc:
                # 1. in contact: landed, announced, committed
                _drop(layout.drop, 0)
                first = _all_committed(stack, since, layout, "in contact")
                # 2. the gateway is out of reach, S3 is not: bundles land, their announcements wait on the node
                gw_relay.down()
                _drop(layout.drop, 1)
                wait_for(lambda: len(_announcements(layout)) > 0 and _spool_empty(layout)
                         and not any(layout.drop.glob("*.parquet")), 300, "bundles landed, their announcements kept")
                waiting = set(_announcements(layout))
                assert waiting <= set(_landed_since(stack, since)) and not waiting & first
                assert not _committed(stack, waiting)  # nothing else announces them (no sweep here)
                # 3. the whole centre out of reach: data waits in the spool
                relay.down()
                _drop(layout.drop, 2)
                n = _out_of_contact(tmp_path / "node.log")
                wait_for(lambda: not any(layout.drop.glob("*.parquet")) and _out_of_contact(tmp_path / "node.log") > n,
                         300, "a drain attempt out of contact")
                assert not _spool_empty(layout)
                # 4. reconnection: every bundle, before and after the outage, committed with no manual step
                relay.up()
                gw_relay.up()
                every = _all_committed(stack, since, layout, "after reconnection")
                wait_for(lambda: not _announcements(layout), 120, "the outbox's announcements to be sent")
                assert proc.poll() is None
                assert first | waiting < every
                assert _node_landing_batches(layout) == 0  # the node never started central work itself
        finally:
            relay.down()
            gw_relay.down()
        runs = _core_runs(uid)
    # the core was started by the gateway's landing batches alone, and took only keys: the node of each bundle
    # comes from its landing key (core_ingest checks the manifest against it), never from an announcement
    assert runs and all(set(r.parameters["params"]) == {"store_block", "result_storage", "bundle_keys"} for r in runs)
    keys = {k for r in runs for k in r.parameters["params"]["bundle_keys"]}
    assert {k.split("/")[0] for k in keys if k.endswith(tuple(f"{b}.parquet" for b in every))} == {NODE}
    assert all(r.state_name in ("Completed", "Running", "Pending", "Scheduled") for r in runs), \
        [(r.name, r.state_name) for r in runs]


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_node_run_with_a_bad_and_a_good_file_commits_the_good_one_within_one_schedule(
        stack: localstack.StackState, tmp_path: Path) -> None:
    """The bad files go to rejected/ and the runs go on (edgehaul.edge.drop_folder); the good file's bundles are
    announced by the node and committed by the core's trigger (the sweep is served too, on the same interval)."""
    every_s = 20.0
    host, port = stack.s3_endpoint.removeprefix("http://").split(":")
    relay = Relay((host, int(port)))
    with _centre(stack, tmp_path, sweep_s=every_s):
        gw_host, gw_port = localstack.start_gateway(stack).removeprefix("http://").rstrip("/").split(":")
        gw_relay = Relay((gw_host, int(gw_port)))
        layout = _init_node(_node_config(stack, tmp_path / "node", relay, gw_relay, every_s=every_s), tmp_path)
        relay.up()
        gw_relay.up()
        since = datetime.now(UTC)
        try:
            with _node_running(layout, tmp_path / "node.log") as proc:
                # bad files: a CSV that is not UTF-8, and a Parquet file an instrument was cut off writing
                (layout.drop / "bad.csv").write_bytes(b"sample_id,capture_time,seq\n\xff\xfe\x00garbage,\x81,1\n")
                good = _drop(layout.drop, 7)
                whole = (layout.drop / "h007.parquet").read_bytes()
                (layout.drop / "cut.parquet").write_bytes(whole[: len(whole) // 2])
                t0 = time.monotonic()
                # one schedule: an ingest and a drain run (every_s each), then the core's commit bound
                wait_for(lambda: not any(layout.drop.glob("h*.parquet")), 2 * every_s + 120, "the good file to be read")
                landed = _all_committed(stack, since, layout, "good file beside a bad one")
                took = time.monotonic() - t0
                print(f"good file committed {took:.0f} s after it was dropped")
                # within one schedule: the next ingest, the next drain, then the core (no run lost to the bad file)
                assert took < 2 * every_s + COMMIT_BOUND_S, took
                assert set(_node_runs(layout).get("edge_ingest", [])) == {"Completed"}  # no run failed on a file
                assert proc.poll() is None
        finally:
            relay.down()
            gw_relay.down()
    in_bundles = {i for b, m in _landed_since(stack, since).items() if b in landed for i in m.sample_ids}
    assert set(good) <= in_bundles
    assert list((layout.root / "rejected").glob("bad*")), "the unreadable CSV was not set aside in rejected/"
    assert not list(layout.done.glob("cut*")) and not list(layout.done.glob("bad*"))  # neither reported read
