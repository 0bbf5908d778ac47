"""Tested as claimed: a new observation kind needs only its contract file. The contract is written into a
temporary contracts folder (EDGEHAUL_CONTRACTS_DIR, where the node and the core find contracts), its data into a
drop folder as an instrument would, and it goes edge -> spool -> uplink -> validation -> dataset version ->
training (it has a training section) -> model published and sent back to the node's scorer, with no code that
knows the kind."""

from __future__ import annotations

import csv
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pytest

from edgehaul.blocks import ObjectStore
from edgehaul.contracts import load_contract
from edgehaul.decode import with_derived_features
from edgehaul.training import registry
from tests.kinds_support import close_the_loop, run_loop

pytestmark = pytest.mark.integration

# A beehive's sensors: numeric columns with units and ranges, a swarming flag, an MLP to train.
HIVE = """
kind: hive_climate
version: 1
description: Beehive climate and weight, one row a minute; swarming 1 while the colony swarms.
columns:
  temp_c: {type: float32, unit: degC, min: -30, max: 60}
  humidity: {type: float32, unit: percent, min: 0, max: 100}
  weight_kg: {type: float32, unit: kg, min: 0, max: 200}
label:
  column: swarming
  kind: anomaly
training:
  model: mlp
  model_name: hive-swarm
  epochs: 10
  batch_size: 32
  lr: 0.01
  width: 16
expectations:
  - type: expect_column_values_to_be_unique
    kwargs: {column: sample_id}
  - type: expect_column_values_to_be_in_set
    kwargs: {column: swarming, value_set: [0, 1], mostly: 1.0}
  - type: expect_column_values_to_be_between
    kwargs: {column: norm_humidity, min_value: 0.0, max_value: 1.0}
"""


def _hive_csv(path: Path, node_id: str, n: int, seed: int = 0) -> dict[str, dict[str, str]]:
    """n readings a minute apart ending now; a swarm is hot, dry and loses weight. Two rows are broken the ways
    instruments break them: a text in a number column, a reading outside the sensor's range."""
    rng = np.random.default_rng(seed)
    swarm = rng.random(n) < 0.2
    temp = np.where(swarm, rng.normal(48, 2, n), rng.normal(33, 2, n))
    hum = np.where(swarm, rng.normal(30, 4, n), rng.normal(65, 4, n))
    weight = np.where(swarm, rng.normal(35, 3, n), rng.normal(60, 3, n))
    end = datetime.now(UTC).replace(microsecond=0)
    rows = {}
    for i in range(n):
        sid = f"{node_id}-hive-{i:06d}"
        rows[sid] = {"sample_id": sid, "node_id": node_id,
                     "capture_time": (end - timedelta(minutes=n - 1 - i)).isoformat(), "seq": str(i),
                     "swarming": str(int(swarm[i])), "temp_c": f"{temp[i]:.2f}", "humidity": f"{hum[i]:.1f}",
                     "weight_kg": f"{weight[i]:.3f}"}
    rows[f"{node_id}-hive-{3:06d}"]["humidity"] = "sensor-error"
    rows[f"{node_id}-hive-{5:06d}"]["temp_c"] = "99.5"
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(next(iter(rows.values()))))
        w.writeheader()
        w.writerows(rows.values())
    tmp.replace(path)
    return rows


def test_a_kind_from_a_contract_file_alone_goes_all_the_way(store: ObjectStore, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    contracts = tmp_path / "contracts"
    contracts.mkdir()
    (contracts / "hive_climate.v1.yaml").write_text(HIVE)
    monkeypatch.setenv("EDGEHAUL_CONTRACTS_DIR", str(contracts))
    contract = load_contract("hive_climate")  # from the folder: the package has no such kind
    assert contract.layout == "columns" and contract.training is not None

    node_id = f"kd-{uuid.uuid4().hex[:8]}"
    (tmp_path / "drop").mkdir()
    rows = _hive_csv(tmp_path / "drop" / "hive.csv", node_id, 900)
    loop = run_loop(store, contract, tmp_path / "drop", tmp_path, node_id=node_id)

    assert loop.version is not None and not loop.core["quarantined"], loop.core
    # each reading lands once; the per-column feature the contract asks for by default (the reading scaled to its
    # range) is derived where it is read
    assert not set(contract.derived_feature_columns) & set(loop.dataset.column_names)
    got = {r["sample_id"]: r for r in with_derived_features(loop.dataset, contract).to_pylist()}
    assert set(got) | set(loop.rejected) == set(rows) and not set(got) & set(loop.rejected)
    # the two broken rows are rejected alone, each with its reason; their batch's 898 good rows arrived
    assert set(loop.rejected) == {f"{node_id}-hive-{3:06d}", f"{node_id}-hive-{5:06d}"}
    assert loop.rejected[f"{node_id}-hive-{3:06d}"][0] == ("preprocess", "bad-type")
    for sid in list(got)[::37]:
        assert got[sid]["temp_c"] == pytest.approx(float(rows[sid]["temp_c"]), abs=1e-4)
        assert got[sid]["swarming"] == int(rows[sid]["swarming"])
        assert got[sid]["norm_humidity"] == pytest.approx(float(rows[sid]["humidity"]) / 100, abs=1e-5)
    close_the_loop(loop, store, epochs=None, width=None)  # as the contract says
    assert loop.train is not None
    lineage = registry.read_lineage(store, "hive-swarm", loop.train["model_id"])
    assert lineage is not None and lineage["dataset_version"] == loop.version
    assert lineage["dataset_uri"].rstrip("/").endswith("/hive_climate")
    assert loop.scorer_version == loop.train["model_id"] and loop.scores
    # trained as the contract's training section says (at most 10 epochs: early stopping ends a run whose
    # validation no longer improves), and it learned the rule behind the rows
    history = loop.train["history"]
    assert len(history) == 10 or (3 <= len(history) < 10 and lineage["stopped_early"]), (len(history), lineage)
    assert history[-1]["val_macro_f1"] >= 0.9 and history[-1]["val_rare_recall"] >= 0.8
