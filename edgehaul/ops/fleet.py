"""The fleet view: link, spool, queue and accelerator figures per node and the core's queue, checkpoint,
write-throughput and model-freshness figures, from what is stored.

Inputs are plain data, gathered by `edgehaul.tasks.fleet`: each node's latest LINK_STATS and
SPOOL_WATERMARK events (Prefect's event store), the EdgeNode blocks (node ids, contact plans),
core_ingest flow runs (queue time), checkpoint events, the curated zone's objects (write throughput),
the published model's pointer vs its dataset's latest version, and the latency from a bundle's
landing (its LANDING_BATCH announcement) to its commit (core_ingest's receipt): the core's own records,
not what a node claims.

A node's events are its data, not the report's: a payload that does not hold what it should (a word
where a number belongs) makes that figure NaN and costs one line in the run's log, never the view.

One `FleetView` is the artifact (table + chart), the JSON at `reports/fleet/latest.json` in the ops
bucket, and the OpenMetrics text the metrics endpoint serves: the same figures in all three.
A figure nobody reported is NaN (OpenMetrics allows it), never a made-up zero.
"""

from __future__ import annotations

import base64
import io
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

from edgehaul.blocks import ObjectStore


class ContactWindow(Protocol):
    """A predicted contact window of a node's plan (`edgehaul.uplink.pass_plan.Pass` is one)."""

    @property
    def start(self) -> datetime: ...
    @property
    def end(self) -> datetime: ...
    @property
    def duration_s(self) -> float: ...


CORE = "core"  # the `node` label of the core's figures
REPORT_PATH = "reports/fleet/latest.json"
NAN = float("nan")
CHECKPOINT_MARKER = "COMMIT.json"  # edgehaul.training.checkpoints.MARKER (not imported: it pulls in torch)


@dataclass(frozen=True)
class Metric:
    name: str  # OpenMetrics family name (gauge)
    help: str
    scope: str  # "node" or "core"
    field: str  # attribute of NodeFigures / CoreFigures
    quantiles: tuple[str, ...] = ()  # a `quantile` label per value of a dict field


# The monitored set (link, node, cluster figures), one gauge family each; every family carries a `node` label.
METRICS: tuple[Metric, ...] = (
    Metric("edgehaul_link_utilisation_ratio", "Goodput as a fraction of the link's rate cap (last drain).", "node",
           "link_utilisation"),
    Metric("edgehaul_link_retransmission_ratio", "Retransmitted fraction of link traffic (last drain).", "node",
           "retransmission_rate"),
    Metric("edgehaul_landing_latency_seconds", "Landed-to-committed latency percentiles over the window, from the "
           "core's records (landing announcement to commit receipt).", "node", "latency_s", ("0.5", "0.99")),
    Metric("edgehaul_spool_used_ratio", "Edge spool fill as a fraction of its cap (the watermark figure).", "node",
           "spool_used"),
    Metric("edgehaul_uplink_queue_length", "Bundles waiting to uplink: spool queue plus retry queue.", "node",
           "uplink_queue"),
    Metric("edgehaul_accelerator_utilisation_ratio", "Node accelerator busy fraction, as the node reports it.",
           "node", "accelerator_utilisation"),
    Metric("edgehaul_node_silence_seconds", "Seconds since the node was last heard from (its last drain).", "node",
           "silence_s"),
    Metric("edgehaul_core_task_queue_seconds", "core_ingest runs: scheduled-to-started delay percentiles.", "core",
           "queue_s", ("0.5", "0.95")),
    Metric("edgehaul_checkpoint_success_ratio", "Committed checkpoints / checkpoint write attempts in the window.",
           "core", "checkpoint_success"),
    Metric("edgehaul_storage_write_bytes_per_second", "Bytes written into the curated datasets per second, window "
           "average.", "core", "write_bps"),
    Metric("edgehaul_model_data_versions_behind", "Published model's dataset version behind the dataset's latest.",
           "core", "model_versions_behind"),
    Metric("edgehaul_model_age_seconds", "Seconds since the published model was published.", "core", "model_age_s"),
)


@dataclass
class NodeFigures:
    node_id: str
    last_seen: datetime | None = None
    link_utilisation: float = NAN
    retransmission_rate: float = NAN
    latency_s: dict[str, float] = field(default_factory=lambda: {"0.5": NAN, "0.99": NAN})
    spool_used: float = NAN
    uplink_queue: float = NAN
    accelerator_utilisation: float = NAN
    silence_s: float = NAN


@dataclass
class CoreFigures:
    queue_s: dict[str, float] = field(default_factory=lambda: {"0.5": NAN, "0.95": NAN})
    checkpoint_success: float = NAN
    checkpoints_committed: int = 0
    checkpoints_failed: int = 0
    write_bps: float = NAN
    model_versions_behind: float = NAN
    model_age_s: float = NAN


@dataclass
class FleetView:
    at: datetime
    window_s: float
    nodes: dict[str, NodeFigures]
    core: CoreFigures

    def to_json(self) -> bytes:
        def enc(o: Any) -> Any:
            if isinstance(o, datetime):
                return o.isoformat()
            if isinstance(o, float) and math.isnan(o):
                return None
            if isinstance(o, dict):
                return {k: enc(v) for k, v in o.items()}
            return o

        doc = {"at": self.at.isoformat(), "window_s": self.window_s,
               "nodes": {n: enc(asdict(f)) for n, f in sorted(self.nodes.items())}, "core": enc(asdict(self.core))}
        return json.dumps(doc, indent=1).encode()

    @classmethod
    def from_json(cls, body: bytes) -> FleetView:
        doc = json.loads(body)

        def num(v: Any) -> float:
            return NAN if v is None else float(v)

        def nums(d: dict[str, Any]) -> dict[str, float]:
            return {k: num(v) for k, v in d.items()}

        nodes = {}
        for n, f in doc["nodes"].items():
            seen = f.pop("last_seen")
            nodes[n] = NodeFigures(
                node_id=f.pop("node_id"), last_seen=datetime.fromisoformat(seen) if seen else None,
                latency_s=nums(f.pop("latency_s")), **{k: num(v) for k, v in f.items()})
        c = doc["core"]
        core = CoreFigures(queue_s=nums(c.pop("queue_s")), checkpoints_committed=int(c.pop("checkpoints_committed")),
                           checkpoints_failed=int(c.pop("checkpoints_failed")), **{k: num(v) for k, v in c.items()})
        return cls(at=datetime.fromisoformat(doc["at"]), window_s=float(doc["window_s"]), nodes=nodes, core=core)


# -- node figures -------------------------------------------------------------------------------------
def _is_num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _num(p: dict[str, Any], key: str, bad: list[str]) -> float:
    v = p.get(key)
    if v is None:
        return NAN
    if not _is_num(v):
        bad.append(f"{key}={str(v)[:40]!r}")
        return NAN
    return float(v)


def _queue(p: dict[str, Any], bad: list[str]) -> float:
    queued, retry = p.get("queue_lengths"), p.get("retry_queue", 0) or 0
    if queued is None:
        return NAN
    if not isinstance(queued, dict) or not all(_is_num(v) for v in [*queued.values(), retry]):
        bad.append(f"queue_lengths={str(queued)[:60]!r} retry_queue={str(retry)[:20]!r}")
        return NAN
    return float(sum(queued.values()) + retry)


def node_figures(node_id: str, link_stats: tuple[datetime, dict[str, Any]] | None,
                 spool_alert: tuple[datetime, dict[str, Any]] | None, now: datetime,
                 latency_s: dict[str, float] | None = None, problems: list[str] | None = None) -> NodeFigures:
    """A node's figures from its latest LINK_STATS payload (and a later spool alert, if any), with the
    core-measured `latency_s`. A field that is not a finite number is NaN and named in `problems`."""
    f = NodeFigures(node_id)
    bad: list[str] = []
    if latency_s is not None:
        f.latency_s = dict(latency_s)
    if link_stats is not None:
        at, p = link_stats
        p = p if isinstance(p, dict) else {}
        f.last_seen = at
        f.link_utilisation = _num(p, "rate_cap_use", bad)
        f.retransmission_rate = _num(p, "retransmission_rate", bad)
        f.spool_used = _num(p, "spool_used_fraction", bad)
        f.uplink_queue = _queue(p, bad)
        f.accelerator_utilisation = _num(p, "accelerator_utilisation", bad)
    if spool_alert is not None and (link_stats is None or spool_alert[0] > link_stats[0]):
        p = spool_alert[1] if isinstance(spool_alert[1], dict) else {}
        f.spool_used = _num(p, "used_fraction", bad)  # the newer reading wins
    f.silence_s = (now - f.last_seen).total_seconds() if f.last_seen else NAN
    if bad and problems is not None:
        problems.append(f"node {node_id}: unusable figures in its latest events: {', '.join(bad)}")
    return f


def commit_latencies(batches: Iterable[tuple[datetime, dict[str, Any]]],
                     receipts: Iterable[tuple[datetime, str, str]]) -> dict[str, dict[str, float]]:
    """Per node, p50/p99 seconds from a bundle's first landing announcement (LANDING_BATCH: occurred,
    payload) to its commit receipt (occurred, node, bundle id): both are the core's records. A payload
    that is not the expected shape is skipped (it is not a node's to write)."""
    landed: dict[tuple[str, str], datetime] = {}
    for at, p in batches:
        keys, ids = p.get("bundle_keys"), p.get("bundle_ids")
        if not isinstance(keys, list) or not isinstance(ids, list) or len(keys) != len(ids):
            continue
        for key, bundle in zip(keys, ids, strict=True):
            if isinstance(key, str) and isinstance(bundle, str):
                k = (key.split("/", 1)[0], bundle)
                landed[k] = min(at, landed.get(k, at))
    waits: dict[str, list[float]] = {}
    for at, node, bundle in receipts:
        t0 = landed.get((node, bundle))
        if t0 is not None:
            waits.setdefault(node, []).append(max(0.0, (at - t0).total_seconds()))
    return {n: {"0.5": percentile(w, 0.5), "0.99": percentile(w, 0.99)} for n, w in waits.items()}


# -- silence against the contact plan ------------------------------------------------------------------
@dataclass(frozen=True)
class Silence:
    node_id: str
    last_seen: datetime | None
    allowed_s: float  # how long the contact plan (or the default bound) lets the node be silent now
    reason: str


def silence(node_id: str, last_seen: datetime | None, passes: Sequence[ContactWindow] | None, now: datetime, *,
            default_s: float, grace_s: float) -> Silence | None:
    """A Silence when the node has been quiet longer than its contact plan allows, else None.

    With a pass schedule, a node speaks in every pass (each drain publishes link stats): it is silent
    once a pass ended `grace_s` ago without a word from the node since that pass began. Without a
    schedule the bound is `default_s` since it was last heard.
    """
    if passes:
        ended = [p for p in passes if p.end + timedelta(seconds=grace_s) <= now]
        if not ended:
            return None
        last = max(ended, key=lambda p: p.start)
        if last_seen is not None and last_seen >= last.start:
            return None
        return Silence(node_id, last_seen, (now - last.start).total_seconds(),
                       f"no word during the pass of {last.start.isoformat()} ({last.duration_s:.0f} s)")
    if last_seen is not None and (now - last_seen).total_seconds() <= default_s:
        return None
    return Silence(node_id, last_seen, default_s, f"not heard from for more than {default_s:.0f} s")


# -- core figures --------------------------------------------------------------------------------------
def percentile(xs: Sequence[float], q: float) -> float:
    """Nearest-rank percentile; NaN for no samples."""
    if not xs:
        return NAN
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def queue_times(runs: Iterable[tuple[datetime | None, datetime | None]]) -> dict[str, float]:
    """p50/p95 of start - expected start over runs that started (negative delays count as 0)."""
    delays = [max(0.0, (start - expected).total_seconds()) for expected, start in runs if expected and start]
    return {"0.5": percentile(delays, 0.5), "0.95": percentile(delays, 0.95)}


def checkpoint_success(committed: int, failed_attempts: int) -> float:
    total = committed + failed_attempts
    return committed / total if total else NAN


def write_throughput(store: ObjectStore, since: datetime, now: datetime) -> float:
    """Bytes of curated-dataset objects written in [since, now) per second of that window."""
    from edgehaul.ops.lifecycle import list_objects

    s3 = store.client()
    written = sum(o.size for o in list_objects(s3, store.bucket("curated"), store.key("curated"))
                  if since <= o.last_modified < now)
    return written / max(1e-9, (now - since).total_seconds())


def committed_checkpoints(store: ObjectStore, since: datetime) -> int:
    """Commit markers written since `since` (pruned ones are gone: a lower bound over long windows)."""
    from edgehaul.ops.lifecycle import list_objects

    s3 = store.client()
    return sum(1 for o in list_objects(s3, store.bucket("checkpoints"), store.key("checkpoints"))
               if o.key.endswith(f"/{CHECKPOINT_MARKER}") and o.last_modified >= since)


@dataclass(frozen=True)
class ModelStatus:
    model_id: str
    dataset_uri: str
    trained_version: int
    latest_version: int
    published: datetime
    age_s: float

    @property
    def versions_behind(self) -> int:
        return max(0, self.latest_version - self.trained_version)


def is_stale(status: ModelStatus, *, max_age_s: float, max_versions_behind: int) -> bool:
    """Stale: newer data exists and the model is older than the bound, or it is too many versions behind."""
    behind = status.versions_behind
    return behind > max_versions_behind or (behind > 0 and status.age_s > max_age_s)


# -- outputs -------------------------------------------------------------------------------------------
def _fmt(v: float, digits: int = 3) -> str:
    return "-" if math.isnan(v) else f"{v:.{digits}f}"


def table_rows(view: FleetView) -> list[dict[str, Any]]:
    """One row per node plus one for the core: the artifact's table."""
    rows: list[dict[str, Any]] = []
    for n, f in sorted(view.nodes.items()):
        rows.append({"node": n, "last_seen": f.last_seen.isoformat() if f.last_seen else "never",
                     "link_util": _fmt(f.link_utilisation), "retrans": _fmt(f.retransmission_rate, 4),
                     "latency_p50_s": _fmt(f.latency_s["0.5"], 1), "latency_p99_s": _fmt(f.latency_s["0.99"], 1),
                     "spool_used": _fmt(f.spool_used), "uplink_queue": _fmt(f.uplink_queue, 0),
                     "accel_util": _fmt(f.accelerator_utilisation)})
    c = view.core
    rows.append({"node": CORE, "queue_p50_s": _fmt(c.queue_s["0.5"], 1), "queue_p95_s": _fmt(c.queue_s["0.95"], 1),
                 "checkpoint_success": _fmt(c.checkpoint_success),
                 "checkpoints": f"{c.checkpoints_committed} ok / {c.checkpoints_failed} failed",
                 "write_bytes_per_s": _fmt(c.write_bps, 0), "model_versions_behind": _fmt(c.model_versions_behind, 0),
                 "model_age_s": _fmt(c.model_age_s, 0)})
    return rows


def chart_png(view: FleetView) -> bytes:
    """Per node: link utilisation, spool fill and retransmission rate (bars; a missing figure is absent)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted(view.nodes)
    fig, ax = plt.subplots(figsize=(max(5.0, 1.2 * len(names) + 2), 3.5))
    width = 0.27
    for i, (label, attr) in enumerate((("link utilisation", "link_utilisation"), ("spool used", "spool_used"),
                                       ("retransmission", "retransmission_rate"))):
        ys = [getattr(view.nodes[n], attr) for n in names]
        ax.bar([x + (i - 1) * width for x in range(len(names))], [0 if math.isnan(y) else y for y in ys], width,
               label=label)
    ax.axhline(0.85, color="tab:red", linestyle="--", linewidth=0.8, label="spool alert (85%)")
    ax.set_xticks(range(len(names)), names, rotation=30, fontsize=7)
    ax.set_ylim(0, 1.05)
    ax.set_title(f"Fleet at {view.at:%Y-%m-%d %H:%M} UTC")
    ax.legend(fontsize=7)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=72)
    plt.close(fig)
    return buf.getvalue()


def markdown(view: FleetView, png: bytes) -> str:
    """Markdown summary with the chart inline (a data: URI: no link to sign, nothing to expire)."""
    silent = sorted(n for n, f in view.nodes.items() if f.last_seen is None)
    c = view.core
    return "\n".join([
        f"# Fleet view {view.at:%Y-%m-%d %H:%M} UTC",
        "",
        f"{len(view.nodes)} nodes ({len(silent)} never heard from{': ' + ', '.join(silent) if silent else ''}); "
        f"core queue p95 {_fmt(c.queue_s['0.95'], 1)} s, checkpoint success {_fmt(c.checkpoint_success)}, "
        f"write {_fmt(c.write_bps, 0)} B/s, model {_fmt(c.model_versions_behind, 0)} versions behind.",
        "",
        f"![fleet](data:image/png;base64,{base64.b64encode(png).decode()})",
    ])


def openmetrics(view: FleetView, *, now: datetime | None = None) -> bytes:
    """The view as OpenMetrics text: one gauge family per guide metric, `node` label on every sample."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import GaugeMetricFamily
    from prometheus_client.openmetrics.exposition import generate_latest

    class _Collector:
        def collect(self) -> Iterable[GaugeMetricFamily]:
            for m in METRICS:
                labels = ["node", "quantile"] if m.quantiles else ["node"]
                fam = GaugeMetricFamily(m.name, m.help, labels=labels)
                figures: list[tuple[str, Any]] = (
                    [(n, f) for n, f in sorted(view.nodes.items())] if m.scope == "node" else [(CORE, view.core)])
                for node, f in figures:
                    v = getattr(f, m.field)
                    if m.quantiles:
                        for q in m.quantiles:
                            fam.add_metric([node, q], v.get(q, NAN))
                    else:
                        fam.add_metric([node], v)
                yield fam
            age = GaugeMetricFamily("edgehaul_fleet_report_age_seconds", "Seconds since the fleet view was built.")
            age.add_metric([], ((now or datetime.now(UTC)) - view.at).total_seconds())
            yield age

    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Collector())
    return generate_latest(reg)


def write_view(store: ObjectStore, view: FleetView) -> str:
    """The view as `reports/fleet/latest.json` in the ops bucket (what the endpoint serves)."""
    key = store.key("ops", REPORT_PATH)
    store.client().put_object(Bucket=store.bucket("ops"), Key=key, Body=view.to_json(), ContentType="application/json")
    return store.uri("ops", REPORT_PATH)


def read_view(store: ObjectStore) -> FleetView | None:
    from botocore.exceptions import ClientError

    from edgehaul.platform.s3_errors import error_code

    try:
        body = store.client().get_object(Bucket=store.bucket("ops"), Key=store.key("ops", REPORT_PATH))["Body"].read()
    except ClientError as e:
        if error_code(e) in ("NoSuchKey", "404"):
            return None
        raise
    return FleetView.from_json(body)
