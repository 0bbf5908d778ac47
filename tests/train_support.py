"""Helpers of the training tests: a small Delta dataset in the test store, one append per version."""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from edgehaul.blocks import ObjectStore
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
        batch_size=32, width=8, num_threads=1, checkpoint_every_steps=3, allow_local=True, max_hours=0.5),
        return_state=True)
    return state, state.result()
