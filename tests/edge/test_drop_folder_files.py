"""Drop folder for a file kind: one PNG per observation, sample id from the name, label and
capture time from an optional sidecar `<stem>.json` (else the mtime); a file over max_bytes or of another media
type is moved aside with its reason; each file is read once."""

from __future__ import annotations

import io
import json
import os
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
from PIL import Image

from edgehaul.contracts import load_contract
from edgehaul.edge.drop_folder import DropFolder
from edgehaul.edge.preprocess import preprocess

DIGITS = load_contract("digits_png")
NOW = 2_000_000_000.0


def _png(v: int) -> bytes:
    b = io.BytesIO()
    Image.fromarray(np.full((8, 8), v, np.uint8)).save(b, format="PNG")
    return b.getvalue()


def _drop(folder: Path, name: str, data: bytes, sidecar: dict[str, object] | str | None = None,
          mtime: float = NOW - 60) -> None:
    if sidecar is not None:
        side = folder / (Path(name).stem + ".json")
        side.write_text(sidecar if isinstance(sidecar, str) else json.dumps(sidecar))
        os.utime(side, (mtime, mtime))
    (folder / name).write_bytes(data)
    os.utime(folder / name, (mtime, mtime))


def _folder(tmp_path: Path) -> DropFolder:
    (tmp_path / "drop").mkdir(exist_ok=True)
    return DropFolder(tmp_path / "drop", tmp_path / "done", tmp_path / "spool", settle_s=5, clock=lambda: NOW,
                      contract=DIGITS)


def test_png_files_become_observations_with_sidecar_fields_or_the_mtime(tmp_path: Path) -> None:
    d = _folder(tmp_path)
    drop = tmp_path / "drop"
    _drop(drop, "d-001.png", _png(10), {"digit": 7, "capture_time": "2026-03-01T12:00:00+00:00", "seq": 5})
    _drop(drop, "d-002.png", _png(20), {"label": 3, "capture_time": 1772366400000})
    _drop(drop, "d-003.png", _png(30))  # no sidecar: capture time = mtime, seq = mtime in ns
    _drop(drop, "d-004.png", _png(40), {"digit": "seven"})  # not an integer: its row only is rejected
    _drop(drop, "d-005.png", _png(10))  # the same image as d-001 under another name: another observation
    claimed = d.claim()
    assert sorted(f.path.name for f in claimed.files) == [f"d-00{i}.png" for i in range(1, 6)]
    [(raw, files)] = list(d.read_observations(claimed.files, DIGITS, batch_size=100))
    assert len(files) == 5
    r = preprocess(raw, DIGITS, node_id="node-a")
    assert r.accounted() and r.reject_counts == {"bad-type": 1}
    assert r.rejects.column("sample_id").to_pylist() == ["d-004"]
    acc = {row["sample_id"]: row for row in r.accepted.to_pylist()}
    assert acc["d-001"]["digit"] == 7 and acc["d-001"]["seq"] == 5
    assert acc["d-001"]["capture_time"] == datetime(2026, 3, 1, 12, tzinfo=UTC)
    assert acc["d-002"]["digit"] == 3 and acc["d-002"]["capture_time"] == datetime(2026, 3, 1, 12, tzinfo=UTC)
    assert acc["d-003"]["digit"] is None and acc["d-003"]["capture_time"] == datetime.fromtimestamp(NOW - 60, UTC)
    assert acc["d-003"]["seq"] == int((NOW - 60) * 1e9)
    assert acc["d-005"]["image"] == acc["d-001"]["image"] == _png(10)
    assert acc["d-001"]["mean_grey"] == np.float32(np.float32(10) * np.float32(DIGITS.scale))
    for f in files:
        d.mark_read(f, 1)
    assert sorted(p.name for p in (tmp_path / "done").iterdir()) == sorted(
        ["d-001.png", "d-001.json", "d-002.png", "d-002.json", "d-003.png", "d-004.png", "d-004.json", "d-005.png"])
    assert list(drop.iterdir()) == [] and d.counts() == {"read": 5, "rejected": 0, "duplicates": 0}


def test_too_large_wrong_media_and_bad_sidecars_are_moved_aside_with_the_reason(tmp_path: Path) -> None:
    d = _folder(tmp_path)
    drop = tmp_path / "drop"
    _drop(drop, "big.png", b"\x89PNG\r\n\x1a\n" + bytes(5000))
    _drop(drop, "jpeg.png", b"\xff\xd8\xff\xe0 not a png", {"digit": 1})
    _drop(drop, "typo.png", _png(1), {"digt": 1})
    _drop(drop, "naive.png", _png(2), {"capture_time": "2026-03-01T12:00:00"})
    _drop(drop, "junk.png", _png(3), "{not json")
    _drop(drop, "ok.png", _png(4))
    claimed = d.claim()
    assert [f.path.name for f in claimed.files] == ["ok.png"]
    why = claimed.rejected
    assert why["big.png"] == "too-large: 5008 bytes, contract digits_png.v1 allows 4096"
    assert why["jpeg.png"].startswith("bad-file: does not start like image/png")
    assert "unknown fields ['digt']" in why["typo.png"] and why["typo.png"].startswith("bad-sidecar: typo.json")
    assert "has no time zone" in why["naive.png"] and "not JSON" in why["junk.png"]
    rejected = tmp_path / "rejected"
    assert sorted(p.name for p in rejected.iterdir() if not p.name.endswith(".reason.txt")) == sorted(
        ["big.png", "jpeg.png", "jpeg.json", "typo.png", "typo.json", "naive.png", "naive.json", "junk.png",
         "junk.json"])
    for name, reason in why.items():  # each with its reason beside it
        assert (rejected / f"{name}.reason.txt").read_text().strip() == reason
    assert d.counts()["rejected"] == 5


def test_each_file_is_read_once_a_sidecar_waits_for_its_file_and_a_resend_is_a_duplicate(tmp_path: Path) -> None:
    d = _folder(tmp_path)
    drop = tmp_path / "drop"
    _drop(drop, "a.png", _png(5), {"digit": 5})
    (drop / "b.json").write_text(json.dumps({"digit": 6}))  # the sidecar first, its file not yet written
    os.utime(drop / "b.json", (NOW - 60, NOW - 60))
    _drop(drop, "c.png", _png(6), mtime=NOW - 1)  # still settling
    claimed = d.claim()
    assert [f.path.name for f in claimed.files] == ["a.png"] and sorted(claimed.waiting) == ["b.json", "c.png"]
    (drop / "a.png").unlink()  # the bytes were read at claim: reading the batch does not open the file again
    [(raw, _)] = list(d.read_observations(claimed.files, DIGITS, batch_size=10))
    assert raw.column("image").to_pylist() == [_png(5)]
    (drop / "a.png").write_bytes(_png(5))
    os.utime(drop / "a.png", (NOW - 60, NOW - 60))
    d.mark_read(claimed.files[0], 1)
    _drop(drop, "a.png", _png(5))  # the same observation dropped again
    again = d.claim()
    assert again.files == [] and again.duplicates == ["a.png"]
    assert (tmp_path / "done" / "a.png").exists()


def test_observations_are_batched(tmp_path: Path) -> None:
    d = _folder(tmp_path)
    for i in range(25):
        _drop(tmp_path / "drop", f"o{i:02d}.png", _png(i), {"digit": i % 10})
    claimed = d.claim()
    batches = list(d.read_observations(claimed.files, DIGITS, batch_size=10))
    assert [t.num_rows for t, _ in batches] == [10, 10, 5]
    ids = [s for t, _ in batches for s in t.column("sample_id").to_pylist()]
    assert sorted(ids) == [f"o{i:02d}" for i in range(25)]
    assert all(pc.all(pc.equal(t.column("digit"), pc.cast(pc.utf8_slice_codeunits(t.column("sample_id"), 2, 3),
                                                          "int16"))).as_py() for t, _ in batches)


def test_edge_ingest_spools_every_png_of_a_drop_folder_once(stack: object, tmp_path: Path) -> None:
    """The flow on a file kind's drop folder: every valid PNG spooled once under its stem, the bad ones moved
    aside with their reason, a second run reads nothing."""
    from edgehaul.edge.spool import Spool
    from edgehaul.flows.edge_ingest import EdgeIngestParams, edge_ingest

    drop, done = tmp_path / "drop", tmp_path / "done"
    drop.mkdir()
    now = time.time()
    for i in range(130):  # two batches of observation files
        _drop(drop, f"digit-{i:03d}.png", _png(i), {"digit": i % 10}, mtime=now - 60)
    _drop(drop, "huge.png", b"\x89PNG\r\n\x1a\n" + bytes(5000), mtime=now - 60)
    _drop(drop, "gif.png", b"GIF89a....", mtime=now - 60)
    params = EdgeIngestParams(edge_node=None, node_id="node-a", spool_dir=str(tmp_path / "spool"), source="drop",
                              contract="digits_png.v1", source_path=str(drop), done_path=str(done), batch_size=100,
                              result_storage=None)
    first = edge_ingest(params)
    assert first["samples_in"] == 130
    assert sorted(p.name for p in (tmp_path / "rejected").iterdir()) == [
        "gif.png", "gif.png.reason.txt", "huge.png", "huge.png.reason.txt"]
    assert len(list(done.iterdir())) == 260 and list(drop.iterdir()) == []  # each PNG with its sidecar
    assert edge_ingest(params)["samples_in"] == 0
    spool = Spool(tmp_path / "spool", cap_bytes=2**30, emit=lambda *a, **k: True)
    try:
        held = [i for e in spool.pending() + spool.raw_entries() for i in e.manifest.sample_ids]
        assert {e.manifest.contract for e in spool.pending()} == {"digits_png.v1"}
    finally:
        spool.close()
    assert sorted(set(held)) == [f"digit-{i:03d}" for i in range(130)]


def test_a_telemetry_csv_with_one_bad_value_rejects_only_its_row(tmp_path: Path) -> None:
    """A columns kind from an instrument's CSV: one unreadable reading and one out of range reject their rows;
    the batch's other rows go on (one bad value never rejects the valid rows of its batch)."""
    gait = load_contract("daphnet_gait")
    d = DropFolder(tmp_path / "drop", tmp_path / "done", tmp_path / "spool", settle_s=5, clock=lambda: NOW,
                   contract=gait)
    (tmp_path / "drop").mkdir()
    header = ["sample_id", "capture_time", "seq", "is_anomaly", *gait.numeric_columns]
    lines = [",".join(header)]
    for i in range(40):
        values = [str(1000 + i)] * len(gait.numeric_columns)
        if i == 7:
            values[2] = "ERR"
        if i == 9:
            values[0] = "9999"
        lines.append(",".join([f"g{i}", "2026-03-01T12:00:00Z", str(i), str(i % 2), *values]))
    path = tmp_path / "drop" / "run1.csv"
    path.write_text("\n".join(lines) + "\n")
    os.utime(path, (NOW - 60, NOW - 60))
    [f] = d.claim().files
    [raw] = list(d.read(f, gait, batch_size=100))
    r = preprocess(raw, gait, node_id="node-a")
    assert r.accepted.num_rows == 38 and r.accounted()
    assert dict(zip(r.rejects.column("sample_id").to_pylist(), r.rejects.column("reason").to_pylist(),
                    strict=True)) == {"g7": "bad-type", "g9": "out-of-range"}
    assert r.accepted.column("ankle_horiz_fwd").to_pylist()[:2] == [1000.0, 1001.0]
