"""Training by kind: model family, label and defaults from the contract, sample weights
from inclusion probabilities, per-class metrics, resume, the dataset-committed trigger, and the edge model
scorer for every family (the closed loop)."""

from __future__ import annotations

import io
import math
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from edgehaul import downlink, events
from edgehaul.blocks import ObjectStore, TeamQuota, TieringPolicy
from edgehaul.contracts import Contract, ContractError, load_contract
from edgehaul.edge.scorer_registry import ScorerContext
from edgehaul.training import registry
from edgehaul.training.checkpoints import CheckpointStore
from edgehaul.training.data import DatasetRef, open_fragments, sample_weights, trainable
from edgehaul.training.metrics import class_metrics, rare_classes
from edgehaul.training.model import Cnn1d, LandCoverNet, Mlp, arch_for, build_model, family_of, inputs
from edgehaul.training.trainer import TrainConfig, TrainResult, train, weighted_loss_sum
from edgehaul_dev import localstack
from tests.builders import processed_rows
from tests.conftest import store_for
from tests.train_support import kind_rows, make_kind_dataset

ROOT = Path(__file__).resolve().parents[2]
CONTRACTS = ROOT / "edgehaul" / "data_contracts"
KINDS = ("basic_motions", "daphnet_gait", "digits_png")
FAMILY = {"basic_motions": "cnn1d", "daphnet_gait": "mlp", "digits_png": "cnn2d", "landsat_patch": "cnn2d"}


def _labels(contract: Contract, n: int) -> np.ndarray:
    """Four classes in turn; the anomaly kind 1 in 5 rows anomalous (imbalanced, as telemetry is)."""
    if contract.label.kind == "anomaly":
        return (np.arange(n) % 5 == 0).astype(np.int64)
    return np.asarray(contract.label_values[:4])[np.arange(n) % 4]


def _rows(kind: str, n: int, seed: int = 0, **kw: Any) -> pa.Table:
    c = load_contract(kind)
    return kind_rows(c, n, seed=seed, labels=_labels(c, n), **kw)


# ---------------------------------------------------------------------------------------------- units
def test_sample_weights_are_one_over_inclusion_p_and_one_without_it() -> None:
    t = _rows("daphnet_gait", 6)
    assert sample_weights(t).tolist() == [1.0] * 6  # an older table: no inclusion_p column
    p = pa.array([0.5, 1.0, None, 0.25, 0.1, 1.0], pa.float64())
    w = sample_weights(t.append_column("inclusion_p", p))
    assert w.tolist() == pytest.approx([2.0, 1.0, 1.0, 4.0, 10.0, 1.0])  # null: kept in full
    for bad in (0.0, 1.5, float("nan"), -0.2):
        with pytest.raises(ValueError, match=r"inclusion_p .* of sample node-a-daphnet_gait-00000003 is outside"):
            sample_weights(t.append_column("inclusion_p", pa.array([1, 1, 1, bad, 1, 1], pa.float64())))


@settings(max_examples=50, deadline=None)
@given(p=st.lists(st.floats(1e-3, 1.0), min_size=1, max_size=40), scale=st.floats(0.1, 10))
def test_weighted_loss_is_the_weighted_sum_and_scales_with_the_weights(p: list[float], scale: float) -> None:
    g = torch.Generator().manual_seed(len(p))
    logits = torch.randn(len(p), 3, generator=g)
    y = torch.randint(0, 3, (len(p),), generator=g)
    w = torch.tensor([1 / x for x in p])
    ce = torch.nn.functional.cross_entropy(logits, y, reduction="none")
    assert torch.allclose(weighted_loss_sum(logits, y, w), (ce * w).sum(), rtol=1e-5)
    assert torch.allclose(weighted_loss_sum(logits, y, w * scale), scale * weighted_loss_sum(logits, y, w), rtol=1e-4)
    assert torch.allclose(weighted_loss_sum(logits, y, torch.ones(len(p))), ce.sum(), rtol=1e-5)


def test_class_metrics_expose_what_accuracy_hides() -> None:
    # 98 normal rows, 2 anomalies, a model that never predicts an anomaly: accuracy 0.98
    m = class_metrics(np.array([[98.0, 0.0], [2.0, 0.0]]), (0, 1))
    assert m["val_recall_0"] == 1.0 and m["val_recall_1"] == 0.0
    assert m["val_rare_recall"] == 0.0 and m["val_macro_f1"] == pytest.approx((2 * 98 / 198 + 0) / 2)
    assert m["val_support_1"] == 2.0
    # a class absent from validation has a support of 0 and no recall; macro-F1 is over present classes
    m = class_metrics(np.array([[5.0, 0, 0], [0, 0, 0], [1.0, 0, 4.0]]), (1, 2, 3))
    assert "val_recall_2" not in m and m["val_support_2"] == 0
    assert m["val_recall_3"] == pytest.approx(0.8) and m["val_f1_1"] == pytest.approx(2 * (5 / 6) / (5 / 6 + 1))
    assert m["val_macro_f1"] == pytest.approx((m["val_f1_1"] + m["val_f1_3"]) / 2)
    assert math.isnan(class_metrics(np.zeros((2, 2)), (0, 1))["val_macro_f1"])


@given(support=st.lists(st.integers(0, 1000), min_size=1, max_size=12))
def test_rare_classes_are_the_least_supported_quarter_of_present_classes(support: list[int]) -> None:
    s = np.asarray(support, dtype=np.float64)
    rare = rare_classes(s)
    present = [i for i, v in enumerate(support) if v > 0]
    assert len(rare) == (max(1, math.ceil(len(present) / 4)) if present else 0)
    assert set(rare) <= set(present)
    others = set(present) - set(rare)
    assert all(s[r] <= s[o] for r in rare for o in others)


@pytest.mark.parametrize("kind", [*KINDS, "landsat_patch"])
def test_each_kind_gets_its_family_with_inputs_from_the_contract(kind: str) -> None:
    c = load_contract(kind)
    assert family_of(c) == FAMILY[kind]
    rows = processed_rows(12, seed=1) if kind == "landsat_patch" else _rows(kind, 12)
    batch = trainable(rows.to_batches()[0], c)
    assert 0 < batch.num_rows < 12 or kind == "landsat_patch"
    arch = arch_for(c, width=8)
    x = inputs(batch, c, arch)
    want = {"basic_motions": (6, 100), "daphnet_gait": (9,), "digits_png": (1, 8, 8), "landsat_patch": (6, 16, 16)}
    assert tuple(x.shape) == (batch.num_rows, *want[kind]) and x.dtype == torch.float32
    model = build_model(arch)
    assert isinstance(model, {"cnn2d": LandCoverNet, "cnn1d": Cnn1d, "mlp": Mlp}[FAMILY[kind]])
    assert model(x).shape == (batch.num_rows, 2 if c.label.kind == "anomaly" else len(c.label_values))
    # the arch alone rebuilds the same network (what a model file carries)
    buf = io.BytesIO()
    torch.save({"arch": arch, "state_dict": model.state_dict()}, buf)
    f = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    again = build_model(f["arch"])
    again.load_state_dict(f["state_dict"])
    model.eval()
    again.eval()
    assert torch.equal(again(x), model(x))


def test_inputs_follow_the_contracts_layout() -> None:
    motions = load_contract("basic_motions")
    t = _rows("basic_motions", 3, unusable_every=1000)
    raw = np.frombuffer(t.column("series")[1].as_py(), dtype=np.float32).reshape(6, 100)
    x = inputs(t, motions, arch_for(motions, 8))
    assert torch.equal(x[1], torch.from_numpy(raw.copy()))  # channels first already: C x T as stored
    gait = load_contract("daphnet_gait")
    g = _rows("daphnet_gait", 4, unusable_every=1000)
    xg = inputs(g, gait, arch_for(gait, 8))
    want = (np.float32(g.column("ankle_vert")[2].as_py()) + 5000) / 10000  # scaled to its declared range
    assert xg[2, 1].item() == pytest.approx(float(want), rel=1e-5)
    # the trainer reads the readings (a bundle carries no norm_<column>): the edge's features are its inputs
    from edgehaul.decode import with_derived_features

    assert not set(gait.derived_feature_columns) & set(g.column_names)
    feats = with_derived_features(g, gait).select(gait.derived_feature_columns)
    assert torch.equal(xg, torch.from_numpy(np.column_stack([c.to_numpy() for c in feats.columns])))
    digits = load_contract("digits_png")
    d = _rows("digits_png", 4, unusable_every=1000)
    xd = inputs(d, digits, arch_for(digits, 8))
    assert xd.shape == (4, 1, 8, 8) and float(xd.min()) >= 0 and float(xd.max()) <= 1  # scale 1/255


def test_a_checkpoint_of_an_unweighted_run_restores_its_weight_sum() -> None:
    from edgehaul.training.trainer import _Acc

    # what a pre-weights (Landsat) checkpoint holds for the epoch in progress
    old = {"loss": 12.0, "correct": 7.0, "n": 10.0, "val_loss": 1.0, "val_correct": 1.0, "val_n": 2.0, "steps": 3}
    acc = _Acc.restore(old, n_classes=7)
    assert acc.wsum == 10.0 and acc.val_confusion == [0.0] * 49 and acc.loss / acc.wsum == 1.2
    new = _Acc.restore({**old, "wsum": 40.0, "val_confusion": [1.0] * 4}, n_classes=2)
    assert new.wsum == 40.0 and new.val_confusion == [1.0] * 4


def test_a_legacy_landsat_arch_without_a_family_is_the_cnn2d() -> None:
    m = build_model({"in_channels": 6, "n_classes": 7, "width": 8})
    assert isinstance(m, LandCoverNet)
    with pytest.raises(ValueError, match="unknown model family 'gbt'"):
        build_model({"family": "gbt", "n_classes": 2})


def test_a_kind_without_a_training_section_is_refused_naming_its_contract(tmp_path: Path) -> None:
    text = (CONTRACTS / "basic_motions.v1.yaml").read_text()
    doc = yaml.safe_load(text)
    doc.pop("training")
    doc["kind"] = "untrained_motions"
    (tmp_path / "untrained_motions.v1.yaml").write_text(yaml.safe_dump(doc))
    c = load_contract("untrained_motions", directory=tmp_path)
    with pytest.raises(ContractError, match=r"untrained_motions\.v1 has no training section"):
        family_of(c)


def test_the_train_trigger_matches_commits_of_trainable_kinds_only() -> None:
    from prefect.events.schemas.events import Resource, ResourceSpecification

    spec = yaml.safe_load((ROOT / "edgehaul" / "deployments" / "prefect.yaml").read_text())
    trigger = spec["definitions"]["triggers"]["dataset_committed"]
    match = ResourceSpecification(trigger["match"])
    assert trigger["parameters"]["params"]["dataset_kind"] == "{{ event.payload.kind }}"
    assert "model_name" not in trigger["parameters"]["params"]  # the contract names the model

    def committed(kind: str, trainable: bool) -> Resource:  # the resource of core_ingest's event
        return Resource({"prefect.resource.id": f"edgehaul.dataset.{kind}",
                         **events.dataset_committed_labels(kind, trainable)})

    for kind in (*KINDS, "landsat_patch"):
        assert match.matches(committed(kind, load_contract(kind).training is not None)), kind
    assert not match.matches(committed("notes", trainable=False))


# ---------------------------------------------------------------------------------------- integration
@dataclass
class KindRun:
    kind: str
    contract: Contract
    store: ObjectStore
    uri: str
    cfg: TrainConfig
    result: TrainResult


N_ROWS = {"basic_motions": 360, "daphnet_gait": 900, "digits_png": 360}
EPOCHS = {"basic_motions": 6, "daphnet_gait": 6, "digits_png": 8}


def _config(uri: str, contract: Contract, run_id: str, **kw: Any) -> TrainConfig:
    assert contract.training is not None
    base: dict[str, Any] = dict(
        run_id=run_id, dataset_uri=uri, dataset_version=1, team="geo", seed=3, epochs=EPOCHS[contract.kind],
        batch_size=32, width=8, lr=1e-2, num_threads=1, checkpoint_every_steps=8, val_fraction=0.25,
        contract_id=contract.id, model_name=contract.training.model_name, augment=contract.training.augment,
        emit_events=False, patience=0,  # every epoch run: the history's length is asserted
    )
    base.update(kw)
    return TrainConfig.model_validate(base)


@pytest.fixture(scope="module")
def runs(stack: localstack.StackState) -> Iterator[dict[str, KindRun]]:
    """Per new kind: a two-version Delta table of separable rows and one uninterrupted run on version 1."""
    out = {}
    for kind in KINDS:
        store = store_for(stack, prefix=f"t-{uuid.uuid4().hex[:10]}")
        c = load_contract(kind)
        half = N_ROWS[kind] // 2
        uri = make_kind_dataset(store, c, [half, half], labels=_labels(c, half))
        cfg = _config(uri, c, f"whole-{kind.replace('_', '-')}")
        out[kind] = KindRun(kind, c, store, uri, cfg, train(cfg, store))
    yield out


def _chance(contract: Contract) -> float:
    return 0.8 if contract.label.kind == "anomaly" else 0.25  # majority share / uniform over 4 classes


@pytest.mark.integration
@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_learns_with_per_class_metrics_in_history_and_lineage(runs: dict[str, KindRun], kind: str) -> None:
    r = runs[kind]
    h = r.result.history
    assert len(h) == EPOCHS[kind]
    final = h[-1]
    assert final["val_acc"] >= _chance(r.contract) + 0.15, final
    assert final["train_loss"] < h[0]["train_loss"]
    present = [v for v in r.contract.label_values if final[f"val_support_{v}"] > 0]
    assert len(present) == (2 if r.contract.label.kind == "anomaly" else 4)
    assert all(f"val_recall_{v}" in final for v in present) and final["val_macro_f1"] > 0.6
    assert final["val_rare_recall"] > 0.5  # the rare class (anomalies) is found, not just the majority
    # every usable row (labelled, not a summary) once per epoch, train + validation
    n = N_ROWS[kind]
    usable = sum(1 for s in range(n) if s % 9 not in (7, 8))
    assert all(row["train_samples"] + row["val_samples"] == usable for row in h)
    lin = registry.read_lineage(r.store, r.cfg.model_name, r.cfg.run_id)
    assert lin is not None and lin["metrics"] == h and lin["final"]["val_macro_f1"] == final["val_macro_f1"]
    assert lin["contract"] == r.contract.id and lin["kind"] == kind and lin["model_family"] == FAMILY[kind]
    if r.contract.label.kind == "anomaly":
        assert lin["rare_classes"] == [1]
    f = registry.load_model_file(r.store, lin["model_uri"])
    assert f["arch"]["family"] == FAMILY[kind] and f["label_kind"] == r.contract.label.kind


@pytest.mark.integration
def test_weights_change_the_loss_and_uniform_weights_change_nothing(stack: localstack.StackState) -> None:
    c = load_contract("daphnet_gait")
    n = 300
    labels = _labels(c, n)
    results = {}
    for name, p in (("none", None), ("uniform", np.full(n, 0.5)),
                    ("anomalies-sampled", np.where(labels == 1, 1.0, 0.1)),
                    ("every-other-sampled", np.where(np.arange(n) % 2 == 0, 1.0, 0.1))):
        store = store_for(stack, prefix=f"t-{uuid.uuid4().hex[:10]}")
        uri = make_kind_dataset(store, c, [n], labels=labels, inclusion_p=p)
        if p is not None:
            assert "inclusion_p" in open_fragments(DatasetRef(uri, 0, store.storage_options()), c)[1]
        results[name] = train(_config(uri, c, f"w-{name}", dataset_version=0, epochs=2), store).history
    # the loss is normalised by the weight sum: weights that are all equal are no weights at all
    for a, b in zip(results["none"], results["uniform"], strict=True):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5)
    # rows kept 1 in 10 weigh 10 each: the loss (and what the model learns) changes. (Sampling by class alone
    # would not show it: gait's contract balances classes, which cancels a per-class weight exactly.)
    assert results["every-other-sampled"][0]["train_loss"] != pytest.approx(results["none"][0]["train_loss"],
                                                                           rel=1e-3)
    # per-class supports are weighted: the population's normal share, not the sample's
    last = results["anomalies-sampled"][-1]
    assert last["val_support_0"] / (last["val_support_0"] + last["val_support_1"]) > 0.95


class _Stop(BaseException):
    """Ends a training run from its progress callback, as a kill would: no lineage, checkpoints kept."""


@pytest.mark.integration
def test_a_non_landsat_run_stopped_after_a_checkpoint_resumes_to_the_same_metrics(runs: dict[str, KindRun]) -> None:
    r = runs["basic_motions"]
    cfg = r.cfg.model_copy(update={"run_id": "stopped-motions"})

    def stop_at_second_checkpoint(pct: float, what: str) -> None:
        if "checkpoint committed at step 16" in what:
            raise _Stop

    with pytest.raises(_Stop):
        train(cfg, r.store, progress=stop_at_second_checkpoint)
    assert registry.read_lineage(r.store, cfg.model_name, cfg.run_id) is None
    latest = CheckpointStore(r.store, cfg.run_id).latest()
    assert latest is not None and latest.step == 16
    resumed = train(cfg, r.store)
    assert resumed.resumed_from_step == 16 and resumed.steps == r.result.steps
    for a, b in zip(r.result.history, resumed.history, strict=True):
        for k in ("train_loss", "train_acc", "val_loss", "val_acc", "val_macro_f1", "val_rare_recall"):
            assert math.isclose(a[k], b[k], rel_tol=1e-4, abs_tol=1e-6), (k, a, b)


@pytest.mark.integration
@pytest.mark.parametrize("kind", KINDS)
def test_the_published_model_scores_its_kind_at_the_edge(runs: dict[str, KindRun], kind: str, tmp_path: Path,
                                                         stack: localstack.StackState) -> None:
    from edgehaul.edge.model_scorer import ModelScorer, from_context

    r = runs[kind]
    name = r.cfg.model_name
    registry.publish(r.store, name, r.cfg.run_id)
    scorer = ModelScorer(f"latest:{name}", r.store)
    assert scorer.version == r.cfg.run_id and scorer.contract.id == r.contract.id
    rows = _rows(kind, 90, seed=77, node="node-b")
    values = scorer.score(rows)
    summary = np.asarray(rows.column("is_summary").to_pylist())
    assert values.shape == (90,) and ((values >= 0) & (values <= 1)).all()
    assert (values[summary] == 0).all() and values[~summary].std() > 0
    p = scorer.probabilities(rows)[~summary]
    entropy = -(p * np.log(np.clip(p, 1e-30, 1))).sum(1) / np.log(scorer.n_classes)
    if r.contract.label.kind == "anomaly":  # at least the anomaly probability: anomalies score above normal rows
        assert np.allclose(values[~summary], np.maximum(entropy, p[:, 1]), atol=1e-5)
        lab = _labels(r.contract, 90)[~summary]
        assert values[~summary][lab == 1].mean() > values[~summary][lab == 0].mean() + 0.3
    else:
        assert np.allclose(values[~summary], entropy, atol=1e-5)
    # a policy's `latest` is the scored kind's own model (its contract's training.model_name)
    policy = TieringPolicy(scorer="model", model_uri="latest")
    ctx = ScorerContext(contract=r.contract, policy=policy, store=r.store, state_dir=tmp_path)
    assert from_context(ctx).version == r.cfg.run_id
    # the same model downlinked to a node (no store access there): `downlink:` alone is the kind's own model
    data = registry.read_model_bytes(r.store, scorer.model_uri)
    downlink.publish_update(store_for(stack, "ingest"), "node-a", [(name, "model", r.cfg.run_id, data)])
    assert downlink.sync(store_for(stack, "node-a"), "node-a", tmp_path).applied
    node_ctx = ScorerContext(contract=r.contract, policy=TieringPolicy(scorer="model", model_uri="downlink:"),
                             store=None, state_dir=tmp_path / "state",
                             downlinked=partial(downlink.current_file, tmp_path))
    on_node = from_context(node_ctx)
    assert on_node.version == r.cfg.run_id and np.allclose(on_node.score(rows), values)
    other = load_contract("landsat_patch" if kind != "landsat_patch" else "basic_motions")
    with pytest.raises(ValueError, match=f"trained on {r.contract.id}, cannot score {other.id}"):
        from_context(ScorerContext(contract=other, policy=TieringPolicy(scorer="model", model_uri=f"latest:{name}"),
                                   store=r.store, state_dir=tmp_path))


@pytest.mark.integration
def test_train_model_trains_the_kind_with_the_contracts_defaults(store: ObjectStore) -> None:
    from edgehaul.flows.train_model import KindNotTrainable, TrainModelParams, train_model

    c = load_contract("daphnet_gait")
    make_kind_dataset(store, c, [200], labels=_labels(c, 200))
    tag = uuid.uuid4().hex[:8]
    store.save(f"store-{tag}", overwrite=True)
    TeamQuota(team="geo", accelerator_hours_per_month=100, storage_bytes=10**9).save(f"quota-{tag}", overwrite=True)
    out = train_model(TrainModelParams(team="geo", dataset_kind="daphnet_gait", store_block=f"store-{tag}",
                                       quota_block=f"quota-{tag}", num_threads=1, allow_local=True, max_hours=0.5,
                                       publish=True))
    assert c.training is not None
    assert out["model_name"] == c.training.model_name == "gait-freeze" and out["model_family"] == "mlp"
    assert 1 <= len(out["history"]) <= c.training.epochs and out["contract"] == "daphnet_gait.v1"
    lin = registry.read_lineage(store, "gait-freeze", out["model_id"])
    assert lin is not None and lin["config"]["batch_size"] == c.training.batch_size
    assert "val_macro_f1" in lin["final"]
    from edgehaul.edge.model_scorer import ModelScorer

    assert out["published"]["model_id"] == out["model_id"]  # the closed loop: the kind's edge model
    assert ModelScorer("latest:gait-freeze", store).version == out["model_id"]
    with pytest.raises(ContractError, match="no data contract for kind 'no_such_kind'"):
        train_model(TrainModelParams(dataset_kind="no_such_kind", allow_local=True))
    assert issubclass(KindNotTrainable, ContractError)


def test_the_metrics_artifact_rows_carry_the_per_class_metrics() -> None:
    from edgehaul.training.report import metrics_table

    row = {"epoch": 0, "step": 5, "train_loss": 0.5, "val_loss": 0.6, "train_acc": 0.9, "val_acc": 0.98,
           "train_samples": 80.0, "val_samples": 20.0,
           **class_metrics(np.array([[98.0, 0.0], [2.0, 0.0]]), (0, 1))}
    (out,) = metrics_table([row])
    assert out["val_recall_1"] == 0.0 and out["val_rare_recall"] == 0.0 and out["val_recall_0"] == 1.0
    assert out["val_macro_f1"] == pytest.approx(0.49495, abs=1e-5)


def _image_contract(tmp_path: Path, kind: str, shape: list[int], axis: int) -> Contract:
    doc = {"kind": kind, "version": 1,
           "tensor": {"column": "img", "shape": shape, "dtype": "uint8", "channel_axis": axis,
                      "channels": ["r", "g", "b"], "scale": 0.5},
           "label": {"column": "label", "values": [1, 2]},
           "training": {"model": "cnn2d", "model_name": kind.replace("_", "-")}}
    (tmp_path / f"{kind}.v1.yaml").write_text(yaml.safe_dump(doc))
    return load_contract(kind, directory=tmp_path)


def test_cnn2d_takes_images_channels_last_or_first_of_any_size(tmp_path: Path) -> None:
    last = _image_contract(tmp_path, "hwc_kind", [5, 7, 3], -1)
    first = _image_contract(tmp_path, "chw_kind", [3, 5, 7], 0)
    hwc = np.random.default_rng(0).integers(0, 256, (4, 5, 7, 3), dtype=np.uint8)
    chw = np.ascontiguousarray(hwc.transpose(0, 3, 1, 2))
    xl = inputs(pa.table({"img": pa.array([a.tobytes() for a in hwc], pa.binary())}), last, arch_for(last, 8))
    xf = inputs(pa.table({"img": pa.array([a.tobytes() for a in chw], pa.binary())}), first, arch_for(first, 8))
    assert xl.shape == xf.shape == (4, 3, 5, 7) and torch.equal(xl, xf)
    assert torch.equal(xl, torch.from_numpy(chw.astype(np.float32) * 0.5))
    assert build_model(arch_for(first, 8))(xf).shape == (4, 2)


def test_an_mlp_takes_a_flattened_tensor() -> None:
    motions = load_contract("basic_motions")
    arch = arch_for(motions, 8, family="mlp")
    t = _rows("basic_motions", 3, unusable_every=1000)
    x = inputs(t, motions, arch)
    assert arch["in_features"] == 600 and x.shape == (3, 600)
    assert torch.equal(x[2], torch.from_numpy(np.frombuffer(t.column("series")[2].as_py(), np.float32).copy()))
    assert build_model(arch)(x).shape == (3, 4)


def test_standardised_inputs_have_zero_mean_and_unit_spread_and_constant_inputs_pass_unscaled() -> None:
    from edgehaul.training.model import input_statistics, standardise

    rng = np.random.default_rng(3)
    x = np.stack([rng.normal(1000, 200, 4000), rng.normal(-5, 0.1, 4000), np.full(4000, 7.0)], axis=1)
    arch = {"family": "mlp", **input_statistics(x.astype(np.float32))}
    z = standardise(x.astype(np.float32), arch)
    assert np.allclose(z[:, :2].mean(axis=0), 0, atol=1e-3) and np.allclose(z[:, :2].std(axis=0), 1, atol=1e-3)
    assert np.allclose(z[:, 2], 0.0)  # constant: shifted, scale kept at 1
    series = rng.normal(0, 3, (50, 6, 100)).astype(np.float32)  # cnn1d: one statistic per channel
    stats = input_statistics(series)
    assert len(stats["input_shift"]) == 6
    assert np.allclose(standardise(series, {**stats}).std(axis=(0, 2)), 1, atol=1e-3)
    assert standardise(series, {"family": "cnn1d"}) is series  # an arch without statistics: unchanged (Landsat)
