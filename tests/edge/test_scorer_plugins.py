"""Scorers as plugins (entry point `edgehaul.scorers`), with state kept per node AND kind."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest

from edgehaul.blocks import TieringPolicy
from edgehaul.blocks.policies import EdgeNode
from edgehaul.contracts import Contract, load_contract
from edgehaul.edge.batch import ingest_batch
from edgehaul.edge.landsat import generate
from edgehaul.edge.preprocess import batch_key
from edgehaul.edge.scorer_registry import UnknownScorer, available_scorers
from edgehaul.edge.scoring import ContextualScorer, NoveltyScorer, NoveltyState
from edgehaul.edge.spool import Spool
from edgehaul.tasks.edge import LEGACY_NOVELTY_STATE, make_scorer

LANDSAT = load_contract("landsat_patch")
CONTRACTS = Path(__file__).resolve().parents[2] / "edgehaul" / "data_contracts"


@pytest.fixture
def other_kind(tmp_path: Path) -> Contract:
    """A second kind with the same channel count as Landsat: the case where one shared state mixed silently."""
    d = tmp_path / "contracts"
    d.mkdir()
    text = (CONTRACTS / "landsat_patch.v1.yaml").read_text().replace("kind: landsat_patch", "kind: other_patch")
    (d / "other_patch.v1.yaml").write_text(text)
    return load_contract("other_patch", directory=d)


def _node(tmp_path: Path) -> EdgeNode:
    return EdgeNode(node_id="node-a", spool_dir=str(tmp_path / "spool"))


def _spool(tmp_path: Path) -> Spool:
    return Spool(tmp_path / "spool", cap_bytes=2**30, emit=lambda *a, **k: True)


def _run(raw: pa.Table, contract: Contract, node: EdgeNode, spool: Spool, policy: TieringPolicy) -> int:
    key, hashes = batch_key(raw)
    scorer = make_scorer(policy, node, contract)
    res = ingest_batch(raw, contract, policy, spool, scorer, key=key, hashes=hashes, node_id=node.node_id)
    if isinstance(scorer, ContextualScorer):
        scorer.save()
    return res.accepted


def _rows_seen(path: Path) -> int:
    return sum(s.n for s in NoveltyState.load(path).batches.values())


def test_two_kinds_on_one_node_keep_separate_scorer_state(tmp_path: Path, other_kind: Contract) -> None:
    node, spool, policy = _node(tmp_path), _spool(tmp_path), TieringPolicy()
    a = list(generate(600, "node-a", seed=3, batch_size=300))
    b = next(generate(250, "node-a", seed=4, batch_size=250))
    n_a = sum(_run(t, LANDSAT, node, spool, policy) for t in a)
    n_b = _run(b, other_kind, node, spool, policy)
    spool.close()
    sa, sb = (make_scorer(policy, node, c) for c in (LANDSAT, other_kind))
    assert isinstance(sa, NoveltyScorer) and isinstance(sb, NoveltyScorer)
    assert sa.state_path != sb.state_path
    assert sa.state_path is not None and sb.state_path is not None
    assert (_rows_seen(sa.state_path), _rows_seen(sb.state_path)) == (n_a, n_b)  # no row counted in the other
    assert (len(sa.state.batches), len(sb.state.batches)) == (len(a), 1)


def test_legacy_single_state_becomes_landsats(tmp_path: Path, other_kind: Contract) -> None:
    node, policy = _node(tmp_path), TieringPolicy()
    legacy = Path(node.spool_dir) / LEGACY_NOVELTY_STATE
    old = NoveltyScorer(LANDSAT)
    old.fold(_accepted(), "k")
    old.state.save(legacy)
    sa = make_scorer(policy, node, LANDSAT)
    assert not legacy.exists() and isinstance(sa, NoveltyScorer) and sa.version == old.version
    sb = make_scorer(policy, node, other_kind)
    assert isinstance(sb, NoveltyScorer) and sb.state.batches == {}


def _accepted() -> pa.Table:
    from edgehaul.edge.preprocess import preprocess

    return preprocess(next(generate(100, "node-a", seed=1, batch_size=100)), LANDSAT).accepted


@pytest.fixture
def plugin_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """An installed third-party scorer: one module plus its distribution's entry point, nothing in edgehaul."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "acme_scorers.py").write_text(textwrap.dedent("""
        import numpy as np

        class Urgent:
            version = "acme-urgent-1"

            def __init__(self, label: str) -> None:
                self.label = label

            def score(self, table):
                return np.ones(table.num_rows, np.float32)

        def from_context(ctx):
            return Urgent(ctx.contract.label_column)
    """))
    dist = site / "acme_scorers-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-scorers\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[edgehaul.scorers]\nacme-urgent = acme_scorers:from_context\n")
    monkeypatch.syspath_prepend(str(site))
    available_scorers.cache_clear()
    yield "acme-urgent"
    available_scorers.cache_clear()


def test_a_scorer_from_another_package_is_chosen_by_name(tmp_path: Path, plugin_package: str) -> None:
    assert plugin_package in available_scorers() and {"novelty", "model"} <= set(available_scorers())
    node, spool = _node(tmp_path), _spool(tmp_path)
    raw = next(generate(300, "node-a", seed=9, batch_size=300))
    key, hashes = batch_key(raw)
    policy = TieringPolicy(scorer=plugin_package)
    res = ingest_batch(raw, LANDSAT, policy, spool, make_scorer(policy, node, LANDSAT), key=key, hashes=hashes,
                       node_id="node-a")
    spool.close()
    assert res.accepted == 300 and {b["tier"] for b in res.bundles} == {"high"}  # the plugin's 1.0 for every row
    baseline = ingest_batch(raw, LANDSAT, TieringPolicy(), _spool(tmp_path / "b"), NoveltyScorer(LANDSAT),
                            key=key, hashes=hashes, node_id="node-a")
    assert {b["tier"] for b in baseline.bundles} != {"high"}  # so the tiers above came from the plugin


def test_an_unknown_scorer_is_refused_when_the_policy_is_made() -> None:
    with pytest.raises(ValueError, match=r"scorer 'vibration' is not registered .* installed: .*novelty"):
        TieringPolicy(scorer="vibration")


def test_a_broken_plugin_names_itself(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    site = tmp_path / "site"
    (site / "broken_scorer-1.0.dist-info").mkdir(parents=True)
    (site / "broken_scorer-1.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-scorer\n"
                                                                   "Version: 1.0\n")
    (site / "broken_scorer-1.0.dist-info" / "entry_points.txt").write_text(
        "[edgehaul.scorers]\nbroken = broken_scorer_missing:from_context\n")
    monkeypatch.syspath_prepend(str(site))
    available_scorers.cache_clear()
    try:
        policy = TieringPolicy(scorer="broken")
        with pytest.raises(UnknownScorer, match=r"scorer 'broken' \(broken_scorer_missing:from_context\) failed "
                                                 r"to import: ModuleNotFoundError"):
            make_scorer(policy, _node(tmp_path), LANDSAT)
    finally:
        available_scorers.cache_clear()


def test_state_file_is_json_in_the_kinds_folder(tmp_path: Path) -> None:
    node, spool = _node(tmp_path), _spool(tmp_path)
    _run(next(generate(120, "node-a", seed=2, batch_size=120)), LANDSAT, node, spool, TieringPolicy())
    spool.close()
    path = Path(node.spool_dir) / "scorer" / "novelty" / LANDSAT.id / NoveltyScorer.STATE_FILE
    assert len(json.loads(path.read_bytes())["batches"]) == 1


def test_the_model_scorer_before_its_kind_has_a_model_scores_with_the_fallback_and_says_so(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from edgehaul.edge.model_scorer import ColdStart, NoModelYet

    node, spool = _node(tmp_path), _spool(tmp_path)
    policy = TieringPolicy(scorer="model", model_uri="downlink:")  # the kind's own model, none downlinked yet
    with caplog.at_level("WARNING", logger="edgehaul.edge.model_scorer"):
        accepted = sum(_run(t, LANDSAT, node, spool, policy) for t in generate(300, "node-a", seed=5, batch_size=150))
    spool.close()
    assert accepted == 300 and len(spool.pending()) > 0
    assert "no model 'landcover' downlinked to this node yet" in caplog.text and "scoring with novelty" in caplog.text
    cold = make_scorer(policy, node, LANDSAT)
    assert isinstance(cold, ColdStart) and isinstance(cold.fallback, NoveltyScorer)
    # the fallback learnt from both batches, in a folder of its own under the model scorer's
    assert cold.fallback.state_path is not None and _rows_seen(cold.fallback.state_path) == 300
    assert cold.fallback.state_path.is_relative_to(Path(node.spool_dir) / "scorer" / "model")
    assert cold.version.startswith("model-pending+novelty") and cold.cache_version("x").startswith("model-pending+")
    with pytest.raises(NoModelYet):
        make_scorer(policy.model_copy(update={"fallback_scorer": None}), node, LANDSAT)


def test_the_fallback_scorer_is_checked_and_keys_only_model_policies() -> None:
    with pytest.raises(ValueError, match="fallback_scorer cannot be 'model'"):
        TieringPolicy(scorer="model", model_uri="latest", fallback_scorer="model")
    with pytest.raises(ValueError, match="scorer 'vibration' is not registered"):
        TieringPolicy(fallback_scorer="vibration")
    # only the model scorer ever falls back: other policies keep their fingerprint, so their edge cache holds
    assert TieringPolicy().fingerprint == TieringPolicy(fallback_scorer="anomaly").fingerprint
    model = TieringPolicy(scorer="model", model_uri="latest")
    assert model.fingerprint != model.model_copy(update={"fallback_scorer": "anomaly"}).fingerprint
