"""Alerts as automations: each fires on its condition and not below it, on the real Prefect server."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from fnmatch import fnmatchcase
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from edgehaul import events
from edgehaul.blocks import EdgeNode, ObjectStore
from edgehaul.platform.reporting import CHECK_PREFIX, CHECK_TAG
from edgehaul.services.automations import (
    L1_NAME,
    L2_NAME,
    L3_NAME,
    L3_RETRY_NAME,
    MODEL_STALE_NAME,
    NODE_SILENT_NAME,
    RUN_FAILED_NAME,
    AlertPolicy,
    apply_automations,
    at_least_globs,
)
from edgehaul_dev.localstack import StackState
from tests.waiting import wait_for


@given(st.integers(0, 9999), st.integers(0, 9999))
def test_at_least_globs_match_exactly_values_at_or_above(threshold: int, value: int) -> None:
    globs = at_least_globs(threshold)
    assert any(fnmatchcase(f"{value:04d}", g) for g in globs) == (value >= threshold)


@given(st.integers(0, 100_000), st.sampled_from([0.05, 0.1, 0.85, 0.9, 0.001]))
def test_permille_label_against_threshold_globs_is_a_numeric_comparison(k: int, threshold: float) -> None:
    x = k / 100_000
    label = events.alert_labels({"used_fraction": x})[events.ALERT_LABELS["used_fraction"]]
    assert any(fnmatchcase(label, g) for g in at_least_globs(round(threshold * 1000))) == (x >= threshold)


def test_alert_labels_ignore_non_numbers() -> None:
    assert events.alert_labels({"used_fraction": "0.9", "retransmission_rate": float("nan")}) == {}
    assert events.alert_labels({"retransmission_rate": True}) == {}


def test_policy_rejects_thresholds_finer_than_permille() -> None:
    with pytest.raises(ValueError, match="spool_watermark"):
        AlertPolicy(spool_watermark=0.8505)


class Receiver:
    """A local HTTP server collecting the JSON bodies the notification block posts."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.auth: list[str | None] = []
        lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                n = int(self.headers.get("content-length", 0))
                doc = json.loads(self.rfile.read(n))
                with lock:
                    outer.bodies.append(json.loads(doc["body"]) | {"subject": doc["subject"]})
                    outer.auth.append(self.headers.get("authorization"))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/alerts"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait_for(self, pred: Callable[[dict[str, Any]], bool], timeout: float = 60) -> dict[str, Any]:
        return wait_for(lambda: next((b for b in list(self.bodies) if pred(b)), None), timeout,
                        lambda: f"a matching notification; got {self.bodies}", interval=0.2)

    def probe(self, fire: Callable[[], object], seen: Callable[[dict[str, Any]], bool], timeout: float = 60,
              every: float = 1) -> None:
        """`fire()` an event every `every` seconds until a notification `seen` arrives: the server's automations
        load only once an event fires."""
        def arrived() -> bool:
            if any(seen(b) for b in list(self.bodies)):
                return True
            fire()
            return False

        wait_for(arrived, timeout, lambda: f"the automations to fire on a probe; got {self.bodies}", interval=every)


def _named_flow(name: str) -> Any:
    from prefect import flow

    @flow(name=name)
    def f() -> None: ...

    return f


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.server.shutdown()


@pytest.mark.integration
def test_alerts_fire_on_condition_and_not_below(stack: StackState, receiver: Receiver) -> None:
    from prefect.client.orchestration import get_client

    policy = AlertPolicy(sustained_samples=3, sustained_window_s=120, retry_delay_s=0)
    first = apply_automations(policy, webhook_url=receiver.url, token="t0k3n")
    again = apply_automations(policy, webhook_url=receiver.url, token="t0k3n")
    assert [a.id for a in first] == [a.id for a in again] and not any(a.created for a in again)

    uid = uuid.uuid4().hex[:8]
    with get_client(sync_client=True) as client:
        for name in (L1_NAME, L2_NAME, L3_NAME, L3_RETRY_NAME, RUN_FAILED_NAME, NODE_SILENT_NAME, MODEL_STALE_NAME):
            assert len(client.read_automations_by_name(name)) == 1
        # A train_model deployment (no worker serves it) whose run fails on a checkpoint write.
        flow_id = client.create_flow_from_name("train_model")
        dep_id = client.create_deployment(flow_id=flow_id, name=f"retry-target-{uid}")
        failed = client.create_flow_run_from_deployment(dep_id, parameters={"params": {"epochs": 2, "team": "t"}})
        other = client.create_flow_run_from_deployment(dep_id, parameters={"params": {"epochs": 5}})
        crashed = client.create_flow_run_from_deployment(dep_id, parameters={"params": {"epochs": 7}})
        outside = client.create_flow_run(flow=_named_flow(f"not-ours-{uid}"))  # not a pipeline flow: no alert
        check = client.create_flow_run_from_deployment(dep_id, parameters={"params": {"epochs": 9}},  # `make verify`'s
                                                       name=f"{CHECK_PREFIX}train_model: {uid}", tags=[CHECK_TAG])

    try:
        # Warm-up: the automations are loaded once a probe fires.
        receiver.probe(lambda: events.emit(events.SPOOL_WATERMARK, f"probe-{uid}-{time.monotonic_ns()}",
                                           {"used_fraction": 0.99}),
                       lambda b: b["resource"].startswith(f"probe-{uid}"))

        # Level 2: 0.86 fires, 0.84 and 0.849 do not.
        events.emit(events.SPOOL_WATERMARK, f"spool-{uid}-low", {"level": "cleanup", "used_fraction": 0.84})
        events.emit(events.SPOOL_WATERMARK, f"spool-{uid}-edge", {"level": "cleanup", "used_fraction": 0.849})
        events.emit(events.SPOOL_WATERMARK, f"spool-{uid}-high", {"level": "alert", "used_fraction": 0.86})
        # Level 1: three samples above 5% on one link fire; one spike among low samples does not.
        for rate in (0.5, 0.01, 0.02):
            events.emit(events.LINK_STATS, f"link-{uid}-spike", {"retransmission_rate": rate, "goodput_bps": 1e6})
        for rate in (0.07, 0.12, 0.09):
            events.emit(events.LINK_STATS, f"link-{uid}-sustained", {"retransmission_rate": rate, "goodput_bps": 1e5})
        # Level 3: every failed checkpoint write notifies; a run that failed on one is re-run once,
        # resuming its run_id with its other parameters.
        events.emit(events.CHECKPOINT_FAILED, f"edgehaul.training.run.{uid}",
                    {"run_id": uid, "step": 40, "error": "ClientError: PUT checkpoint: 503 SlowDown", "attempt": 1})
        from prefect.states import Failed

        with get_client(sync_client=True) as client:
            client.set_flow_run_state(failed.id, Failed(message="Flow run encountered an exception: CheckpointError: "
                                                               "checkpoint of run x step 40 failed after 3 attempts"),
                                      force=True)
            client.set_flow_run_state(other.id, Failed(message="Flow run encountered an exception: ValueError: bad"),
                                      force=True)
            from prefect.states import Crashed

            client.set_flow_run_state(crashed.id, Crashed(message="Flow run infrastructure exited with code 137"),
                                      force=True)
            client.set_flow_run_state(outside.id, Failed(message="not ours"), force=True)
            client.set_flow_run_state(check.id, Failed(message="QuotaExceeded: refused, as the check asked"), force=True)

        l2 = receiver.wait_for(lambda b: b["resource"] == f"spool-{uid}-high")
        assert l2["level"] == 2 and l2["used_fraction"] == 0.86 and "[edgehaul L2]" in l2["subject"]
        l1 = receiver.wait_for(lambda b: b["resource"] == f"link-{uid}-sustained")
        assert l1["level"] == 1 and l1["alert"] == "link-retransmission"
        l3 = receiver.wait_for(lambda b: b["resource"] == f"edgehaul.training.run.{uid}")
        assert l3["level"] == 3 and "SlowDown" in l3["error"]
        from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

        def five_runs() -> list[Any]:
            with get_client(sync_client=True) as client:
                runs = client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[dep_id])))
            return runs if len(runs) >= 5 else []

        runs = wait_for(five_runs, 30, "the level-3 retry run of the deployment", interval=0.5)
        retries = [r for r in runs if r.id not in (failed.id, other.id, crashed.id, check.id)]
        assert len(retries) == 1, "level 3 should re-run the deployment exactly once"
        assert retries[0].parameters == {"params": {"epochs": 2, "team": "t", "run_id": f"train-{failed.id}"}}

        # Any pipeline run that fails or crashes alerts, with its name, flow and message.
        for fr, state, says in ((other, "Failed", "ValueError: bad"), (crashed, "Crashed", "code 137"),
                                (failed, "Failed", "CheckpointError")):
            name = fr.name
            b = receiver.wait_for(lambda b: b["alert"] == "run-failed" and b["run"] == name)  # noqa: B023
            assert b["level"] == 2 and b["flow"] == "train_model" and b["state"] == state and says in b["message"]

        # Give the below-threshold cases as long again as the slowest positive took.
        time.sleep(5)
        fired = {b["resource"] for b in receiver.bodies}
        assert not fired & {f"spool-{uid}-low", f"spool-{uid}-edge", f"link-{uid}-spike"}, fired
        assert sum(b["resource"] == f"link-{uid}-sustained" for b in receiver.bodies) == 1
        assert not [b for b in receiver.bodies if b.get("run") in (outside.name, check.name)]
        assert set(receiver.auth) == {"Bearer t0k3n"}
        with get_client(sync_client=True) as client:
            runs = client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[dep_id])))
        assert len(runs) == 5, "a run failing for another reason is not retried"
    finally:
        with get_client(sync_client=True) as client:
            for a in first:
                client.delete_automation(a.id)
            client.delete_deployment(dep_id)


def _stale_model(store: ObjectStore, name: str) -> str:
    """A published model trained on version 0 of a dataset that has reached version 2."""
    import pyarrow as pa
    from deltalake import write_deltalake

    from edgehaul.training import registry

    uri = store.uri("curated", "fleet_kind")
    for v in range(3):
        write_deltalake(uri, pa.table({"v": [v]}), storage_options=store.storage_options(), mode="append")
    model_id = f"m-{uuid.uuid4().hex[:8]}"
    registry.register_model(store, name, model_id, {"x": 1}, {"team": "geo", "dataset_uri": uri, "dataset_version": 0})
    registry.publish(store, name, model_id)
    return model_id


@pytest.mark.integration
def test_fleet_report_alerts_on_a_silent_node_and_a_stale_model(
        stack: StackState, store: ObjectStore, receiver: Receiver, tmp_path: Path) -> None:
    from prefect.client.orchestration import get_client

    from edgehaul.flows.fleet_report import FleetReportParams, fleet_report

    applied = apply_automations(AlertPolicy(sustained_samples=3, sustained_window_s=120, retry_delay_s=0),
                                webhook_url=receiver.url, token="t0k3n")
    uid = uuid.uuid4().hex[:8]
    try:
        receiver.probe(lambda: events.emit(events.NODE_SILENT, f"probe-{uid}-{time.monotonic_ns()}",
                                           {"node_id": "probe", "last_seen": None, "allowed_s": 1.0, "reason": "probe"}),
                       lambda b: b["resource"].startswith(f"probe-{uid}"))

        # A node whose contact plan had a pass that ended an hour ago, and that said nothing in it.
        plan = tmp_path / "passes.yaml"
        start = datetime.now(UTC) - timedelta(hours=2)
        plan.write_text(yaml.safe_dump({"passes": [{"start": start.isoformat(), "duration_s": 3600, "rate_bps": 1e6}]}))
        node = f"silent-{uid}"
        EdgeNode(node_id=node, spool_dir=str(tmp_path / "spool"), pass_schedule=str(plan)).save(node, overwrite=True)
        model_id = _stale_model(store, "landcover")
        store.save(f"fleet-{uid}", overwrite=True)

        out = fleet_report(FleetReportParams(store_block=f"fleet-{uid}", model_max_versions_behind=1,
                                             silence_grace_s=60))
        assert node in out["silent"] and out["stale_model"] == model_id

        silent = receiver.wait_for(lambda b: b["alert"] == "node-silent" and b.get("node") == node)
        assert silent["level"] == 2 and silent["last_seen"] is None and silent["allowed_s"] >= 3600
        assert start.isoformat() in silent["reason"]
        stale = receiver.wait_for(lambda b: b["alert"] == "model-stale" and b.get("model") == model_id)
        assert (stale["trained_version"], stale["latest_version"]) == (0, 2) and stale["max_age_s"] == 86400
    finally:
        with get_client(sync_client=True) as client:
            for a in applied:
                client.delete_automation(a.id)
