"""The uplink_drain flow end to end: blocks on the real Prefect server, a real spool, real SeaweedFS."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from edgehaul import events
from edgehaul.blocks import EdgeNode, LinkProfile, ObjectStore
from edgehaul.bundles import write_bundle
from edgehaul.contracts import load_contract
from edgehaul.edge.spool import Spool
from edgehaul.flows.uplink_drain import UplinkDrainParams, uplink_drain
from edgehaul_dev import localstack
from tests.builders import bundle, processed_rows
from tests.conftest import api_auth
from tests.waiting import wait_for

MiB = 1024 * 1024


def _poll(url: str, body: dict[str, Any], key: str, timeout: float = 15) -> list[dict[str, Any]]:
    def items() -> list[dict[str, Any]]:
        r = httpx.post(url, json=body, timeout=10, auth=api_auth())
        r.raise_for_status()
        doc = r.json()
        return list(doc.get(key, []) if isinstance(doc, dict) else doc)

    return wait_for(items, timeout, f"a non-empty answer of {url} to {body}", interval=0.5)


@pytest.mark.integration
def test_uplink_drain_flow_lands_the_spool_in_priority_order_and_publishes_metrics(
    stack: localstack.StackState, store: ObjectStore, tmp_path: Path
) -> None:
    tag = uuid.uuid4().hex[:8]
    node_id = f"node-f{tag}"
    node = EdgeNode(node_id=node_id, spool_dir=str(tmp_path / "spool"), spool_cap_bytes=200 * MiB)
    node.save(f"uplink-node-{tag}")
    LinkProfile(bandwidth_bps=8 * 20 * MiB / 0.7, chunk_bytes=256 * 1024).save(f"uplink-link-{tag}")
    store.save(f"uplink-store-{tag}")

    spool = Spool.from_block(node)
    normal = [bundle(300, node_id, seed=s, start_seq=1000 * s) for s in (81, 82)]
    high = write_bundle(processed_rows(50, node_id, seed=83, start_seq=83_000, tier="high"),
                        load_contract("landsat_patch"), tier="high")
    for d, m in [*normal, high]:
        assert spool.put(d, m) is not None

    params = UplinkDrainParams(edge_node=f"uplink-node-{tag}", link_profile=f"uplink-link-{tag}",
                               object_store=f"uplink-store-{tag}", max_seconds=60, max_active=1)
    metrics = uplink_drain(params)
    assert metrics["bundles_landed"] == 3 and metrics["bundles_failed"] == 0
    assert metrics["landed_keys"][0].endswith(f"{high[1].bundle_id}.parquet")  # high tier first
    assert spool.pending() == [] and all(spool.is_acked(m.bundle_id) for _, m in [*normal, high])
    s3 = store.client()
    for _, m in [*normal, high]:
        key = store.key("landing", m.object_key)
        head = s3.head_object(Bucket=store.bucket("landing"), Key=key)
        assert head["Metadata"]["sha256"] == m.sha256 and head["Metadata"]["tier"] == m.tier
        s3.head_object(Bucket=store.bucket("landing"), Key=store.key("landing", m.manifest_key))

    api = stack.prefect_api_url
    evs = _poll(f"{api}/events/filter",
                {"filter": {"event": {"name": [events.LINK_STATS]}, "resource": {"id": [f"edgehaul.link.{node_id}"]}},
                 "limit": 5}, "events")
    assert evs and evs[0]["payload"]["bundles_landed"] == 3 and "goodput_bps" in evs[0]["payload"]
    # the fleet view's spool figure: the drained spool holds nothing
    assert metrics["spool_used_fraction"] == evs[0]["payload"]["spool_used_fraction"] == 0.0
    # one batch event for the run (what triggers core_ingest), carrying every landed key
    batches = _poll(f"{api}/events/filter", {"filter": {"event": {"name": [events.LANDING_BATCH]},
                                                        "resource": {"labels": {"edgehaul.node.id": [node_id]}}},
                                             "limit": 5}, "events")
    assert len(batches) == 1 and batches[0]["resource"]["edgehaul.batch.source"] == "uplink"
    assert sorted(batches[0]["payload"]["bundle_keys"]) == sorted(m.object_key for _, m in [*normal, high])
    arts = _poll(f"{api}/artifacts/filter", {"artifacts": {"key": {"any_": [f"uplink-{node_id}"]}}}, "")
    assert arts and arts[0]["type"] == "table"

    # a second run finds nothing to send and sends nothing twice
    again = uplink_drain(params)
    assert again["bundles_landed"] == 0 and again["bytes_landed"] == 0
    spool.close()


@pytest.mark.integration
def test_task_retries_only_safe_errors(stack: localstack.StackState) -> None:
    from botocore.exceptions import ClientError
    from prefect import task

    from edgehaul.platform.s3_errors import CLIENT_MAX_ATTEMPTS, TASK_RETRIES, retry_condition

    calls: dict[str, int] = {}

    def s3_error(code: str, status: int, client_retries: int) -> ClientError:
        return ClientError({"Error": {"Code": code, "Message": "no"},  # type: ignore[typeddict-item]
                            "ResponseMetadata": {"HTTPStatusCode": status, "RetryAttempts": client_retries}}, "PutObject")

    @task(retries=TASK_RETRIES, retry_delay_seconds=0, retry_condition_fn=retry_condition)
    def flaky(kind: str) -> None:
        calls[kind] = calls.get(kind, 0) + 1
        if kind == "denied":
            raise s3_error("AccessDenied", 403, 0)
        if kind == "throttled":
            raise s3_error("SlowDown", 503, 0)
        if kind == "throttled-client-exhausted":  # the client already made its attempts: no more
            raise s3_error("SlowDown", 503, CLIENT_MAX_ATTEMPTS - 1)
        raise ConnectionResetError("link dropped")

    for kind in ("denied", "reset", "throttled", "throttled-client-exhausted"):
        with pytest.raises((ClientError, ConnectionResetError)):
            flaky(kind)
    assert calls == {"denied": 1, "reset": 1 + TASK_RETRIES, "throttled": 1 + TASK_RETRIES,
                     "throttled-client-exhausted": 1}
