"""Drop folder: Parquet, Arrow IPC and CSV from an instrument's output folder; partial files
never read; each file read once (by content), recorded in the node's source log before it moves to done/."""

from __future__ import annotations

import base64
import os
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgehaul.contracts import load_contract
from edgehaul.edge.drop_folder import DropFolder, is_partial_name
from edgehaul.edge.landsat import generate
from edgehaul.edge.preprocess import preprocess
from tests.waiting import wait_for

C = load_contract("landsat_patch")


class Clock:
    def __init__(self) -> None:
        self.t = 2_000_000_000.0

    def __call__(self) -> float:
        return self.t


def _raw(n: int = 60, seed: int = 1) -> pa.Table:
    """A file's observations: the same seed, the same content; another seed, other sample ids."""
    return next(generate(n, "node-a", seed=seed, batch_size=n, start_seq=seed * 10_000))


def _write(t: pa.Table, path: Path, fmt: str) -> None:
    if fmt == "parquet":
        pq.write_table(t, path)
    elif fmt == "ipc-file":
        with ipc.new_file(path, t.schema) as w:
            w.write_table(t)
    elif fmt == "ipc-stream":
        with ipc.new_stream(path, t.schema) as w:
            w.write_table(t)
    else:  # csv: binary as base64, timestamps as ISO text (what a logger would write)
        cols = {n: t.column(n).to_pylist() for n in t.column_names}
        cols["pixels"] = [base64.b64encode(b).decode() for b in cols["pixels"]]
        cols["capture_time"] = [v.isoformat() for v in cols["capture_time"]]
        pacsv.write_csv(pa.table(cols), path)


def _folder(tmp_path: Path, clock: Clock) -> DropFolder:
    (tmp_path / "drop").mkdir(exist_ok=True)
    return DropFolder(tmp_path / "drop", tmp_path / "done", tmp_path / "spool", settle_s=5, clock=clock)


def _age(path: Path, clock: Clock, s: float) -> None:
    os.utime(path, (clock.t - s, clock.t - s))


def _ingest(df: DropFolder) -> list[str]:
    """One run: read every claimed file, preprocess, record; returns accepted sample ids."""
    ids: list[str] = []
    for f in df.claim().files:
        rows = 0
        for t in df.read(f, C, batch_size=25):
            ids += preprocess(t, C, node_id="node-a").accepted.column("sample_id").to_pylist()
            rows += t.num_rows
        assert df.unchanged(f)
        df.mark_read(f, rows)
    return ids


@pytest.mark.parametrize("fmt", ["parquet", "ipc-file", "ipc-stream", "csv"])
def test_each_format_gives_the_same_rows_as_the_instrument_wrote(tmp_path: Path, fmt: str) -> None:
    clock, raw = Clock(), _raw()
    suffix = {"parquet": ".parquet", "ipc-file": ".arrow", "ipc-stream": ".ipc", "csv": ".csv"}[fmt]
    p = tmp_path / "drop" / f"obs{suffix}"
    p.parent.mkdir()
    _write(raw, p, fmt)
    _age(p, clock, 60)
    df = _folder(tmp_path, clock)
    want = preprocess(raw, C, node_id="node-a").accepted
    ids = _ingest(df)
    assert sorted(ids) == sorted(want.column("sample_id").to_pylist()) and len(ids) == raw.num_rows
    assert not p.exists() and (tmp_path / "done" / p.name).exists() and df.counts()["read"] == 1


def test_a_bad_csv_value_rejects_its_row_not_the_file(tmp_path: Path) -> None:
    clock, raw = Clock(), _raw(40)
    p = tmp_path / "drop" / "obs.csv"
    p.parent.mkdir()
    _write(raw, p, "csv")
    lines = p.read_text().splitlines()
    lines[3] = lines[3].replace(lines[3].split(",")[-1], '"not base64!"')  # the pixels value of one row
    p.write_text("\n".join(lines) + "\n")
    _age(p, clock, 60)
    assert len(_ingest(_folder(tmp_path, clock))) == 39


def test_partial_and_settling_files_wait_then_are_read_once(tmp_path: Path) -> None:
    clock = Clock()
    df = _folder(tmp_path, clock)
    drop = tmp_path / "drop"
    for name in (".obs1.parquet", "obs2.parquet.tmp", "obs3.parquet.part", "~obs4.parquet"):
        _write(_raw(10, seed=len(name)), drop / name, "parquet")
        _age(drop / name, clock, 3600)
    fresh = drop / "obs5.parquet"
    _write(_raw(10, seed=5), fresh, "parquet")
    _age(fresh, clock, 1)  # written a second ago: maybe still being appended
    c = df.claim()
    assert c.files == [] and sorted(c.waiting) == sorted(p.name for p in drop.iterdir())
    (drop / "obs2.parquet.tmp").rename(drop / "obs2.parquet")  # the writer's final rename
    clock.t += 10
    assert len(_ingest(df)) == 20  # obs2 and obs5
    assert _ingest(df) == []  # nothing is read twice
    assert {p.name for p in drop.iterdir()} == {".obs1.parquet", "obs3.parquet.part", "~obs4.parquet"}


def test_same_content_under_another_name_and_a_crash_before_the_move(tmp_path: Path) -> None:
    clock = Clock()
    df = _folder(tmp_path, clock)
    drop = tmp_path / "drop"
    _write(_raw(30, seed=7), drop / "a.parquet", "parquet")
    _age(drop / "a.parquet", clock, 60)
    assert len(_ingest(df)) == 30
    (tmp_path / "done" / "a.parquet").rename(drop / "a-resent.parquet")  # the instrument sends it again
    _age(drop / "a-resent.parquet", clock, 60)
    c = df.claim()
    assert c.files == [] and c.duplicates == ["a-resent.parquet"] and not (drop / "a-resent.parquet").exists()
    # a run that recorded a file and died before moving it: the next run moves it, unread
    _write(_raw(20, seed=8), drop / "b.parquet", "parquet")
    _age(drop / "b.parquet", clock, 60)
    f = df.claim().files[0]
    df._record(f.path.name, f.sha256, f.size, 20, "read", "")
    assert _ingest(df) == [] and (tmp_path / "done" / "b.parquet").exists()
    assert df.counts() == {"read": 2, "rejected": 0, "duplicates": 2}


def test_an_unknown_format_is_moved_aside_with_its_reason(tmp_path: Path) -> None:
    clock = Clock()
    df = _folder(tmp_path, clock)
    p = tmp_path / "drop" / "frame.tiff"
    p.write_bytes(b"II*\x00" + b"\x00" * 64)
    _age(p, clock, 60)
    c = df.claim()
    assert "unknown format .tiff" in c.rejected["frame.tiff"] and (tmp_path / "rejected" / "frame.tiff").exists()
    assert df.counts()["rejected"] == 1


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(drops=st.lists(st.tuples(st.integers(0, 5), st.booleans(), st.integers(0, 2)), min_size=1, max_size=12))
def test_every_distinct_content_is_read_exactly_once(tmp_path_factory: pytest.TempPathFactory,
                                                     drops: list[tuple[int, bool, int]]) -> None:
    """Drops of (content seed, written as a partial name first, runs before it is renamed), over several runs:
    each distinct content is read once, every file ends in done/ or still waits under a partial name."""
    tmp = tmp_path_factory.mktemp("prop")
    clock = Clock()
    df = _folder(tmp, clock)
    drop = tmp / "drop"
    pending: list[tuple[Path, int]] = []
    ids: list[str] = []
    for i, (seed, partial, delay) in enumerate(drops):
        name = f"f{i}.parquet"
        path = drop / (f"{name}.tmp" if partial else name)
        _write(_raw(5, seed=100 + seed), path, "parquet")
        _age(path, clock, 60)
        if partial:
            pending.append((path, delay))
        ids += _ingest(df)
        for j, (pp, d) in enumerate(pending):
            if d == 0 and pp.exists():
                pp.rename(pp.with_suffix(""))
                _age(pp.with_suffix(""), clock, 60)
            pending[j] = (pp, d - 1)
        clock.t += 1
    for pp, _ in pending:
        if pp.exists():
            pp.rename(pp.with_suffix(""))
            _age(pp.with_suffix(""), clock, 60)
    ids += _ingest(df)
    distinct = {s for s, _, _ in drops}
    assert sorted(ids) == sorted(i for s in distinct for i in _raw(5, seed=100 + s).column("sample_id").to_pylist())
    assert not any(drop.iterdir()) and len(list((tmp / "done").iterdir())) == len(drops)
    df.close()


def _bad_files(drop: Path) -> dict[str, str]:
    """Files as broken instruments leave them -> a phrase of the reason each must be rejected with."""
    good = drop / "tmp-src.csv"
    _write(_raw(10, seed=41), good, "csv")
    text = good.read_bytes()
    good.unlink()
    (drop / "latin1.csv").write_bytes(text.replace(b"node-a", "nöde".encode("latin-1"), 1))
    lines = text.splitlines()
    (drop / "cut.csv").write_bytes(b"\n".join([*lines[:-1], lines[-1][:40]]) + b"\n")  # cut mid-write
    (drop / "broken.parquet").write_bytes(b"PAR1" + bytes(100) + b"PAR1")
    (drop / "empty.csv").write_bytes(b"")
    pq.write_table(pa.table({"reading": [1.0, 2.0], "when": ["a", "b"]}), drop / "other-schema.parquet")
    return {"latin1.csv": "not UTF-8", "cut.csv": "columns", "broken.parquet": "not readable as parquet",
            "empty.csv": "empty file", "other-schema.parquet": "missing required columns"}


def test_an_unreadable_file_is_rejected_with_its_reason_and_the_others_are_read(tmp_path: Path) -> None:
    """One bad file never blocks the folder: each bad one goes to rejected/ with `<name>.reason.txt`, the good
    ones behind it are read, and the source log says which is which."""
    from edgehaul.edge.drop_folder import DropRun

    clock = Clock()
    df = _folder(tmp_path, clock)
    drop = tmp_path / "drop"
    bad = _bad_files(drop)
    _write(_raw(30, seed=42), drop / "good.parquet", "parquet")
    _write(_raw(20, seed=43), drop / "good.csv", "csv")
    for p in drop.iterdir():
        _age(p, clock, 60)
    run = DropRun(df, C, batch_size=25)
    ids = []
    for t, part in run.batches():
        r = preprocess(t, C, node_id="node-a")
        ids += r.accepted.column("sample_id").to_pylist()
        run.done(part, t.num_rows, r.accepted.num_rows, r.reject_counts)
    assert len(ids) == 50 and {p.name for p in (tmp_path / "done").iterdir()} == {"good.parquet", "good.csv"}
    summary = run.summary()
    assert summary["files_read"] == 2 and summary["files_rejected"] == len(bad)
    rejected = tmp_path / "rejected"
    for name, phrase in bad.items():
        assert (rejected / name).exists(), name
        why = (rejected / f"{name}.reason.txt").read_text()
        assert phrase in why and summary["rejected_files"][name] == why.strip(), (name, why)
    msg = run.message()
    assert msg is not None and msg.startswith(f"{len(bad)} of {len(bad) + 2} drop files rejected")
    assert all(name in msg for name in bad)
    assert df.counts() == {"read": 2, "rejected": len(bad), "duplicates": 0}
    assert not list(drop.iterdir())


def _assert_drop_alert(stack: object, node_id: str, names: set[str]) -> None:
    """The run's level-2 edgehaul.drop.rejected event reached the Prefect API, naming each file."""
    import httpx
    from prefect.events.worker import EventsWorker

    from tests.conftest import api_auth

    EventsWorker.drain_all()
    api = stack.prefect_api_url  # type: ignore[attr-defined]
    evs: list[dict[str, object]] = wait_for(lambda: httpx.post(f"{api}/events/filter", timeout=10, auth=api_auth(), json={
        "filter": {"event": {"name": ["edgehaul.drop.rejected"]}, "resource": {"id": [f"edgehaul.node.{node_id}"]}},
        "limit": 5}).json().get("events", []), 15, "an edgehaul.drop.rejected event", interval=0.5)
    payload = evs[0]["payload"]
    assert isinstance(payload, dict) and payload["level"] == 2 and set(payload["files"]) == names


def test_partial_names() -> None:
    assert all(map(is_partial_name, [".x.parquet", "~x.csv", "x.csv.tmp", "x.PART", "x.parquet.inprogress"]))
    assert not any(map(is_partial_name, ["x.parquet", "x.csv", "tmp.arrow"]))


@pytest.mark.integration
def test_edge_ingest_reads_a_drop_folder_once(stack: object, tmp_path: Path) -> None:
    """The flow on a node's drop folder: two formats read, a file still being written left alone, nothing read
    twice by the next run, every sample spooled once."""
    from edgehaul.edge.spool import Spool
    from edgehaul.flows.edge_ingest import EdgeIngestParams, edge_ingest

    drop, done = tmp_path / "drop", tmp_path / "done"
    drop.mkdir()
    a, b, c = _raw(120, seed=31), _raw(80, seed=32), _raw(50, seed=33)
    _write(a, drop / "a.parquet", "parquet")
    _write(b, drop / "b.csv", "csv")
    _write(c, drop / "c.arrow.part", "ipc-file")  # the instrument is still writing it
    for p in drop.iterdir():
        os.utime(p, (p.stat().st_mtime - 60, p.stat().st_mtime - 60))
    params = EdgeIngestParams(edge_node=None, node_id="node-a", spool_dir=str(tmp_path / "spool"), source="drop",
                              source_path=str(drop), done_path=str(done), batch_size=100, result_storage=None)
    first = edge_ingest(params)
    assert first["samples_in"] == 200 and {p.name for p in done.iterdir()} == {"a.parquet", "b.csv"}
    (drop / "c.arrow.part").rename(drop / "c.arrow")
    os.utime(drop / "c.arrow", (time.time() - 60, time.time() - 60))
    assert edge_ingest(params)["samples_in"] == 50  # only the file that was finished since
    assert edge_ingest(params)["samples_in"] == 0
    spool = Spool(tmp_path / "spool", cap_bytes=2**30, emit=lambda *a, **k: True)
    try:
        held = [i for e in spool.pending() + spool.raw_entries() for i in e.manifest.sample_ids]
    finally:
        spool.close()
    want = [i for t in (a, b, c) for i in t.column("sample_id").to_pylist()]
    assert sorted(set(held)) == sorted(want)


@pytest.mark.integration
def test_edge_ingest_goes_on_past_unreadable_files_and_says_so(stack: object, tmp_path: Path) -> None:
    """A run over a folder with broken files beside good ones completes: the good files are spooled, each bad
    one is in rejected/ with its reason, and the run's final state message names them; the next run has
    nothing left to trip on."""
    from edgehaul.edge.spool import Spool
    from edgehaul.flows.edge_ingest import EdgeIngestParams, edge_ingest

    drop, done = tmp_path / "drop", tmp_path / "done"
    drop.mkdir()
    bad = _bad_files(drop)
    good = _raw(40, seed=51)
    _write(good, drop / "zz-good.parquet", "parquet")  # after the bad ones in mtime order
    for p in drop.iterdir():
        os.utime(p, (time.time() - 60, time.time() - 60))
    os.utime(drop / "zz-good.parquet", (time.time() - 30, time.time() - 30))
    params = EdgeIngestParams(edge_node=None, node_id="node-a", spool_dir=str(tmp_path / "spool"), source="drop",
                              source_path=str(drop), done_path=str(done), batch_size=100, result_storage=None)
    state = edge_ingest(params, return_state=True)
    assert state.is_completed(), state.message
    out = state.result()
    assert out["samples_in"] == 40 and out["files_read"] == 1 and out["files_rejected"] == len(bad)
    assert state.message is not None and all(name in state.message for name in bad)
    assert set(out["rejected_files"]) == set(bad) and [p.name for p in done.iterdir()] == ["zz-good.parquet"]
    assert {p.name for p in (tmp_path / "rejected").iterdir()} == {n for b in bad for n in (b, f"{b}.reason.txt")}
    _assert_drop_alert(stack, "node-a", set(bad))
    again = edge_ingest(params, return_state=True)
    assert again.is_completed() and again.message in (None, "") and again.result()["samples_in"] == 0
    # a node-local run: the alert goes to the node's outbox (forwarded when in contact), at alert priority
    from edgehaul.edge.outbox import PRIO_ALERT_L2, node_outbox

    (drop / "late.csv").write_bytes(b"\xff\xfe not text")
    os.utime(drop / "late.csv", (time.time() - 60, time.time() - 60))
    local = edge_ingest(params.model_copy(update={"route_events_to_outbox": True}), return_state=True)
    assert local.is_completed() and "late.csv" in (local.message or "")
    box = node_outbox(str(tmp_path / "spool"), "node-a")
    try:
        [alert] = [e for e in box.peek(100) if e.event == "edgehaul.drop.rejected"]
    finally:
        box.close()
    assert alert.priority == PRIO_ALERT_L2 and alert.payload["level"] == 2
    assert list(alert.payload["files"]) == ["late.csv"] and "not UTF-8" in alert.payload["files"]["late.csv"]
    spool = Spool(tmp_path / "spool", cap_bytes=2**30, emit=lambda *a, **k: True)
    try:
        held = {i for e in spool.pending() + spool.raw_entries() for i in e.manifest.sample_ids}
    finally:
        spool.close()
    assert held == set(good.column("sample_id").to_pylist())
