"""Builders of realistic test data in the contract's bundle schema (preprocessed, scored rows).

Other stages' tests (validation, datasets, uplink, training, lifecycle) use these so they do not
depend on each other's internals. Rows come from real Landsat patches via the generator.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from edgehaul.bundles import BundleManifest, conform, write_bundle
from edgehaul.contracts import Contract, load_contract
from edgehaul.edge.landsat import generate, table_sha256
from edgehaul.edge.preprocess import preprocess
from edgehaul.edge.scoring import NoveltyScorer

if TYPE_CHECKING:
    from edgehaul.blocks import ObjectStore


def processed_rows(
    n: int, node_id: str = "node-a", *, seed: int = 0, start_seq: int = 0, tier: str = "normal",
    contract: Contract | None = None,
) -> pa.Table:
    """n rows through the real edge preprocessing and novelty scorer; every row gets `tier`."""
    contract = contract or load_contract("landsat_patch")
    raw = pa.concat_tables(list(generate(n, node_id, seed=seed, start_seq=start_seq, batch_size=max(n, 1))))
    accepted = preprocess(raw, contract, node_id=node_id).accepted
    values = NoveltyScorer(contract).score(accepted, batch_key=table_sha256(raw))
    t = accepted.append_column("value", pa.array(values, pa.float32()))
    t = t.append_column("tier", pa.array([tier] * n, pa.string()))
    t = t.append_column("is_summary", pa.array(np.zeros(n, dtype=bool)))
    return conform(t, contract)


def bundle(n: int, node_id: str = "node-a", *, seed: int = 0, start_seq: int = 0) -> tuple[bytes, BundleManifest]:
    contract = load_contract("landsat_patch")
    return write_bundle(processed_rows(n, node_id, seed=seed, start_seq=start_seq), contract, tier="normal")


def land(store: ObjectStore, data: bytes, m: BundleManifest, manifest_body: bytes | None = None) -> str:
    """Put a bundle and its manifest (or `manifest_body`) in the landing zone as a node would; returns the key."""
    s3 = store.client()
    key = store.key("landing", m.object_key)
    s3.put_object(Bucket=store.bucket("landing"), Key=key, Body=data)
    s3.put_object(Bucket=store.bucket("landing"), Key=store.key("landing", m.manifest_key),
                  Body=m.to_json() if manifest_body is None else manifest_body)
    return key
