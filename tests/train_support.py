"""Helpers of the training tests: a small Delta dataset in the test store, one append per version."""

from __future__ import annotations

import hashlib
import io
from typing import Any

import numpy as np
import pyarrow as pa

from edgehaul.blocks import ObjectStore
from edgehaul.contracts import Contract
from tests.builders import processed_rows


def with_unusable_rows(table: pa.Table, every: int = 7) -> pa.Table:
    """Make every `every`-th row unlabelled and every (every+1)-th a summary (null pixels), as real
    datasets have; training must skip both."""
    n = table.num_rows
    labels = table.column("label").to_pylist()
    pixels = table.column("pixels").to_pylist()
    summary = [False] * n
    for i in range(n):
        if i % every == every - 1:
            labels[i] = None
        if i % (every + 1) == every:
            pixels[i] = None
            summary[i] = True
    t = table.set_column(table.schema.get_field_index("label"), "label", pa.array(labels, pa.int16()))
    t = t.set_column(t.schema.get_field_index("pixels"), "pixels", pa.array(pixels, pa.binary()))
    t = t.set_column(t.schema.get_field_index("is_summary"), "is_summary", pa.array(summary))
    return t.cast(table.schema)


def make_dataset(store: ObjectStore, sizes: list[int], kind: str = "landsat_patch", node: str = "node-a") -> str:
    """Append one batch of real rows per entry of `sizes` (Delta versions 0..len-1); returns the URI."""
    from deltalake import write_deltalake

    uri = store.uri("curated", kind)
    start = 0
    for v, n in enumerate(sizes):
        rows = with_unusable_rows(processed_rows(n, node, seed=100 + v, start_seq=start))
        write_deltalake(uri, rows, storage_options=store.storage_options(), mode="append")
        start += n
    return uri


def train_small(store: ObjectStore, tag: str, epochs: int = 2) -> tuple[Any, dict[str, Any]]:
    """train_model called in-process on a fresh 200-row dataset, model `m-<tag>`: (its final state, result)."""
    from edgehaul.blocks import TeamQuota
    from edgehaul.flows.train_model import TrainModelParams, train_model

    make_dataset(store, [200])
    store.save(f"store-{tag}", overwrite=True)
    TeamQuota(team="geo", accelerator_hours_per_month=100, storage_bytes=10**9).save(f"quota-{tag}", overwrite=True)
    state: Any = train_model(TrainModelParams(
        team="geo", store_block=f"store-{tag}", quota_block=f"quota-{tag}", model_name=f"m-{tag}", epochs=epochs,
        batch_size=32, width=8, num_threads=1, checkpoint_every_steps=3, allow_local=True, max_hours=0.5,
        quality_gate=False),  # plumbing, not learning: 200 rows, 2 epochs
        return_state=True)
    return state, state.result()


# ------------------------------------------------------------------ the other kinds: separable synthetic rows
def _png(a: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(a[:, :, 0], mode="L").save(buf, format="PNG")
    return buf.getvalue()


def _payloads(contract: Contract, labels: np.ndarray, rng: np.random.Generator) -> dict[str, list[Any]]:
    """Payload column(s) whose content follows the label, learnably: per kind, one signal a small model of
    the kind's family picks up in a few epochs."""
    n = len(labels)
    if contract.kind == "basic_motions":  # class k: channel k-1 rides 2 sigma high, and oscillates k times
        t = np.linspace(0, 2 * np.pi, contract.shape[1], dtype=np.float32)
        x = rng.normal(0, 1, (n, *contract.shape)).astype(np.float32)
        for i, k in enumerate(labels):
            x[i, int(k) - 1] += 2.0 + np.sin(int(k) * t)
        return {"series": [r.tobytes() for r in x]}
    if contract.kind == "digits_png":  # 0 dark, 1 bright, 2 horizontal stripes, 3 vertical stripes
        imgs = np.empty((n, 8, 8, 1), dtype=np.uint8)
        stripes = (np.arange(8) % 2 * 200 + 30).astype(np.float64)
        for i, k in enumerate(labels):
            base = {0: np.full((8, 8), 40.0), 1: np.full((8, 8), 210.0), 2: np.repeat(stripes[:, None], 8, 1),
                    3: np.repeat(stripes[None, :], 8, 0)}[int(k)]
            imgs[i, :, :, 0] = np.clip(base + rng.normal(0, 12, (8, 8)), 0, 255).astype(np.uint8)
        return {"image": [_png(a) for a in imgs]}
    if contract.kind == "daphnet_gait":  # a freeze: the ankle trembles 1.5 g off its normal reading
        x = rng.normal(0, 300, (n, len(contract.columns))).astype(np.float32)
        x[:, 0:3] += (labels[:, None] == 1) * 1500.0
        x[:, 7] += 1000.0  # the trunk's vertical axis carries gravity
        return {c.name: x[:, j].tolist() for j, c in enumerate(contract.columns)}
    raise ValueError(f"no synthetic rows for kind {contract.kind}")


def kind_rows(contract: Contract, n: int, *, seed: int = 0, start_seq: int = 0, node: str = "node-a",
              labels: np.ndarray | None = None, inclusion_p: np.ndarray | None = None,
              unusable_every: int = 9) -> pa.Table:
    """n dataset rows of `contract` (its bundle schema + bundle_id, + `inclusion_p` when given): labels
    cycling over `labels` values (default: the kind's first four), every `unusable_every`-th row unlabelled
    and the next a summary (payload null), as real datasets have."""
    rng = np.random.default_rng(seed)
    label_col = contract.label_column
    assert label_col is not None
    if labels is None:
        values = np.asarray(contract.label_values[:4])
        labels = values[np.arange(n) % len(values)]
    payload = _payloads(contract, labels, rng)
    seqs = np.arange(start_seq, start_seq + n)
    summary = (seqs % unusable_every) == unusable_every - 1
    label_list: list[int | None] = [None if s % unusable_every == unusable_every - 2 else int(v)
                                    for s, v in zip(seqs, labels, strict=True)]
    cols: dict[str, Any] = {
        "sample_id": [f"{node}-{contract.kind}-{s:08d}" for s in seqs], "node_id": [node] * n,
        "capture_time": pa.array(np.datetime64("2026-12-01T00:00:00", "ms") + seqs.astype("timedelta64[s]"),
                                 pa.timestamp("ms", tz="UTC")),
        "seq": seqs.tolist(), label_col: label_list,
        "content_sha256": [hashlib.sha256(str(s).encode()).hexdigest() for s in seqs],
    }
    for name, values_ in payload.items():
        cols[name] = [None if summary[i] else v for i, v in enumerate(values_)]
    for f in contract.feature_columns:
        cols[f] = np.zeros(n, dtype=np.float32)
    cols["value"] = np.full(n, 0.5, dtype=np.float32)
    cols["tier"] = ["low" if s else "normal" for s in summary]
    cols["is_summary"] = summary.tolist()
    schema = contract.bundle_schema
    if inclusion_p is None:  # a table from before tier sampling: no inclusion_p column
        schema = schema.remove(schema.get_field_index("inclusion_p"))
    else:
        cols["inclusion_p"] = inclusion_p
    t = pa.table({f.name: pa.array(cols[f.name], f.type) for f in schema}, schema=schema)
    return t.append_column("bundle_id", pa.array([f"b-{seed}"] * n, pa.string()))


def make_kind_dataset(store: ObjectStore, contract: Contract, sizes: list[int], **kw: Any) -> str:
    """One append of `kind_rows` per entry of `sizes` (Delta versions 0..len-1); returns the URI."""
    from deltalake import write_deltalake

    uri = store.uri("curated", contract.kind)
    start = 0
    for v, n in enumerate(sizes):
        write_deltalake(uri, kind_rows(contract, n, seed=200 + v, start_seq=start, **kw),
                        storage_options=store.storage_options(), mode="append")
        start += n
    return uri
