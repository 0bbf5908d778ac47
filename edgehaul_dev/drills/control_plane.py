"""Control-plane drill: the central API and the webhook gateway are unreachable for a random stretch of
simulated hours while data keeps arriving at the node and draining to the object store.

The node's events go the product's way: `events.emit` inside `events.routed(outbox.sink())` appends to
the node's `Outbox`; every simulated hour the `Forwarder` tries to drain it to the gateway app
(`create_app`, its real SQLite state, the node's own signed key) over the node's `Link`. While the
control plane is down the forwarder meets a refused connection; when it returns, one recovery fault is
drawn: Prefect lost again midway through a batch (503 after k events), the gateway restarted between
two batches, or a batch's answer lost (the node re-sends it). "Central" is the gateway's emitter, a
recorder standing in for Prefect's events API that counts every event it is handed (a duplicate by
event id is counted too, although Prefect would drop it). Afterwards, by sample id: every sample in
the dataset once, none lost; by alert id: every alert raised during the outage present centrally
exactly once, every event in seq order, outage alerts labelled stale with their age.
"""

from __future__ import annotations

import random
import time
import uuid
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
from starlette.testclient import TestClient

from edgehaul import events
from edgehaul.edge.outbox import Outbox
from edgehaul.services.gateway import GatewayConfig, SenderRegistry, create_app, new_secret, signed_headers, write_senders
from edgehaul.uplink.forwarder import HOOK, Forwarder, batch_body
from edgehaul.uplink.link import Link
from edgehaul_dev.drills.accounting import account
from edgehaul_dev.drills.env import DrillEnv, ids_of, spool_all
from edgehaul_dev.drills.pipeline import drain, fast_profile, ingest_landed, open_spool
from edgehaul_dev.drills.report import TrialResult

HOUR = 3600.0
NODE = "node-a"  # the pool bundles' node
STALE_AFTER_S = 600.0
ALERTS = {1: events.LINK_STATS, 2: events.SPOOL_WATERMARK, 3: events.RETRY_EXPIRED}  # a node's level 3: samples lost
RECOVERY_FAULTS = ("prefect-cut-midway", "gateway-restart", "answer-lost")


class Central:
    """Stands in for Prefect's events API behind the gateway: keeps every event handed to it; `fail_after`
    makes it refuse once after that many more events (Prefect going away mid batch)."""

    def __init__(self) -> None:
        self.got: list[tuple[str, dict[str, Any], uuid.UUID]] = []
        self.fail_after: int | None = None

    async def __call__(self, name: str, resource: dict[str, str], payload: dict[str, Any], event_id: uuid.UUID,
                       occurred: datetime | None = None) -> None:
        if self.fail_after is not None:
            if self.fail_after <= 0:
                self.fail_after = None
                raise ConnectionError("Prefect unreachable")
            self.fail_after -= 1
        self.got.append((name, {**payload, "_stale": resource.get("edgehaul.stale")}, event_id))


def _gateway(d: Path, central: Central) -> TestClient:
    return TestClient(create_app(GatewayConfig(SenderRegistry(d / "senders.json"), d / "gw",
                                               stale_after_s=STALE_AFTER_S), central))


def drill_control_plane_down(env: DrillEnv, rng: random.Random) -> TrialResult:
    d, store = env.trial_dir("cpd"), env.store("cpd")
    before, hours, after = rng.randint(1, 3), rng.randint(2, 48), 2
    total = before + hours + after
    # The simulated clock ends at about the real now, so the gateway's ages are the simulated lateness.
    now = [time.time() - total * HOUR]
    key = new_secret()
    write_senders(d / "senders.json", {NODE: {"keys": [key], "nodes": [NODE], "hooks": [HOOK]}})
    box = Outbox(d / "outbox.sqlite", NODE)
    sp = open_spool(d / "spool")
    link = Link(fast_profile(), emit_events=False)
    picks = rng.sample(env.small, rng.randint(3, 8))
    # data arrives at random hours, at least one bundle while the control plane is down
    arrive = [rng.randint(before, before + hours - 1)] + [rng.randrange(total) for _ in picks[1:]]
    central = Central()
    fault = rng.choice(RECOVERY_FAULTS)
    raised: dict[str, float] = {}  # alert id -> simulated time, every alert
    in_outage: list[str] = []
    failed_tries = 0
    problems: list[str] = []
    dead = httpx.Client(base_url="http://127.0.0.1:9", timeout=2.0)  # nothing listens: connection refused
    gw = _gateway(d, central).__enter__()
    try:
        with events.routed(box.sink(clock=lambda: now[0])):
            for h in range(total):
                down = before <= h < before + hours
                spool_all(sp, [b for b, at in zip(picks, arrive, strict=True) if at == h])
                drain(store, sp, d / "uplink", link=link)  # the data path needs no control plane
                events.emit(events.NODE_RUN_SUMMARY, f"edgehaul.node.{NODE}",
                            {"hour": h, "spool_pending": len(sp.pending())})
                for k in range(rng.randint(0, 3)):
                    level = rng.randint(1, 3)
                    aid = f"{h}-{k}"
                    raised[aid] = now[0]
                    events.emit(ALERTS[level], f"edgehaul.node.{NODE}",
                                {"level": level, "alert_id": aid, "retransmission_rate": 0.3, "used_fraction": 0.9})
                    if down:
                        in_outage.append(aid)
                if down:
                    tried = Forwarder(box, dead, NODE, key, link=link).forward()
                    failed_tries += bool(tried.error)
                else:
                    if h == before + hours:  # contact returns: one recovery fault
                        gw = _recover_with_fault(fault, d, gw, central, box, key, rng)
                    Forwarder(box, gw, NODE, key, link=link, batch_max=rng.randint(2, 20)).forward()
                now[0] += HOUR
        for _ in range(5):  # whatever a cut-off batch left: the next runs send it
            if not len(box):
                break
            Forwarder(box, gw, NODE, key, link=link).forward()
    finally:
        gw.__exit__(None, None, None)
        dead.close()
    ingest_landed(store, env.s3)
    a = account(store, ids_of(picks), [sp], env.s3)
    problems += _check_events(central, raised, in_outage, box)
    sp.close()
    box.close()
    res = a.result(bool(in_outage) and failed_tries > 0, problems)
    seen = Counter(_alert_ids(central))
    res.counts = {"alerts_in_outage": len(in_outage),
                  "outage_alerts_central_once": sum(seen[aid] == 1 for aid in in_outage),
                  "events_central": len(central.got), f"recovery_{fault}": 1}
    return res


def _recover_with_fault(fault: str, d: Path, gw: TestClient, central: Central, box: Outbox, key: str,
                        rng: random.Random) -> TestClient:
    if fault == "prefect-cut-midway":
        central.fail_after = rng.randint(0, max(0, len(box) - 1))
        Forwarder(box, gw, NODE, key, batch_max=rng.randint(2, 20)).forward()  # stops at the 503, keeps the rest
    elif fault == "gateway-restart":
        Forwarder(box, gw, NODE, key, batch_max=rng.randint(1, 5)).forward(max_batches=rng.randint(1, 3))
        gw.__exit__(None, None, None)
        gw = _gateway(d, central).__enter__()
    else:  # a batch reached the gateway but its answer did not reach the node: the node sends it again
        body = batch_body(NODE, box.peek(rng.randint(1, 20)))
        r = gw.post(f"/hooks/{NODE}/{HOOK}", content=body, headers=signed_headers(key, body))
        if r.status_code != 202:
            raise RuntimeError(f"control_plane_down: gateway answered {r.status_code} to a valid batch: {r.text[:200]}")
    return gw


def _alert_ids(central: Central) -> list[str]:
    return [str(p["alert_id"]) for _, p, _ in central.got if "alert_id" in p]


def _check_events(central: Central, raised: dict[str, float], in_outage: list[str], box: Outbox) -> list[str]:
    problems = []
    seen = Counter(_alert_ids(central))
    missing = [a for a in raised if seen[a] == 0]
    twice = [a for a, n in seen.items() if n > 1]
    if missing:
        problems.append(f"{len(missing)} alerts never reached central ({sum(a in in_outage for a in missing)} "
                        f"raised in the outage): {missing[:3]}")
    if twice:
        problems.append(f"{len(twice)} alerts reached central more than once: {twice[:3]}")
    seqs = [p["seq"] for _, p, _ in central.got]
    if seqs != sorted(set(seqs)):
        problems.append(f"central got the node's events out of seq order or twice: {seqs[:12]}")
    late = [p for _, p, _ in central.got if p.get("alert_id") in set(in_outage)]
    if any(p["_stale"] != "true" or p["age_s"] < HOUR - 1 for p in late):
        problems.append("an alert delivered hours late was not labelled stale with its age")
    if len(box) or box.dropped():
        problems.append(f"outbox not drained: {len(box)} left, dropped {box.dropped()}")
    return problems
