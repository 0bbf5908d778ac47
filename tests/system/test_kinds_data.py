"""The real data of the non-Landsat kinds (edgehaul_dev.kinds_data): aeon's and scikit-learn's files read into raw
batches that follow each kind's contract, with the values of the files, real capture times and drop-folder
files a node can read. No stack needed."""

from __future__ import annotations

import csv
import gzip
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

from edgehaul.contracts import load_contract
from edgehaul.decode import decode_file, decode_tensors
from edgehaul.edge.drop_folder import DropFolder
from edgehaul_dev import kinds_data as kd

END = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)


def test_gait_rows_are_the_recordings_readings_at_real_times() -> None:
    contract = load_contract("daphnet_gait")
    t = kd.gait_table("node-a", end=END)
    with open(kd.aeon_file(kd.DAPHNET), newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert t.schema.equals(contract.raw_schema) and t.num_rows == len(rows) == 7040
    for i in (0, 1234, len(rows) - 1):  # every reading exactly as the instrument wrote it
        got = t.slice(i, 1).to_pylist()[0]
        assert all(got[c.name] == float(rows[i][c.name]) for c in contract.columns)
        assert got["is_anomaly"] == int(rows[i]["is_anomaly"])
    times = t.column("capture_time").cast(pa.int64()).to_numpy()
    steps = np.diff(times)
    assert set(np.unique(steps)) <= {15, 16}  # 64 Hz, the file's own clock
    span = datetime.fromisoformat(rows[-1]["timestamp"]) - datetime.fromisoformat(rows[0]["timestamp"])
    assert times[-1] == int(END.timestamp() * 1000) and times[-1] - times[0] == span // timedelta(milliseconds=1)
    assert len(set(t.column("sample_id").to_pylist())) == t.num_rows
    assert kd.gait_table("node-a", limit=100).column("capture_time")[-1].as_py() > datetime.now(UTC) - timedelta(
        seconds=60)  # default: the recording ends now, not in 1970


def test_motions_cases_are_the_ts_files_values_labelled_by_class_name() -> None:
    contract = load_contract("basic_motions")
    t = kd.motions_table("node-a", end=END)
    mo = kd.motions()
    assert t.schema.equals(contract.raw_schema) and t.num_rows == 80
    x = decode_tensors(t.column("series"), contract)
    assert x.shape == (80, 6, 100) and x.dtype == np.float32
    first = kd.aeon_file("BasicMotions/BasicMotions_TRAIN.ts").read_text().split("@data", 1)[1].split()[0]
    dims = first.split(":")
    assert np.allclose(x[0, 1, :3], [float(v) for v in dims[1].split(",")[:3]])  # channel 1 = the 2nd dimension
    names = dict(zip(contract.label.values, contract.label.names, strict=True))
    labels = t.column("activity").to_numpy()
    assert [names[int(v)] for v in labels] == [n.lower() for n in mo.names]
    assert dims[-1] == mo.names[0] and np.bincount(labels).tolist() == [0, 20, 20, 20, 20]
    assert np.diff(t.column("capture_time").cast(pa.int64()).to_numpy()).tolist() == [10_000] * 79


def test_digits_become_png_files_that_decode_to_the_scaled_images() -> None:
    contract = load_contract("digits_png")
    assert contract.file is not None and contract.tensor is not None
    d = kd.digits()
    with gzip.open(kd.digits_file(), "rt") as fh:
        raw = np.loadtxt(fh, delimiter=",", dtype=np.int64, max_rows=3)
    assert len(d.labels) == 1797 and set(d.labels.tolist()) == set(contract.label.values)
    assert (d.images[:3].reshape(3, -1) == kd.scale_levels(raw[:, :64])).all() and d.labels[:3].tolist() == [0, 1, 2]
    t = kd.digits_table("node-a", n=200, end=END)
    assert t.schema.equals(contract.raw_schema)
    files = t.column("image").to_pylist()
    assert max(len(f) for f in files) <= contract.file.max_bytes
    assert all(f.startswith(b"\x89PNG\r\n\x1a\n") for f in files)
    x = decode_tensors(t.column("image"), contract)
    assert x.shape == (200, 8, 8, 1) and (x[..., 0] == d.images[:200]).all()


@given(st.lists(st.integers(0, kd.DIGIT_LEVELS), min_size=1, max_size=64))
def test_scaling_keeps_every_ink_level_apart_and_spans_the_byte(levels: list[int]) -> None:
    g = kd.scale_levels(np.array(levels))
    assert (np.rint(g.astype(np.float64) * kd.DIGIT_LEVELS / 255).astype(int) == levels).all()  # invertible
    assert kd.scale_levels(np.array([0, kd.DIGIT_LEVELS])).tolist() == [0, 255]


def test_digit_files_have_sidecars_and_no_partial_names(tmp_path: Path) -> None:
    contract = load_contract("digits_png")
    assert contract.tensor is not None
    ids = kd.write_digit_files(tmp_path / "drop", "node-a", n=12, end=END)
    names = sorted(p.name for p in (tmp_path / "drop").iterdir())
    assert names == sorted([f"{i}.png" for i in ids] + [f"{i}.json" for i in ids])
    d = kd.digits()
    for k, sid in enumerate(ids):
        meta = json.loads((tmp_path / "drop" / f"{sid}.json").read_text())
        assert meta["label"] == int(d.labels[k]) and meta["seq"] == k
        assert datetime.fromisoformat(meta["capture_time"]) == END - timedelta(seconds=11 - k)
        img = decode_file((tmp_path / "drop" / f"{sid}.png").read_bytes(), contract.tensor)
        assert (img[..., 0] == d.images[k]).all()


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_gait_drop_files_read_back_as_the_same_raw_rows(tmp_path: Path, suffix: str) -> None:
    """What the node's drop folder reads from the file casts back to exactly the table written (CSV as text)."""
    contract = load_contract("daphnet_gait")
    t = kd.gait_table("node-a", end=END, limit=500)
    kd.write_drop_table(t, tmp_path / "drop", f"gait{suffix}")
    drop = DropFolder(tmp_path / "drop", tmp_path / "done", tmp_path / "log", settle_s=0)
    try:
        (f,) = drop.claim().files
        back = pa.concat_tables(list(drop.read(f, contract, 10_000)))
    finally:
        drop.close()
    back = pa.table([back.column(n).cast(contract.raw_schema.field(n).type) for n in contract.raw_schema.names],
                    schema=contract.raw_schema)
    assert back.equals(t)
    with pytest.raises(ValueError, match="binary column"):
        kd.write_drop_table(kd.motions_table("node-a"), tmp_path, "m.csv")


def test_generated_motions_follow_the_class_mix_and_run_on_in_time() -> None:
    batches = list(kd.generate_motions(3000, "node-a", seed=3, class_weights={1: 1, 2: 3}, batch_size=1000,
                                       end=END))
    t = pa.concat_tables(batches)
    labels = t.column("activity").to_numpy()
    assert set(labels.tolist()) == {1, 2} and abs((labels == 2).mean() - 0.75) < 0.03
    assert t.column("seq").to_pylist() == list(range(3000)) and len(set(t.column("sample_id").to_pylist())) == 3000
    times = t.column("capture_time").cast(pa.int64()).to_numpy()
    assert (np.diff(times) == 10_000).all() and times[-1] == int(END.timestamp() * 1000)
    x = decode_tensors(t.column("series"), load_contract("basic_motions"))
    assert np.isfinite(x).all() and not (x[0] == x[1]).all()
    again = pa.concat_tables(list(kd.generate_motions(3000, "node-a", seed=3, class_weights={1: 1, 2: 3},
                                                      batch_size=1000, end=END)))
    assert again.equals(t)  # a seed gives the same data
    with pytest.raises(ValueError, match="select no case"):
        next(kd.generate_motions(10, class_weights={9: 1.0}))


def test_generated_gait_marks_its_synthetic_freezes_with_a_tremor() -> None:
    contract = load_contract("daphnet_gait")
    t = pa.concat_tables(list(kd.generate_gait(4000, "node-a", seed=1, anomaly_fraction=0.2, end=END)))
    assert t.schema.equals(contract.raw_schema)
    flag = t.column("is_anomaly").to_numpy() == 1
    assert abs(flag.mean() - 0.2) < 0.03
    base = kd.gait_recording()
    ankle, trunk = t.column("ankle_horiz_fwd").to_numpy(), t.column("trunk_vert").to_numpy()
    assert ankle[flag].mean() - ankle[~flag].mean() > 400  # the tilt, on the ankle only
    assert abs(trunk[flag].mean() - base.readings["trunk_vert"].mean()) < 25
    plain = pa.concat_tables(list(kd.generate_gait(500, "node-a", seed=1, end=END)))
    assert plain.column("is_anomaly").to_numpy().sum() == 0  # the recording's own labels: no freeze in it
    times = t.column("capture_time").cast(pa.int64()).to_numpy()
    assert set(np.unique(np.diff(times))) <= {15, 16} and times[-1] == int(END.timestamp() * 1000)  # 64 Hz
    assert kd.digits_table("node-a", n=0).num_rows == 0


def test_a_missing_data_package_names_its_install_line() -> None:
    with pytest.raises(kd.DataFilesMissing, match=r"pip install --no-deps nope==1"):
        kd.package_dir("edgehaul_no_such_package", "nope==1")
