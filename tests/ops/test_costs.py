"""Cost report: meters equal their inputs exactly, prices follow the price sheet, outputs land in the ops bucket."""

from __future__ import annotations

import base64
import io
import json
import os
import re
import uuid
from datetime import UTC, datetime, timedelta

import httpx
import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import strategies as st

from edgehaul.blocks import ObjectStore, PriceSheet
from edgehaul.bundles import write_bundle
from edgehaul.contracts import load_contract
from edgehaul.ops import costs
from edgehaul.ops import lifecycle as lc
from edgehaul.ops.storage_classes import billable_bytes
from tests.builders import processed_rows
from tests.conftest import store_for

KiB = 1024


@given(
    uplink=st.lists(st.integers(0, 10**12), max_size=5), hours=st.lists(st.floats(0, 1e4), max_size=5),
    reqs=st.lists(st.integers(0, 10**9), max_size=5),
)
def test_pricing_is_quantity_times_unit_price(uplink: list[int], hours: list[float], reqs: list[int]) -> None:
    prices = PriceSheet(uplink_per_gb=0.5, accelerator_hour=2.5, per_1000_requests=0.005)
    rep = costs.price(
        "2026-01", prices,
        [{"node": f"n{i}", "team": "geo", "bundles": 1, "bytes": b} for i, b in enumerate(uplink)],
        [{"bucket": "b", "storage_class": "STANDARD_IA", "team": "geo", "objects": 1, "bytes": 10,
          "billable_bytes": 128 * KiB}],
        [{"team": f"t{i}", "runs": 1, "hours": h} for i, h in enumerate(hours)],
        [{"team": "geo", "source": f"s{i}", "requests": r} for i, r in enumerate(reqs)],
        datetime(2026, 2, 1, tzinfo=UTC),
    )
    t = rep.totals()
    assert t.get("uplink_quantity", 0) == sum(uplink)
    assert t.get("uplink_cost", 0) == pytest.approx(sum(uplink) / costs.GB * 0.5)
    assert t.get("accelerator_cost", 0) == pytest.approx(sum(hours) * 2.5)
    assert t.get("requests_cost", 0) == pytest.approx(sum(reqs) / 1000 * 0.005)
    assert t["storage_quantity"] == 10  # metered size, billed at the 128 KiB minimum
    assert t["storage_cost"] == pytest.approx(128 * KiB / costs.GB * 0.0125)
    assert t["cost"] == pytest.approx(sum(rep.cost_by_team().values()))


_KEYS = st.tuples(st.sampled_from(["node-a", "node-b"]), st.sampled_from(["geo", "finance"]))


@given(uplink=st.dictionaries(_KEYS, st.integers(0, 10**12), max_size=4),
       backup=st.dictionaries(_KEYS, st.integers(0, 10**15), max_size=4))
def test_property_a_backup_claim_only_reprices_measured_bytes_of_its_own_node_and_team(
        uplink: dict[tuple[str, str], int], backup: dict[tuple[str, str], int]) -> None:
    rep = costs.price("2026-01", PriceSheet(), [{"node": n, "team": t, "bundles": 1, "bytes": b}
                                                for (n, t), b in uplink.items()],
                      [], [], [], datetime(2026, 2, 1, tzinfo=UTC),
                      backup=[{"node": n, "team": t, "bytes": b} for (n, t), b in backup.items()])
    billed: dict[tuple[str, str], float] = {}
    for x in rep.lines:
        billed[(x["node"], x["team"])] = billed.get((x["node"], x["team"]), 0.0) + x["quantity"]
        if x["meter"] == "uplink_backup":
            assert x["basis"] == costs.NODE_REPORTED and x["quantity"] <= uplink[(x["node"], x["team"])]
    assert {k: v for k, v in billed.items() if v} == {k: float(v) for k, v in uplink.items() if v}


def test_usage_records_are_validated() -> None:
    s = ObjectStore()
    with pytest.raises(ValueError, match="timezone-aware"):
        costs.record_usage(s, costs.UsageRecord(at=datetime(2026, 1, 1), meter="requests", quantity=1))
    with pytest.raises(ValueError, match="negative quantity"):
        costs.record_usage(s, costs.UsageRecord(at=datetime(2026, 1, 1, tzinfo=UTC), meter="requests", quantity=-1))
    assert costs.month_bounds("2026-12") == (datetime(2026, 12, 1, tzinfo=UTC), datetime(2027, 1, 1, tzinfo=UTC))


def _seed(store: ObjectStore, now: datetime) -> dict[str, object]:
    """Real bundles + manifests of two nodes/teams, model lineages, a cold copy, metering records."""
    s3 = store.client()
    contract = load_contract("landsat_patch")
    uplink: dict[tuple[str, str], int] = {}
    sizes: dict[tuple[str, str], int] = {}  # (class, team) -> bytes
    billable: dict[tuple[str, str], int] = {}

    def put(bucket: str, key: str, body: bytes, team: str, cls: str = "STANDARD") -> None:
        s3.put_object(Bucket=bucket, Key=key, Body=body, **({"StorageClass": cls} if cls != "STANDARD" else {}))
        sizes[(cls, team)] = sizes.get((cls, team), 0) + len(body)
        billable[(cls, team)] = billable.get((cls, team), 0) + billable_bytes(len(body), cls)

    for node, team, n in (("node-a", "geo", 2), ("node-b", "ice", 1)):
        for i in range(n):
            data, m = write_bundle(processed_rows(40 + i, node, seed=i, start_seq=100 * i), contract, tier="normal",
                                   team=team)
            put(store.bucket("landing"), store.key("landing", m.object_key), data, team)
            put(store.bucket("landing"), store.key("landing", m.manifest_key), m.to_json(), team)
            uplink[(node, team)] = uplink.get((node, team), 0) + m.nbytes
    hours = {"geo": 0.0, "ice": 0.0}
    for mid, team, h in (("m1", "geo", 1.25), ("m2", "geo", 3.5), ("m3", "ice", 0.75)):
        lin = {"team": team, "accelerator_hours": h, "dataset_version": 0, "dataset_uri": store.uri("curated", "x"),
               "finished_at": now.isoformat()}
        put(store.bucket("models"), store.key("models", f"landcover/{mid}/lineage.json"), json.dumps(lin).encode(), team)
        put(store.bucket("models"), store.key("models", f"landcover/{mid}/model.pt"), os.urandom(50 * KiB), team)
        hours[team] += h
    # an old run from last month is not this month's
    old = {"team": "geo", "accelerator_hours": 99.0, "finished_at": (now - timedelta(days=40)).isoformat()}
    put(store.bucket("models"), store.key("models", "landcover/m0/lineage.json"), json.dumps(old).encode(), "geo")
    # a cold copy of a node-b bundle is billed to node-b's team, in its class
    cold_key = lc.cold_key(store, store.bucket("landing"), store.key("landing", "node-b/2026-01-01/old.parquet"))
    put(store.bucket("cold"), cold_key, os.urandom(150 * KiB), "ice", "STANDARD_IA")
    put(store.bucket("curated"), store.key("curated", "landsat_patch/part-0.parquet"), os.urandom(30 * KiB), "shared")
    costs.record_usage(store, [costs.UsageRecord(at=now, meter="requests", quantity=1200, team="geo", source="train"),
                               costs.UsageRecord(at=now, meter="requests", quantity=34, team="ice", source="ingest")])
    costs.record_usage(store, costs.UsageRecord(at=now - timedelta(days=40), meter="requests", quantity=7, team="geo"))
    return {"uplink": uplink, "sizes": sizes, "billable": billable, "hours": hours}


@pytest.mark.integration
def test_report_totals_match_metered_inputs(stack: object) -> None:
    store = store_for(stack, prefix=f"t-{uuid.uuid4().hex[:10]}")  # type: ignore[arg-type]
    now = datetime.now(UTC)
    seed = _seed(store, now)
    month = f"{now:%Y-%m}"
    prices = PriceSheet()
    rep = costs.build_report(store, prices, month, now=now, node_teams={"node-a": "geo", "node-b": "ice"})
    by = lambda meter: [x for x in rep.lines if x["meter"] == meter]  # noqa: E731
    assert {(x["node"], x["team"]): x["quantity"] for x in by("uplink")} == seed["uplink"]
    # the usage log lives in the ops bucket too: take the report's ops rows out, then compare exactly
    storage = {(x["storage_class"], x["team"]): x["quantity"] for x in by("storage")}
    ops_rows = [s for s in rep.storage if s["bucket"] == store.bucket("ops")]
    assert {(s["storage_class"], s["team"]) for s in ops_rows} == {("STANDARD", "shared")}
    storage[("STANDARD", "shared")] -= sum(s["bytes"] for s in ops_rows)
    if storage[("STANDARD", "shared")] == 0:
        del storage[("STANDARD", "shared")]
    assert storage == seed["sizes"]
    assert {x["team"]: x["quantity"] for x in by("accelerator")} == seed["hours"]
    assert {x["team"]: x["quantity"] for x in by("requests")} == {"geo": 1200, "ice": 34}
    t = rep.totals()
    assert t["cost"] == pytest.approx(sum(x["billed_quantity"] * x["unit_price"] for x in rep.lines))
    ia = next(x for x in by("storage") if x["storage_class"] == "STANDARD_IA")
    assert ia["unit_price"] == prices.storage_per_gb_month["STANDARD_IA"]


@pytest.mark.integration
def test_cost_report_flow_writes_artifacts_parquet_and_chart(stack: object) -> None:
    from prefect.artifacts import Artifact

    from edgehaul.flows.cost_report import CostReportParams, cost_report

    store = store_for(stack, prefix=f"t-{uuid.uuid4().hex[:10]}")  # type: ignore[arg-type]
    now = datetime.now(UTC)
    seed = _seed(store, now)
    name = f"t-{uuid.uuid4().hex[:10]}"
    # the flow runs as its deployment does (edgehaul.platform.roles: lifecycle), not as the admin that seeded
    store_for(stack, "lifecycle", prefix=store.prefix).save(name)  # type: ignore[arg-type]
    PriceSheet(uplink_per_gb=1.0).save(name)
    out = cost_report(CostReportParams(store_block=name, prices_block=name, month=f"{now:%Y-%m}", now=now))
    s3 = store.client()
    bucket, key = out["report"].removeprefix("s3://").split("/", 1)
    table = pq.read_table(io.BytesIO(s3.get_object(Bucket=bucket, Key=key)["Body"].read()))
    rows = table.to_pylist()
    assert sum(r["quantity"] for r in rows if r["meter"] == "uplink") == sum(seed["uplink"].values())  # type: ignore[attr-defined]
    assert sum(r["cost"] for r in rows) == pytest.approx(out["totals"]["cost"]) == pytest.approx(out["total"])
    mine = [r for r in costs.usage_records(s3, store, now - timedelta(minutes=1), now + timedelta(minutes=1))
            if r.source == "cost_report"]
    assert [r.quantity for r in mine] == [out["requests"]] and out["requests"] > 0
    bucket, key = out["chart"].removeprefix("s3://").split("/", 1)
    png = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    md = Artifact.get(f"cost-report-{now:%Y-%m}-summary")
    assert md is not None and out["chart_url"] in str(md.data)
    # the chart is in the artifact itself (the UI needs no access to the store), and the link works unsigned-in
    inline = re.search(r"!\[[^]]*\]\(data:image/png;base64,([A-Za-z0-9+/=]+)\)", str(md.data))
    assert inline and base64.b64decode(inline.group(1)) == png
    got = httpx.get(out["chart_url"], timeout=10)
    assert got.status_code == 200 and got.content == png
    assert "chart_inline" not in out  # the run's result keeps URIs, not the image
    tab = Artifact.get(f"cost-report-{now:%Y-%m}")
    assert tab is not None and "uplink" in str(tab.data)


@pytest.mark.integration
def test_forged_manifest_fields_and_link_metadata_bill_no_other_team(stack: object) -> None:
    """node-a lands one real bundle whose manifest names node-b, team `finance` and a petabyte, with object
    metadata claiming the backup link, a team and a size; plus a manifest with no data object. Written as
    node-a's identity would (it writes only under `landing/node-a/`, tests/security/test_access.py). The report bills
    node-a's team for the bytes the store lists, `finance` and node-b nothing; the backup split is marked as
    the node's word and never exceeds what the core measured."""
    store = store_for(stack, prefix=f"t-{uuid.uuid4().hex[:10]}")  # type: ignore[arg-type]
    s3, landing = store.client(), store.bucket("landing")
    contract = load_contract("landsat_patch")
    data, m = write_bundle(processed_rows(40, "node-a", seed=3), contract, tier="normal", team="geo")
    forged = {**json.loads(m.to_json()), "node_id": "node-b", "team": "finance", "nbytes": 10**15, "row_count": 10**9}
    lie = {"link": "backup", "team": "finance", "node": "node-b", "bytes": str(10**15)}
    s3.put_object(Bucket=landing, Key=store.key("landing", m.object_key), Body=data)
    s3.put_object(Bucket=landing, Key=store.key("landing", m.manifest_key), Body=json.dumps(forged).encode(),
                  Metadata=lie)
    ghost = store.key("landing", m.manifest_key.replace(m.bundle_id, "0" * 12))  # its data object never landed
    s3.put_object(Bucket=landing, Key=ghost, Body=json.dumps(forged).encode(), Metadata=lie)
    now = datetime.now(UTC)
    rep = costs.build_report(store, PriceSheet(uplink_per_gb=1.0, backup_uplink_per_gb=50.0), f"{now:%Y-%m}",
                             now=now, node_teams={"node-a": "geo", "node-b": "finance"})
    link = [x for x in rep.lines if x["meter"] in ("uplink", "uplink_backup")]
    assert {(x["node"], x["team"]) for x in link} == {("node-a", "geo")}
    assert rep.cost_by_team().get("finance", 0.0) == 0.0 and not [x for x in rep.lines if x["node"] == "node-b"]
    assert sum(x["quantity"] for x in link) == len(data)  # the size the store lists, not the manifest's
    backup = next(x for x in link if x["meter"] == "uplink_backup")
    assert backup["quantity"] == len(data) and backup["basis"] == costs.NODE_REPORTED
    assert {x["basis"] for x in rep.lines if x["meter"] != "uplink_backup"} == {costs.MEASURED}
    assert "basis" in rep.table().column_names

    # price() caps a backup share by the measured bytes of the same node and team, and drops one with none
    capped = costs.price("2026-01", PriceSheet(), [{"node": "node-a", "team": "geo", "bundles": 1, "bytes": 100}],
                         [], [], [], now, backup=[{"node": "node-a", "team": "geo", "bytes": 10**15},
                                                  {"node": "node-b", "team": "finance", "bytes": 10**15}])
    assert [(x["meter"], x["team"], x["quantity"]) for x in capped.lines] == [("uplink", "geo", 0.0),
                                                                             ("uplink_backup", "geo", 100.0)]
