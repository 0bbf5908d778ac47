"""Scorers: novelty values in [0, 1] that favour rare classes, deterministic for caching."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from edgehaul.blocks import TieringPolicy
from edgehaul.contracts import load_contract
from edgehaul.edge.landsat import generate, table_sha256
from edgehaul.edge.preprocess import preprocess
from edgehaul.edge.scoring import NoveltyScorer, NoveltyState, Scorer, scorer_cache_version

C = load_contract("landsat_patch")


@pytest.fixture(scope="module")
def batches() -> list[tuple[str, pa.Table]]:
    out = []
    for raw in generate(6000, "node-a", seed=5, batch_size=2000):
        out.append((table_sha256(raw), preprocess(raw, C).accepted))
    return out


def test_values_in_range_and_rare_classes_score_higher(batches: list[tuple[str, pa.Table]]) -> None:
    key, t = batches[0]
    s = NoveltyScorer(C, use_labels=True)  # rarity needs the label
    v = s.score(t, key)
    assert v.dtype == np.float32 and v.shape == (t.num_rows,) and v.min() >= 0 and v.max() <= 1
    labels = t.column("label").to_numpy()
    counts = {lab: (labels == lab).sum() for lab in np.unique(labels)}
    common = max(counts, key=lambda k: counts[k])
    rare = [lab for lab, n in counts.items() if n < 0.05 * counts[common]]
    assert rare
    for lab in rare:
        assert v[labels == lab].mean() > v[labels == common].mean() + 0.3


def test_spectral_outliers_score_higher_than_typical_samples(batches: list[tuple[str, pa.Table]]) -> None:
    key, t = batches[0]
    s = NoveltyScorer(C)
    base = s.score(t, key)
    col = t.column("mean_b4_nir").to_numpy().copy()
    col[:10] = 0.999  # saturated NIR: far from the sketch
    odd = t.set_column(t.schema.get_field_index("mean_b4_nir"), t.schema.field("mean_b4_nir"), pa.array(col, pa.float32()))
    v = s.score(odd, key)
    assert (v[:10] >= base[:10]).all() and (v[:10] - base[:10]).mean() > 0.2


def test_running_sketch_is_deterministic_per_batch(batches: list[tuple[str, pa.Table]], tmp_path: Path) -> None:
    s = NoveltyScorer(C)
    first = {}
    versions = {}
    for key, t in batches:
        versions[key] = s.cache_version(key)
        first[key] = s.score(t, key)
        s.fold(t, key)
    # after everything was folded (a rerun), each batch sees exactly the context it saw first
    for key, t in batches:
        assert s.cache_version(key) == versions[key]
        np.testing.assert_array_equal(s.score(t, key), first[key])
    assert len(set(versions.values())) == len(batches)  # the sketch did move between batches
    # persisted state round-trips; a new batch is scored against everything folded
    path = tmp_path / "state.json"
    s.state.save(path)
    again = NoveltyScorer(C, NoveltyState.load(path))
    assert again.version == s.version
    assert again.cache_version("new-batch") == s.cache_version("new-batch") != versions[batches[-1][0]]
    s.fold(batches[0][1], batches[0][0])  # folding the same batch again changes nothing
    assert s.version == again.version


def test_registry_returns_the_policy_scorer(tmp_path: Path) -> None:
    from edgehaul.blocks.policies import EdgeNode
    from edgehaul.tasks.edge import make_scorer

    sc = make_scorer(TieringPolicy(), EdgeNode(node_id="node-a", spool_dir=str(tmp_path)), C)
    assert isinstance(sc, NoveltyScorer) and isinstance(sc, Scorer)
    assert scorer_cache_version(sc, "k").startswith("novelty-1/")


def test_the_model_scorer_values_what_the_model_does_not_know_and_says_when_it_cannot() -> None:
    """No label read: a row the model is sure of is worth little, an uncertain one much; for an anomaly kind a
    row the model calls an anomaly is worth at least its anomaly probability. Summaries only: CannotScore."""
    import torch

    from edgehaul.edge.model_scorer import ModelScorer
    from edgehaul.edge.scoring import CannotScore
    from edgehaul.edge.tiering import assign, summarise
    from edgehaul.training.model import arch_for, build_model
    from tests.gait_rows import GAIT, gait_rows

    arch = arch_for(GAIT, width=4)
    model = build_model(dict(arch))
    torch.manual_seed(0)
    scorer = ModelScorer("local", model_file={"model_id": "m-test", "contract": GAIT.id, "arch": arch,
                                              "state_dict": model.state_dict()})
    rows = gait_rows(200, anomaly_rate=0.1, seed=4)
    p = scorer.probabilities(rows)
    v = scorer.score(rows)
    entropy = -(p * np.log(np.clip(p, 1e-12, 1))).sum(axis=1) / np.log(2)
    assert np.allclose(v, np.maximum(entropy, p[:, 1]), atol=1e-5)
    assert ((v >= 0) & (v <= 1)).all()
    # the head pinned: sure of "normal" -> near 0; no idea (0.5/0.5) -> 1; sure of "anomaly" -> near 1
    head_w, head_b = [k for k in model.state_dict() if k.endswith(("weight", "bias"))][-2:]
    for bias, lo, hi in (([6.0, -6.0], 0.0, 0.05), ([0.0, 0.0], 0.999, 1.0), ([-6.0, 6.0], 0.99, 1.0)):
        sd = {**model.state_dict(), head_w: torch.zeros_like(model.state_dict()[head_w]),
              head_b: torch.tensor(bias)}
        pinned = ModelScorer("local", model_file={"model_id": f"m-{bias[0]}", "contract": GAIT.id, "arch": arch,
                                                  "state_dict": sd})
        got = pinned.score(rows)
        assert ((got >= lo) & (got <= hi)).all(), (bias, got[:5])
    unlabelled = rows.set_column(rows.schema.get_field_index("is_anomaly"), "is_anomaly",
                                 pa.nulls(rows.num_rows, pa.int16()))
    assert np.array_equal(scorer.score(unlabelled), v)  # the label plays no part
    summaries = summarise(assign(rows, np.zeros(200), TieringPolicy(), GAIT), GAIT)
    with pytest.raises(CannotScore, match="payload"):
        scorer.score(summaries)
