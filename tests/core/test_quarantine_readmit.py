"""An operator lists quarantined bundles and re-admits chosen ones after a fix.

Re-admission puts the bundle back in landing, so the next core_ingest validates it for real (a bad bundle
is quarantined again, never committed), and leaves an audit record (who, when, why, from/to) in the ops
bucket. On main at 8a307c0 there was no way to re-admit a bundle (`edgehaul quarantine` did not exist).
"""

from __future__ import annotations

import uuid

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from edgehaul import cli
from edgehaul.blocks import ObjectStore
from edgehaul.bundles import write_bundle
from edgehaul.contracts import load_contract
from edgehaul.core import quarantine
from edgehaul.core.datasets import read_version
from edgehaul.core.validation import ValidationResult
from edgehaul.flows.core_ingest import CoreIngestParams, core_ingest
from tests.builders import bundle, land, processed_rows

CONTRACT = load_contract("landsat_patch")
pytestmark = pytest.mark.integration


def _objects(store: ObjectStore) -> dict[tuple[str, str], str]:
    """Every object of this test (landing, curated + quarantine, ops) -> ETag."""
    s3 = store.client()
    out = {}
    for zone in ("landing", "curated", "quarantine", "ops"):
        bucket = store.bucket(zone)  # type: ignore[arg-type]
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{store.prefix}/"):
            out.update({(bucket, o["Key"]): o["ETag"] for o in page.get("Contents", [])})
    return out


def test_list_and_readmit_quarantined_bundles_through_the_cli(store: ObjectStore,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    block = f"q-{uuid.uuid4().hex[:10]}"
    store.save(block, overwrite=True)
    good_data, good = bundle(30, "node-a", seed=51)
    good_key = land(store, good_data, good)
    t = processed_rows(20, "node-b", seed=52, start_seq=100)
    for name in CONTRACT.feature_columns:  # features at x255: validation rejects them, every time
        t = t.set_column(t.schema.get_field_index(name), name, pc.multiply(t.column(name), pa.scalar(255.0, pa.float32())))
    bad_data, bad = write_bundle(t, CONTRACT, tier="normal")
    land(store, bad_data, bad)
    # a good bundle held back by a forced reason (the false positive an operator fixes), a bad one by validation
    hold = ValidationResult(bundle_id=good.bundle_id, node_id="node-a", contract=good.contract, contract_sha256="",
                            bundle_sha256=good.sha256, rows=good.row_count, success=False, reason="operator-hold",
                            error="held for review")
    quarantine.quarantine_bundle(store, good_key, hold, good, emit_event=False)
    first = core_ingest(CoreIngestParams(store_block=block))
    assert [q["bundle_id"] for q in first["quarantined"]] == [bad.bundle_id] and first["versions"] == {}

    # list: bundle, node, reason, samples, age; filters by node and by reason
    assert cli.main(["quarantine", "--store-block", block, "list"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert sorted(r[:4] for r in rows) == sorted([[good.bundle_id, "node-a", "operator-hold", "30"],
                                                  [bad.bundle_id, "node-b", "expectations", "20"]])
    assert all(r[4].endswith(("m", "h", "d")) for r in rows)
    assert cli.main(["quarantine", "--store-block", block, "list", "--reason", "expectations"]) == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:]] == [bad.bundle_id]
    assert cli.main(["quarantine", "--store-block", block, "list", "--node", "node-a"]) == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:]] == [good.bundle_id]

    # an unknown bundle is named, and nothing changes (not even the known one asked for beside it)
    before = _objects(store)
    assert cli.main(["quarantine", "--store-block", block, "readmit", "no-such-bundle", good.bundle_id,
                     "--reason", "x"]) == 1
    assert "not in quarantine: no-such-bundle" in capsys.readouterr().err
    assert _objects(store) == before

    # re-admit both: back in landing under their nodes' prefixes, out of quarantine, audited
    why = "hold lifted after review; contract checked"
    assert cli.main(["quarantine", "--store-block", block, "readmit", good.bundle_id, bad.bundle_id,
                     "--reason", why, "--by", "alice"]) == 0
    out = capsys.readouterr().out
    assert out.count("re-admitted") == 2
    s3 = store.client()
    assert s3.get_object(Bucket=store.bucket("landing"), Key=good_key)["Body"].read() == good_data
    assert s3.get_object(Bucket=store.bucket("landing"),
                         Key=store.key("landing", bad.object_key))["Body"].read() == bad_data
    assert quarantine.list_quarantined(store) == []
    audit = quarantine.audit_records(store)
    assert sorted(a["bundle_id"] for a in audit) == sorted([good.bundle_id, bad.bundle_id])
    g = next(a for a in audit if a["bundle_id"] == good.bundle_id)
    assert g["by"] == "alice" and g["why"] == why and g["at"] and g["quarantine_reason"] == "operator-hold"
    assert g["to"] == sorted([good_key, store.key("landing", good.manifest_key)])
    assert all(k.startswith(store.key("quarantine", f"node-a/{good.bundle_id}/")) for k in g["from"])

    # the next core_ingest validates for real: the good one is committed, the bad one quarantined again
    second = core_ingest(CoreIngestParams(store_block=block))
    assert second["valid"] == 1 and second["versions"] == {CONTRACT.kind: 1}
    assert [q["bundle_id"] for q in second["quarantined"]] == [bad.bundle_id]
    ids = read_version(store, CONTRACT.kind, 1, columns=["sample_id"]).column("sample_id").to_pylist()
    assert sorted(ids) == sorted(good.sample_ids)
    assert len(quarantine.audit_records(store)) == 2  # the audit log keeps what it had


def test_readmit_refuses_without_a_reason(store: ObjectStore) -> None:
    with pytest.raises(quarantine.QuarantineError, match="needs a reason"):
        quarantine.readmit(store, ["b"], why="  ", by="alice")


def test_readmit_of_a_bundle_whose_objects_left_quarantine_names_them_and_changes_nothing(store: ObjectStore) -> None:
    data, m = bundle(10, "node-a", seed=61)
    key = land(store, data, m)
    hold = ValidationResult(bundle_id=m.bundle_id, node_id="node-a", contract=m.contract, contract_sha256="",
                            bundle_sha256=m.sha256, rows=m.row_count, success=False, reason="operator-hold")
    rec = quarantine.quarantine_bundle(store, key, hold, m, emit_event=False)
    parquet = next(o for o in rec.objects if o.endswith(".parquet"))
    store.client().delete_object(Bucket=store.bucket("quarantine"), Key=parquet)  # e.g. moved to the cold tier
    before = _objects(store)
    with pytest.raises(quarantine.QuarantineError, match=f"{parquet} no longer in quarantine"):
        quarantine.readmit(store, [m.bundle_id], why="fixed", by="alice")
    assert _objects(store) == before and quarantine.audit_records(store) == []
