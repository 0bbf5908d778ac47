"""Each new kind end to end on the real stack, from real data files: the instrument's files
in a drop folder -> edge_ingest -> spool -> uplink_drain -> core_ingest -> a dataset version that holds every
accepted observation exactly as it was written (sample ids accounted for: in the dataset or in the node's ledger
with a reason) -> train_model on that version -> published -> sent down to the node -> its model scorer.

- daphnet_gait (columns): the real Daphnet recording as CSV plus generated readings with synthetic freezes as
  Parquet (the recording has no freezing episode, and a model needs both classes);
- basic_motions (tensor [6, 100]): the 80 real BasicMotions windows plus resampled ones, as Parquet;
- digits_png (file): one PNG per observation with a JSON sidecar (label, capture time);
- and one node with two kinds: one drain, one core run, a dataset and a scorer state per kind.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from edgehaul.blocks import ObjectStore
from edgehaul.contracts import Contract, load_contract
from edgehaul.training import registry
from edgehaul.training.data import is_validation, val_block_rows
from edgehaul_dev import kinds_data as kd
from tests.kinds_support import Loop, close_the_loop, run_loop

pytestmark = pytest.mark.integration


def _by_id(t: pa.Table) -> dict[str, dict[str, object]]:
    return {r["sample_id"]: r for r in t.to_pylist()}


def _check_accounted(loop: Loop, sent: set[str]) -> set[str]:
    """Every sample id sent is in the dataset version or in the node's ledger, never both, never neither;
    returns the rejected ids."""
    assert loop.version is not None, loop.core
    assert not loop.core["quarantined"] and not loop.core["errors"], loop.core
    in_dataset = loop.dataset.column("sample_id").to_pylist()
    assert len(in_dataset) == len(set(in_dataset)), "a sample id twice in the dataset"
    rejected = set(loop.rejected)
    assert set(in_dataset) | rejected == sent and not set(in_dataset) & rejected
    assert sum(loop.edge["rejected"].values()) == len(rejected)  # the run's own count says the same
    assert loop.dataset.schema.field("capture_time").type.tz == "UTC"
    return rejected


def _check_closed_loop(loop: Loop, store: ObjectStore, epochs: int | None, min_macro_f1: float) -> None:
    close_the_loop(loop, store, epochs, width=None)
    training = loop.contract.training
    assert training is not None and loop.train is not None
    model_id = loop.train["model_id"]
    lineage = registry.read_lineage(store, training.model_name, model_id)
    assert lineage is not None and lineage["dataset_version"] == loop.version
    assert lineage["dataset_uri"].rstrip("/").endswith(f"/{loop.contract.kind}")
    pointer, _ = registry.read_json(store, registry.latest_uri(store, training.model_name))
    assert pointer["model_id"] == model_id  # published
    assert loop.scorer_version == model_id  # the node scores with the model it was sent
    assert loop.scores and all(0.0 <= v <= 1.0 for v in loop.scores)
    final = loop.train["history"][-1]
    assert final["val_macro_f1"] >= min_macro_f1, final  # it learnt its kind, not only closed the loop


def test_daphnet_gait_from_csv_and_parquet_drop_files(store: ObjectStore, tmp_path: Path) -> None:
    contract = load_contract("daphnet_gait")
    node_id = f"kd-{uuid.uuid4().hex[:8]}"
    end = datetime.now(UTC).replace(microsecond=0)
    real = kd.gait_table(node_id, end=end - timedelta(minutes=5))
    # The trainer holds out stretches of (node, seq) by hash; the recording has no freezing, so the synthetic part
    # must be long enough that some of its stretches are held out: with 1,500 readings (35 stretches) none was
    # for 2.5% of node ids, the validation rows held one class and the gate could not judge the model.
    synthetic = pa.concat_tables(list(kd.generate_gait(4000, node_id, seed=7, anomaly_fraction=0.25,
                                                       start_seq=100_000, end=end)))
    both = pa.concat_tables([real, synthetic])
    held = is_validation(both, 0.1, val_block_rows(both.num_rows, 0.1))
    assert 0 < int(pa.compute.sum(both.column("is_anomaly").filter(pa.array(held))).as_py()) < int(held.sum()), (
        f"node id {node_id}: the held-out stretches hold one class; the closed loop below cannot be judged")
    kd.write_drop_table(real, tmp_path / "drop", "S06R02E0.csv")
    kd.write_drop_table(synthetic, tmp_path / "drop", "gait-2.parquet")
    loop = run_loop(store, contract, tmp_path / "drop", tmp_path, node_id=node_id, batch_size=5000)

    sent = pa.concat_tables([real, synthetic])
    rejected = _check_accounted(loop, set(sent.column("sample_id").to_pylist()))
    # the recording has a reading outside the contract's declared range (ankle_horiz_fwd -5010 mg < -5000):
    # exactly such rows are rejected, each with its reason, and the batch's other rows go on
    assert rejected == _outside_ranges(sent, contract)
    assert all(r[0][0] == "preprocess" for r in loop.rejected.values())
    got, want = _by_id(loop.dataset), _by_id(sent)
    for sid in list(got)[:: max(1, len(got) // 500)]:  # values, labels and times exactly as written
        assert {k: got[sid][k] for k in want[sid]} == want[sid]
    assert int(pa.compute.sum(loop.dataset.column("is_anomaly")).as_py()) == int(
        pa.compute.sum(synthetic.column("is_anomaly")).as_py())
    _check_closed_loop(loop, store, epochs=None, min_macro_f1=0.0)  # barely separable per reading


def _outside_ranges(t: pa.Table, contract: Contract) -> set[str]:
    bad = np.zeros(t.num_rows, dtype=bool)
    for c in contract.columns:
        x = t.column(c.name).to_numpy(zero_copy_only=False).astype(np.float64)
        if c.min is not None:
            bad |= x < c.min
        if c.max is not None:
            bad |= x > c.max
    return {s for s, b in zip(t.column("sample_id").to_pylist(), bad, strict=True) if b}


def test_basic_motions_from_parquet_drop_files(store: ObjectStore, tmp_path: Path) -> None:
    contract = load_contract("basic_motions")
    node_id = f"kd-{uuid.uuid4().hex[:8]}"
    end = datetime.now(UTC).replace(microsecond=0)
    real = kd.motions_table(node_id, end=end - timedelta(hours=1))
    more = pa.concat_tables(list(kd.generate_motions(240, node_id, seed=5, start_seq=1000, end=end)))
    kd.write_drop_table(real, tmp_path / "drop", "BasicMotions.parquet")
    kd.write_drop_table(more, tmp_path / "drop", "motions-2.parquet")
    loop = run_loop(store, contract, tmp_path / "drop", tmp_path, node_id=node_id, batch_size=100)

    sent = pa.concat_tables([real, more])
    assert _check_accounted(loop, set(sent.column("sample_id").to_pylist())) == set()
    got, want = _by_id(loop.dataset), _by_id(sent)
    for sid, row in want.items():  # every window's bytes, label and time as written
        assert {k: got[sid][k] for k in row} == row
    assert got[f"{node_id}-{0:012d}"]["activity"] == 3  # the first real case is "Standing": class 3 by name
    _check_closed_loop(loop, store, epochs=None, min_macro_f1=0.8)


def test_digits_from_png_files_with_sidecars(store: ObjectStore, tmp_path: Path) -> None:
    contract = load_contract("digits_png")
    node_id = f"kd-{uuid.uuid4().hex[:8]}"
    end = datetime.now(UTC).replace(microsecond=0)
    ids = kd.write_digit_files(tmp_path / "drop", node_id, n=300, end=end)
    files = {sid: (tmp_path / "drop" / f"{sid}.png").read_bytes() for sid in ids}
    sidecars = {sid: json.loads((tmp_path / "drop" / f"{sid}.json").read_text()) for sid in ids}
    loop = run_loop(store, contract, tmp_path / "drop", tmp_path, node_id=node_id, batch_size=100)

    assert _check_accounted(loop, set(ids)) == set()
    got = _by_id(loop.dataset)
    for sid in ids:  # the file itself travels: same bytes, its digest, its sidecar's label and time
        assert got[sid]["image"] == files[sid]
        assert got[sid]["content_sha256"] == hashlib.sha256(files[sid]).hexdigest()
        assert got[sid]["digit"] == sidecars[sid]["label"]
        assert got[sid]["capture_time"] == datetime.fromisoformat(sidecars[sid]["capture_time"])
        assert got[sid]["seq"] == sidecars[sid]["seq"]
    assert not list((tmp_path / "drop").glob("*.png"))  # each file read once, moved out of the drop folder
    _check_closed_loop(loop, store, epochs=None, min_macro_f1=0.5)


def test_one_node_two_kinds_one_drain_one_core_run(store: ObjectStore, tmp_path: Path) -> None:
    """A node that observes two kinds spools both, drains them in one run, and one core_ingest run commits each
    to its own dataset; the novelty scorer keeps a state per kind."""
    from edgehaul.core.datasets import read_version
    from edgehaul.flows.core_ingest import CoreIngestParams, core_ingest
    from edgehaul.flows.edge_ingest import EdgeIngestParams, edge_ingest
    from edgehaul.flows.uplink_drain import UplinkDrainParams, uplink_drain
    from tests.kinds_support import blocks

    tag = uuid.uuid4().hex[:8]
    node_id, spool_dir = f"kd-{tag}", tmp_path / "spool"
    names = blocks(store, node_id, spool_dir, tag)
    motions = kd.motions_table(node_id)
    kd.write_drop_table(motions, tmp_path / "motions", "BasicMotions.parquet")
    digit_ids = kd.write_digit_files(tmp_path / "digits", node_id, n=120, start_seq=10_000)
    for kind, folder in (("basic_motions.v1", "motions"), ("digits_png.v1", "digits")):
        edge_ingest(EdgeIngestParams(edge_node=names["node"], tiering_policy=names["policy"], contract=kind,
                                     source="drop", source_path=str(tmp_path / folder),
                                     done_path=str(tmp_path / f"done-{folder}"), settle_s=0, batch_size=100))
    drained = uplink_drain(UplinkDrainParams(edge_node=names["node"], link_profile=names["link"],
                                             object_store=names["store"], max_seconds=120))
    core = core_ingest(CoreIngestParams(store_block=names["store"], bundle_keys=drained["landed_keys"]))
    assert set(core["versions"]) == {"basic_motions", "digits_png"} and not core["quarantined"], core
    got_motions = read_version(store, "basic_motions", core["versions"]["basic_motions"])
    got_digits = read_version(store, "digits_png", core["versions"]["digits_png"])
    assert sorted(got_motions.column("sample_id").to_pylist()) == sorted(motions.column("sample_id").to_pylist())
    assert sorted(got_digits.column("sample_id").to_pylist()) == sorted(digit_ids)
    states = {p.name for p in (spool_dir / "scorer" / "novelty").iterdir()}
    assert states == {"basic_motions.v1", "digits_png.v1"}
