"""The same training flow launched as 2 torchrun processes on CPU (gloo): disjoint data shards,
one model, every usable row trained on once per epoch."""

from __future__ import annotations

import uuid

import pytest

from edgehaul.blocks import ObjectStore, TeamQuota
from edgehaul.flows.train_model import TrainModelParams, train_model
from edgehaul.training import registry
from edgehaul.training.checkpoints import CheckpointStore
from tests.train_support import make_dataset


@pytest.mark.integration
def test_torchrun_two_processes_train_disjoint_shards(store: ObjectStore) -> None:
    make_dataset(store, [150, 150, 150])  # version 2 has three data files
    tag = uuid.uuid4().hex[:8]
    store.save(f"store-{tag}", overwrite=True)
    TeamQuota(team="geo", accelerator_hours_per_month=10, storage_bytes=10**9).save(f"quota-{tag}", overwrite=True)
    out = train_model(TrainModelParams(
        team="geo", store_block=f"store-{tag}", quota_block=f"quota-{tag}", run_id="ddp", nproc_per_node=2,
        epochs=2, batch_size=16, width=8, num_threads=1, checkpoint_every_steps=5, allow_local=True,
    ))
    assert out["world_size"] == 2
    rank0, rank1 = out["rank_files"]
    assert set(rank0) == set(rank1) == {"0", "1"}
    for epoch in ("0", "1"):
        assert not set(rank0[epoch]) & set(rank1[epoch])  # disjoint shards
        assert len(rank0[epoch]) + len(rank1[epoch]) == 3  # together: every file of the version
    lin = registry.read_lineage(store, "landcover", "ddp")
    assert lin is not None and lin["accelerators"] == 2 and lin["dataset_version"] == 2
    usable = sum(1 for i in range(150) if i % 7 != 6 and i % 8 != 7) * 3
    for h in out["history"]:
        assert h["train_samples"] + h["val_samples"] == usable  # each row once per epoch across both ranks
    assert out["history"][-1]["train_loss"] == out["history"][-1]["train_loss"]  # not NaN
    # checkpoints carry both ranks' data positions
    cs = CheckpointStore(store, "ddp")
    latest = cs.latest()
    assert latest is not None and latest.meta["world_size"] == 2
    ranks = cs.load(latest)["ranks"]
    assert len(ranks) == 2 and all("position" in r for r in ranks)
