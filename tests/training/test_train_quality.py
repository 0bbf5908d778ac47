"""A trainer that learns what it is given, and registers nothing it should not: balanced loss on skewed kinds,
early stopping, the quality gate against a uniform-prior guesser, non-finite losses, undecodable rows."""

from __future__ import annotations

import math
import uuid

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from edgehaul.blocks import ObjectStore
from edgehaul.contracts import Contract, load_contract
from edgehaul.training import registry
from edgehaul.training.data import is_validation, val_block_rows
from edgehaul.training.metrics import chance_macro_f1, class_metrics
from edgehaul.training.model import build_model, inputs
from edgehaul.training.trainer import (
    NonFiniteLoss,
    QualityGateFailed,
    TrainConfig,
    WeightAverage,
    _class_weights,
    _Run,
    train,
)
from tests.train_support import kind_rows

GAIT = load_contract("daphnet_gait")
MOTIONS = load_contract("basic_motions")
DIGITS = load_contract("digits_png")


def _write(store: ObjectStore, contract: Contract, tables: list[pa.Table]) -> str:
    from deltalake import write_deltalake

    uri = store.uri("curated", f"{contract.kind}-{uuid.uuid4().hex[:6]}")
    for t in tables:
        write_deltalake(uri, t, storage_options=store.storage_options(), mode="append")
    return uri


def _cfg(uri: str, contract: Contract, run_id: str, **kw: object) -> TrainConfig:
    base: dict[str, object] = dict(run_id=run_id, dataset_uri=uri, dataset_version=0, contract_id=contract.id,
                                   model_name=f"m-{run_id}", epochs=6, batch_size=32, width=16, num_threads=1,
                                   val_fraction=0.25, emit_events=False, checkpoint_every_steps=10_000)
    base.update(kw)
    return TrainConfig.model_validate(base)


def _replace(t: pa.Table, name: str, values: pa.Array) -> pa.Table:
    return t.set_column(t.schema.get_field_index(name), name, values)


# ---------------------------------------------------------------------------------------- units
@settings(deadline=None)
@given(st.integers(2, 12))
def test_chance_of_k_balanced_classes_is_one_over_k(k: int) -> None:
    assert math.isclose(chance_macro_f1(np.full(k, 10.0)), 1 / k)
    # on a skewed kind, always answering the commonest class is the guesser to beat
    assert math.isclose(chance_macro_f1(np.asarray([90.0, 10.0])), max(2 * 0.9 / 1.9 / 2, (1.8 / 2.8 + 0.2 / 1.2) / 2))


@settings(deadline=None)
@given(st.lists(st.integers(0, 500), min_size=2, max_size=10).filter(lambda s: sum(s) > 0))
def test_a_perfect_model_beats_chance_and_a_constant_one_does_not(support: list[int]) -> None:
    s = np.asarray(support, dtype=np.float64)
    chance = chance_macro_f1(s)
    assert 0 < chance <= 1
    perfect = class_metrics(np.diag(s), list(range(len(s))))["val_macro_f1"]
    assert perfect == 1.0
    if (s > 0).sum() >= 2:  # the commonest class always predicted: a label-blind guesser, no better than chance
        constant = np.zeros((len(s), len(s)))
        constant[:, int(np.argmax(s))] = s
        assert class_metrics(constant, list(range(len(s))))["val_macro_f1"] <= chance + 1e-9


def test_validation_holds_out_whole_stretches_of_a_nodes_readings() -> None:
    n = 64 * 200
    rows = pa.table({"sample_id": [f"a-{i}" for i in range(n)], "node_id": ["a"] * n, "seq": np.arange(n)})
    val = is_validation(rows, 0.2, block_rows=64)
    blocks = val.reshape(200, 64)
    assert (blocks.all(axis=1) | ~blocks.any(axis=1)).all()  # a stretch is on one side
    assert 0.1 < val.mean() < 0.3
    assert (is_validation(rows.slice(640, 640), 0.2, block_rows=64) == val[640:1280]).all()  # stable
    assert not is_validation(rows, 0.0).any()


def test_a_small_version_still_holds_rows_out_for_validation() -> None:
    """Stretches of 64 readings hold nothing out of a 320-row version about half the time (5 stretches at 10%):
    the stretch shrinks with the version, so the gates always have something to judge."""
    assert val_block_rows(320, 0.1) == 1 and val_block_rows(1_000_000, 0.1) == 64 and val_block_rows(0, 0.1) == 1
    for start in range(0, 20 * 320, 320):
        rows = kind_rows(GAIT, 320, start_seq=start)
        assert 10 <= int(is_validation(rows, 0.1, val_block_rows(320, 0.1)).sum()) <= 60


def test_balanced_training_is_the_default_for_every_kind() -> None:
    for kind in ("landsat_patch", "basic_motions", "digits_png", "daphnet_gait"):
        spec = load_contract(kind).training
        assert spec is not None and spec.balance_classes


def test_the_publish_gate_judges_macro_f1_against_chance_plus_its_floor() -> None:
    good = {"model_id": "g", "final": {"val_macro_f1": 0.61, "val_chance_macro_f1": 0.5, "val_acc": 0.7}}
    assert registry.check_quality(good)["floor"] == pytest.approx(0.5 + registry.PUBLISH_MARGIN)
    with pytest.raises(registry.QualityGateFailed, match=r"macro-F1 0.520 below the publish gate 0.550"):
        registry.check_quality({"model_id": "w", "final": {"val_macro_f1": 0.52, "val_chance_macro_f1": 0.5}})
    with pytest.raises(registry.QualityGateFailed, match="no validation macro-F1"):
        registry.check_quality({"model_id": "u", "final": {"val_acc": 0.99}})
    # a lineage without the chance figure: computed from the support it records
    legacy = {"model_id": "l", "final": {"val_macro_f1": 0.9, "val_support_1": 50.0, "val_support_2": 50.0}}
    assert registry.check_quality(legacy)["chance_macro_f1"] == pytest.approx(0.5)
    # validation rows of one class (a rare class missed by the split): chance is 1.0, nothing could pass; said so
    one = {"model_id": "o", "final": {"val_macro_f1": 1.0, "val_support_0": 57.0, "val_support_1": 0.0}}
    with pytest.raises(registry.QualityGateFailed, match=r"validation rows hold one class only \(val_support_0\)"):
        registry.check_quality(one)


def _linear(values: list[float]) -> torch.nn.Linear:
    m = torch.nn.Linear(len(values), 1, bias=False)
    with torch.no_grad():
        m.weight.copy_(torch.tensor([values]))
    return m


@settings(deadline=None, max_examples=50)
@given(st.lists(st.lists(st.floats(-10, 10), min_size=3, max_size=3), min_size=1, max_size=40),
       st.floats(0.5, 0.999))
def test_the_weight_average_is_the_warmed_up_moving_average_and_resumes_exactly(
        steps: list[list[float]], decay: float) -> None:
    src = _linear([0.0, 0.0, 0.0])
    avg = WeightAverage(src, decay)
    expected = np.zeros(3)
    for t, values in enumerate(steps, start=1):
        with torch.no_grad():
            src.weight.copy_(torch.tensor([values]))
        avg.update(src)
        keep = min(decay, (1 + t) / (10 + t))
        expected = keep * expected + (1 - keep) * np.asarray(values)
    got = avg.model.weight.detach().numpy()[0]
    assert np.allclose(got, expected, atol=1e-4)
    # an average: never outside what the weights were
    seen = np.asarray([[0.0, 0.0, 0.0], *steps])
    assert (got >= seen.min(0) - 1e-4).all() and (got <= seen.max(0) + 1e-4).all()
    assert not avg.model.training and not any(p.requires_grad for p in avg.model.parameters())
    # a resumed average (its checkpointed state) goes on exactly as the uninterrupted one
    again = WeightAverage(_linear([5.0, 5.0, 5.0]), decay)
    again.load(avg.state())
    for a in (avg, again):
        a.update(src)
    assert torch.equal(avg.model.weight, again.model.weight) and again.updates == len(steps) + 1


def _ranking_run(patience: int, rank_by: str = "macro_f1") -> _Run:
    """A run as far as early stopping needs it (no data, no store)."""
    run = _Run(TrainConfig(run_id="r", dataset_uri="s3://b/t", dataset_version=0, contract_id=GAIT.id,
                           patience=patience, emit_events=False, rank_by=rank_by),  # type: ignore[arg-type]
               store=None, progress=None)  # type: ignore[arg-type]
    run.raw_model, run.average, run.class_rows = build_model(run.arch), None, None
    return run


def _epochs(run: _Run, f1s: list[float]) -> int | None:
    """Feeds epochs with these validation macro-F1s; the epoch the run stops at, or None."""
    for epoch, f1 in enumerate(f1s):
        row = {"epoch": epoch, "val_macro_f1": f1, "val_samples": 200.0, "val_rows_0": 180.0, "val_rows_1": 20.0}
        run.history.append(row)
        if run.keep_best(row):
            return epoch
    return None


def test_one_lucky_epoch_does_not_stop_a_model_that_is_still_learning() -> None:
    """Gait at 10%, FIFO's rows, seed 1: epoch 9's spike (0.70) stopped the run at epoch 24 of 72 while the curve
    still rose; it scored 0.635 on the test set where the same rows scored 0.755-0.789 with seeds 0 and 2."""
    rising = [0.5, 0.55, 0.70, 0.60, 0.62, 0.64, 0.66, 0.68, 0.69, 0.695, 0.70, 0.71]
    run = _ranking_run(patience=3)
    assert _epochs(run, rising) is None and run.best.epoch == 11
    # the same spike followed by a flat or falling stretch stops, and keeps the spike's weights
    run = _ranking_run(patience=3)
    assert _epochs(run, [0.5, 0.55, 0.70, 0.60, 0.58, 0.56, 0.55, 0.55]) == 5 and run.best.epoch == 2
    assert run.best.stopped_early


@settings(deadline=None, max_examples=80)
@given(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=30), st.integers(1, 6))
def test_early_stopping_keeps_the_best_epoch_and_stops_by_twice_patience_after_it(
        f1s: list[float], patience: int) -> None:
    run = _ranking_run(patience)
    stopped = _epochs(run, f1s)
    seen = f1s if stopped is None else f1s[: stopped + 1]
    assert run.best.epoch == int(np.argmax(seen)) and run.best.macro_f1 == max(seen)  # the first best kept
    if stopped is not None:
        assert stopped - run.best.epoch >= patience
    # a curve that never beats its best again stops no later than 2 x patience after it (its trend cannot rise)
    flat = [*seen[: run.best.epoch + 1], *[seen[run.best.epoch] - 0.01] * (3 * patience)]
    run = _ranking_run(patience)
    end = _epochs(run, flat)
    assert end is not None and end <= run.best.epoch + 2 * patience


def test_the_balanced_loss_weighs_every_class_alike() -> None:
    """Each class's weighted mean cross-entropy, averaged over the classes seen: a rare class counts as much as the
    commonest, as balanced training weighs them; a class with no validation row is left out, and none is NaN."""
    from edgehaul.training.trainer import balanced_loss

    assert balanced_loss([2.0, 9.0, 1.0, 3.0]) == pytest.approx(2.5)  # (2/1 + 9/3) / 2, not 11/4
    assert balanced_loss([2.0, 0.0, 9.0, 1.0, 0.0, 3.0]) == pytest.approx(2.5)
    assert math.isnan(balanced_loss([0.0, 0.0, 0.0, 0.0]))


@settings(deadline=None, max_examples=60)
@given(st.lists(st.floats(0.01, 5.0), min_size=1, max_size=30), st.integers(1, 6))
def test_ranked_by_the_balanced_loss_early_stopping_keeps_the_epoch_of_the_lowest(
        losses: list[float], patience: int) -> None:
    run = _ranking_run(patience, rank_by="balanced_loss")
    stopped = None
    for epoch, loss in enumerate(losses):
        row = {"epoch": epoch, "val_macro_f1": 0.5, "val_balanced_loss": loss, "val_samples": 200.0,
               "val_rows_0": 180.0, "val_rows_1": 20.0}
        run.history.append(row)
        if run.keep_best(row):
            stopped = epoch
            break
    seen = losses if stopped is None else losses[: stopped + 1]
    assert run.best.epoch == int(np.argmin(seen))  # the first lowest kept
    if stopped is not None:
        assert stopped - run.best.epoch >= patience


# ---------------------------------------------------------------------------------------- real runs
def _skewed_motions(n: int, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    labels = rng.choice(np.asarray([1, 2, 3, 4]), size=n, p=[0.82, 0.1, 0.05, 0.03])
    return kind_rows(MOTIONS, n, seed=seed, labels=labels, unusable_every=10_000)


@pytest.mark.integration
def test_a_skewed_kind_learns_every_class_with_a_falling_loss(store: ObjectStore) -> None:
    uri = _write(store, MOTIONS, [_skewed_motions(1600, 1)])
    res = train(_cfg(uri, MOTIONS, "skewed", patience=3), store)
    h = res.history
    assert h[-1]["train_loss"] < h[0]["train_loss"]
    assert h[-1]["val_balanced_loss"] < h[0]["val_balanced_loss"]  # every class's validation loss, averaged
    lin = res.lineage
    gate = lin["quality_gate"]
    assert gate["passed"] and gate["val_macro_f1"] > gate["chance_macro_f1"] + 0.2
    # the registered model predicts every class of a fresh skewed stream, the rarest included
    f = registry.load_model_file(store, lin["model_uri"])
    model = build_model(dict(f["arch"]))
    model.load_state_dict(f["state_dict"])
    model.eval()
    test = _skewed_motions(1200, 99)
    with torch.no_grad():
        pred = model(inputs(test, MOTIONS, dict(f["arch"]))).argmax(1).numpy()
    assert MOTIONS.label_column is not None
    truth = np.asarray(test.column(MOTIONS.label_column).to_pylist()) - 1
    for c in range(4):
        assert ((pred == c) & (truth == c)).sum() / max((truth == c).sum(), 1) > 0.5, c


def _gait(n: int, seed: int, span: tuple[float, float]) -> pa.Table:
    """Daphnet gait readings with synthetic freezing on 5%: the classes overlap (one reading, moderate shift)."""
    from edgehaul_dev.kinds_data import generate_gait

    raw = pa.concat_tables(generate_gait(n, "node-g", seed=seed, anomaly_fraction=0.05, contract=GAIT, span=span))
    assert GAIT.label_column is not None
    t = kind_rows(GAIT, n, seed=seed, labels=np.asarray(raw.column(GAIT.label_column).to_numpy()),
                  inclusion_p=np.ones(n), unusable_every=10**9)
    for c in GAIT.numeric_columns:
        t = _replace(t, c, raw.column(c).cast(t.schema.field(c).type))
    return t


@pytest.mark.integration
def test_a_skewed_kind_with_overlapping_classes_beats_the_label_blind_guesser(store: ObjectStore) -> None:
    """Balanced training makes the rare class as likely as the commonest a priori; decided by argmax, a gait model
    called most readings freezing (accuracy 0.43, below always-normal's 0.95). The decision rule chosen on
    validation keeps the rare class found and the commonest one right: macro-F1 and accuracy on later readings
    both beat the guesser that always answers 'normal'."""
    uri = _write(store, GAIT, [_gait(4000, 0, (0.0, 0.7))])
    res = train(_cfg(uri, GAIT, "gait", epochs=30, batch_size=250, patience=8, val_fraction=0.15,
                     quality_gate=False), store)
    lin = res.lineage
    assert lin["decision_rule"]["tau"] in (0.0, 0.25, 0.5, 0.75, 1.0)
    assert lin["final"]["val_macro_f1"] >= lin["final"]["val_macro_f1_argmax"]
    f = registry.load_model_file(store, lin["model_uri"])
    model = build_model(dict(f["arch"]))
    model.load_state_dict(f["state_dict"])
    model.eval()
    test = _gait(2000, 1, (0.7, 1.0))
    with torch.no_grad():
        pred = model(inputs(test, GAIT, dict(f["arch"]))).argmax(1).numpy()
    assert GAIT.label_column is not None
    truth = np.asarray(test.column(GAIT.label_column).to_numpy())
    cm = np.zeros((2, 2))
    np.add.at(cm, (truth, pred), 1.0)
    blind = np.zeros((2, 2))
    blind[:, 0] = cm.sum(axis=1)
    f1, f1_blind = (class_metrics(m, [0, 1])["val_macro_f1"] for m in (cm, blind))
    accuracy, accuracy_blind = np.trace(cm) / cm.sum(), blind[0, 0] / cm.sum()
    assert f1 > f1_blind + 0.1, (f1, f1_blind, lin["decision_rule"])
    assert accuracy > accuracy_blind - 0.03, (accuracy, accuracy_blind, lin["decision_rule"])
    assert cm[1, 1] / cm[1].sum() > 0.3  # the rare class is still found


@pytest.mark.integration
def test_a_model_no_better_than_chance_registers_nothing_and_early_stopping_keeps_the_best(
        store: ObjectStore) -> None:
    t = kind_rows(GAIT, 800, seed=3, labels=np.arange(800) % 2, unusable_every=10_000)
    for c in GAIT.numeric_columns:  # inputs that say nothing about the label
        t = _replace(t, c, pa.array(np.ones(t.num_rows), t.schema.field(c).type))
    uri = _write(store, GAIT, [t])
    with pytest.raises(QualityGateFailed, match="not above a uniform-prior guesser"):
        train(_cfg(uri, GAIT, "chance", epochs=4, patience=2), store)
    assert registry.read_lineage(store, "m-chance", "chance") is None
    # with the gate off it registers, and the run stopped once `patience` epochs brought nothing better
    res = train(_cfg(uri, GAIT, "nogate", epochs=20, patience=2, quality_gate=False), store)
    assert res.lineage["stopped_early"] and len(res.history) == res.lineage["best_epoch"] + 3 < 20
    assert res.lineage["quality_gate"] == {**res.lineage["quality_gate"], "measured": True, "passed": False}


@pytest.mark.integration
def test_a_validation_split_of_one_class_is_said_so_and_registers_nothing(store: ObjectStore) -> None:
    """The held-out stretches of a version can miss its rare class (a node whose freezing readings all fell in
    training stretches: the kinds e2e test, 2.5% of node ids). A constant guesser scores 1.0 on one class, so the
    gate cannot judge: it says so, instead of 'learnt nothing usable', and registers nothing."""
    t = kind_rows(GAIT, 800, seed=3, labels=np.arange(800) % 2, unusable_every=10_000)
    held = is_validation(t, 0.25, val_block_rows(800, 0.25))
    assert 0 < held.sum() < 800
    t = _replace(t, "is_anomaly", pa.array(np.where(held, 0, np.arange(800) % 2), t.schema.field("is_anomaly").type))
    uri = _write(store, GAIT, [t])
    with pytest.raises(QualityGateFailed, match=r"validation rows hold one class only \(val_support_0\), so its "
                                                "quality cannot be judged"):
        train(_cfg(uri, GAIT, "oneclass", epochs=2), store)
    assert registry.read_lineage(store, "m-oneclass", "oneclass") is None


@pytest.mark.integration
def test_a_validation_split_too_small_to_rank_epochs_keeps_the_last_epoch(store: ObjectStore) -> None:
    """Eight validation readings cannot rank epochs: early stopping on them once kept a barely trained first epoch
    (a 10% digits cell predicted one class). Below 5 validation rows per class every epoch counts as better, so
    the run trains all its epochs and registers the last."""
    # 200 rows at 4% are held out row by row (`val_block_rows`): a start where exactly 8 of them are
    block = val_block_rows(200, 0.04)
    k = next(k for k in range(0, 10_000)
             if int(is_validation(kind_rows(GAIT, 200, start_seq=200 * k), 0.04, block).sum()) == 8)
    t = kind_rows(GAIT, 200, seed=6, start_seq=200 * k, labels=np.arange(200) % 2, unusable_every=10_000)
    for c in GAIT.numeric_columns:  # no epoch better than another on validation: patience 1 would stop at once
        t = _replace(t, c, pa.array(np.ones(t.num_rows), t.schema.field(c).type))
    uri = _write(store, GAIT, [t])
    res = train(_cfg(uri, GAIT, "tiny-val", epochs=5, patience=1, quality_gate=False, val_fraction=0.04), store)
    assert [h["val_samples"] for h in res.history] == [8.0] * 5
    assert res.lineage["best_epoch"] == 4 and not res.lineage["stopped_early"]


@pytest.mark.integration
def test_balanced_loss_counts_a_class_rows_alike_and_the_prior_stays_the_streams(store: ObjectStore) -> None:
    """The loss's class weights balance the loss's own row weights, (1/p)^weight_power (0: landed counts, so
    every class has the same total weight and a row with a small p is not worth 10 of its class); the decision
    rule's prior is always from 1/p counts (the stream's mix); weight_power 1: both Horvitz-Thompson."""
    from edgehaul.training.data import DatasetRef, open_fragments

    labels = np.r_[np.zeros(300, dtype=np.int64), np.ones(50, dtype=np.int64)]
    p = np.r_[np.full(150, 0.1), np.ones(150), np.ones(50)]  # class 0 stands for 1,650 rows, class 1 for 50
    uri = _write(store, GAIT, [kind_rows(GAIT, 350, seed=5, labels=labels, inclusion_p=p, unusable_every=10**9)])
    frags, cols = open_fragments(DatasetRef(uri, 0, store.storage_options()), GAIT)
    loss_w, prior_w, rows = _class_weights(frags, cols, GAIT, 2, power=0.0)
    assert loss_w.tolist() == pytest.approx([1.0, 6.0]) and rows.tolist() == [300.0, 50.0]  # rows, unweighted
    assert prior_w.tolist() == pytest.approx([1.0, 33.0])
    ht_loss, ht_prior, _ = _class_weights(frags, cols, GAIT, 2, power=1.0)
    assert ht_loss.tolist() == pytest.approx([1.0, 33.0]) and ht_prior.tolist() == pytest.approx([1.0, 33.0])
    half, _, _ = _class_weights(frags, cols, GAIT, 2, power=0.5)  # class 0: 150 x sqrt(10) + 150 rows' worth
    assert half.tolist() == pytest.approx([1.0, (150 * 10**0.5 + 150) / 50], rel=1e-5)
    assert TrainConfig.model_fields["weight_power"].default == 0.5


@pytest.mark.integration
def test_a_non_finite_loss_fails_the_run_and_registers_nothing(store: ObjectStore) -> None:
    p = np.full(600, 0.5)
    p[::50] = 1e-40  # in (0, 1], but 1/p overflows float32
    uri = _write(store, GAIT, [kind_rows(GAIT, 600, seed=4, labels=np.arange(600) % 2, inclusion_p=p)])
    with pytest.raises(NonFiniteLoss, match=r"1/inclusion_p is not finite.*nothing registered"):
        train(_cfg(uri, GAIT, "poisoned", epochs=2), store)
    assert registry.read_lineage(store, "m-poisoned", "poisoned") is None


@pytest.mark.integration
def test_an_undecodable_file_payload_is_skipped_and_named(store: ObjectStore) -> None:
    t = kind_rows(DIGITS, 400, seed=5, unusable_every=10_000)
    col = t.column(DIGITS.payload_columns[0]).to_pylist()
    junk = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4
    bad = [7, 150]
    for i in bad:
        col[i] = junk
    t = _replace(t, DIGITS.payload_columns[0], pa.array(col, t.schema.field(DIGITS.payload_columns[0]).type))
    uri = _write(store, DIGITS, [t])
    res = train(_cfg(uri, DIGITS, "junk", epochs=3, quality_gate=False), store)
    lin = res.lineage
    ids = t.column("sample_id").to_pylist()
    assert lin["skipped_rows"] == 2
    assert [s["sample_id"] for s in lin["skipped_samples"]] == sorted(ids[i] for i in bad)
    assert all("not a readable image" in s["reason"] for s in lin["skipped_samples"])
    assert registry.read_lineage(store, "m-junk", "junk") is not None
    assert sum(h["train_samples"] + h["val_samples"] for h in res.history[:1]) == 398
