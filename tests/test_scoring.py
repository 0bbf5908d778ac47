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
