"""Tiering keeps training honest. On generated data with a known mix, through the edge
path (`ingest_batch`: preprocess -> score -> assign -> Batcher -> spool), the rows central training keeps
(`training.data.trainable`), weighted by `training.data.sample_weights`, match the class distribution the
node observed within 2 percentage points per class, although the scorer sends some classes mostly to the
low tier; the high tier still leaves first; every sample travels once (in full or as a summary)."""

from __future__ import annotations

import collections
import logging
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from edgehaul.blocks import TieringPolicy
from edgehaul.bundles import read_bundle, write_bundle
from edgehaul.contracts import Contract, load_contract
from edgehaul.core.validation import validate_bundle
from edgehaul.edge.anomaly_scorer import AnomalyScorer
from edgehaul.edge.batch import ingest_batch
from edgehaul.edge.landsat import generate, real_patches
from edgehaul.edge.scoring import NoveltyScorer
from edgehaul.edge.spool import Spool
from edgehaul.edge.tiering import Batcher, assign, summarise
from edgehaul.training.data import sample_weights, trainable
from tests.builders import processed_rows
from tests.gait_rows import GAIT, gait_raw, gait_rows

log = logging.getLogger(__name__)
LANDSAT = load_contract("landsat_patch")
TOLERANCE = 0.02  # 2 percentage points per class
RATE = 0.25


def _spool(root: Path) -> Spool:
    return Spool(root, cap_bytes=2**34, node_id="node-a", emit=lambda *a, **k: True)


def _shares(labels: np.ndarray, weights: np.ndarray, classes: list[int]) -> dict[int, float]:
    return {k: float(weights[labels == k].sum() / weights.sum()) for k in classes}


def _check(spool: Spool, contract: Contract, observed: collections.Counter[int]) -> dict[str, object]:
    """What central training sees of the spool's uplink bundles, against what the node observed."""
    label = contract.label_column
    assert label is not None
    pending = spool.pending()
    # the high tier leaves first: the drain order puts every urgent bundle before any normal one
    tiers = [e.tier for e in pending]
    assert tiers == sorted(tiers, key=("high", "normal").index) and "high" in tiers and "normal" in tiers
    sent = pa.concat_tables([read_bundle(spool.read(e.bundle_id), e.manifest) for e in pending]).combine_chunks()
    # nothing lost: every observed sample travels in full or stays in the raw store, never both; a summary goes
    # up only for a sample left on the node, and only where it earns its bytes (a pixel patch, not a gait row)
    ids = sent.column("sample_id").to_pylist()
    assert len(ids) == len(set(ids))
    summary_ids = set(sent.filter(sent.column("is_summary")).column("sample_id").to_pylist())
    full_ids = set(ids) - summary_ids
    raw_ids = {i for e in spool.raw_entries() for i in e.manifest.sample_ids}
    assert full_ids.isdisjoint(raw_ids) and len(full_ids) + len(raw_ids) == sum(observed.values())
    assert summary_ids <= raw_ids
    assert bool(summary_ids) == (contract.layout != "columns")
    rows = trainable(sent.to_batches()[0], contract)
    assert not any(rows.column("is_summary").to_pylist())
    labels = np.array(rows.column(label).to_pylist())
    w = sample_weights(rows)
    assert set(np.round(w, 4).tolist()) == {1.0, 1 / RATE}
    classes = sorted(observed)
    n = sum(observed.values())
    want = {k: observed[k] / n for k in classes}
    weighted = _shares(labels, w, classes)
    unweighted = _shares(labels, np.ones(len(labels)), classes)
    err = {k: abs(weighted[k] - want[k]) for k in classes}
    assert max(err.values()) <= TOLERANCE, (want, weighted)
    # without the weights the training mix is far off: what the check above would catch
    assert max(abs(unweighted[k] - want[k]) for k in classes) > 5 * TOLERANCE, (want, unweighted)
    figures = {"observed": want, "weighted": weighted, "unweighted": unweighted,
               "max_err_pp": round(100 * max(err.values()), 3), "train_rows": rows.num_rows, "samples": n}
    log.info("%s: %s", contract.id, figures)
    return figures


def _low_share_by_class(sent_tiers: dict[int, collections.Counter[str]]) -> dict[int, float]:
    return {k: c["low"] / sum(c.values()) for k, c in sent_tiers.items()}


def test_landsat_weighted_class_mix_matches_the_node_within_2pp(tmp_path: Path) -> None:
    # a known mix: 40% class 1, 40% class 5, 12% class 3, 5% class 4, 3% class 6 (weights per scene patch)
    patches = collections.Counter(real_patches().labels.tolist())
    mix = {1: 0.40, 5: 0.40, 3: 0.12, 4: 0.05, 6: 0.03}
    policy = TieringPolicy(sample_rate=RATE, use_labels=True)  # labels at the edge, read: class rarity counts
    spool = _spool(tmp_path / "spool")
    scorer = NoveltyScorer(LANDSAT, use_labels=True)
    observed: collections.Counter[int] = collections.Counter()
    by_class: dict[int, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for i, raw in enumerate(generate(40_000, "node-a", seed=11, batch_size=10_000,
                                     class_weights={k: s / patches[k] for k, s in mix.items()})):
        result = ingest_batch(raw, LANDSAT, policy, spool, scorer, key=f"landsat-{i}", node_id="node-a")
        assert result.accepted == raw.num_rows
        observed.update(raw.column("label").to_pylist())
    for e in [*spool.pending(), *spool.raw_entries()]:
        t = read_bundle(spool.read(e.bundle_id), e.manifest)
        if e.tier != "low":  # the raw store repeats the summarised samples
            for lab, tier in zip(t.column("label").to_pylist(), t.column("tier").to_pylist(), strict=True):
                by_class[lab][tier] += 1
    # the generated mix is the known one (binomial noise), and the scorer sends the common classes mostly low
    for k, s in mix.items():
        assert abs(observed[k] / 40_000 - s) < 0.015
    low = _low_share_by_class(by_class)
    assert low[1] > 0.5 and low[5] > 0.5 and low[6] < 0.1, low
    _check(spool, LANDSAT, observed)


def test_gait_weighted_anomaly_rate_matches_the_node_within_2pp(tmp_path: Path) -> None:
    """The columns kind with the anomaly-aware scorer: freezes (8%) go high, normal readings mostly low."""
    policy = TieringPolicy(scorer="anomaly", sample_rate=RATE)
    spool = _spool(tmp_path / "spool")
    scorer = AnomalyScorer(GAIT)
    observed: collections.Counter[int] = collections.Counter()
    for i in range(4):
        raw = gait_raw(5_000, anomaly_rate=0.08, seed=20 + i, start_seq=i * 5_000, outliers=5)
        result = ingest_batch(raw, GAIT, policy, spool, scorer, key=f"gait-{i}", node_id="node-a")
        assert result.accepted == raw.num_rows
        observed.update(raw.column("is_anomaly").to_pylist())
    by_class: dict[int, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for e in spool.pending():
        t = read_bundle(spool.read(e.bundle_id), e.manifest)
        for lab, tier in zip(t.column("is_anomaly").to_pylist(), t.column("tier").to_pylist(), strict=True):
            by_class[lab][tier] += 1
    assert by_class[1]["high"] == observed[1]  # every labelled freeze is high
    assert _low_share_by_class(by_class)[0] > 0.9
    assert abs(observed[1] / 20_000 - 0.08) < 0.01
    _check(spool, GAIT, observed)


@pytest.mark.parametrize("rate", [0.0, 1.0])
def test_rate_zero_sends_no_low_row_in_full_and_rate_one_all(tmp_path: Path, rate: float) -> None:
    policy = TieringPolicy(scorer="anomaly", sample_rate=rate)
    rows = gait_rows(2_000, anomaly_rate=0.05, seed=3)
    scored = assign(rows, AnomalyScorer(GAIT).score(rows, batch_key="k"), policy, GAIT)
    b = Batcher(policy, GAIT)
    out = b.add(scored) + b.flush()
    sent = pa.concat_tables([read_bundle(x.data, x.manifest) for x in out if x.manifest.tier != "low"])
    low_full = sent.filter(pa.compute.and_(pa.compute.equal(sent.column("tier"), "low"),
                                           pa.compute.invert(sent.column("is_summary"))))
    n_low = sum(1 for t in scored.column("tier").to_pylist() if t == "low")
    assert n_low > 1000
    assert low_full.num_rows == (n_low if rate == 1.0 else 0)
    assert [x for x in out if x.manifest.tier == "low"] == ([] if rate == 1.0 else [x for x in out if x.reason == "raw"])
    assert b.report.sampled_low == low_full.num_rows


def _with_p(rows: pa.Table, p: list[float]) -> pa.Table:
    return rows.set_column(rows.schema.get_field_index("inclusion_p"), "inclusion_p", pa.array(p, pa.float32()))


def test_core_validation_refuses_a_full_row_with_p_outside_0_1_and_names_it() -> None:
    base = processed_rows(6, seed=12, start_seq=70_000)
    ids = base.column("sample_id").to_pylist()
    for p, bad in (([1.0, 0.5, 0.05, 1.0, 1.0, 1.0], None), ([1.0, 0.0, 1.0, 1.0, 1.0, 1.0], 1),
                   ([1.0, 1.0, 1.0, 1.5, 1.0, 1.0], 3), ([-0.5, 1.0, 1.0, 1.0, 1.0, 1.0], 0)):
        data, m = write_bundle(_with_p(base, p), LANDSAT, tier="normal")
        _, result = validate_bundle(data, m)
        assert result.success == (bad is None), (p, result.error)
        if bad is not None:
            assert result.reason == "inclusion_p" and ids[bad] in result.error, result.error
    with pytest.raises(ValueError, match="inclusion_p"):  # the writer refuses a row without p
        write_bundle(base.set_column(base.schema.get_field_index("inclusion_p"), "inclusion_p",
                                     pa.array([1.0, None, 1.0, 1.0, 1.0, 1.0], pa.float32())), LANDSAT, tier="normal")
    # a summary of a tier sampled at rate 0 carries p = 0: valid (it is never a training row)
    data, m = write_bundle(_with_p(summarise(base, LANDSAT), [0.0] * 6), LANDSAT, tier="normal")
    _, result = validate_bundle(data, m)
    assert result.success, result.error


@pytest.mark.parametrize("share", [0.05, 0.10])
def test_under_a_byte_budget_the_weighted_class_mix_is_the_nodes_within_2pp(tmp_path: Path, share: float) -> None:
    """Landsat at a tight budget with the default scorer: the rows sent are value-weighted (the rare class
    over-represented) and 1/inclusion_p gives the node's class mix back: over four draws (policy versions) within
    2 points per class, each draw within 4 (a draw of 1,500 rows misses by 1-2 points by chance alone)."""
    patches = collections.Counter(real_patches().labels.tolist())
    mix = {1: 0.40, 5: 0.40, 3: 0.12, 4: 0.05, 6: 0.03}
    weighted: list[dict[int, float]] = []
    for version in "1234":
        policy = TieringPolicy(budget_share=share, version=version)
        spool = _spool(tmp_path / f"spool-{version}")
        scorer = NoveltyScorer(LANDSAT)
        observed: collections.Counter[int] = collections.Counter()
        for i, raw in enumerate(generate(30_000, "node-a", seed=12, batch_size=10_000,
                                         class_weights={k: s / patches[k] for k, s in mix.items()})):
            result = ingest_batch(raw, LANDSAT, policy, spool, scorer, key=f"landsat-b-{i}", node_id="node-a")
            assert result.accepted == raw.num_rows
            observed.update(raw.column("label").to_pylist())
        sent = pa.concat_tables([read_bundle(spool.read(e.bundle_id), e.manifest) for e in spool.pending()])
        rows = trainable(sent.combine_chunks().to_batches()[0], LANDSAT)
        assert abs(rows.num_rows / 30_000 - share) < 0.3 * share  # equal-size rows: the share of rows, near enough
        labels = np.array(rows.column("label").to_pylist())
        n = sum(observed.values())
        weighted.append(_shares(labels, sample_weights(rows), sorted(observed)))
        unweighted = _shares(labels, np.ones(len(labels)), sorted(observed))
        log.info("budget %.2f v%s: %d rows; observed %s weighted %s unweighted %s", share, version, rows.num_rows,
                 {k: round(observed[k] / n, 3) for k in observed}, weighted[-1], unweighted)
        assert max(abs(weighted[-1][k] - observed[k] / n) for k in observed) <= 2 * TOLERANCE, weighted[-1]
        assert unweighted[6] > 1.5 * observed[6] / n  # the rare class lands more often than its share
    err = {k: abs(float(np.mean([w[k] for w in weighted])) - observed[k] / n) for k in observed}
    assert max(err.values()) <= TOLERANCE, err
