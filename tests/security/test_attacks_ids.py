"""A node's ids can never collide with another node's data: sample ids and bundle ids are unique per node,
and the core keys duplicate detection, claims, Delta transaction ids and receipts by (node, id).

Reproduced with each node's own identity (`store_for(stack, "node-a")` writes only under `node-a/` in
landing) through the real `core_ingest` flow, on the real stack (SeaweedFS + Delta). On main at e80770e
node-a committed rows under node-b's next sample ids and bundle id, and node-b's real rows were then
dropped as duplicates (0 of 30 kept) or skipped as "already committed" (0 of 25 kept).
"""

from __future__ import annotations

import random
import uuid
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from edgehaul import events
from edgehaul.bundles import BUNDLE_ID_PATTERN, BundleManifest, write_bundle
from edgehaul.contracts import load_contract
from edgehaul.core import datasets, quarantine
from edgehaul.core.datasets import BUNDLE_ID_COLUMN, id_shard, read_version
from edgehaul.flows.core_ingest import CoreIngestParams, core_ingest
from edgehaul_dev import localstack
from tests.builders import processed_rows
from tests.conftest import store_for

CONTRACT = load_contract("landsat_patch")
KIND = CONTRACT.kind


def _seq() -> int:
    """A fresh block of sequence numbers: tests share the root landing prefix and so the root dataset."""
    return random.randrange(10**9, 10**11) * 1000


def _as_node(t: pa.Table, node: str, label: int | None = None) -> pa.Table:
    """The same rows (same sample ids, same content digests: the same bundle id) claimed by `node`."""
    t = t.set_column(t.schema.get_field_index("node_id"), "node_id",
                     pa.array([node] * t.num_rows, t.schema.field("node_id").type))
    if label is not None:
        t = t.set_column(t.schema.get_field_index("label"), "label",
                         pa.array([label] * t.num_rows, t.schema.field("label").type))
    return t


def _land(node_store: Any, data: bytes, m: BundleManifest) -> str:
    s3 = node_store.client()
    s3.put_object(Bucket=node_store.bucket("landing"), Key=node_store.key("landing", m.object_key), Body=data)
    s3.put_object(Bucket=node_store.bucket("landing"), Key=node_store.key("landing", m.manifest_key), Body=m.to_json())
    return m.object_key


@pytest.fixture(scope="module")
def ingest_block(stack: localstack.StackState) -> str:
    name = f"ids-ingest-{uuid.uuid4().hex[:8]}"
    store_for(stack, "ingest").save(name, overwrite=True)
    return name


def _run(block: str, keys: list[str]) -> dict[str, Any]:
    state = core_ingest(CoreIngestParams(store_block=block, bundle_keys=keys), return_state=True)
    assert state.is_completed(), state
    out: dict[str, Any] = state.result()
    return out


def _rows(stack: localstack.StackState, node: str, bundle_id: str) -> pa.Table:
    data = read_version(store_for(stack, "ingest"), KIND, columns=["sample_id", "node_id", "label", BUNDLE_ID_COLUMN])
    mask = pc.and_(pc.equal(data.column("node_id"), node), pc.equal(data.column(BUNDLE_ID_COLUMN), bundle_id))
    return data.filter(mask)


@given(st.from_regex(r"[a-z][a-z0-9-]{0,20}", fullmatch=True), st.integers(0, 10**12), st.integers(0, 10**12))
def test_property_id_shards_are_safe_names_and_numbered_ids_share_them_by_block(prefix: str, a: int, b: int) -> None:
    for sid in (f"{prefix}-{a:012d}", f"{prefix}{a}", f"{prefix}-{a}-{b}x"):
        assert BUNDLE_ID_PATTERN.fullmatch(id_shard(sid)) and id_shard(sid) == id_shard(sid)
    same_block = a // datasets.SHARD_SPAN == b // datasets.SHARD_SPAN
    assert (id_shard(f"{prefix}-{a:012d}") == id_shard(f"{prefix}-{b:012d}")) == same_block


@pytest.mark.integration
def test_two_nodes_with_colliding_sample_and_bundle_ids_both_keep_all_their_rows(
    stack: localstack.StackState, ingest_block: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """node-a lands node-b's next 30 sample ids (label forced to 7) under the same bundle id node-b will use,
    first alone, then a second pair in the same run as node-b's: every row of both nodes is kept, each under
    its own node, and each node gets its own receipt."""
    node_a, node_b = store_for(stack, "node-a"), store_for(stack, "node-b")
    receipts: list[tuple[str, dict[str, Any]]] = []
    real_emit = events.emit

    def spy(event: str, resource_id: str, payload: dict[str, Any] | None = None, **labels: str) -> bool:
        if event == events.BUNDLE_RECEIPT:
            receipts.append((resource_id, dict(payload or {})))
        return real_emit(event, resource_id, payload, **labels)

    monkeypatch.setattr(events, "emit", spy)
    pairs, labels = [], []
    for _ in range(2):
        real = processed_rows(30, "node-b", seed=random.randrange(10**6), start_seq=_seq())
        d_b, m_b = write_bundle(real, CONTRACT, tier="normal")
        d_a, m_a = write_bundle(_as_node(real, "node-a", label=7), CONTRACT, tier="normal")
        assert m_a.bundle_id == m_b.bundle_id and m_a.sample_ids == m_b.sample_ids  # a full collision
        pairs.append(((d_a, m_a), (d_b, m_b)))
        labels.append(sorted(real.column("label").to_pylist()))
    (a1, b1), (a2, b2) = pairs

    first = _run(ingest_block, [_land(node_a, *a1)])  # the squatter goes first
    assert first["commits"][0]["bundles"] == [a1[1].bundle_id] and first["commits"][0]["rows"] == 30
    second = _run(ingest_block, [_land(node_b, *b1), _land(node_a, *a2), _land(node_b, *b2)])
    c = second["commits"][0]
    assert c["rows"] == 90 and not c["duplicates"] and not c["already_committed"] and not c["deferred"]
    assert sorted(c["refs"]["bundles"]) == sorted([f"node-b/{b1[1].bundle_id}", f"node-a/{a2[1].bundle_id}",
                                                   f"node-b/{b2[1].bundle_id}"])
    for ((_, ma), (_, mb)), real_labels in zip(pairs, labels, strict=True):
        theirs, mine = _rows(stack, "node-a", ma.bundle_id), _rows(stack, "node-b", mb.bundle_id)
        assert sorted(mine.column("sample_id").to_pylist()) == sorted(mb.sample_ids)  # all 30 of node-b's rows
        assert sorted(mine.column("label").to_pylist()) == real_labels  # with node-b's own labels
        assert sorted(theirs.column("sample_id").to_pylist()) == sorted(ma.sample_ids)
        assert set(theirs.column("label").to_pylist()) == {7}
        ingest = store_for(stack, "ingest")  # no duplicate record for either node
        for node, m in (("node-a", ma), ("node-b", mb)):
            with pytest.raises(ingest.client().exceptions.NoSuchKey):
                ingest.client().get_object(Bucket=ingest.bucket("quarantine"),
                                           Key=quarantine.duplicates_key(ingest, KIND, node, m.bundle_id))
    got = {(p["node_id"], rid) for rid, p in receipts if p["status"] == "committed"}
    assert got == {("node-a", f"edgehaul.bundle.{a1[1].bundle_id}"), ("node-b", f"edgehaul.bundle.{b1[1].bundle_id}"),
                   ("node-a", f"edgehaul.bundle.{a2[1].bundle_id}"), ("node-b", f"edgehaul.bundle.{b2[1].bundle_id}")}

    # the same bundle again from node-b: already committed, node-b's own; node-a's copy is not re-added either
    again = _run(ingest_block, [_land(node_b, *b1), _land(node_a, *a1)])
    assert sorted(again["already_committed"]) == sorted([b1[1].bundle_id, a1[1].bundle_id]) and not again["commits"]


@pytest.mark.integration
def test_resending_committed_samples_makes_no_version_and_no_training_run(
    stack: localstack.StackState, ingest_block: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """main: a resend of committed samples made v2 and v3 with 0 rows, and each started a full retrain. Now the
    resend is settled as already committed: no version, no `edgehaul.dataset.committed` (the training trigger),
    its receipt and the run's summary say so, and a later run skips it at once."""
    node_a = store_for(stack, "node-a")
    emitted: list[tuple[str, dict[str, Any]]] = []
    real_emit = events.emit

    def spy(event: str, resource_id: str, payload: dict[str, Any] | None = None, **labels: str) -> bool:
        emitted.append((event, dict(payload or {})))
        return real_emit(event, resource_id, payload, **labels)

    monkeypatch.setattr(events, "emit", spy)
    rows = processed_rows(20, "node-a", seed=random.randrange(10**6), start_seq=_seq())
    d1, m1 = write_bundle(rows, CONTRACT, tier="normal")
    first = _run(ingest_block, [_land(node_a, d1, m1)])
    v1 = first["versions"][KIND]
    assert v1 is not None and sum(e == events.DATASET_COMMITTED for e, _ in emitted) == 1
    emitted.clear()
    # the same samples re-sent in another bundle (another tier: another bundle id)
    d2, m2 = write_bundle(rows, CONTRACT, tier="low", policy_fingerprint="resend")
    assert m2.bundle_id != m1.bundle_id
    second = _run(ingest_block, [_land(node_a, d2, m2)])
    c = second["commits"][0]
    assert c["version"] is None and c["rows"] == 0 and second["versions"] == {KIND: None}
    assert c["already_committed"] == [m2.bundle_id] and sorted(c["duplicates"][f"node-a/{m2.bundle_id}"]) == \
        sorted(m1.sample_ids)
    assert not [e for e, _ in emitted if e == events.DATASET_COMMITTED]  # no training run is triggered
    assert [p["status"] for e, p in emitted if e == events.BUNDLE_RECEIPT] == ["already_committed"]
    assert datasets.open_table(store_for(stack, "ingest"), KIND).version() == v1
    third = _run(ingest_block, [_land(node_a, d2, m2)])  # settled: no version, not recorded again
    assert third["commits"][0]["already_committed"] == [m2.bundle_id] and third["versions"] == {KIND: None}
    assert not [e for e, _ in emitted if e == events.DATASET_COMMITTED]
    assert datasets.open_table(store_for(stack, "ingest"), KIND).version() == v1
