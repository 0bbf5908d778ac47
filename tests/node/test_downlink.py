"""Downlink: the core publishes a model, a policy or a contract to a node; the node fetches it
with its own identity when in contact, verifies it, applies it atomically and reports back through its outbox.
Real SeaweedFS, real node and central identities."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ClientError

from edgehaul import downlink
from edgehaul.downlink import APPLIED_EVENT, REFUSED_EVENT, DownlinkError, Update, current_file, current_generation
from edgehaul.edge.outbox import Outbox
from edgehaul_dev import localstack
from tests.conftest import store_for

pytestmark = pytest.mark.integration

CONTRACT = (Path(__file__).resolve().parents[2] / "edgehaul" / "data_contracts" / "landsat_patch.v1.yaml").read_bytes()


def _policy(version: str, high: float = 0.8) -> bytes:
    return json.dumps({"version": version, "scorer": "novelty", "high_threshold": high}).encode()


def _in_force(state_dir: Path) -> dict[str, bytes]:
    """Every file of the generation in force, checked against that generation's own update.json."""
    cur = downlink.root(state_dir) / "current"
    up = Update.parse((cur / "update.json").read_bytes(), str(cur))
    out = {}
    for i in up.items:
        data = (cur / i.filename).read_bytes()
        assert hashlib.sha256(data).hexdigest() == i.sha256, f"{i.filename} of generation {up.generation} is torn"
        out[i.filename] = data
    return out


def _events(ob: Outbox) -> list[tuple[str, dict[str, Any]]]:
    return [(e.event, e.payload) for e in ob.peek(1000)]


def test_publish_fetch_verify_apply_and_report(stack: localstack.StackState, tmp_path: Path) -> None:
    core, node = store_for(stack, "ingest"), store_for(stack, "node-a")
    ob = Outbox(tmp_path / "outbox.sqlite", "node-a")
    model = b"\x80torch-ish model bytes " * 100
    up = downlink.publish_update(core, "node-a", [("landcover", "model", "m-1", model),
                                                  ("tiering", "policy", "p-1", _policy("p-1")),
                                                  ("landsat_patch.v1", "contract", "landsat_patch.v1", CONTRACT)])
    res = downlink.sync(node, "node-a", tmp_path, outbox=ob)
    assert res.applied == up.generation == current_generation(tmp_path) and res.refused is None
    assert current_file(tmp_path, "model", "landcover").read_bytes() == model  # type: ignore[union-attr]
    assert _in_force(tmp_path)["policy-tiering"] == _policy("p-1")
    assert downlink.sync(node, "node-a", tmp_path, outbox=ob).applied is None  # nothing new: nothing done
    # a policy change keeps the model and the contract; the previous generation stays for a rollback
    up2 = downlink.publish_update(core, "node-a", [("tiering", "policy", "p-2", _policy("p-2", 0.9))])
    assert downlink.sync(node, "node-a", tmp_path, outbox=ob).applied == up2.generation == up.generation + 1
    files = _in_force(tmp_path)
    assert files["policy-tiering"] == _policy("p-2", 0.9) and files["model-landcover"] == model
    assert {p.name for p in downlink.root(tmp_path).glob("gen-*")} == {f"gen-{up.generation}", f"gen-{up2.generation}"}
    assert [(name, p["generation"]) for name, p in _events(ob)] == [(APPLIED_EVENT, up.generation),
                                                                     (APPLIED_EVENT, up2.generation)]
    assert "policy/tiering@p-2" in _events(ob)[1][1]["items"]


def test_a_tampered_or_mislabelled_update_is_refused_whole_and_the_node_keeps_what_it_had(
    stack: localstack.StackState, tmp_path: Path
) -> None:
    core, node, admin = store_for(stack, "ingest"), store_for(stack, "node-a"), store_for(stack).client()
    ob = Outbox(tmp_path / "outbox.sqlite", "node-a")
    downlink.publish_update(core, "node-a", [("tiering", "policy", "p-3", _policy("p-3"))])
    before = downlink.sync(node, "node-a", tmp_path, outbox=ob).applied
    kept = _in_force(tmp_path)
    # 1. a blob changed after publishing (its sha256 no longer matches)
    up = downlink.publish_update(core, "node-a", [("tiering", "policy", "p-4", _policy("p-4"))])
    blob = next(i for i in up.items if i.name == "tiering").sha256
    admin.put_object(Bucket="edgehaul-ops", Key=f"downlink/node-a/blobs/{blob}", Body=_policy("p-4", 0.1))
    res = downlink.sync(node, "node-a", tmp_path, outbox=ob)
    assert res.refused == up.generation and "does not match its sha256" in res.why and "tiering" in res.why
    assert current_generation(tmp_path) == before and _in_force(tmp_path) == kept
    assert not list(downlink.root(tmp_path).glob(".staging-*"))
    # 2. content that says another version than the update claims (written around publish_update's own check)
    body = _policy("p-6")
    sha = hashlib.sha256(body).hexdigest()
    admin.put_object(Bucket="edgehaul-ops", Key=f"downlink/node-a/blobs/{sha}", Body=body)
    forged = Update(node_id="node-a", generation=up.generation + 1, items=(downlink.Item(
        name="tiering", kind="policy", version="p-5", sha256=sha, size=len(body)),))
    admin.put_object(Bucket="edgehaul-ops", Key="downlink/node-a/update.json", Body=forged.to_json())
    res = downlink.sync(node, "node-a", tmp_path, outbox=ob)
    assert res.refused == forged.generation and "says version 'p-6'" in res.why
    # 3. an update addressed to another node
    other = Update(node_id="node-b", generation=forged.generation + 1, items=forged.items)
    admin.put_object(Bucket="edgehaul-ops", Key="downlink/node-a/update.json", Body=other.to_json())
    res = downlink.sync(node, "node-a", tmp_path, outbox=ob)
    assert res.refused == other.generation and "addressed to 'node-b'" in res.why
    assert current_generation(tmp_path) == before and _in_force(tmp_path) == kept
    assert [e for e, _ in _events(ob)] == [APPLIED_EVENT, REFUSED_EVENT, REFUSED_EVENT, REFUSED_EVENT]
    # the publisher refuses a mislabelled item itself
    with pytest.raises(DownlinkError, match=r"says version 'p-7', published as 'p-8'"):
        downlink.publish_update(core, "node-a", [("tiering", "policy", "p-8", _policy("p-7"))])


@pytest.mark.parametrize("fault", ["fetch", "rename", "switch"])
def test_a_crash_mid_apply_never_leaves_a_half_applied_update(
    stack: localstack.StackState, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    core, node = store_for(stack, "ingest"), store_for(stack, "node-a")
    downlink.publish_update(core, "node-a", [("tiering", "policy", f"q-{fault}-1", _policy(f"q-{fault}-1")),
                                             ("landcover", "model", f"m-{fault}-1", b"model one")])
    old_gen = downlink.sync(node, "node-a", tmp_path).applied
    old = _in_force(tmp_path)
    up = downlink.publish_update(core, "node-a", [("tiering", "policy", f"q-{fault}-2", _policy(f"q-{fault}-2")),
                                                  ("landcover", "model", f"m-{fault}-2", b"model two")])

    class Crash(BaseException):  # what kill -9 looks like to the code that follows: nothing runs after it
        pass

    s3 = node.client()
    if fault == "fetch":  # the link drops after the first item arrived
        real, calls = s3.get_object, []

        def get_object(**kw: Any) -> Any:
            calls.append(kw["Key"])
            if "/blobs/" in kw["Key"] and sum("/blobs/" in k for k in calls) == 2:
                raise Crash()
            return real(**kw)
        monkeypatch.setattr(s3, "get_object", get_object)
    else:
        target = {"rename": "rename", "switch": "replace"}[fault]

        def crash(*a: Any, **k: Any) -> None:
            raise Crash()
        monkeypatch.setattr(downlink.os, target, crash)
    with pytest.raises(Crash):
        downlink.sync(node, "node-a", tmp_path, s3=s3)
    monkeypatch.undo()
    assert current_generation(tmp_path) == old_gen and _in_force(tmp_path) == old  # the old one, whole
    res = downlink.sync(node, "node-a", tmp_path)  # contact again: the update applies, leftovers go
    assert res.applied == up.generation and _in_force(tmp_path)["model-landcover"] == b"model two"
    assert not list(downlink.root(tmp_path).glob(".staging-*"))


def test_a_node_reads_only_its_own_downlink_and_writes_none(stack: localstack.StackState) -> None:
    downlink.publish_update(store_for(stack, "ingest"), "node-b", [("tiering", "policy", "b-1", _policy("b-1"))])
    a, b = store_for(stack, "node-a").client(), store_for(stack, "node-b").client()
    assert b.get_object(Bucket="edgehaul-ops", Key="downlink/node-b/update.json")["Body"].read()
    for call, kw in ((a.get_object, {"Key": "downlink/node-b/update.json"}),
                     (b.put_object, {"Key": "downlink/node-b/update.json", "Body": b"{}"}),
                     (b.put_object, {"Key": "downlink/node-b/blobs/" + "0" * 64, "Body": b"x"}),
                     (b.get_object, {"Key": "prefect-results/core/x"})):
        with pytest.raises(ClientError) as e:
            call(Bucket="edgehaul-ops", **kw)
        assert e.value.response["Error"]["Code"] in ("AccessDenied", "403")


def _model_bytes(model_id: str, seed: int) -> bytes:
    import io

    import torch

    from edgehaul.training.model import build_model

    torch.manual_seed(seed)
    arch = {"in_channels": 6, "n_classes": 7, "width": 8, "dropout": 0.0}
    buf = io.BytesIO()
    torch.save({"arch": arch, "state_dict": build_model(arch).state_dict(), "contract": "landsat_patch.v1",
                "label_values": [1, 2, 3, 4, 5, 6, 7], "model_id": model_id, "model_name": "landcover"}, buf)
    return buf.getvalue()


def test_the_edge_model_scorer_uses_the_downlinked_model(stack: localstack.StackState, tmp_path: Path) -> None:
    """The closed loop without store access from the node: the node identity cannot read models/, the model
    arrives by downlink and the scorer follows each new generation."""
    import numpy as np

    from edgehaul.blocks import TieringPolicy
    from edgehaul.blocks.policies import EdgeNode
    from edgehaul.contracts import load_contract
    from edgehaul.edge.landsat import generate
    from edgehaul.edge.model_scorer import ColdStart, ModelScorer, NoModelYet
    from edgehaul.edge.preprocess import preprocess
    from edgehaul.edge.scoring import NoveltyScorer
    from edgehaul.tasks.edge import make_scorer
    from edgehaul.training.registry import parse_model_file

    core, node_store = store_for(stack, "ingest"), store_for(stack, "node-a")
    with pytest.raises(ClientError):
        node_store.client().get_object(Bucket="edgehaul-checkpoints", Key="models/landcover/latest.json")
    contract = load_contract("landsat_patch")
    node = EdgeNode(node_id="node-a", spool_dir=str(tmp_path))
    policy = TieringPolicy(scorer="model", model_uri="downlink:landcover")
    rows = preprocess(next(generate(200, "node-a", seed=4, batch_size=200)), contract).accepted
    with pytest.raises(NoModelYet, match="no model 'landcover' downlinked to this node yet"):
        make_scorer(policy.model_copy(update={"fallback_scorer": None}), node, contract)
    # The cold start: until a model arrives, the policy's fallback scorer values the rows, and says so.
    cold = make_scorer(policy, node, contract)
    assert isinstance(cold, ColdStart) and cold.version.startswith("model-pending+novelty")
    assert "no model 'landcover' downlinked" in cold.reason
    novelty = NoveltyScorer(contract)  # a fresh sketch, as the cold start's own
    np.testing.assert_allclose(cold.score(rows, batch_key="b1"), novelty.score(rows, batch_key="b1"))
    for model_id, seed in (("dl-m1", 1), ("dl-m2", 2)):
        data = _model_bytes(model_id, seed)
        downlink.publish_update(core, "node-a", [("landcover", "model", model_id, data)])
        assert downlink.sync(node_store, "node-a", tmp_path).applied
        scorer = make_scorer(policy, node, contract)
        assert scorer.version == model_id
        want = ModelScorer(model_id, model_file=parse_model_file(data)).score(rows)
        np.testing.assert_allclose(scorer.score(rows), want)


def test_operator_commands_publish_sync_and_status(stack: localstack.StackState, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    import uuid

    from edgehaul.blocks import TieringPolicy
    from edgehaul.cli import main

    tag = uuid.uuid4().hex[:8]
    store_for(stack, "ingest").save(f"dl-core-{tag}")
    store_for(stack, "node-a").save(f"dl-node-a-{tag}")
    TieringPolicy(version=f"cli-{tag}", high_threshold=0.7).save(f"dl-policy-{tag}")
    assert main(["downlink", "publish", "--node", "node-a", "--policy", f"dl-policy-{tag}", "--contract",
                 "landsat_patch.v1", "--note", "new thresholds", "--store-block", f"dl-core-{tag}"]) == 0
    assert "policy/tiering@cli-" in capsys.readouterr().out
    assert main(["downlink", "sync", "--node", "node-a", "--state-dir", str(tmp_path),
                 "--store-block", f"dl-node-a-{tag}"]) == 0
    assert "applied generation" in capsys.readouterr().out
    assert main(["downlink", "status", "--state-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "new thresholds" in out and f"cli-{tag}" in out and "landsat_patch.v1" in out
    pol = json.loads(current_file(tmp_path, "policy", "tiering").read_bytes())  # type: ignore[union-attr]
    assert TieringPolicy(**pol).high_threshold == 0.7  # what arrives is a policy the node can load
    with pytest.raises(SystemExit, match="2"):  # nothing named to send: a usage error, nothing published
        main(["downlink", "publish", "--node", "node-a", "--store-block", f"dl-core-{tag}"])
    assert "nothing to send" in capsys.readouterr().err


def test_edge_ingest_tiers_with_the_downlinked_policy(stack: localstack.StackState, tmp_path: Path) -> None:
    """A changed tiering policy published by the core is what the node's next ingest uses (recorded in
    every bundle's manifest), once it has been applied; before that, the node's own block."""
    import uuid

    from edgehaul.edge.spool import Spool
    from edgehaul.flows.edge_ingest import EdgeIngestParams, edge_ingest

    version = f"dl-{uuid.uuid4().hex[:8]}"
    spool_dir = tmp_path / "spool"
    params = EdgeIngestParams(edge_node=None, node_id="node-a", spool_dir=str(spool_dir), n_samples=300,
                              batch_size=300, result_storage=None, seed=11)

    def versions() -> set[str]:
        spool = Spool(spool_dir, cap_bytes=2**30, emit=lambda *a, **k: True)
        try:
            return {e.manifest.policy_version for e in spool.pending() + spool.raw_entries()}
        finally:
            spool.close()

    edge_ingest(params)
    before = versions()
    assert before and version not in before
    downlink.publish_update(store_for(stack, "ingest"), "node-a", [
        ("tiering", "policy", version, json.dumps({"version": version, "high_threshold": 0.9}).encode())])
    assert downlink.sync(store_for(stack, "node-a"), "node-a", spool_dir).applied
    edge_ingest(params.model_copy(update={"seed": 12, "refresh_cache": True}))
    assert version in versions() - before


def test_a_downlinked_contract_version_becomes_readable_and_is_never_rewritten(
        stack: localstack.StackState, tmp_path: Path) -> None:
    from edgehaul.contracts import load_contract

    core, node = store_for(stack, "ingest"), store_for(stack, "node-a")
    contracts = tmp_path / "contracts"
    contracts.mkdir()
    v2 = CONTRACT.replace(b"version: 1", b"version: 2", 1)
    downlink.publish_update(core, "node-a", [("landsat_patch.v2", "contract", "landsat_patch.v2", v2)])
    assert downlink.sync(node, "node-a", tmp_path / "state").applied
    assert "landsat_patch.v2" in downlink.install_contracts(tmp_path / "state", contracts)
    assert load_contract("landsat_patch", 2, directory=contracts).id == "landsat_patch.v2"
    assert downlink.install_contracts(tmp_path / "state", contracts) == []  # already there: nothing to do
    changed = v2.replace(b"16x16 px patches", b"16x16 pixel patches", 1)
    downlink.publish_update(core, "node-a", [("landsat_patch.v2", "contract", "landsat_patch.v2", changed)])
    assert downlink.sync(node, "node-a", tmp_path / "state").applied
    with pytest.raises(DownlinkError, match="differs from the downlinked one"):
        downlink.install_contracts(tmp_path / "state", contracts)
    assert (contracts / "landsat_patch.v2.yaml").read_bytes() == v2
