"""The `density` scorer: sparse neighbourhoods are worth more; well-populated clusters, near or far, alike."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgehaul.blocks import TieringPolicy
from edgehaul.blocks.policies import EdgeNode
from edgehaul.contracts import load_contract
from edgehaul.edge import density_scorer
from edgehaul.edge.density_scorer import DensityScorer
from edgehaul.edge.scoring import CannotScore, NoveltyScorer
from edgehaul.tasks.edge import make_scorer

GAIT = load_contract("daphnet_gait")
K = len(GAIT.feature_columns)


def _table(x: np.ndarray) -> pa.Table:
    """Feature columns (and the label column, unlabelled: no label at the edge)."""
    cols = {c: pa.array(x[:, i], pa.float32()) for i, c in enumerate(GAIT.feature_columns)}
    assert GAIT.label_column is not None
    return pa.table({**cols, GAIT.label_column: pa.nulls(len(x), pa.int8())})


def _clusters(sizes: list[int], centres: list[float], seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = np.concatenate([rng.normal(c, 1.0, (n, K)) for n, c in zip(sizes, centres, strict=True)])
    which = np.concatenate([np.full(n, i) for i, n in enumerate(sizes)])
    return x, which


def test_a_rare_cluster_is_worth_more_than_the_common_ones() -> None:
    x, which = _clusters([600, 380, 20], [0.0, 4.0, 9.0])
    v = DensityScorer(GAIT).score(_table(x))
    assert v.shape == (1000,) and v.dtype == np.float32 and ((v >= 0) & (v <= 1)).all()
    common = max(v[which == 0].mean(), v[which == 1].mean())
    assert common < 0.1 and v[which == 2].mean() > max(0.35, 4 * common)


def test_balanced_clusters_are_worth_alike_however_far_from_the_mean_where_novelty_favours_the_far_one(
        tmp_path: Path) -> None:
    x, which = _clusters([250, 250, 250, 250], [0.0, 1.5, 3.0, 12.0], seed=1)
    t = _table(x)
    means = [float(DensityScorer(GAIT).score(t)[which == i].mean()) for i in range(4)]
    assert max(means) - min(means) < 0.05, means
    novelty = NoveltyScorer(GAIT).score(t, batch_key="b")
    assert novelty[which == 3].mean() > novelty[which == 0].mean() + 0.3  # the contrast this scorer exists for


def test_a_large_batch_searches_a_seeded_reference_and_scores_the_same_on_a_rerun(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(density_scorer, "REFERENCE_ROWS", 300)
    monkeypatch.setattr(density_scorer, "BLOCK_ROWS", 128)
    x, which = _clusters([900, 100], [0.0, 8.0], seed=2)
    t = _table(x)
    a, b = DensityScorer(GAIT).score(t), DensityScorer(GAIT).score(t)
    np.testing.assert_array_equal(a, b)
    assert a[which == 1].mean() > a[which == 0].mean()


def test_it_says_when_it_cannot_score_and_is_chosen_by_name(tmp_path: Path) -> None:
    with pytest.raises(CannotScore, match="too few to have 10 neighbours"):
        DensityScorer(GAIT).score(_table(np.zeros((10, K))))
    scorer = make_scorer(TieringPolicy(scorer="density"), EdgeNode(node_id="n", spool_dir=str(tmp_path)), GAIT)
    assert isinstance(scorer, DensityScorer) and scorer.version == "density-1+k10"


@settings(max_examples=40, deadline=None)
@given(n=st.integers(11, 400), nan_share=st.floats(0, 0.5), dup=st.booleans(), seed=st.integers(0, 2**16))
def test_values_are_finite_in_0_1_one_per_row_whatever_the_features(n: int, nan_share: float, dup: bool,
                                                                   seed: int) -> None:
    rng = np.random.default_rng(seed)
    x = rng.standard_cauchy((n, K))
    x[rng.random((n, K)) < nan_share] = np.nan
    if dup:  # identical rows: a neighbourhood of distance 0
        x[: n // 2] = x[0]
    v = DensityScorer(GAIT).score(_table(x))
    assert v.shape == (n,) and np.isfinite(v).all() and ((v >= 0) & (v <= 1)).all()
