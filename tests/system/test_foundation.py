"""Foundation: contracts, real data, blocks validation, and the local stack's services."""

from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest
from botocore.exceptions import ClientError
from pydantic import ValidationError

from edgehaul.blocks import EdgeNode, LinkProfile, ObjectStore, TieringPolicy
from edgehaul.contracts import ContractError, contract_by_id, load_contract
from edgehaul.edge.landsat import generate, real_patches, table_sha256
from edgehaul_dev import localstack
from tests.conftest import store_for


def test_contract_loads_and_derives_schemas() -> None:
    c = load_contract("landsat_patch")
    assert c.id == "landsat_patch.v1"
    assert c.sample_nbytes == 16 * 16 * 6
    assert "mean_b4_nir" in c.bundle_schema.names
    assert c.bundle_schema.metadata[b"edgehaul.contract"] == b"landsat_patch.v1"


@pytest.mark.parametrize("bad", ["landsat_patch.v99", "nope.v1", "landsat_patch", "x.vv"])
def test_unknown_or_malformed_contract_ids_fail_clearly(bad: str) -> None:
    with pytest.raises(ContractError, match=r"contract"):
        contract_by_id(bad)


def test_real_patches_are_labelled_landsat() -> None:
    p = real_patches()
    assert p.pixels.shape[1:] == (16, 16, 6) and p.pixels.dtype == np.uint8
    assert len(p.pixels) > 600
    assert set(np.unique(p.labels)) <= set(range(1, 8))
    # heavily imbalanced: the rarest present class is far below the commonest
    counts = np.bincount(p.labels)[1:]
    assert counts[counts > 0].min() * 20 < counts.max()


def test_generator_streams_batches_with_requested_mix() -> None:
    batches = list(generate(2500, class_weights={2: 1.0}, batch_size=1000, seed=1))
    assert [b.num_rows for b in batches] == [1000, 1000, 500]
    labels = np.concatenate([b.column("label").to_numpy() for b in batches])
    assert (labels == 2).all()
    ids = [i for b in batches for i in b.column("sample_id").to_pylist()]
    assert len(set(ids)) == 2500
    assert table_sha256(batches[0]) == table_sha256(next(generate(1000, class_weights={2: 1.0}, seed=1)))


def test_blocks_reject_bad_values_with_field_names() -> None:
    with pytest.raises(ValidationError, match="cleanup_watermark"):
        EdgeNode(node_id="n1", spool_dir="/tmp/x", cleanup_watermark=0.9, alert_watermark=0.85)
    with pytest.raises(ValidationError, match="rate_cap_fraction"):
        LinkProfile(bandwidth_bps=1e6, rate_cap_fraction=1.5)
    with pytest.raises(ValidationError, match="low_threshold"):
        TieringPolicy(low_threshold=0.9, high_threshold=0.5)
    with pytest.raises(ValidationError, match="endpoint_url"):
        ObjectStore(endpoint_url="127.0.0.1:8333")
    assert TieringPolicy(version="2").fingerprint != TieringPolicy(version="1").fingerprint


def test_object_store_block_hides_secrets() -> None:
    s = ObjectStore(endpoint_url="http://x:1", access_key_id="AKIDSECRET", secret_access_key="SUPERSECRET")
    assert "SUPERSECRET" not in repr(s) and "SUPERSECRET" not in s.model_dump_json()


@pytest.mark.integration
def test_stack_serves_prefect_and_s3(stack: localstack.StackState) -> None:
    with urllib.request.urlopen(f"{stack.prefect_api_url}/health", timeout=5) as r:
        assert json.loads(r.read()) is True
    s3 = store_for(stack).client()
    names = {b["Name"] for b in s3.list_buckets()["Buckets"]}
    assert set(localstack.BUCKETS) <= names
    # the server is configured not to create buckets on write
    with pytest.raises(ClientError):
        s3.put_object(Bucket="no-such-bucket-eh", Key="k", Body=b"x")


@pytest.mark.integration
def test_edge_identity_is_confined_to_its_prefix(stack: localstack.StackState) -> None:
    node = store_for(stack, "node-a").client()
    node.put_object(Bucket="edgehaul-landing", Key="node-a/probe", Body=b"1")
    for bucket, key in (("edgehaul-landing", "node-b/probe"), ("edgehaul-curated", "probe")):
        with pytest.raises(ClientError) as e:
            node.put_object(Bucket=bucket, Key=key, Body=b"1")
        assert e.value.response["Error"]["Code"] == "AccessDenied"
    with pytest.raises(ClientError):
        node.get_object(Bucket="edgehaul-curated", Key="datasets/_delta_log/00000000000000000000.json")
