"""Metering and pricing: uplink, storage, accelerator hours and requests, per team.

Meters (one source each, so nothing is counted twice). What a node wrote is never believed about
its bill: node, team and bytes come from what the core measured, not from a manifest's claims.
- uplink bytes per node and team: each landing manifest whose object arrived (LastModified) in the
  month is one bundle; the lifecycle never moves manifests, so they stay countable. Node: the first
  segment of its landing key (a node's S3 identity writes only under its own prefix); team: the
  operator's EdgeNode block of that node (`node_teams`; a node without one is `unassigned`); bytes: the
  size the store lists for the bundle's data object (`<bundle>.parquet`, in landing or moved to cold;
  manifests are billed as storage). Bytes whose manifest object says `link: backup` (metadata the uplink
  writes) are billed as `uplink_backup` at the backup link's price, the rest as `uplink`. That split is the
  one thing the node reports (the core cannot see which link carried a bundle): its lines say
  `basis: node-reported`, and it only moves the node's own measured bytes between the two prices of the
  node's own team, never more bytes than the core listed and never to another node or team;
- storage bytes per class and team: a listing of every zone bucket under the store prefix (Size,
  StorageClass). Team: landing and quarantine objects by their node (its EdgeNode block), `models/<name>/<id>/`
  by that model's lineage, cold copies like their source; anything else (datasets, checkpoints, ops)
  is `shared`. Priced as one month at the snapshot taken by the report, on billable bytes (the class's
  minimum billable size and per-object overhead);
- accelerator hours per team: `lineage.json` of models (`team`, `accelerator_hours`) finished in the month;
- requests: the metering log below. Flows count their own S3 calls with `RequestMeter` and append them
  (boto3 calls only: reads deltalake/pyarrow make through their own S3 clients are not counted, and
  flows that record nothing are not metered; the meter is as complete as its callers).

An input the report cannot use (a metering record that does not parse, a manifest object gone between
list and HEAD) costs one line in `CostReport.problems` (shown in the summary), never the report.

Metering log (append-only; anyone may write): `record_usage(store, UsageRecord(...))` writes one
JSON-lines object at `<ops prefix>metering/usage/<yyyy-mm>/<yyyymmddTHHMMSS>-<uuid>.jsonl` with
`If-None-Match: *`, each line `{"at": iso, "meter": "requests", "quantity": float, "unit": "requests",
"team": str, "node": str, "source": str}`. Records are never rewritten; a month is summed by `at`.

Units: GB = 2**30 bytes. Outputs of `build_report`: report lines (one row per meter x team x node x
class with quantity, unit price and cost), the storage snapshot (kept under `metering/storage/` so
the chart can show bytes per tier over time), a markdown summary and a PNG chart.
"""

from __future__ import annotations

import base64
import io
import json
import uuid
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from edgehaul.ops.lifecycle import list_objects, model_lineages, origin_of
from edgehaul.ops.storage_classes import billable_bytes

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

    from edgehaul.blocks import ObjectStore, PriceSheet

GB = 2**30
USAGE = "metering/usage/"
SNAPSHOTS = "metering/storage/"
REPORTS = "reports/costs/"
SHARED = "shared"
UNASSIGNED = "unassigned"  # the team of a node no EdgeNode block names: billed to nobody until an operator says
MANIFEST = ".manifest.json"
MEASURED, NODE_REPORTED = "measured", "node-reported"  # a report line's basis: what the core saw, or a node's word


class MeteringError(ValueError):
    """A metering input is malformed; the message names the object."""


# ------------------------------------------------------------------------------ metering log


@dataclass(frozen=True)
class UsageRecord:
    at: datetime
    meter: str  # "requests" is the one the report prices today
    quantity: float
    unit: str = "requests"
    team: str = SHARED
    node: str = ""
    source: str = ""  # e.g. the flow that made the requests

    def to_json(self) -> str:
        d = asdict(self)
        d["at"] = self.at.isoformat()
        return json.dumps(d, sort_keys=True)


def record_usage(store: ObjectStore, records: UsageRecord | list[UsageRecord], s3: S3Client | None = None) -> str:
    """Append usage records to the metering log (one new object per call). Returns its key."""
    recs = [records] if isinstance(records, UsageRecord) else list(records)
    if not recs:
        raise ValueError("record_usage: no records")
    for r in recs:
        if r.at.tzinfo is None:
            raise ValueError(f"record_usage: `at` must be timezone-aware ({r.meter} from {r.source!r})")
        if r.quantity < 0:
            raise ValueError(f"record_usage: negative quantity {r.quantity} ({r.meter} from {r.source!r})")
    at = recs[0].at.astimezone(UTC)
    key = store.key("ops", f"{USAGE}{at:%Y-%m}/{at:%Y%m%dT%H%M%S}-{uuid.uuid4().hex}.jsonl")
    body = "\n".join(r.to_json() for r in recs).encode()
    (s3 or store.client()).put_object(Bucket=store.bucket("ops"), Key=key, Body=body, IfNoneMatch="*")
    return key


class RequestMeter:
    """Counts S3 API calls (one per operation call; each pagination page is one).

    `RequestMeter(client)` counts one client's calls; `with RequestMeter.process() as m:` counts the
    calls of every client created from boto3's default session inside the block (`ObjectStore.client()`
    creates its clients there), which is how a flow meters the requests of its tasks.
    """

    def __init__(self, s3: S3Client | None = None) -> None:
        self.count = 0
        self.by_operation: dict[str, int] = defaultdict(int)
        if s3 is not None:
            s3.meta.events.register("before-call.s3", self._on_call)

    def _on_call(self, model: Any = None, **_: Any) -> None:
        self.count += 1
        self.by_operation[getattr(model, "name", "?")] += 1

    @classmethod
    @contextmanager
    def process(cls) -> Iterator[RequestMeter]:
        import boto3

        if boto3.DEFAULT_SESSION is None:
            boto3.setup_default_session()
        session = boto3.DEFAULT_SESSION
        assert session is not None
        meter = cls()
        uid = f"edgehaul-request-meter-{id(meter)}"
        session.events.register("before-call.s3", meter._on_call, unique_id=uid)
        try:
            yield meter
        finally:
            session.events.unregister("before-call.s3", unique_id=uid)


def usage_records(s3: S3Client, store: ObjectStore, start: datetime, end: datetime,
                  problems: list[str] | None = None) -> list[UsageRecord]:
    """The month's records; a malformed one is a line in `problems` (raised without it)."""
    out = []
    months = sorted({f"{start:%Y-%m}", f"{end:%Y-%m}"})
    for m in months:
        for o in list_objects(s3, store.bucket("ops"), store.key("ops", f"{USAGE}{m}/")):
            for line in s3.get_object(Bucket=o.bucket, Key=o.key)["Body"].read().decode().splitlines():
                if not line.strip():
                    continue
                try:
                    d = json.loads(line)
                    d["at"] = datetime.fromisoformat(d["at"])
                    rec = UsageRecord(**d)
                    if not isinstance(rec.quantity, int | float) or rec.quantity < 0 or rec.quantity > 1e15:
                        raise ValueError(f"quantity {rec.quantity!r}")
                except (json.JSONDecodeError, TypeError, KeyError, ValueError, AttributeError) as e:
                    err = MeteringError(f"s3://{o.bucket}/{o.key}: malformed usage record {line[:120]!r} ({e})")
                    if problems is None:
                        raise err from e
                    problems.append(str(err))
                    continue
                if start <= rec.at < end:
                    out.append(rec)
    return out


# ---------------------------------------------------------------------------------- meters


def month_bounds(month: str) -> tuple[datetime, datetime]:
    start = datetime.strptime(month, "%Y-%m").replace(tzinfo=UTC)
    end = start.replace(year=start.year + 1, month=1) if start.month == 12 else start.replace(month=start.month + 1)
    return start, end


def _manifests(s3: S3Client, store: ObjectStore) -> list[tuple[datetime, str]]:
    """(arrival time, key) of every landing manifest."""
    return [(o.last_modified, o.key) for o in list_objects(s3, store.bucket("landing"), store.key("landing"))
            if o.key.endswith(MANIFEST)]


def landed_sizes(s3: S3Client, store: ObjectStore) -> dict[str, int]:
    """Landing key -> size as the store lists it, for objects still in landing or moved to cold (the
    cold copy stands for its source; one that is in both counts once)."""
    landing = store.bucket("landing")
    sizes = {o.key: o.size for o in list_objects(s3, landing, store.key("landing"))}
    for o in list_objects(s3, store.bucket("cold"), store.key("cold")):
        try:
            bucket, key = origin_of(store, o.key)
        except ValueError:
            continue
        if bucket == landing:
            sizes.setdefault(key, o.size)
    return sizes


def node_of_key(store: ObjectStore, key: str) -> str:
    """The node a landing key belongs to: its first segment under the landing prefix."""
    return key[len(store.key("landing")):].split("/", 1)[0]


def meter_uplink(s3: S3Client, store: ObjectStore, start: datetime, end: datetime,
                 node_teams: dict[str, str] | None = None, problems: list[str] | None = None,
                 sizes: dict[str, int] | None = None) -> list[dict[str, Any]]:
    """Per node and team: bundles and bytes that arrived in [start, end), and of those bytes how many the
    backup link carried (the `link` metadata the uplink writes on each manifest object). Node from the
    key, team from `node_teams`, bytes from `sizes` (`landed_sizes`): never from the manifest's body."""
    teams = node_teams or {}
    sizes = landed_sizes(s3, store) if sizes is None else sizes
    acc: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0])
    for at, key in _manifests(s3, store):
        if not start <= at < end:
            continue
        node = node_of_key(store, key)
        stem = key.removesuffix(MANIFEST)
        nbytes = sizes.get(stem + ".parquet", 0)
        try:
            meta = dict(s3.head_object(Bucket=store.bucket("landing"), Key=key).get("Metadata") or {})
        except Exception as e:  # gone between list and HEAD, or unreadable: billed as primary, said once
            meta = {}
            if problems is not None:
                problems.append(f"s3://{store.bucket('landing')}/{key}: no link metadata ({type(e).__name__}): "
                                "billed at the primary link's price")
        team = teams.get(node, UNASSIGNED)
        acc[(node, team)][0] += 1
        acc[(node, team)][1] += nbytes
        if meta.get("link") == "backup":
            acc[(node, team)][2] += nbytes
    return [{"node": n, "team": t, "bundles": v[0], "bytes": v[1], "backup_bytes": v[2]}
            for (n, t), v in sorted(acc.items())]


@dataclass
class TeamMap:
    node_team: dict[str, str] = field(default_factory=dict)
    model_team: dict[str, str] = field(default_factory=dict)  # "<base>models/<name>/<id>/" -> team

    def node(self, node_id: str) -> str:
        return self.node_team.get(node_id, UNASSIGNED)

    def team_of(self, store: ObjectStore, bucket: str, key: str) -> str:
        if bucket == store.bucket("cold"):
            try:
                bucket, key = origin_of(store, key)
            except ValueError:
                return SHARED
        base = store.key("landing")
        rel = key[len(base):]
        if bucket == store.bucket("landing"):
            return self.node(rel.split("/", 1)[0])
        if bucket == store.bucket("curated") and rel.startswith("quarantine/"):
            return self.node(rel.split("/")[1]) if rel.count("/") >= 2 else SHARED
        if bucket == store.bucket("models") and rel.startswith("models/"):
            parts = rel.split("/")
            if len(parts) >= 4:
                return self.model_team.get(base + "/".join(parts[:3]) + "/", SHARED)
        return SHARED


def team_map(lineages: list[dict[str, Any]], node_teams: dict[str, str] | None = None) -> TeamMap:
    """Node -> team from the operator's EdgeNode blocks (never a manifest), model -> team from lineage."""
    tm = TeamMap(node_team=dict(node_teams or {}))
    for lin in lineages:
        tm.model_team[lin["_key"].removesuffix("lineage.json")] = str(lin.get("team") or SHARED)
    return tm


def meter_storage(s3: S3Client, store: ObjectStore, teams: TeamMap) -> list[dict[str, Any]]:
    """Per bucket, storage class and team: objects, bytes and billable bytes now."""
    acc: dict[tuple[str, str, str], list[int]] = defaultdict(lambda: [0, 0, 0])
    base = store.key("landing")
    buckets = dict.fromkeys(store.bucket(z) for z in ("landing", "curated", "cold", "checkpoints", "ops"))
    for bucket in buckets:
        for o in list_objects(s3, bucket, base):
            a = acc[(bucket, o.storage_class, teams.team_of(store, bucket, o.key))]
            a[0] += 1
            a[1] += o.size
            a[2] += billable_bytes(o.size, o.storage_class)
    return [
        {"bucket": b, "storage_class": c, "team": t, "objects": v[0], "bytes": v[1], "billable_bytes": v[2]}
        for (b, c, t), v in sorted(acc.items())
    ]


def meter_accelerators(lineages: list[dict[str, Any]], start: datetime, end: datetime) -> list[dict[str, Any]]:
    acc: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for lin in lineages:
        if not start <= lin["_at"] < end:
            continue
        try:
            hours = float(lin["accelerator_hours"])
        except (KeyError, TypeError, ValueError) as e:
            raise MeteringError(f"{lin['_key']}: lineage lacks a numeric accelerator_hours ({e})") from e
        a = acc[str(lin.get("team") or SHARED)]
        a[0] += 1
        a[1] += hours
    return [{"team": t, "runs": int(v[0]), "hours": v[1]} for t, v in sorted(acc.items())]


def meter_backup_uplink(uplink: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per node and team: the landed bytes the backup link carried (from `meter_uplink`)."""
    return [{"node": u["node"], "team": u["team"], "bytes": u["backup_bytes"]} for u in uplink if u.get("backup_bytes")]


def meter_requests(records: list[UsageRecord]) -> list[dict[str, Any]]:
    acc: dict[tuple[str, str], float] = defaultdict(float)
    for r in records:
        if r.meter == "requests":
            acc[(r.team, r.source)] += r.quantity
    return [{"team": t, "source": s, "requests": q} for (t, s), q in sorted(acc.items())]


# ---------------------------------------------------------------------------------- report


@dataclass
class CostReport:
    month: str
    currency: str
    lines: list[dict[str, Any]]  # meter, team, node, storage_class, quantity, unit, unit_price, cost, basis
    storage: list[dict[str, Any]]
    taken_at: datetime
    problems: list[str] = field(default_factory=list)  # inputs not used, one line each

    def totals(self) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for line in self.lines:
            out[f"{line['meter']}_quantity"] += line["quantity"]
            out[f"{line['meter']}_cost"] += line["cost"]
            out["cost"] += line["cost"]
        return dict(out)

    def cost_by_team(self) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for line in self.lines:
            out[line["team"]] += line["cost"]
        return dict(sorted(out.items()))

    def table(self) -> pa.Table:
        schema = pa.schema([
            ("month", pa.string()), ("meter", pa.string()), ("team", pa.string()), ("node", pa.string()),
            ("storage_class", pa.string()), ("quantity", pa.float64()), ("unit", pa.string()),
            ("billed_quantity", pa.float64()), ("unit_price", pa.float64()), ("cost", pa.float64()),
            ("currency", pa.string()), ("basis", pa.string()),
        ])
        rows = [{**line, "month": self.month, "currency": self.currency} for line in self.lines]
        return pa.Table.from_pylist(rows, schema=schema)


def price(
    month: str, prices: PriceSheet, uplink: list[dict[str, Any]], storage: list[dict[str, Any]],
    accel: list[dict[str, Any]], requests: list[dict[str, Any]], taken_at: datetime,
    backup: Sequence[dict[str, Any]] = (),
) -> CostReport:
    """Turn meters into priced report lines (quantity in its own unit; billed quantity in the priced unit)."""
    lines: list[dict[str, Any]] = []

    def add(meter: str, team: str, node: str, cls: str, qty: float, unit: str, billed: float, unit_price: float,
            basis: str = MEASURED) -> None:
        lines.append({"meter": meter, "team": team, "node": node, "storage_class": cls, "quantity": float(qty),
                      "unit": unit, "billed_quantity": billed, "unit_price": unit_price, "cost": billed * unit_price,
                      "basis": basis})

    # Every landed bundle has a manifest; those the backup carried are billed at its price, not twice. The
    # backup share is the node's word, so it is capped by the bytes the core measured for that node and team.
    measured: dict[tuple[str, str], int] = defaultdict(int)
    for u in uplink:
        measured[(u["node"], u["team"])] += int(u["bytes"])
    over_backup = {(b["node"], b["team"]): min(int(b["bytes"]), measured.get((b["node"], b["team"]), 0))
                   for b in backup}
    left = dict(over_backup)
    for u in uplink:
        k = (u["node"], u["team"])
        taken = min(int(u["bytes"]), left.get(k, 0))
        left[k] = left.get(k, 0) - taken
        n = int(u["bytes"]) - taken
        add("uplink", u["team"], u["node"], "", n, "bytes", n / GB, prices.uplink_per_gb)
    for (node, team), n in sorted(over_backup.items()):
        if n:
            add("uplink_backup", team, node, "", n, "bytes", n / GB, prices.backup_uplink_per_gb, NODE_REPORTED)
    by_class_team: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    for s in storage:
        by_class_team[(s["storage_class"], s["team"])][0] += s["bytes"]
        by_class_team[(s["storage_class"], s["team"])][1] += s["billable_bytes"]
    for (cls, team), (nbytes, billable) in sorted(by_class_team.items()):
        unit_price = prices.storage_per_gb_month.get(cls, prices.storage_per_gb_month.get("STANDARD", 0.0))
        add("storage", team, "", cls, nbytes, "bytes", billable / GB, unit_price)
    for a in accel:
        add("accelerator", a["team"], "", "", a["hours"], "hours", a["hours"], prices.accelerator_hour)
    for r in requests:
        add("requests", r["team"], r["source"], "", r["requests"], "requests", r["requests"] / 1000,
            prices.per_1000_requests)
    return CostReport(month, prices.currency, lines, storage, taken_at)


def build_report(
    store: ObjectStore, prices: PriceSheet, month: str, *, now: datetime, s3: S3Client | None = None,
    node_teams: dict[str, str] | None = None,
) -> CostReport:
    """Meter every input of `month` (storage: as of now) and price it. `node_teams`: node -> team from the
    operator's EdgeNode blocks (a node without one is billed to `unassigned`)."""
    s3 = s3 or store.client()
    start, end = month_bounds(month)
    problems: list[str] = []
    lineages = model_lineages(s3, store)
    teams = team_map(lineages, node_teams)
    records = usage_records(s3, store, start, end, problems)
    uplink = meter_uplink(s3, store, start, end, teams.node_team, problems)
    rep = price(
        month, prices, uplink, meter_storage(s3, store, teams),
        meter_accelerators(lineages, start, end), meter_requests(records), now, meter_backup_uplink(uplink),
    )
    rep.problems = problems
    return rep


# --------------------------------------------------------------------------------- outputs


def snapshot_table(report: CostReport) -> pa.Table:
    rows = [{"taken_at": report.taken_at, "storage_class": s["storage_class"], "team": s["team"], "bytes": s["bytes"]}
            for s in report.storage]
    schema = pa.schema([("taken_at", pa.timestamp("us", tz="UTC")), ("storage_class", pa.string()),
                        ("team", pa.string()), ("bytes", pa.int64())])
    return pa.Table.from_pylist(rows, schema=schema)


def storage_history(s3: S3Client, store: ObjectStore) -> pa.Table | None:
    tables = [pq.read_table(io.BytesIO(s3.get_object(Bucket=o.bucket, Key=o.key)["Body"].read()))
              for o in list_objects(s3, store.bucket("ops"), store.key("ops", SNAPSHOTS)) if o.key.endswith(".parquet")]
    return pa.concat_tables(tables) if tables else None


def chart_png(history: pa.Table, report: CostReport) -> bytes:
    """Bytes per storage class over time (from snapshots) and this month's cost per team."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    series: dict[str, dict[datetime, int]] = defaultdict(lambda: defaultdict(int))
    for row in history.to_pylist():
        series[row["storage_class"]][row["taken_at"]] += row["bytes"]
    for cls, pts in sorted(series.items()):
        xs = sorted(pts)
        ax1.plot(xs, [pts[x] / GB for x in xs], marker="o", label=cls)
    ax1.set_title("Stored GB per storage class")
    ax1.set_ylabel("GB")
    ax1.legend(fontsize=8)
    ax1.tick_params(axis="x", labelrotation=30, labelsize=7)
    by_team = report.cost_by_team()
    ax2.bar(list(by_team), list(by_team.values()), color="tab:blue")
    ax2.set_title(f"Cost per team, {report.month} ({report.currency})")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return buf.getvalue()


def markdown_summary(report: CostReport, chart_uri: str, chart_url: str, report_uri: str, chart_inline: str = "") -> str:
    """The summary in markdown; the chart is shown from `chart_inline` (a data: URI, which the UI renders
    without reaching the store) when given, else from `chart_url`, and linked either way."""
    t = report.totals()
    cur = report.currency
    lines = [
        f"# Cost report {report.month}",
        "",
        "| meter | quantity | cost |",
        "|---|---:|---:|",
        f"| uplink | {t.get('uplink_quantity', 0) / GB:.3f} GB | {t.get('uplink_cost', 0):.4f} {cur} |",
        f"| uplink (backup link; the node's word on which of its measured bytes) "
        f"| {t.get('uplink_backup_quantity', 0) / GB:.3f} GB "
        f"| {t.get('uplink_backup_cost', 0):.4f} {cur} |",
        f"| storage (snapshot {report.taken_at:%Y-%m-%d}) | {t.get('storage_quantity', 0) / GB:.3f} GB "
        f"| {t.get('storage_cost', 0):.4f} {cur} |",
        f"| accelerator | {t.get('accelerator_quantity', 0):.2f} h | {t.get('accelerator_cost', 0):.4f} {cur} |",
        f"| requests | {t.get('requests_quantity', 0):.0f} | {t.get('requests_cost', 0):.4f} {cur} |",
        f"| **total** | | **{t.get('cost', 0):.4f} {cur}** |",
        "",
        "Cost per team: " + ", ".join(f"{k} {v:.4f}" for k, v in report.cost_by_team().items()),
        "",
        *([f"{len(report.problems)} inputs not used:", *(f"- {p}" for p in report.problems[:50]), ""]
          if report.problems else []),
        f"![bytes per tier and cost per team]({chart_inline or chart_url})",
        "",
        f"Chart: [`{chart_uri}`]({chart_url}); report: `{report_uri}`",
    ]
    return "\n".join(lines)


def write_outputs(store: ObjectStore, report: CostReport, s3: S3Client | None = None) -> dict[str, str]:
    """Snapshot, Parquet report and chart into the ops bucket; returns their s3:// URIs, the chart's URL
    (presigned for 7 days: the bucket is private) and the chart itself as a data: URI (`chart_inline`)."""
    s3 = s3 or store.client()
    ops = store.bucket("ops")
    snap_key = store.key("ops", f"{SNAPSHOTS}{report.taken_at:%Y%m%dT%H%M%S}.parquet")
    buf = io.BytesIO()
    pq.write_table(snapshot_table(report), buf)
    s3.put_object(Bucket=ops, Key=snap_key, Body=buf.getvalue())
    rep_key = store.key("ops", f"{REPORTS}{report.month}/report.parquet")
    buf = io.BytesIO()
    pq.write_table(report.table(), buf, compression="zstd")
    s3.put_object(Bucket=ops, Key=rep_key, Body=buf.getvalue())
    history = storage_history(s3, store)
    assert history is not None  # the snapshot was just written
    chart_key = store.key("ops", f"{REPORTS}{report.month}/chart.png")
    png = chart_png(history, report)
    s3.put_object(Bucket=ops, Key=chart_key, Body=png, ContentType="image/png")
    url = s3.generate_presigned_url("get_object", Params={"Bucket": ops, "Key": chart_key}, ExpiresIn=7 * 86400)
    return {"report": f"s3://{ops}/{rep_key}", "chart": f"s3://{ops}/{chart_key}", "chart_url": url,
            "snapshot": f"s3://{ops}/{snap_key}", "chart_inline": "data:image/png;base64," + base64.b64encode(png).decode()}
