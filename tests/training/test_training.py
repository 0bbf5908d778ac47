"""Training: model/data units, streaming shards, quota and placement refusals, kill -9 + resume with
matching metrics, data-version mismatch refusal, and the edge scorer loading the trained model."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from edgehaul.blocks import ObjectStore, TeamQuota
from edgehaul.contracts import load_contract
from edgehaul.training import registry
from edgehaul.training.checkpoints import CheckpointStore, DataVersionMismatch, next_interval
from edgehaul.training.data import DatasetRef, Position, epoch_order, open_fragments, shard, stream, trainable
from edgehaul.training.launch import child_env, store_to_public
from edgehaul.training.model import LandCoverNet, labels_to_targets, pixels_to_tensor
from edgehaul.training.placement import PlacementError, check_placement
from edgehaul.training.quota import QuotaExceeded, Usage, check_quota, usage_from_lineage
from edgehaul.training.trainer import TrainConfig, TrainResult, train
from edgehaul_dev import localstack
from tests.builders import processed_rows
from tests.conftest import store_for
from tests.train_support import make_dataset, with_unusable_rows

CONTRACT = load_contract("landsat_patch")
ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------------------- units
def test_pixels_become_normalised_nchw_and_bad_widths_fail() -> None:
    t = processed_rows(5, seed=3)
    x = pixels_to_tensor(t.column("pixels"), CONTRACT)
    assert x.shape == (5, 6, 16, 16) and x.dtype == torch.float32
    raw = np.frombuffer(t.column("pixels")[2].as_py(), dtype=np.uint8).reshape(16, 16, 6)
    assert torch.allclose(x[2, 4], torch.from_numpy(raw[:, :, 4].astype(np.float32) * CONTRACT.scale))
    with pytest.raises(ValueError, match=r"row 1: 3 bytes, the tensor \[16, 16, 6\] uint8 has 1536"):
        pixels_to_tensor(pa.array([b"x" * CONTRACT.sample_nbytes, b"abc"], pa.binary()), CONTRACT)
    assert LandCoverNet()(x).shape == (5, 7)


def test_labels_map_to_class_indices_and_unknown_labels_fail() -> None:
    assert labels_to_targets(pa.array([1, 7, 3], pa.int16()), CONTRACT).tolist() == [0, 6, 2]
    with pytest.raises(ValueError, match=r"label 9 not in contract landsat_patch\.v1"):
        labels_to_targets(pa.array([1, 9], pa.int16()), CONTRACT)


def test_training_skips_summary_and_unlabelled_rows() -> None:
    t = with_unusable_rows(processed_rows(40, seed=1))
    kept = trainable(t.to_batches()[0], CONTRACT)
    assert kept.num_rows == sum(1 for i in range(40) if i % 7 != 6 and i % 8 != 7)
    assert kept.column("label").null_count == 0 and kept.column("pixels").null_count == 0
    assert not any(kept.column("is_summary").to_pylist())


@given(n=st.integers(1, 60), seed=st.integers(0, 2**31), epoch=st.integers(0, 50), world=st.integers(1, 8))
def test_epoch_order_is_a_seeded_permutation_split_into_disjoint_shards(n: int, seed: int, epoch: int, world: int) -> None:
    order = epoch_order(n, seed, epoch)
    assert sorted(order) == list(range(n)) and order == epoch_order(n, seed, epoch)
    shards = [shard(order, r, world) for r in range(world)]
    flat = [i for s in shards for i in s]
    assert sorted(flat) == list(range(n)) and len(flat) == len(set(flat))
    assert max(map(len, shards)) - min(map(len, shards)) <= 1


def test_the_same_data_in_two_tables_streams_in_the_same_order(tmp_path: Path) -> None:
    """Data file names are random: the file order (and so each epoch's order) comes from what the files hold,
    so the same commits train the same model in any store."""
    from deltalake import write_deltalake

    batches = [processed_rows(30, seed=s, start_seq=1000 * s) for s in (3, 1, 2, 5, 4)]
    orders = []
    for name in ("a", "b"):
        uri = str(tmp_path / name)
        for t in (batches if name == "a" else batches[::-1]):  # committed in another order too
            write_deltalake(uri, t, mode="append")
        frags, columns = open_fragments(DatasetRef(uri, len(batches) - 1, {}), CONTRACT)
        assert len({f.path for f in frags}) == len(batches)
        orders.append([b.column("sample_id").to_pylist()
                       for _, b in stream(frags, epoch_order(len(frags), 7, 0), Position(), 1024, columns)])
    assert orders[0] == orders[1]


@settings(max_examples=200)
@given(c=st.floats(1e-4, 100), t=st.floats(1e-5, 10), target=st.floats(0.01, 0.5))
def test_checkpoint_interval_is_the_smallest_under_the_cost_target(c: float, t: float, target: float) -> None:
    n = next_interval(c, t, target, max_interval=10**12)
    share = c / (n * t + c)
    assert share <= 0.8 * target + 1e-9 < target
    if n > 1:  # one step fewer would be over the aim: the interval is not needlessly long
        assert c / ((n - 1) * t + c) > 0.8 * target - 1e-9


def test_quota_refusal_names_team_quota_usage_and_request() -> None:
    now = datetime(2026, 12, 3, tzinfo=UTC)
    records = [
        {"team": "geo", "accelerator_hours": 7.5, "finished": "2026-12-01T10:00:00+00:00", "storage_bytes": 1000},
        {"team": "geo", "accelerator_hours": 50, "finished": "2026-11-30T10:00:00+00:00", "storage_bytes": 500},
        {"team": "other", "accelerator_hours": 99, "finished": "2026-12-02T10:00:00+00:00"},
    ]
    usage = usage_from_lineage(records, "geo", now)
    assert usage == Usage("geo", "2026-12", 7.5, 1500, 1)
    quota = TeamQuota(team="geo", accelerator_hours_per_month=10, max_accelerators_per_run=4, storage_bytes=10_000)
    check_quota(quota, usage, accelerators=2, hours=1.0, storage_bytes=100)  # 9.5 h of 10: allowed
    with pytest.raises(QuotaExceeded) as e:
        check_quota(quota, usage, accelerators=2, hours=2.0, storage_bytes=100)
    msg = str(e.value)
    assert "team 'geo'" in msg and "accelerator_hours_per_month is 10 h" in msg and "7.5 h used in 2026-12" in msg
    assert "2 x 2 h = 4 h" in msg
    with pytest.raises(QuotaExceeded, match=r"8 accelerators requested, max_accelerators_per_run is 4"):
        check_quota(quota, usage, accelerators=8, hours=0.1, storage_bytes=0)
    with pytest.raises(QuotaExceeded, match=r"storage_bytes quota is 10000 B, 1500 B kept, request adds 9000 B"):
        check_quota(quota, usage, accelerators=1, hours=0.1, storage_bytes=9000)


@pytest.mark.parametrize("pool", ["edge-node-a", "EDGE-b", "edge"])
def test_training_refuses_edge_pools(pool: str) -> None:
    with pytest.raises(PlacementError, match="edge pool"):
        check_placement(pool, allow_local=True)


def test_training_outside_a_pool_needs_the_flag() -> None:
    with pytest.raises(PlacementError, match="allow_local"):
        check_placement(None, allow_local=False)
    assert check_placement(None, allow_local=True) == "local"
    assert check_placement("central-gpu", allow_local=False) == "central-gpu"


# ---------------------------------------------------------------------------------------- integration
@dataclass
class Trained:
    store: ObjectStore
    uri: str
    cfg: TrainConfig
    result: TrainResult


def config(uri: str, run_id: str, version: int = 1, **kw: object) -> TrainConfig:
    base: dict[str, object] = dict(
        run_id=run_id, dataset_uri=uri, dataset_version=version, team="geo", seed=7, epochs=3, batch_size=16,
        width=8, num_threads=1, checkpoint_every_steps=10, val_fraction=0.15,
    )
    base.update(kw)
    return TrainConfig.model_validate(base)


@pytest.fixture(scope="module")
def trained(stack: localstack.StackState) -> Iterator[Trained]:
    """Two dataset versions (400 rows each) and one uninterrupted 3-epoch run on version 1."""
    store = store_for(stack, prefix=f"t-{uuid.uuid4().hex[:10]}")
    uri = make_dataset(store, [400, 400])
    cfg = config(uri, "uninterrupted")
    yield Trained(store, uri, cfg, train(cfg, store))


@pytest.mark.integration
def test_stream_continues_exactly_from_a_position(trained: Trained) -> None:
    frags, columns = open_fragments(DatasetRef(trained.uri, 1, trained.store.storage_options()), CONTRACT)
    # bundle rows carry p; node and seq place a row in time (the validation split)
    assert columns == ["sample_id", "node_id", "seq", "label", "pixels", "is_summary", "inclusion_p"]
    assert len(frags) == 2
    files = shard(epoch_order(len(frags), 7, 0), 0, 1)
    stored = [b.column("sample_id").to_pylist() for _, b in stream(frags, files, Position(0), 50, columns)]
    for seed in (None, 7):  # stored order, and rows shuffled within each file
        full = [(p, b.column("sample_id").to_pylist())
                for p, b in stream(frags, files, Position(0), 50, columns, shuffle_seed=seed)]
        assert len(full) > 3
        cut = full[len(full) // 2][0]
        resumed = [b.column("sample_id").to_pylist() for _, b in stream(frags, files, cut, 50, columns,
                                                                           shuffle_seed=seed)]
        assert resumed == [ids for _, ids in full[len(full) // 2 + 1 :]]
        ids = [i for _, b in full for i in b]
        assert len(ids) == len(set(ids)) == 800  # version 1 = both appends, each row once per epoch
        if seed is not None:  # the same rows, not in the stored order
            assert sorted(ids) == sorted(i for b in stored for i in b) and ids != [i for b in stored for i in b]


@pytest.mark.integration
def test_uninterrupted_run_learns_and_registers_lineage(trained: Trained) -> None:
    h = trained.result.history
    assert [r["epoch"] for r in h] == [0, 1, 2]
    assert h[-1]["train_loss"] < h[0]["train_loss"]
    usable = sum(1 for i in range(400) if i % 7 != 6 and i % 8 != 7) * 2
    assert all(r["train_samples"] + r["val_samples"] == usable for r in h)
    lin = registry.read_lineage(trained.store, "landcover", "uninterrupted")
    assert lin is not None
    assert lin["dataset_version"] == 1 and lin["dataset_uri"] == trained.uri and lin["team"] == "geo"
    assert lin["seed"] == 7 and lin["accelerator_hours"] > 0 and lin["metrics"] == h
    assert lin["storage_bytes"] > lin["model_bytes"] > 0  # model plus retained checkpoints
    # checkpoints of a finished run are pruned to the last `keep_checkpoints`
    assert len(CheckpointStore(trained.store, "uninterrupted").committed_steps()) == 3


def _spawn_training(cfg: TrainConfig, store: ObjectStore, tmp: Path, name: str) -> tuple[subprocess.Popen[str], Path]:
    cfg_path, res_path = tmp / f"{name}.json", tmp / f"{name}-result.json"
    cfg_path.write_text(json.dumps({"config": cfg.model_dump(mode="json"), "store": store_to_public(store)}))
    proc = subprocess.Popen(
        [sys.executable, "-m", "edgehaul.training", "--config", str(cfg_path), "--result", str(res_path)],
        cwd=ROOT, env=child_env(store), stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
    )
    return proc, res_path


@pytest.mark.integration
def test_kill_9_mid_training_then_resume_matches_the_uninterrupted_run(trained: Trained, tmp_path: Path) -> None:
    cfg = config(trained.uri, "killed")
    proc, _ = _spawn_training(cfg, trained.store, tmp_path, "first")
    assert proc.stderr is not None
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if "checkpoint committed run=killed step=20" in line:
            os.kill(proc.pid, signal.SIGKILL)
            break
    assert proc.wait(timeout=60) == -signal.SIGKILL, "".join(seen[-20:])
    assert registry.read_lineage(trained.store, "landcover", "killed") is None  # it did not finish
    ckpts = CheckpointStore(trained.store, "killed")
    latest = ckpts.latest()
    assert latest is not None and latest.step >= 20
    total_steps = trained.result.steps
    assert latest.step < total_steps

    # Resuming on another dataset version is refused, naming both versions.
    with pytest.raises(DataVersionMismatch, match=r"version 1, this run asks for .* version 0"):
        train(config(trained.uri, "killed", version=0), trained.store)

    proc2, res_path = _spawn_training(cfg, trained.store, tmp_path, "second")
    _, err = proc2.communicate(timeout=300)
    assert proc2.returncode == 0, err[-3000:]
    resumed = json.loads(res_path.read_text())
    assert resumed["resumed_from_step"] == latest.step and resumed["steps"] == total_steps
    for a, b in zip(trained.result.history, resumed["history"], strict=True):
        for k in ("train_loss", "train_acc", "val_loss", "val_acc"):
            assert math.isclose(a[k], b[k], rel_tol=1e-4, abs_tol=1e-6), (k, a, b)
        assert a["train_samples"] == b["train_samples"]


@pytest.mark.integration
def test_edge_scorer_loads_the_published_model(trained: Trained) -> None:
    from edgehaul.edge.model_scorer import ModelScorer

    with pytest.raises(registry.RegistryError, match="no published landcover model"):
        ModelScorer("latest", trained.store)
    pointer = registry.publish(trained.store, "landcover", "uninterrupted")
    assert pointer["previous"] is None
    scorer = ModelScorer("latest", trained.store)
    assert scorer.version == "uninterrupted"
    rows = with_unusable_rows(processed_rows(64, "node-b", seed=9))
    values = scorer.score(rows)
    assert values.shape == (64,) and values.dtype == np.float64
    assert ((values >= 0) & (values <= 1)).all()
    summary = np.asarray(rows.column("is_summary").to_pylist())
    assert (values[summary] == 0).all() and values[~summary].std() > 0
    p = scorer.probabilities(rows)[~summary]
    assert np.allclose(values[~summary], -(p * np.log(p)).sum(1) / np.log(7), atol=1e-5)
    same = ModelScorer(trained.result.lineage["model_uri"], trained.store)
    assert np.allclose(same.score(rows), values)
