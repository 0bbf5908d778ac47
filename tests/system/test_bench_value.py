"""The value benchmark's ground truth: held out by place, never uplinked, not even as a generated copy."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from benchmarks.bench_value import (
    Config,
    ConstantScorer,
    Guard,
    Split,
    blocks_of,
    edge_round,
    edge_stream,
    land_and_commit,
    pixel_array,
    pixel_hashes,
    policy_for,
    schedule,
    scores,
    spatial_split,
    version_rows,
    within,
)
from edgehaul.blocks import ObjectStore
from edgehaul.contracts import load_contract
from edgehaul.edge import landsat
from edgehaul.edge.tiering import TierReport
from edgehaul_dev import localstack
from tests.conftest import api_auth

C = load_contract("landsat_patch")
CFG_ROWS = 16


@pytest.fixture(scope="module")
def split() -> Split:
    return spatial_split(landsat.real_patches(), block=4, test_share=0.25, seed=0)


def stream_pixels(batches: list[pa.Table]) -> np.ndarray:
    return np.concatenate([pixel_array(b, C) for b in batches])


def copies_of(stream: np.ndarray, test: np.ndarray) -> int:
    """Stream samples that are a test patch under one of the 8 flips/rotations `generate` applies,
    within its +-2 noise. Band means are invariant under those and move by at most 2 with the
    noise, so only pairs with close means are compared pixel by pixel."""
    sm, tm = stream.mean(axis=(1, 2)), test.mean(axis=(1, 2))
    views = [np.rot90(test, k, axes=(1, 2)) for k in range(4)]
    views += [v[:, :, ::-1] for v in views]
    hits = 0
    for i in range(len(stream)):
        near = np.flatnonzero(np.abs(tm - sm[i]).max(axis=1) <= 2.0)
        s = stream[i].astype(np.int16)
        if any((np.abs(v[j].astype(np.int16) - s) <= 2).all() for j in near for v in views):
            hits += 1
    return hits


def test_split_is_by_whole_blocks(split: Split) -> None:
    sp = split
    test_blocks = {tuple(b) for b in blocks_of(sp.test.origins, sp.block)}
    train_blocks = {tuple(b) for b in blocks_of(sp.train.origins, sp.block)}
    assert test_blocks == set(sp.test_blocks)
    assert not test_blocks & train_blocks
    n = len(sp.train.labels) + len(sp.test.labels)
    assert n == len(landsat.real_patches().labels)
    assert 0.2 <= len(sp.test.labels) / n <= 0.35
    # Every class of the scene is learnable and measurable.
    assert set(np.unique(sp.test.labels)) == set(np.unique(sp.train.labels))


def test_split_is_seeded(split: Split) -> None:
    again = spatial_split(landsat.real_patches(), block=4, test_share=0.25, seed=0)
    assert again.test_blocks == split.test_blocks


def test_stream_holds_no_test_patch_nor_a_generated_copy(split: Split) -> None:
    batches = edge_stream(split, 2000, batch=500, seed=3, contract=C)
    px = stream_pixels(batches)
    assert len(px) == 2000
    assert not pixel_hashes(px) & pixel_hashes(split.test.pixels)
    assert copies_of(px, split.test.pixels) == 0
    # Every real training patch is in the stream as it is.
    assert pixel_hashes(split.train.pixels) <= pixel_hashes(px)


def test_copy_check_finds_copies_when_the_whole_scene_is_generated(split: Split) -> None:
    """The check above can fail: generating from the whole scene copies test patches."""
    leaky = stream_pixels(list(landsat.generate(400, "x", seed=3, batch_size=400)))
    assert copies_of(leaky, split.test.pixels) > 0


def test_guard_refuses_a_version_holding_a_test_patch(split: Split) -> None:
    guard = Guard(pixel_hashes(split.test.pixels))
    clean = pa.table({"content_sha256": sorted(pixel_hashes(split.train.pixels[:5]))})
    guard.check(clean, "clean")
    leak = pa.table({"content_sha256": [next(iter(pixel_hashes(split.test.pixels[:1])))]})
    with pytest.raises(AssertionError, match="held-out"):
        guard.check(leak, "leaky")
    assert guard.versions == 1


def test_scores_macro_f1_and_rare_recall() -> None:
    truth = np.array([1, 1, 1, 1, 5, 5, 6, 6])
    pred = np.array([1, 1, 1, 5, 5, 5, 6, 1])
    s = scores(truth, pred, rare=[6])
    # class 1: P 3/4 R 3/4; class 5: P 2/3 R 1; class 6: P 1 R 1/2
    f1 = [0.75, 2 * (2 / 3) / (5 / 3), 2 * 0.5 / 1.5]
    assert s["macro_f1"] == pytest.approx(np.mean(f1))
    assert s["rare_recall"] == pytest.approx(0.5)
    assert s["accuracy"] == pytest.approx(6 / 8)


def _cell(policy: str, budget: float, f1: tuple[float, float, float], rare: tuple[float, float, float]
          ) -> dict[str, Any]:
    """A bench cell as run_experiment reports it: means and 90% intervals (lo, mean, hi)."""
    return {"policy": policy, "budget": budget, "runs": [{}], "macro_f1_mean": f1[1], "rare_recall_mean": rare[1],
            "accuracy_mean": 0.9, "ci": {"macro_f1": [f1[0], f1[2]], "rare_recall": [rare[0], rare[2]]}}


def test_verdicts_state_each_target_of_issue_30_met_or_not() -> None:
    """The README's verdict is generated: the small-budget target needs the rare recall apart from FIFO's AND
    random's (bounds that meet are not apart) and macro-F1 not below; the balanced kind's needs every tiered cell
    not below random's, said with whether the intervals overlap."""
    from benchmarks.bench_value import plain_verdict, verdicts

    skewed = {"kind": "gait", "skewed": True, "policies": ["fifo", "random", "tier-anomaly"], "cells": [
        _cell("fifo", 0.02, (0.50, 0.568, 0.63), (0.013, 0.093, 0.169)),
        _cell("random", 0.02, (0.49, 0.518, 0.55), (0.016, 0.068, 0.138)),
        _cell("tier-anomaly", 0.02, (0.56, 0.589, 0.62), (0.169, 0.222, 0.279)),  # touches FIFO's bound
        _cell("fifo", 0.05, (0.50, 0.56, 0.62), (0.02, 0.11, 0.22)),
        {**_cell("random", 0.05, (0.54, 0.58, 0.61), (0.21, 0.29, 0.36)), "runs": [{}] * 6},
        {**_cell("tier-anomaly", 0.05, (0.55, 0.59, 0.63), (0.37, 0.45, 0.52)), "runs": [{}] * 6},  # apart, F1 ok
        _cell("fifo", 0.10, (0.57, 0.591, 0.62), (0.4, 0.6, 0.7)),
        _cell("random", 0.10, (0.53, 0.555, 0.58), (0.1, 0.3, 0.5)),
        _cell("tier-anomaly", 0.10, (0.58, 0.609, 0.63), (0.4, 0.58, 0.66)),
        *[_cell(p, 1.0, (0.61, 0.641, 0.67), (0.5, 0.6, 0.7)) for p in ("fifo", "random", "tier-anomaly")]]}
    lines = verdicts(skewed)
    small = [v for v in lines if v.startswith("small-budget target")]
    assert len(small) == 2 and small[0].startswith("small-budget target at 2%: tier-anomaly")
    assert "(overlapping)" in small[0] and small[0].endswith("NOT met")
    assert "(apart)" in small[1] and "(not below)" in small[1] and small[1].endswith("MET")
    assert any(v.startswith("target at 10%") and v.endswith(": MET") for v in lines)  # 0.609 >= 0.95 x 0.641
    assert "the rare-recall target at 2% not met, 5% met" in plain_verdict([skewed])
    # the same cells over three draws: apart, but a recall line is called on six or more (gait: twice luck)
    skewed["cells"][5] = {**skewed["cells"][5], "runs": [{}] * 3}
    three = next(v for v in verdicts(skewed) if v.startswith("small-budget target at 5%"))
    assert "(apart)" in three and "3 draws, a recall line is called on 6 or more" in three and three.endswith("NOT met")
    assert "the rare-recall target at 2% not met, 5% not met" in plain_verdict([skewed])
    skewed["cells"][5] = _cell("tier-anomaly", 0.05, (0.50, 0.57, 0.63), (0.37, 0.45, 0.52))  # F1 below random's
    assert next(v for v in verdicts(skewed) if v.startswith("small-budget target at 5%")).endswith("(below): NOT met")
    # the model trained on every row is selection's reach: a line it could not meet itself is said to be so
    assert not any("the 100% model's own" in v for v in verdicts(skewed))  # its recall 0.5-0.7 is apart from both
    skewed["cells"][-3] = _cell("fifo", 1.0, (0.61, 0.641, 0.67), (0.10, 0.16, 0.25))
    two = next(v for v in verdicts(skewed) if v.startswith("small-budget target at 2%"))
    assert two.endswith("(not below); the 100% model's own 0.160 [0.100, 0.250] is not apart from them either: NOT met")

    balanced = {"kind": "digits", "skewed": False, "policies": ["fifo", "random", "tier-novelty"], "cells": [
        _cell("fifo", 0.10, (0.79, 0.815, 0.835), (0.7, 0.8, 0.85)),
        _cell("random", 0.10, (0.788, 0.825, 0.860), (0.7, 0.75, 0.82)),
        _cell("tier-novelty", 0.10, (0.761, 0.787, 0.809), (0.57, 0.67, 0.77)),
        *[_cell(p, 1.0, (0.88, 0.905, 0.92), (0.8, 0.9, 0.95)) for p in ("fifo", "random", "tier-novelty")]]}
    balanced["cells"] += [{**_cell("fifo", 0.02, (0, 0, 0), (0, 0, 0)), "runs": [], "macro_f1_mean": float("nan")},
                          _cell("random", 0.02, (0.375, 0.437, 0.506), (0.1, 0.3, 0.5)),
                          _cell("tier-novelty", 0.02, (0.184, 0.243, 0.296), (0.1, 0.26, 0.46))]
    lines = verdicts(balanced)
    # FIFO landed nothing at 2% (its bundle overran the budget): tiering is judged against random's model
    assert ("  2% tier-novelty: macro-F1 0.243 [0.184, 0.296] loses to the better of FIFO/random (random 0.437 "
            "[0.375, 0.506])") in lines
    assert ("target (balanced kind): every tiered cell not below random's macro-F1: NOT met, below it: "
            "tier-novelty@10% 0.787 < 0.825 (intervals overlap), tier-novelty@2% 0.243 < 0.437 (intervals apart)") in lines
    assert not any(v.startswith("small-budget") for v in lines)  # a balanced kind has no rare-recall target
    balanced["stream_share"] = {0: 0.5, 1: 0.5}
    for c, mix in ((balanced["cells"][-2], {0: 0.56, 1: 0.44}), (balanced["cells"][-1], {0: 0.47, 1: 0.53})):
        c.update(weighted_mix=mix, draws=[{}], rows=100)
    mix_line = next(v for v in verdicts(balanced) if v.startswith("weighted class mix"))
    # 100 rows of a 50/50 stream, one draw: a uniform sample is off by 4.0 points on average, so 3.0 is chance
    assert mix_line.startswith("weighted class mix more than 2 points off the stream's (points; random's at the same "
                               "bytes; a uniform sample's of as many rows: mean, 90th percentile): tier-novelty@2% 3.0 "
                               "(random 6.0; chance at 100 rows x 1: 4.")
    assert mix_line.endswith("1 of 1 within chance's 90th percentile, 1 where chance's mean itself is over 2 points")
    balanced["cells"][-1].update(rows=10_000, weighted_mix={0: 0.47, 1: 0.53})  # as many rows leave 0.4 by chance
    mix_line = next(v for v in verdicts(balanced) if v.startswith("weighted class mix"))
    assert "chance at 10000 rows x 1: 0.4, p90 0.8)" in mix_line
    assert mix_line.endswith("0 of 1 within chance's 90th percentile, 0 where chance's mean itself is over 2 points")
    balanced["cells"][2] = _cell("tier-novelty", 0.10, (0.80, 0.83, 0.86), (0.6, 0.7, 0.8))
    balanced["cells"][-1] = _cell("tier-novelty", 0.02, (0.40, 0.45, 0.50), (0.1, 0.3, 0.5))
    assert "target (balanced kind): every tiered cell not below random's macro-F1: MET" in verdicts(balanced)


def test_chance_mix_gap_is_the_sampling_noise_of_a_uniform_sample() -> None:
    """The yardstick of the mix line: for two even classes and one draw of n rows the gap is 100 x |Binomial(n, 0.5)/n
    - 0.5|, whose mean is 50 x sqrt(2 / (pi n)) for large n; four times the rows or the draws halve it; a stream of
    one class leaves none; the same seed, the same figure."""
    from benchmarks.bench_value import chance_mix_gap

    mean, p90 = chance_mix_gap({0: 0.5, 1: 0.5}, 400, 1)
    assert mean == pytest.approx(50 * np.sqrt(2 / (np.pi * 400)), rel=0.06) and p90 > mean
    assert chance_mix_gap({0: 0.5, 1: 0.5}, 1600, 1)[0] == pytest.approx(mean / 2, rel=0.08)
    assert chance_mix_gap({0: 0.5, 1: 0.5}, 400, 4)[0] == pytest.approx(mean / 2, rel=0.08)
    assert chance_mix_gap({0: 1.0}, 50, 3) == (0.0, 0.0)
    # counts, not shares, are fine: the stream's mix as the benchmark records it
    assert chance_mix_gap({1: 4240, 5: 5992}, 128, 3) == chance_mix_gap({1: 4240, 5: 5992}, 128, 3)
    assert chance_mix_gap({1: 4240, 5: 5992}, 128, 3)[0] == pytest.approx(
        chance_mix_gap({1: 4240 / 10232, 5: 5992 / 10232}, 128, 3)[0])


def _shard(kind: str, *, quick: bool = False, experiment: dict[str, Any] | None = None,
           **config: Any) -> dict[str, Any]:
    from benchmarks.bench_value import FULL, QUICK

    cfg = {**asdict(QUICK if quick else FULL), **config, "kinds": [kind]}
    return {"quick": quick, "experiment": experiment or {}, "kinds": [{"kind": kind, "config": cfg, "cells": []}]}


def test_shards_merge_only_when_together_they_are_the_benchmark(tmp_path: Path) -> None:
    """Per-kind runs merge into one result in the benchmark's kind order; an experiment, a mix of quick and
    full, a missing or doubled kind, or another configuration is refused, saying which."""
    import json

    from benchmarks.bench_value import FULL, merge_shards

    def files(*shards: dict[str, Any]) -> list[Path]:
        out = []
        for i, s in enumerate(shards):
            (f := tmp_path / f"s{i}-{len(list(tmp_path.iterdir()))}.json").write_text(json.dumps(s))
            out.append(f)
        return out

    merged = merge_shards(files(*(_shard(k) for k in reversed(FULL.kinds))))
    assert [r["kind"] for r in merged["kinds"]] == list(FULL.kinds)
    assert merged["quick"] is False and merged["experiment"] == {}
    rest = [_shard(k) for k in FULL.kinds[1:]]
    refusals = [
        ("an experiment", [_shard(FULL.kinds[0], experiment={"budgets": "0.1"}), *rest]),
        ("quick and full runs mixed", [_shard(FULL.kinds[0], quick=True), *rest]),
        ("needs each of", rest),
        ("needs each of", [_shard(FULL.kinds[0]), _shard(FULL.kinds[0]), *rest]),
        ("different configurations", [_shard(FULL.kinds[0], seeds=[0, 1]), *rest]),
    ]
    for why, shards in refusals:
        with pytest.raises(SystemExit, match=why):
            merge_shards(files(*shards))


def test_repeated_tier_flags_all_apply_and_other_flags_given_twice_are_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`--tier a=1 --tier b=0` once kept only a=1, silently: an experiment ran another policy than it said."""
    import sys

    from benchmarks.bench_value import experiment_flags, tier_overrides, train_overrides

    monkeypatch.setattr(sys, "argv", ["bench", "--tier", "coverage=1", "--tier=urgent_max_share=0,summary_min_ratio=10"])
    assert tier_overrides() == {"coverage": 1, "urgent_max_share": 0, "summary_min_ratio": 10}
    assert experiment_flags() == {"tier": {"coverage": 1, "urgent_max_share": 0, "summary_min_ratio": 10}}
    monkeypatch.setattr(sys, "argv", ["bench", "--budgets", "0.1", "--budgets", "0.2"])
    with pytest.raises(SystemExit, match="--budgets given 2 times"):
        experiment_flags()
    monkeypatch.setattr(sys, "argv", ["bench"])
    assert tier_overrides() == {} and experiment_flags() == {}
    # the trainer's settings alike, checked against TrainConfig's fields
    monkeypatch.setattr(sys, "argv", ["bench", "--train", "rank_by=balanced_loss", "--train=weight_power=1"])
    assert train_overrides() == {"rank_by": "balanced_loss", "weight_power": 1}
    assert experiment_flags() == {"train": {"rank_by": "balanced_loss", "weight_power": 1}}
    monkeypatch.setattr(sys, "argv", ["bench", "--train", "rank_bye=balanced_loss"])
    with pytest.raises(SystemExit, match="rank_bye: not a TrainConfig field"):
        train_overrides()


def test_budgets_whose_uniform_draw_lands_a_few_rows_per_class_take_more_draws(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Digits at 2% lands ~10 images for 10 classes: which classes a draw holds decides the model, so the budget
    takes FEW_ROW_DRAWS draws; a budget of enough rows, or a command line that names its seeds, keeps its own."""
    import sys

    from benchmarks.bench_value import FEW_ROW_DRAWS, FEW_ROWS_PER_CLASS, Cell, few_row_draws

    def cell(pol: str, budget: float, *rows: int) -> Cell:
        return Cell(pol, budget, draws=[{"rows": r} for r in rows])

    limit = FEW_ROWS_PER_CLASS * 10
    cells = {(c.policy, c.budget): c for c in (
        cell("random", 0.02, 9, 11, 10), cell("tier-novelty", 0.02, 9, 11, 10),
        cell("random", 0.05, limit - 2, limit + 1, limit - 2),  # a mean just under the line
        cell("random", 0.10, limit, limit + 3, limit - 1), cell("tier-novelty", 0.10, 1, 1, 1),  # random's rows count
        Cell("random", 0.01))}  # nothing landed: no draw to add
    monkeypatch.setattr(sys, "argv", ["bench"])
    logged: list[str] = []
    few, extra = few_row_draws(cells, 10, (0, 1, 2), logged.append)
    assert few == [0.02, 0.05]
    assert extra == tuple(range(3, FEW_ROW_DRAWS)) and len(logged) == 1
    assert few_row_draws(cells, 1, (0, 1, 2), logged.append) == ([], ())  # one class: 9-11 rows are enough
    monkeypatch.setattr(sys, "argv", ["bench", "--seeds", "0,1,2"])
    assert few_row_draws(cells, 10, (0, 1, 2), logged.append) == ([], ())


def test_a_skewed_kind_that_can_rank_recall_takes_six_draws_at_the_small_budget_targets(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Gait's three draws at 2% were apart where six overlapped: a skewed kind with a held-out set large enough to
    rank recall takes MIN_RECALL_DRAWS draws at 2% and 5%, so the full run can call the line; a balanced kind, a
    small held-out set (Landsat's 169 patches) or a command line that names its seeds keeps its own."""
    import sys

    from benchmarks.bench_value import FULL, MIN_RECALL_DRAWS, RECALL_TEST_ROWS, recall_draws

    monkeypatch.setattr(sys, "argv", ["bench"])
    logged: list[str] = []
    budgets, more = recall_draws(True, RECALL_TEST_ROWS, FULL, logged.append)
    assert budgets == [0.02, 0.05] and len(FULL.seeds) + len(more) == MIN_RECALL_DRAWS
    assert set(more).isdisjoint(FULL.seeds) and len(logged) == 1
    assert recall_draws(False, RECALL_TEST_ROWS, FULL) == ([], ())
    assert recall_draws(True, 169, FULL) == ([], ())
    monkeypatch.setattr(sys, "argv", ["bench", "--seeds", "0,1,2"])
    assert recall_draws(True, RECALL_TEST_ROWS, FULL) == ([], ())
    # the README's method line says which budgets took more draws, and why
    from benchmarks.bench_value import few_row_note

    note = few_row_note([{"kind": "daphnet_gait", "recall_budgets": {"0.02": [0, 1, 2, 3, 4, 5]}},
                         {"kind": "digits_png", "few_row_budgets": [0.02]}])
    assert "daphnet_gait 2%: 6 draws" in note and "digits_png 2%: 12 draws" in note
    assert few_row_note([{"kind": "landsat_patch"}]) == ""


def test_a_tiered_edge_plans_the_rows_a_packed_pass_carries() -> None:
    """The edge draws the rows a packed pass carries (FIFO's pack at that budget) times the surplus a pass thins,
    as a share of the round's rows, per unit of budget; a pass of few rows draws with a larger surplus."""
    from benchmarks.bench_value import FULL, planned_per_budget, policy_for, tier_plans
    from edgehaul.uplink.pass_plan import draw_surplus

    plans = tier_plans({0.02: [9.0, 9.0], 0.05: [40.0, 40.0], 1.0: [500.0, 500.0]}, [500, 500])
    assert plans[0.05] * 0.05 * 500 == pytest.approx(40 * draw_surplus(40, 1.0))  # rows measured packed: no margin
    assert plans[0.02] * 0.02 * 500 == pytest.approx(9 * draw_surplus(9, 1.0))
    # rounds whose passes carry different rows: the draw covers each round's pass, not their mean
    uneven = tier_plans({0.02: [9.5, 4.5]}, [600, 478])[0.02] * 0.02
    assert uneven * 600 == pytest.approx(9.5 * draw_surplus(9.5, 1.0)) and uneven * 478 > 4.5 * draw_surplus(4.5, 1.0)
    assert uneven > tier_plans({0.02: [7.0, 7.0]}, [539, 539])[0.02] * 0.02
    assert planned_per_budget(10, 500, 0.02) / (10 / 500 / 0.02) > planned_per_budget(1_000, 500, 0.02) / (
        1_000 / 500 / 0.02) > 1
    assert policy_for("tier-novelty", FULL, 0.8 * 262 / 179).budget_share == 1.0  # a share is at most everything
    assert policy_for("tier-novelty", FULL, 0.1 * 262 / 179).budget_share == pytest.approx(0.1 * 262 / 179)
    # as a node's link_budget does, a pass of few rows draws with the tilt faded (tiering.for_pass_rows)
    few, many = policy_for("tier-novelty", FULL, 0.02, 9), policy_for("tier-novelty", FULL, 0.02, 1500)
    assert few.coverage > many.coverage == 0.8 and few.urgent_max_share < many.urgent_max_share == 0.5
    assert few.budget_share == many.budget_share == 0.02


def test_intervals_bracket_the_mean_and_narrow_with_more_test_samples() -> None:
    """One set of resamples gives every key's 90% interval; it holds the seed mean and shrinks as the test set
    grows (what a larger held-out set buys)."""
    from benchmarks.bench_value import intervals

    rng = np.random.default_rng(3)
    width = {}
    for n in (2_000, 32_000):
        truth = (rng.random(n) < 0.05).astype(np.int64)
        preds = [np.where(rng.random(n) < 0.6, truth, 0) for _ in range(3)]  # recall ~0.6, no false alarm
        ci = intervals(truth, preds, [1], ["macro_f1", "anomaly_recall"], n=200, anomaly=1)
        mean = np.mean([scores(truth, p, [1], 1)["anomaly_recall"] for p in preds])
        assert ci["anomaly_recall"][0] <= mean <= ci["anomaly_recall"][1]
        assert ci["macro_f1"][0] < ci["macro_f1"][1]
        width[n] = ci["anomaly_recall"][1] - ci["anomaly_recall"][0]
    assert width[32_000] < 0.5 * width[2_000]


@pytest.mark.parametrize("rows", [20, 192, 384, 2_000, 4_000, 20_000])
def test_every_model_gets_its_minimum_of_optimiser_steps_whatever_the_cell_size(rows: int) -> None:
    """A 10% cell of a kind with batches of 256 once trained 16 steps in all (2 an epoch) and predicted the rare
    class everywhere: each model now takes at least min_steps steps (up to the epoch cap) and sees sample_passes rows."""
    from benchmarks.bench_value import FULL, QUICK

    for cfg in (QUICK, FULL):
        batch, epochs, patience = schedule(rows, cfg, 256)
        steps = epochs * int(np.ceil(rows * 0.85 / batch))
        assert 16 <= batch <= 256 and (batch <= max(16, rows // 16))
        assert steps >= cfg.min_steps or epochs == 200
        assert epochs * rows >= min(cfg.sample_passes, 200 * rows)
        assert 4 <= patience < epochs or epochs <= 4


@pytest.mark.integration
def test_landed_dataset_version_holds_no_test_patch(split: Split, store: ObjectStore,
                                                    tmp_path: Path) -> None:
    """A round through the product's edge, uplink, validation and dataset commit: the version the
    bench trains on holds rows, and none of them is a held-out patch."""
    work = tmp_path
    cfg = Config(stream=1000, batch=500, bundle_rows=CFG_ROWS, sample_passes=1, width=4, seeds=(0,))
    batches = edge_stream(split, cfg.stream, batch=cfg.batch, seed=0, contract=C)
    reports: list[dict[str, Any]] = []
    spool, order = edge_round(batches, C, policy_for("fifo", cfg), ConstantScorer(), work / "spool", reports)
    raw = sum(e.manifest.nbytes for e in order)
    # bytes per row as the bench records them: every batch's report, the bundles' written bytes over their rows
    per_row = TierReport.merge(reports).bytes_per_row()
    assert len(reports) == len(batches) and per_row["normal"] == pytest.approx(raw / cfg.stream, rel=0.01)
    assert per_row["full_row_raw"] > per_row["normal"]  # uncompressed vs zstd Parquet
    sent = within(order, 0.25 * raw)
    assert 0 < sum(e.manifest.nbytes for e in sent) <= 0.25 * raw
    quarantined: list[str] = []
    version = land_and_commit(store, spool, sent, C, work / "uplink", quarantined)
    assert version is not None and not quarantined
    rows = version_rows(store, version)
    assert rows.num_rows == sum(e.manifest.row_count for e in sent)
    guard = Guard(pixel_hashes(split.test.pixels))
    guard.check(rows, "fifo@25%")
    assert set(rows.column("content_sha256").to_pylist()) <= pixel_hashes(stream_pixels(batches))



def test_fifo_sends_the_oldest_rows_that_fit_one_pack(split: Split, tmp_path: Path) -> None:
    """FIFO is packed as a pass drain packs every policy: the longest arrival-order prefix that fits the pass as one
    bundle (one row more would not), not the flushed 16-row bundles, which spent most of a pass on fixed parts."""
    from benchmarks.bench_value import fifo_packed

    cfg = Config(stream=600, batch=300, bundle_rows=CFG_ROWS, sample_passes=1, width=4, seeds=(0,))
    batches = edge_stream(split, cfg.stream, batch=cfg.batch, seed=0, contract=C)
    spool, order = edge_round(batches, C, policy_for("fifo", cfg), ConstantScorer(), tmp_path / "spool")
    capacity = 0.1 * sum(e.manifest.nbytes for e in order)
    flushed = sum(e.manifest.row_count for e in within(order, capacity))
    _, packed = fifo_packed(spool, order, capacity, tmp_path / "packed")
    [pack] = packed
    assert pack.manifest.nbytes <= capacity and pack.manifest.row_count > flushed
    arrival = [i for e in order for i in e.manifest.sample_ids]
    assert pack.manifest.sample_ids == arrival[:pack.manifest.row_count]
    _, more = fifo_packed(spool, order, pack.manifest.nbytes + 1, tmp_path / "again")
    assert more[0].manifest.row_count == pack.manifest.row_count  # the largest prefix that fits
    assert fifo_packed(spool, order, 10, tmp_path / "none")[1] == []

def test_fifo_draws_a_stretch_of_the_round_from_a_random_point_on(split: Split, tmp_path: Path) -> None:
    """FIFO's draw: the round arrives from a seeded random point on, and the pass carries the oldest rows that fit, so
    each seed lands another circular stretch of the arrival order (on a shuffled stream, another uniform draw),
    where one landing reused for every seed had shown one draw's luck; at 100% every row, whatever the seed."""
    from benchmarks.bench_value import FifoEdge, fifo_draw, rotated

    cfg = Config(stream=600, batch=300, bundle_rows=CFG_ROWS, sample_passes=1, width=4, seeds=(0,))
    batches = edge_stream(split, cfg.stream, batch=cfg.batch, seed=0, contract=C)
    arrival = pa.concat_tables(batches).column("sample_id").to_pylist()
    again = rotated(batches, (1, 0))
    turned = pa.concat_tables(again).column("sample_id").to_pylist()
    assert [b.num_rows for b in again] == [b.num_rows for b in batches]
    start = arrival.index(turned[0])
    assert start > 0 and turned == arrival[start:] + arrival[:start]  # the same rows from a point on
    assert pa.concat_tables(rotated(batches, (1, 0))).column("sample_id").to_pylist() == turned  # seeded
    rounds = [batches[:1], batches[1:]]
    spools = {r: edge_round(rb, C, policy_for("fifo", cfg), ConstantScorer(), tmp_path / f"r{r}")
              for r, rb in enumerate(rounds)}
    raw = [sum(e.manifest.nbytes for e in spools[r][1]) for r in (0, 1)]
    edge = FifoEdge(rounds, raw, spools, C, policy_for("fifo", cfg))
    landed = []
    for seed in (0, 1, 2):
        draw = fifo_draw(edge, 0.1, seed, tmp_path / f"s{seed}")
        ids = []
        for r in (0, 1):
            [pack] = draw[r][1]
            assert pack.manifest.nbytes <= 0.1 * raw[r]
            order = pa.concat_tables(rounds[r]).column("sample_id").to_pylist()
            at = order.index(pack.manifest.sample_ids[0])
            assert pack.manifest.sample_ids == (order[at:] + order[:at])[:pack.manifest.row_count]
            ids += pack.manifest.sample_ids
        landed.append(set(ids))
    assert landed[0] != landed[1] != landed[2] != landed[0]
    every = fifo_draw(edge, 1.0, 5, tmp_path / "all")
    assert sorted(i for r in (0, 1) for e in every[r][1] for i in e.manifest.sample_ids) == sorted(arrival)


def _drawn_cell(policy: str, budget: float, f1: float, seeds: tuple[int, ...] = (0, 1, 2)) -> dict[str, Any]:
    return {"policy": policy, "budget": budget, "macro_f1_mean": f1, "note": "",
            "draws": [{"seed": s} for s in seeds]}


def test_a_rerun_of_some_policies_replaces_their_cells_in_the_whole_run(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """`--policies fifo` reruns FIFO's cells alone; `--merge` puts them in place of the whole run's FIFO cells (and
    random's at 100%, which reports FIFO's), keeping every other cell. A rerun drawn with other seeds or another
    configuration, with no whole run of its kind, or of a policy the kind has not, is refused, saying why."""
    import json
    import sys

    from benchmarks.bench_value import FULL, merge_shards, policies_run, verdicts

    def whole(kind: str) -> dict[str, Any]:
        s = _shard(kind)
        s["kinds"][0] |= {"seconds": 100.0, "cells": [
            _drawn_cell("fifo", 0.02, 0.5), _drawn_cell("random", 0.02, 0.4), _drawn_cell("tier-novelty", 0.02, 0.45),
            _drawn_cell("fifo", 1.0, 0.9), _drawn_cell("random", 1.0, 0.9)]}
        return s

    def rerun(kind: str, seeds: tuple[int, ...] = (0, 1, 2), **config: Any) -> dict[str, Any]:
        s = _shard(kind, experiment={"policies": "fifo"}, **config)
        s["kinds"][0] |= {"seconds": 7.0, "policies_run": ["fifo"], "fifo_draws": True,
                          "cells": [_drawn_cell("fifo", 0.02, 0.38, seeds), _drawn_cell("fifo", 1.0, 0.91),
                                    _drawn_cell("random", 1.0, 0.91)]}
        return s

    def files(*shards: dict[str, Any]) -> list[Path]:
        out = []
        for s in shards:
            (f := tmp_path / f"s{len(list(tmp_path.iterdir()))}.json").write_text(json.dumps(s))
            out.append(f)
        return out

    kind = FULL.kinds[0]
    rest = [whole(k) for k in FULL.kinds[1:]]
    merged = merge_shards(files(whole(kind), *rest, rerun(kind)))
    assert merged["experiment"] == {}
    first = merged["kinds"][0]
    f1 = {(c["policy"], c["budget"]): c["macro_f1_mean"] for c in first["cells"]}
    assert f1 == {("fifo", 0.02): 0.38, ("random", 0.02): 0.4, ("tier-novelty", 0.02): 0.45, ("fifo", 1.0): 0.91,
                  ("random", 1.0): 0.91}
    assert next(c for c in first["cells"] if c["policy"] == "random" and c["budget"] == 1.0)["note"]
    assert first["fifo_draws"] is True and first["reruns"] == [{"policies": ["fifo"], "seconds": 7.0}]
    assert all("reruns" not in r for r in merged["kinds"][1:])
    assert verdicts(rerun(kind)["kinds"][0])[-1] == "no tiered cell in this run: the targets are not judged"
    # over the committed docs/bench-value.json (cells flattened into entries, each kind with its verdicts)
    kinds = [w["kinds"][0] for w in (whole(kind), *rest)]
    docs = {"quick": False, "entries": [{"kind": r["kind"], **c} for r in kinds for c in r["cells"]],
            "kinds": [{k: v for k, v in r.items() if k != "cells"} | {"verdicts": []} for r in kinds]}
    again = merge_shards(files(docs, rerun(kind)))
    assert again["kinds"][0]["cells"] == first["cells"] and again["kinds"][1:] == merged["kinds"][1:]
    for why, shards in [("other seeds", [whole(kind), *rest, rerun(kind, seeds=(0, 1, 5))]),
                        ("another configuration", [whole(kind), *rest, rerun(kind, width=3)]),
                        ("without a whole run", [*rest, rerun(kind)])]:
        with pytest.raises(SystemExit, match=why):
            merge_shards(files(*shards))
    monkeypatch.setattr(sys, "argv", ["bench", "--policies", "fifo,tier-oracle"])
    with pytest.raises(SystemExit, match="tier-oracle not among"):
        policies_run(("fifo", "random", "tier-novelty", "tier-model"))
    monkeypatch.setattr(sys, "argv", ["bench", "--policies", "fifo"])
    assert policies_run(("fifo", "random")) == ("fifo",)
    monkeypatch.setattr(sys, "argv", ["bench"])
    assert policies_run(("fifo", "random")) == ("fifo", "random")


@pytest.mark.integration
def test_run_as_a_flow_the_table_and_chart_are_artifacts_with_the_verdicts(stack: localstack.StackState) -> None:
    import uuid

    import httpx
    from prefect import flow

    from benchmarks.bench_value import BUDGETS, publish_artifacts, verdicts

    cells = [{"policy": pol, "budget": b, "bytes": int(1e6 * b), "rows": int(1e3 * b),
              "macro_f1_mean": 0.5 if pol == "fifo" else 0.4, "rare_recall_mean": 0.1, "accuracy_mean": 0.7}
             for b in (*BUDGETS, 1.0) for pol in ("fifo", "random", "tier-novelty", "tier-model")]
    result = {"cells": cells}
    lines = verdicts(result)
    png = b"\x89PNG\r\n\x1a\n" + uuid.uuid4().bytes

    @flow(name=f"bench-value-{uuid.uuid4().hex[:8]}")
    def bench() -> None:
        publish_artifacts(result, lines, png)

    bench()
    api = stack.prefect_api_url
    got = {a["key"]: a for a in httpx.post(f"{api}/artifacts/filter", json={
        "artifacts": {"key": {"any_": ["bench-value", "bench-value-chart"]}}}, timeout=10,
        auth=api_auth()).json()}
    assert ("10% tier-model: macro-F1 0.400 [0.400, 0.400] loses to the better of FIFO/random (fifo 0.500 "
            "[0.500, 0.500])") in got["bench-value-chart"]["data"]
    assert "data:image/png;base64," in got["bench-value-chart"]["data"]
    table = got["bench-value"]["data"]
    assert "tier-novelty" in str(table) and "977 KiB" in str(table)  # bytes in units


def test_help_prints_what_a_benchmark_measures_and_runs_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.__main__ import main

    # `value --help` used to start the full value run (two hours): a benchmark reads its own flags
    assert main(["value", "--help"]) == 0
    out = capsys.readouterr().out
    assert "=== bench_value ===" in out and "Model quality per uplinked byte" in out and "value benchmark" not in out
    assert main(["--help"]) == 0
    assert "benchmarks: cache core" in capsys.readouterr().out


def test_a_verdict_tells_two_close_scores_apart() -> None:
    from benchmarks.bench_value import distinct

    assert distinct(0.3826, 0.3834) == ("0.3826", "0.3834")  # equal at three decimals: one more
    assert distinct(0.25, 0.5) == ("0.250", "0.500")
    assert distinct(0.5, 0.5) == ("0.500000", "0.500000")


@pytest.mark.parametrize("kind", ["landsat_patch", "daphnet_gait", "digits_png"])
def test_every_kinds_stream_is_the_same_in_every_run(kind: str) -> None:
    """Capture times are in every bundle's bytes: gait's stream, dated to end at the clock, packed a pass differently
    each run (random's 10% cell landed 7,545 rows in one run and 7,600 in another, from the same draw)."""
    import time

    from benchmarks.bench_value import QUICK, SETUPS

    first = SETUPS[kind](QUICK)
    time.sleep(0.01)
    again = SETUPS[kind](QUICK)
    assert len(first.batches) == len(again.batches) > 1
    assert all(a.equals(b) for a, b in zip(first.batches, again.batches, strict=True))
    assert first.test.equals(again.test)
