"""The real Prefect UI (served by the session's `prefect server start`) in headless Debian Chromium:
a demo flow run, its artifacts, and an event-triggered run appear; a training run shows its name,
progress and epoch lines, the cost report its chart, the fleet view its table and chart; after demo, deploy,
a run through the deployments and two verifies, the Runs page filtered to Failed/Crashed counts none; block
pages load no image from the internet. Screenshots go to build/ui-screenshots/ (ignored by git); the
tracked docs/ui-screenshot.png, docs/ui-training-run.png and docs/ui-fleet-view.png change only when asked:
`EDGEHAUL_REFRESH_DOCS_SCREENSHOTS=1 pytest tests/system/test_ui.py`."""

from __future__ import annotations

import contextlib
import html
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from edgehaul import events
from edgehaul_dev import localstack
from tests.conftest import api_auth
from tests.prefect_cleanup import delete_deployments_named
from tests.waiting import run_log_lines, wait_for

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage", "--window-size=1400,1000",
    # virtual time waits for the app's API calls before the DOM is dumped
    "--virtual-time-budget=15000",
]


class AuthProxy:
    """The UI as a signed-in user sees it: the stack's Prefect API is closed (PREFECT_SERVER_API_AUTH_STRING)
    and the UI keeps the string in the browser's localStorage after a login form, which a one-shot headless
    Chromium cannot fill. This proxy adds the Authorization header to every request and points the UI's
    API address (`/ui-settings`) at itself."""

    def __init__(self, upstream: str, auth: tuple[str, str] | None) -> None:
        import base64
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        header = {"Authorization": "Basic " + base64.b64encode(":".join(auth).encode()).decode()} if auth else {}
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def _forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                skip = {"host", "content-length", "connection", "accept-encoding"}
                headers = {k: v for k, v in self.headers.items() if k.lower() not in skip} | header
                r = httpx.request(self.command, upstream + self.path, content=body, headers=headers, timeout=60)
                content = r.content
                if self.path.split("?")[0].endswith("ui-settings"):
                    content = content.replace(upstream.encode(), proxy.url.encode())
                self.send_response(r.status_code)
                for k, v in r.headers.items():
                    if k.lower() not in ("content-length", "content-encoding", "transfer-encoding", "connection"):
                        self.send_header(k, v)
                self.send_header("content-length", str(len(content)))
                self.end_headers()
                self.wfile.write(content)

            do_GET = do_POST = do_PATCH = do_PUT = do_DELETE = do_OPTIONS = _forward

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


REPO = Path(__file__).resolve().parents[2]


def keep_screenshot(shot: Path, name: str) -> Path:
    """Copy a screenshot where a person can look at it: build/ui-screenshots/ (ignored), or the tracked
    docs/ copy when EDGEHAUL_REFRESH_DOCS_SCREENSHOTS=1 (a test run never dirties the checkout otherwise)."""
    refresh = os.environ.get("EDGEHAUL_REFRESH_DOCS_SCREENSHOTS") == "1"
    dest = REPO / "docs" / name if refresh else REPO / "build" / "ui-screenshots" / name
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(shot, dest)
    return dest


def test_screenshots_stay_out_of_tracked_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shot = tmp_path / "x.png"
    shot.write_bytes(b"\x89PNG\r\n\x1a\n")
    monkeypatch.delenv("EDGEHAUL_REFRESH_DOCS_SCREENSHOTS", raising=False)
    dest = keep_screenshot(shot, f"test-{uuid.uuid4().hex[:8]}.png")
    try:
        assert dest.parent == REPO / "build" / "ui-screenshots"
        ignored = subprocess.run(["git", "check-ignore", "-q", str(dest)], cwd=REPO, check=False)
        assert ignored.returncode == 0, f"{dest} is not ignored by git"
    finally:
        dest.unlink()


def test_the_stack_says_how_to_log_in_to_the_ui(tmp_path: Path) -> None:
    state = localstack.StackState(str(tmp_path), 4200, 8333, {}, api_auth_string="edgehaul:s3cret")
    hint = localstack.login_hint(state, Path(".edgehaul-stack.env"))
    assert hint and "grep PREFECT_API_AUTH_STRING .edgehaul-stack.env" in hint and "s3cret" not in hint
    assert localstack.login_hint(localstack.StackState(str(tmp_path), 4200, 8333, {}), None) is None


def test_the_demo_summary_says_where_each_bundle_is_and_which_month_is_priced() -> None:
    from edgehaul_dev import demo

    out = {"edge": {"node-a": {"samples_in": 400, "bundles": 6, "bundles_by_reason": {"final": 5, "raw": 1}}},
           "uplink": {"node-a": {"bundles_landed": 5}}, "cost": {"month": demo.this_month(), "total": 0.01}}
    text = "\n".join(demo.summary_lines(out, "http://ui"))
    assert "6 bundles (1 low-tier, kept in the node's raw store: never uplinked)" in text
    assert f"cost report {datetime.now(UTC):%Y-%m} (month to date)" in text


def test_the_demo_console_drops_only_completed_state_lines() -> None:
    import logging

    from edgehaul_dev import demo

    keep = demo._HideCompleted()

    def rec(msg: str) -> logging.LogRecord:
        return logging.LogRecord("prefect.task_runs", logging.INFO, __file__, 1, msg, None, None)

    assert not keep.filter(rec("Finished in state Completed()"))
    assert keep.filter(rec("Finished in state Failed('boom')")) and keep.filter(rec("node-a: 5 bundles landed"))


def browse(url: str, tmp: Path, screenshot: Path | None = None, raw: bool = False) -> str:
    """The page's rendered text (its DOM with `raw`), via Chromium's own --dump-dom (no driver, no
    downloaded browser)."""
    assert Path(CHROMIUM).exists(), "Debian's chromium is required: apt-get install -y chromium (see .ci/run)"
    profile = tmp / f"profile-{uuid.uuid4().hex[:8]}"  # a fresh profile each time: no cache, no state
    cmd = [CHROMIUM, *FLAGS, f"--user-data-dir={profile}"]
    if screenshot:
        cmd.append(f"--screenshot={screenshot}")
    proc = subprocess.run([*cmd, "--dump-dom", url], capture_output=True, text=True, timeout=180, cwd=tmp)
    assert proc.returncode == 0, proc.stderr[-2000:]
    if raw:
        return proc.stdout
    dom = re.sub(r"<script.*?</script>|<style.*?</style>", " ", proc.stdout, flags=re.S)
    return html.unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", dom)))


_SERVED = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {repo!r})
    from prefect import flow
    from prefect.events import DeploymentEventTrigger
    from edgehaul.platform.reporting import summary_table

    @flow(name="ui-triggered-{uid}")
    def on_contact(node: str) -> str:
        summary_table("ui-triggered-{uid}", [{{"node": node, "bundles": 0}}], "triggered by a contact window")
        return node

    if __name__ == "__main__":
        on_contact.serve(name="on-contact", triggers=[DeploymentEventTrigger(
            name="ui-contact-{uid}",
            expect={{"edgehaul.contact.opened"}},
            match={{"prefect.resource.id": "edgehaul.node.ui-{uid}"}},
            parameters={{"node": "{{{{ event.payload.node_id }}}}"}},
        )])
    """
)


def _artifacts(api: str, key: str) -> list[dict[str, Any]]:
    r = httpx.post(f"{api}/artifacts/filter", json={"artifacts": {"key": {"any_": [key]}}}, timeout=10,
                   auth=api_auth())
    r.raise_for_status()
    return r.json()


@pytest.mark.integration
def test_ui_shows_demo_run_artifacts_and_triggered_run(stack: localstack.StackState, tmp_path: Path) -> None:
    from botocore.exceptions import ClientError
    from prefect import flow, task
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    import edgehaul.tasks  # noqa: F401  (the product's tasks attach the domain loggers to the run logs)
    from edgehaul.platform.reporting import Progress, summary_table
    from edgehaul.platform.s3_errors import IO_RETRY

    uid = uuid.uuid4().hex[:8]
    puts: list[int] = []

    @task(name=f"put-bundle-{uid}", **{**IO_RETRY, "retry_delay_seconds": 0})
    def put_bundle() -> None:  # throttled once, as a busy store does: the retry is a domain log line
        puts.append(1)
        if len(puts) == 1:
            raise ClientError({"Error": {"Code": "SlowDown", "Message": "slow down"},  # type: ignore[typeddict-item]
                               "ResponseMetadata": {"HTTPStatusCode": 503}}, "PutObject")
    api = stack.prefect_api_url
    ui_proxy = AuthProxy(stack.prefect_ui_url, api_auth())
    ui = ui_proxy.url

    # A triggered run: a served deployment whose trigger matches a contact-window event.
    script = tmp_path / "served.py"
    script.write_text(_SERVED.format(uid=uid, repo=str(Path(__file__).resolve().parents[2])))
    env = {**os.environ, "PREFECT_RUNNER_POLL_FREQUENCY": "1", "PREFECT_LOGGING_LEVEL": "WARNING"}
    log = open(tmp_path / "serve.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, str(script)], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        # The demo run, with progress and a summary table, while the served flow starts.
        @flow(name=f"ui-demo-{uid}")
        def demo() -> str:
            with Progress(f"ui-demo-{uid}-progress", total=3, description="bundles validated") as p:
                for _ in range(3):
                    p.advance()
            put_bundle()
            summary_table(f"ui-demo-{uid}", [{"bundle": f"b-{uid}", "rows": 512, "status": "committed"}], "demo run")
            return str(flow_run.id)

        demo_id = demo()
        with get_client(sync_client=True) as client:
            demo_name = client.read_flow_run(uuid.UUID(demo_id)).name

        def served() -> Any:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            with get_client(sync_client=True) as client:
                try:
                    dep = client.read_deployment_by_name(f"ui-triggered-{uid}/on-contact")
                    return client.read_resource_related_automations(f"prefect.deployment.{dep.id}") and dep
                except Exception:
                    return None

        dep = wait_for(served, 120, "the served deployment's trigger", interval=0.5)
        events.emit(events.CONTACT_OPENED, f"edgehaul.node.ui-{uid}", {"node_id": f"ui-{uid}", "station_id": "gs-1"})

        def completed() -> Any:
            with get_client(sync_client=True) as client:
                runs = [r for r in client.read_flow_runs() if r.deployment_id == dep.id]
            return runs and runs[0].state and runs[0].state.is_completed() and runs[0]

        triggered = wait_for(completed, 150,
                             lambda: f"the triggered run completed; {(tmp_path / 'serve.log').read_text()[-3000:]}")
        time.sleep(3)  # the runner cancels runs it still tracks when stopped: let it release this one

        progress = _artifacts(api, f"ui-demo-{uid}-progress")
        assert progress and progress[0]["data"] == 100.0
        table = _artifacts(api, f"ui-demo-{uid}")[0]
        assert _artifacts(api, f"ui-triggered-{uid}")[0]["flow_run_id"] == str(triggered.id)

        run_log_lines(demo_id, f"retrying put-bundle-{uid}")  # shipped to the API before the page loads
        page = browse(f"{ui}/runs/flow-run/{demo_id}", tmp_path)
        assert demo_name in page and f"ui-demo-{uid}" in page and "Completed" in page, page[:1500]
        # the run's Logs tab shows the product's own log line (edgehaul.platform.s3_errors), not only Prefect's
        assert f"retrying put-bundle-{uid} after SlowDown" in page, page[:3000]

        page = browse(f"{ui}/artifacts/artifact/{table['id']}", tmp_path)
        assert f"ui-demo-{uid}" in page and f"b-{uid}" in page and "committed" in page, page[:1500]
        assert f"Flow Run {demo_name}" in page, page[:1500]

        shot = tmp_path / "ui-triggered-run.png"
        page = browse(f"{ui}/runs/flow-run/{triggered.id}", tmp_path, screenshot=shot)
        assert triggered.name in page and "Completed" in page, page[:1500]
        assert f"Automation ui-contact-{uid}" in page and "Deployment on-contact" in page, page[:1500]
        assert shot.stat().st_size > 20_000 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        keep_screenshot(shot, "ui-screenshot.png")
    finally:
        ui_proxy.close()
        proc.terminate()
        proc.wait(timeout=30)
        log.close()



@pytest.mark.integration
def test_ui_shows_the_fleet_view(stack: localstack.StackState, tmp_path: Path) -> None:
    """The fleet artifacts as an operator opens them: a row per node and the core, the chart an inline image."""
    import base64

    from prefect.artifacts import Artifact

    from edgehaul.blocks import EdgeNode
    from edgehaul.flows.fleet_report import FleetReportParams, fleet_report
    from edgehaul.ops import fleet
    from edgehaul.tasks.uplink import publish_link_stats
    from tests.conftest import store_for

    tag = uuid.uuid4().hex[:8]
    node = f"ui-fleet-{tag}"
    EdgeNode(node_id=node, spool_dir=str(tmp_path / node)).save(node, overwrite=True)
    assert publish_link_stats.fn(node, {"retransmission_rate": 0.02, "goodput_bps": 3e5, "rate_cap_use": 0.55,
                                        "retry_queue": 1, "queue_lengths": {"normal": 2}, "bundles_landed": 3,
                                        "spool_used_fraction": 0.3})
    store = store_for(stack, "lifecycle")
    store.save(f"ui-fleet-{tag}", overwrite=True)
    def reported() -> bool:  # the link-stats event must be in the event store before the report reads it
        fleet_report(FleetReportParams(store_block=f"ui-fleet-{tag}"))
        view = fleet.read_view(store)
        return bool(view and node in view.nodes and view.nodes[node].link_utilisation == 0.55)

    wait_for(reported, 60, f"the fleet view to show {node}'s link utilisation 0.55", interval=2)
    table, chart = Artifact.get("fleet-view"), Artifact.get("fleet-view-chart")
    assert table is not None and chart is not None
    ui_proxy = AuthProxy(stack.prefect_ui_url, api_auth())
    try:
        shot = tmp_path / "ui-fleet-view.png"
        page = browse(f"{ui_proxy.url}/artifacts/artifact/{table.id}", tmp_path, screenshot=shot)
        assert node in page and fleet.CORE in page and "0.550" in page, page[:2000]
        assert shot.stat().st_size > 20_000 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        keep_screenshot(shot, "ui-fleet-view.png")
        dom = browse(f"{ui_proxy.url}/artifacts/artifact/{chart.id}", tmp_path, raw=True)
        srcs = re.findall(r'<img[^>]*src="data:image/png;base64,([A-Za-z0-9+/=]+)"', dom)
        assert srcs and base64.b64decode(srcs[0])[:8] == b"\x89PNG\r\n\x1a\n", dom[:2000]
    finally:
        ui_proxy.close()


@pytest.mark.integration
def test_ui_shows_training_progress_logs_and_cost_chart(stack: localstack.StackState, tmp_path: Path) -> None:
    import base64
    from datetime import UTC, datetime

    from prefect.artifacts import Artifact
    from prefect.client.orchestration import get_client

    from edgehaul.blocks import PriceSheet
    from edgehaul.flows.cost_report import CostReportParams, cost_report
    from tests.conftest import store_for
    from tests.train_support import train_small

    tag = uuid.uuid4().hex[:8]
    store = store_for(stack, prefix=f"t-{tag}")
    state, out = train_small(store, tag, epochs=2)
    train_id = state.state_details.flow_run_id
    with get_client(sync_client=True) as client:
        train_name = client.read_flow_run(train_id).name
    epoch_line = f"run {out['run_id']} epoch 1: loss"
    run_log_lines(train_id, epoch_line)  # shipped to the API before the page loads
    progress = Artifact.get(f"train-m-{tag}-progress")
    assert progress is not None and progress.data == 100.0

    now = datetime.now(UTC)
    store_for(stack, "lifecycle", prefix=store.prefix).save(f"cost-{tag}")
    PriceSheet(uplink_per_gb=1.0).save(f"cost-{tag}")
    costs = cost_report(CostReportParams(store_block=f"cost-{tag}", prices_block=f"cost-{tag}", month=f"{now:%Y-%m}",
                                         now=now))
    summary = Artifact.get(f"cost-report-{now:%Y-%m}-summary")
    assert summary is not None
    bucket, key = costs["chart"].removeprefix("s3://").split("/", 1)
    png = store.client().get_object(Bucket=bucket, Key=key)["Body"].read()

    ui_proxy = AuthProxy(stack.prefect_ui_url, api_auth())
    ui = ui_proxy.url
    try:
        # The training run: its name says what it trained, its logs carry the trainer's epoch and checkpoint lines.
        shot = tmp_path / "ui-training-run.png"
        page = browse(f"{ui}/runs/flow-run/{train_id}", tmp_path, screenshot=shot)
        assert train_name in page and f"m-{tag} on landsat_patch@latest" in page and "Completed" in page, page[:1500]
        assert epoch_line in page and f"checkpoint committed run={out['run_id']}" in page, page[:3000]
        assert shot.stat().st_size > 20_000 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        keep_screenshot(shot, "ui-training-run.png")

        # Its progress artifact: 100 % and where the training got to.
        page = browse(f"{ui}/artifacts/artifact/{progress.id}", tmp_path)
        assert "100%" in page and "epoch 2/2: loss" in page, page[:1500]

        # The cost report's chart is rendered from the artifact itself: the page's <img> holds the stored PNG.
        dom = browse(f"{ui}/artifacts/artifact/{summary.id}", tmp_path, raw=True)
        srcs = re.findall(r'<img[^>]*src="data:image/png;base64,([A-Za-z0-9+/=]+)"', dom)
        assert [base64.b64decode(s) for s in srcs] == [png], dom[:2000]
    finally:
        ui_proxy.close()


def test_reporting_helpers_are_noops_outside_a_run() -> None:
    from edgehaul.platform.reporting import Progress, artifact_key, summary_table

    assert artifact_key("Core Ingest: node_A/2026") == "core-ingest-node-a-2026"
    assert artifact_key("***") == "edgehaul"
    with Progress("x", total=0) as p:  # total 0 is clamped, not a division by zero
        p.advance(5)
    assert p.percent == 100.0
    assert summary_table("x", [{"a": 1}]) is None


@given(n=st.integers(0, 2**50), other=st.integers(0, 10**6))
def test_table_artifacts_show_byte_counts_in_units_and_keep_everything_else(n: int, other: int) -> None:
    from edgehaul.platform.reporting import human_bytes, human_table

    rows = [{"metric": "bytes_landed", "value": n}, {"metric": "bundles_landed", "value": other},
            {"meter": "storage", "quantity": n, "unit": "bytes", "billed_quantity": other},
            {"tier": "high", "uplink_bytes": n, "samples": other}]
    out = human_table(rows)
    cols = ["metric", "value", "meter", "quantity", "unit", "billed_quantity", "tier", "uplink_bytes", "samples"]
    assert all(list(r) == cols for r in out)  # one column set: the UI's table needs it
    assert [out[0]["value"], out[2]["quantity"], out[3]["uplink_bytes"]] == [human_bytes(n)] * 3
    assert [out[1]["value"], out[2]["billed_quantity"], out[3]["samples"]] == [other] * 3
    assert out[1]["metric"] == "bundles_landed" and out[0]["quantity"] == ""


def _failed_runs_view(ui: str, since: datetime, tmp: Path, states: tuple[str, ...] = ("Failed", "Crashed"),
                      screenshot: Path | None = None) -> tuple[int, str]:
    """(runs the UI's Runs page counts, its text) with the page's own filters: these states, started
    since `since` (the saved-search query the state and date pickers write into the address)."""
    from urllib.parse import urlencode

    query = urlencode([("state", s) for s in states] + [
        ("type", "range"), ("startDate", since.isoformat().replace("+00:00", "Z")),
        ("endDate", (datetime.now(UTC) + timedelta(hours=1)).isoformat().replace("+00:00", "Z"))])
    page = browse(f"{ui}/runs?{query}", tmp, screenshot=screenshot)
    if "No flow runs" in page:
        return 0, page
    m = re.search(r"\b(\d+) runs?\b", page)
    assert m, f"the Runs page shows neither a run count nor 'No flow runs': {page[:2000]}"
    return int(m.group(1)), page


@pytest.mark.integration
@pytest.mark.timeout(1500)  # 4 worker processes and a process per flow run on a loaded 2-core machine
def test_ui_failed_runs_view_holds_no_failure_after_demo_deploy_deployment_run_and_two_verifies(
        stack: localstack.StackState, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The UI shows no failed run after the operator's sequence, typed in order: `make demo`, `make deploy`, a run
    through the deployments (`demo --via-deployments`), `make verify` twice; then the UI's Runs page filtered to
    Failed and Crashed, read in Chromium, counts no run since the sequence began."""
    from prefect.client.orchestration import get_client

    from edgehaul_dev import configure, demo, deploy, verify

    t0 = datetime.now(UTC) - timedelta(seconds=2)
    # `make` targets read the stack of EDGEHAUL_STACK_DIR (localstack.DEFAULT_ROOT): here the session's
    monkeypatch.setattr(localstack, "DEFAULT_ROOT", Path(stack.root))
    timings: dict[str, float] = {}
    clock = time.monotonic()

    def lap(name: str) -> None:
        nonlocal clock
        timings[name] = round(time.monotonic() - clock, 1)
        clock = time.monotonic()

    # make demo (edgehaul_dev.demo._main): blocks, then the pipeline as flow runs of this process
    configure.register_block_types()
    configure.save_blocks(stack)
    out = demo.run(samples=1500, epochs=2, nodes=["node-a", "node-b"])  # val rows enough for the gates (400: chance-level)
    assert out["train"].get("model_id"), out["train"]
    assert out["cost"]["month"] == demo.this_month()  # month to date: the demo's own use shows
    lap("demo")
    # make deploy: blocks, pools, deployments, triggers, alert automations, workers
    deployed = deploy.deploy(edge_workers=True)  # the demo simulates its nodes here, as `make verify-demo` does
    lap("deploy")
    try:
        # a run through the deployments, one node (a process per flow run: each costs 10-20 s here). Its sample
        # ids (node + number) start past any other test's: earlier tests of this session committed node-a rows
        # from spools of their own to the same dataset, and rows already there make no version and no training
        via = demo.run_via_deployments(300, 1, ["node-a"], stack, timeout=900, start_seq=int(time.time() * 1000))
        lap("via_deployments")
        assert via["bundles_landed"] > 0, via
        assert via["versions_committed"] > 0, via  # else nothing trains through the deployment, and verify says so
        bad = [r for r in via["runs"] if not demo.run_ok(r)]
        assert not bad, bad
        # make verify, twice
        verdicts = []
        for i in (1, 2):
            verify.prerequisites(stack)
            checks = verify.run_checks(stack, say=lambda s: None)
            verdicts.append({c.name: (c.ok, c.detail) for c in checks})
            lap(f"verify_{i}")

        ui_proxy = AuthProxy(stack.prefect_ui_url, api_auth())
        try:
            shot = tmp_path / "ui-failed-runs.png"
            failed, page = _failed_runs_view(ui_proxy.url, t0, tmp_path, screenshot=shot)
            done, done_page = _failed_runs_view(ui_proxy.url, t0, tmp_path, states=("Completed",))
        finally:
            ui_proxy.close()
        lap("ui")
        print(f"timings {timings}; failed runs in the UI: {failed}; completed: {done}")
        with get_client(sync_client=True) as client:  # only to name them when the page counts some
            from prefect.client.schemas.filters import (
                FlowRunFilter,
                FlowRunFilterStartTime,
                FlowRunFilterState,
                FlowRunFilterStateName,
            )

            named = [f"{r.name}: {r.state_name}: {(r.state.message or '')[:300] if r.state else ''}"
                     for r in client.read_flow_runs(flow_run_filter=FlowRunFilter(
                         state=FlowRunFilterState(name=FlowRunFilterStateName(any_=["Failed", "Crashed"])),
                         start_time=FlowRunFilterStartTime(after_=t0)), limit=50)]  # type: ignore[arg-type]
        assert failed == 0, (failed, named, page[:2000])
        # the same page does count runs: the sequence's completed ones
        assert done >= len(via["runs"]), (done, done_page[:2000])
        # each failing check whole (a dict of all six is cut short in a CI log)
        failing = [f"verify {i}: {name}: {detail}" for i, v in enumerate(verdicts, 1)
                   for name, (ok, detail) in v.items() if not ok]
        for line in failing:
            print(line)
        assert not failing, "\n".join(failing)
    finally:
        pid = localstack._read_pid(Path(stack.root), "workers")
        if pid:
            os.killpg(pid, signal.SIGTERM)
            (Path(stack.root) / "pids" / "workers.pid").unlink(missing_ok=True)
        spec = deploy.load_spec(overlay=deploy.DEMO_OVERLAY)
        # leave no schedules, triggers or unserved runs to the session's other tests (a name not deployed: skipped)
        delete_deployments_named(deploy.deployment_names(spec))
        with get_client(sync_client=True) as client:
            for name in {t["name"] for ts in deploy.split_triggers(spec)[1].values() for t in ts}:
                for a in client.read_automations_by_name(name):
                    client.delete_automation(a.id)
            for name in deployed.get("automations", []):
                for a in client.read_automations_by_name(name):
                    client.delete_automation(a.id)
            # and no pools: their stopped workers' heartbeats stay fresh for 2 minutes, which later tests
            # (verify's no-deployment case) would read as a deployed control plane
            for name in deploy.pools_of(spec):
                with contextlib.suppress(Exception):  # not made: deploy failed before it
                    client.delete_work_pool(name)


@pytest.mark.integration
def test_ui_block_pages_show_no_logo_that_needs_the_internet(stack: localstack.StackState, tmp_path: Path) -> None:
    """The core's results block (prefect-aws S3Bucket) and the alert webhook block, as `blocks apply` and
    the alert automations save them: their pages in Chromium name no image off this site (cdn.sanity.io,
    raw.githubusercontent.com load nowhere offline: broken icons)."""
    from prefect.client.orchestration import get_client

    from edgehaul.blocks.logos import UNREACHABLE
    from edgehaul.platform.caching import core_result_storage_block
    from edgehaul.services.automations import ensure_webhook_block
    from edgehaul_dev import configure
    from tests.conftest import store_for

    tag = uuid.uuid4().hex[:8]
    with get_client(sync_client=True) as client:
        core_result_storage_block(store_for(stack, "ingest")).save(f"logo-results-{tag}")  # as prefect-aws saves it
        assert client.read_block_type_by_slug("s3-bucket").logo_url is not None  # the internet logo is back
        assert "S3Bucket" in configure.save_blocks(stack)  # `edgehaul blocks apply` for the stack
        hook = ensure_webhook_block("http://127.0.0.1:9/alerts", f"logo-hook-{tag}")
        results = client.read_block_document_by_name(f"logo-results-{tag}", "s3-bucket")
        assert {s: client.read_block_type_by_slug(s).logo_url for s in UNREACHABLE} == dict.fromkeys(UNREACHABLE)
    ui_proxy = AuthProxy(stack.prefect_ui_url, api_auth())
    try:
        for doc_id, name in ((results.id, f"logo-results-{tag}"), (hook, f"logo-hook-{tag}")):
            dom = browse(f"{ui_proxy.url}/blocks/block/{doc_id}", tmp_path, raw=True)
            assert name in dom, dom[:2000]
            srcs = re.findall(r'<img[^>]*src="([^"]+)"', dom)
            offsite = [s for s in srcs if re.match(r"https?://", s) and not s.startswith(ui_proxy.url)]
            assert not offsite, offsite
    finally:
        ui_proxy.close()
        with get_client(sync_client=True) as client:
            for doc in (results.id, hook):
                client.delete_block_document(doc)
