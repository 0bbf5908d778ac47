"""Builders of realistic test data in the contract's bundle schema (preprocessed, scored rows).

Other stages' tests (validation, datasets, uplink, training, lifecycle) use these so they do not
depend on each other's internals. Rows come from real Landsat patches via the generator.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow as pa

from edgehaul.bundles import BundleManifest, write_bundle
from edgehaul.contracts import Contract, load_contract
from edgehaul.landsat import generate


def processed_rows(
    n: int, node_id: str = "node-a", *, seed: int = 0, start_seq: int = 0, tier: str = "normal",
    contract: Contract | None = None,
) -> pa.Table:
    contract = contract or load_contract("landsat_patch")
    raw = pa.concat_tables(list(generate(n, node_id, seed=seed, start_seq=start_seq, batch_size=max(n, 1))))
    pix = np.frombuffer(raw.column("pixels").combine_chunks().buffers()[2], dtype=contract.np_dtype)
    pix = pix[: n * contract.sample_nbytes // contract.np_dtype.itemsize].reshape((n, *contract.shape))
    norm = pix.astype(np.float32) * contract.scale + contract.offset
    cols: dict[str, pa.Array | pa.ChunkedArray] = {
        name: raw.column(name) for name in ("sample_id", "node_id", "capture_time", "seq", "label")
    }
    cols["content_sha256"] = pa.array([hashlib.sha256(p.tobytes()).hexdigest() for p in pix])
    cols["pixels"] = raw.column("pixels")
    means = norm.mean(axis=(1, 2))
    stds = norm.std(axis=(1, 2))
    for i, ch in enumerate(contract.channels):
        cols[f"mean_{ch}"] = pa.array(means[:, i])
    for i, ch in enumerate(contract.channels):
        cols[f"std_{ch}"] = pa.array(stds[:, i])
    rng = np.random.default_rng(seed)
    cols["value"] = pa.array(rng.random(n, dtype=np.float32))
    cols["tier"] = pa.array([tier] * n)
    cols["is_summary"] = pa.array([False] * n)
    return pa.table(cols).cast(contract.bundle_schema)


def bundle(n: int, node_id: str = "node-a", *, seed: int = 0, start_seq: int = 0) -> tuple[bytes, BundleManifest]:
    contract = load_contract("landsat_patch")
    return write_bundle(processed_rows(n, node_id, seed=seed, start_seq=start_seq), contract, tier="normal")
