"""The anomaly-aware scorer (`anomaly` under `edgehaul.scorers`): labelled anomalies tier
high, rows far from the normal class too (robust z-score), normal rows mostly low; its state persists and
is kept per node and kind."""

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
from edgehaul.edge.anomaly_scorer import AnomalyScorer, AnomalyState
from edgehaul.edge.landsat import generate
from edgehaul.edge.preprocess import preprocess
from edgehaul.edge.scorer_registry import available_scorers
from edgehaul.edge.scoring import CannotScore, ContextualScorer
from edgehaul.edge.tiering import route
from edgehaul.tasks.edge import make_scorer
from tests.gait_rows import GAIT, gait_rows

LANDSAT = load_contract("landsat_patch")
POLICY = TieringPolicy(scorer="anomaly")


def _node(tmp_path: Path) -> EdgeNode:
    return EdgeNode(node_id="node-a", spool_dir=str(tmp_path / "spool"))


def test_labelled_anomalies_and_far_rows_tier_high_normal_rows_mostly_low() -> None:
    scorer = AnomalyScorer(GAIT)
    for i in range(3):  # learns over batches; every batch is judged the same way
        rows = gait_rows(3_000, anomaly_rate=0.1, seed=i, start_seq=i * 3_000, outliers=8)
        tiers = route(scorer.score(rows, batch_key=f"k{i}"), POLICY)
        scorer.fold(rows, f"k{i}")
        label = np.array(rows.column("is_anomaly").to_pylist())
        normal = np.flatnonzero(label == 0)
        assert (tiers[label == 1] == "high").all()
        assert (tiers[normal[:8]] == "high").all()  # knocked sensor, labelled normal: still sent first
        rest = tiers[normal[8:]]
        assert (rest != "high").mean() > 0.99 and (rest == "low").mean() > 0.9


def test_state_persists_and_a_rescored_batch_sees_the_same_context(tmp_path: Path) -> None:
    node = _node(tmp_path)
    first = make_scorer(POLICY, node, GAIT)
    assert isinstance(first, AnomalyScorer) and isinstance(first, ContextualScorer)
    a, b = (gait_rows(1_000, anomaly_rate=0.05, seed=s, start_seq=s * 1_000) for s in (1, 2))
    va = first.score(a, batch_key="a")
    first.fold(a, "a")
    vb = first.score(b, batch_key="b")
    first.fold(b, "b")
    first.save()
    again = make_scorer(POLICY, node, GAIT)  # a new process: the state comes from the node's folder
    assert isinstance(again, AnomalyScorer)
    assert again.version == first.version and list(again.state.batches) == ["a", "b"]
    assert again.cache_version("a") == first.cache_version("a") != again.cache_version("b")
    assert np.array_equal(again.score(a, batch_key="a"), va)  # exactly: tiers and the edge cache depend on it
    assert np.array_equal(again.score(b, batch_key="b"), vb)
    # a fresh scorer (no state) judges batch b against b alone: not the same context, not the same values
    assert not np.allclose(AnomalyScorer(GAIT).score(b, batch_key="b"), vb)


def test_state_is_separate_per_kind_on_one_node(tmp_path: Path) -> None:
    node = _node(tmp_path)
    landsat = preprocess(next(generate(400, "node-a", seed=5, batch_size=400)), LANDSAT).accepted
    gait = gait_rows(800, anomaly_rate=0.05, seed=6)
    for contract, rows in ((GAIT, gait), (LANDSAT, landsat), (GAIT, gait_rows(800, anomaly_rate=0.05, seed=7,
                                                                              start_seq=800))):
        s = make_scorer(POLICY, node, contract)
        assert isinstance(s, AnomalyScorer)
        key = f"{contract.kind}-{len(s.state.batches)}"
        v = s.score(rows, batch_key=key)
        assert v.shape == (rows.num_rows,) and np.isfinite(v).all()
        s.fold(rows, key)
        s.save()
    sg, sl = make_scorer(POLICY, node, GAIT), make_scorer(POLICY, node, LANDSAT)
    assert isinstance(sg, AnomalyScorer) and isinstance(sl, AnomalyScorer)
    assert sg.state_path != sl.state_path
    assert list(sg.state.batches) == ["daphnet_gait-0", "daphnet_gait-1"] and list(sl.state.batches) == [
        "landsat_patch-0"]
    # each kind's reference rows have its own feature width: 9 normalised readings, 12 band statistics
    assert {r.shape[1] for r in sg.state.batches.values()} == {len(GAIT.feature_columns)} == {9}
    assert {r.shape[1] for r in sl.state.batches.values()} == {len(LANDSAT.feature_columns)} == {12}


def test_registered_by_name_and_chosen_by_the_policy() -> None:
    assert "anomaly" in available_scorers()
    assert TieringPolicy(scorer="anomaly").scorer == "anomaly"


def test_a_scorer_without_reference_rows_says_so_and_without_labels_needs_none() -> None:
    rows = gait_rows(50, anomaly_rate=1.0, seed=8)
    rows = rows.set_column(rows.schema.get_field_index("is_anomaly"), "is_anomaly",
                           pa.array([1] * 25 + [None] * 25, pa.int16()))
    # reading labels, no row is labelled normal: no reference, and it says so instead of handing out 0.5
    with pytest.raises(CannotScore, match="no reference rows"):
        AnomalyScorer(GAIT, AnomalyState(use_labels=True)).score(rows, batch_key="k")
    # by default labels are not read: the batch is its own reference, and the values spread
    v = AnomalyScorer(GAIT).score(rows, batch_key="k")
    assert np.isfinite(v).all() and len(np.unique(v)) > 10


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 300), rate=st.floats(0.0, 1.0), seed=st.integers(0, 10_000), outliers=st.integers(0, 5))
def test_values_are_in_range_and_labelled_anomalies_are_always_one(n: int, rate: float, seed: int,
                                                                    outliers: int) -> None:
    rows = gait_rows(n, anomaly_rate=rate, seed=seed, outliers=outliers)
    label = np.array(rows.column("is_anomaly").to_pylist())
    scorer = AnomalyScorer(GAIT, AnomalyState(use_labels=True))
    if not (label == 0).any():
        with pytest.raises(CannotScore):
            scorer.score(rows, batch_key="k")
        return
    v = scorer.score(rows, batch_key="k")
    assert v.dtype == np.float32 and v.shape == (n,)
    assert ((v >= 0) & (v <= 1)).all()
    assert (v[label == 1] == 1.0).all()
    unlabelled = AnomalyScorer(GAIT).score(rows, batch_key="k")
    assert ((unlabelled >= 0) & (unlabelled <= 1)).all()


def test_the_reference_sample_is_bounded() -> None:
    s = AnomalyScorer(GAIT)
    rows = gait_rows(500, anomaly_rate=0.0, seed=9)
    for i in range(70):
        s.fold(rows, f"k{i}")
    assert len(s.state.batches) == s.state.max_batches == 64
    assert next(iter(s.state.batches)) == "k6"  # the oldest dropped first
    assert all(len(r) == s.state.per_batch for r in s.state.batches.values())
