"""A node cannot bill anyone else, nor stop the month's report: node, team and bytes come from what the
core measured (the landing key, the operator's EdgeNode block, the size the store lists).

On main at e80770e one 300-byte manifest billed 465,661 USD to team `finance`, and a manifest that is not
JSON made the whole month's report fail.
"""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime

import pytest

from edgehaul.blocks import PriceSheet
from edgehaul.bundles import write_bundle
from edgehaul.contracts import load_contract
from edgehaul.ops import costs
from tests.builders import processed_rows
from tests.conftest import store_for

pytestmark = pytest.mark.integration


def test_a_forged_manifest_bills_nobody_else_and_a_broken_one_costs_a_line_not_the_report(stack: object) -> None:
    store = store_for(stack, prefix=f"t-{uuid.uuid4().hex[:10]}")  # type: ignore[arg-type]
    s3, landing = store.client(), store.bucket("landing")
    contract = load_contract("landsat_patch")
    now = datetime.now(UTC)
    data, m = write_bundle(processed_rows(30, "node-a", seed=1), contract, tier="normal", team="geo")
    s3.put_object(Bucket=landing, Key=store.key("landing", m.object_key), Body=data)
    s3.put_object(Bucket=landing, Key=store.key("landing", m.manifest_key), Body=m.to_json())
    # node-x (its S3 identity writes only under node-x/) claims to be node-a, of team finance, with 500 TB
    day = f"{now:%Y-%m-%d}"
    small = b"x" * 300
    forged = {"node_id": "node-a", "team": "finance", "nbytes": 500 * 2**40, "bundle_id": "b-forged"}
    s3.put_object(Bucket=landing, Key=store.key("landing", f"node-x/{day}/b-forged.parquet"), Body=small)
    s3.put_object(Bucket=landing, Key=store.key("landing", f"node-x/{day}/b-forged.manifest.json"),
                  Body=json.dumps(forged).encode())
    s3.put_object(Bucket=landing, Key=store.key("landing", f"node-x/{day}/b-junk.manifest.json"),
                  Body=b"\x00not json{{{" + b"[" * 5000)
    # and a metering record that does not parse
    s3.put_object(Bucket=store.bucket("ops"), Key=store.key("ops", f"{costs.USAGE}{now:%Y-%m}/bad.jsonl"),
                  Body=b'{"at": "yesterday", "meter": "requests", "quantity": 1e300}\nnot json\n')

    rep = costs.build_report(store, PriceSheet(uplink_per_gb=1.0), f"{now:%Y-%m}", now=now,
                             node_teams={"node-a": "geo"})
    uplink = {(x["node"], x["team"]): x for x in rep.lines if x["meter"] == "uplink"}
    assert set(uplink) == {("node-a", "geo"), ("node-x", costs.UNASSIGNED)}
    assert uplink[("node-a", "geo")]["quantity"] == len(data)  # what the store holds, not a claim
    assert uplink[("node-x", costs.UNASSIGNED)]["quantity"] == len(small)
    assert "finance" not in rep.cost_by_team()
    assert rep.totals()["uplink_cost"] == pytest.approx((len(data) + len(small)) / costs.GB)
    assert len(rep.problems) == 2 and all("bad.jsonl" in p for p in rep.problems), rep.problems
    md = costs.markdown_summary(rep, "s3://x/c.png", "c.png", "s3://x/r.parquet")
    assert "2 inputs not used" in md
