"""Raw files as instruments write them: identity columns derived where the contract says so, a file missing a
required column rejected as a whole, extra columns reported, NaN reported as `nan`, and the reject ledger
bounded however many rows a bad file brings."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from edgehaul.contracts import Contract, load_contract
from edgehaul.edge.drop_folder import DropFolder, DropRun
from edgehaul.edge.ledger import Ledger
from edgehaul.edge.preprocess import preprocess

NOW = 2_000_000_000.0
GAIT = """
kind: gait_raw
version: 1
columns:
  ankle: {type: float32, unit: mg, min: -5000, max: 5000}
  trunk: {type: float32, unit: mg, min: -5000, max: 5000}
label: {column: is_anomaly, kind: anomaly}
"""
DERIVE = "raw:\n  capture_time: epoch_ms\n  derive: {sample_id: content-hash, capture_time: file-time, seq: row-order}\n"


def _contract(tmp_path: Path, extra: str = "") -> Contract:
    d = tmp_path / f"contracts-{len(extra)}"  # contracts are cached by folder: one folder per text
    d.mkdir(exist_ok=True)
    (d / "gait_raw.v1.yaml").write_text(GAIT + extra)
    return load_contract("gait_raw", 1, d)


def _run(tmp_path: Path, contract: Contract, batch_size: int = 1000) -> tuple[DropRun, list[pa.Table]]:
    df = DropFolder(tmp_path / "drop", tmp_path / "done", tmp_path / "spool", settle_s=5, clock=lambda: NOW,
                    contract=contract)
    run = DropRun(df, contract, batch_size)
    accepted = []
    for t, part in run.batches():
        r = preprocess(t, contract, node_id="node-a")
        accepted.append(r.accepted)
        run.done(part, t.num_rows, r.accepted.num_rows, r.reject_counts)
    df.close()
    return run, accepted


def _drop(tmp_path: Path, name: str, text: str, mtime: float = NOW - 60) -> Path:
    (tmp_path / "drop").mkdir(exist_ok=True)
    p = tmp_path / "drop" / name
    p.write_text(text)
    os.utime(p, (mtime, mtime))
    return p


def test_identity_columns_are_derived_as_the_contract_declares(tmp_path: Path) -> None:
    """A logger's CSV with readings only: seq from row order, capture time from the file's mtime, sample id
    from the row's content (the same reading in another file is the same observation)."""
    c = _contract(tmp_path, DERIVE)
    assert c.required_raw_columns == ("ankle", "trunk")
    _drop(tmp_path, "a.csv", "ankle,trunk\n1,2\n3,4\n5,6\n", mtime=NOW - 60)
    _drop(tmp_path, "b.csv", "trunk,ankle,capture_time\n10,9,1767225600100\n8,7,1767225600200\n", mtime=NOW - 30)
    _drop(tmp_path, "c.csv", "trunk,ankle\n6,5\n", mtime=NOW - 20)  # a reading exported twice
    run, accepted = _run(tmp_path, c, batch_size=2)
    t = pa.concat_tables(accepted).to_pylist()
    rows: dict[tuple[float, float], dict[str, object]] = {}
    for r in t:  # the first of each reading: a.csv's comes before c.csv's
        rows.setdefault((r["ankle"], r["trunk"]), r)
    assert sorted(rows) == [(1.0, 2.0), (3.0, 4.0), (5.0, 6.0), (7.0, 8.0), (9.0, 10.0)]
    assert len(t) == 6 and len({r["sample_id"] for r in t}) == 5  # (5, 6) twice: one sample id
    assert [rows[k]["seq"] for k in [(1.0, 2.0), (3.0, 4.0), (5.0, 6.0)]] == [0, 1, 2]  # across batches of 2
    times = {k: r["capture_time"].timestamp() for k, r in rows.items()}  # type: ignore[attr-defined]
    assert times[(1.0, 2.0)] == NOW - 60  # the file's mtime
    assert times[(7.0, 8.0)] == 1767225600.2  # given in the file, epoch ms
    assert all(str(r["sample_id"]).startswith("row-") and len(str(r["sample_id"])) == 36 for r in rows.values())
    assert run.summary()["derived_columns"] == {"a.csv": ["capture_time", "sample_id", "seq"],
                                                "b.csv": ["sample_id", "seq"],
                                                "c.csv": ["capture_time", "sample_id", "seq"]}
    assert run.summary()["files_read"] == 3


def test_a_file_missing_a_required_column_is_rejected_whole_with_the_reason(tmp_path: Path) -> None:
    """Without a declared derivation, a file lacking sample_id/capture_time/seq is never 'read' with 100% of
    its rows rejected: the file goes to rejected/ naming the columns."""
    c = _contract(tmp_path)
    _drop(tmp_path, "readings.csv", "ankle,trunk\n1,2\n")
    _drop(tmp_path, "ok.csv", "sample_id,capture_time,seq,ankle,trunk\ns1,2026-01-01T00:00:00.100000+00:00,1,1,2\n")
    run, accepted = _run(tmp_path, c)
    why = (tmp_path / "rejected" / "readings.csv.reason.txt").read_text()
    assert "missing required columns ['sample_id', 'capture_time', 'seq']" in why and "derives nothing" in why
    assert sum(t.num_rows for t in accepted) == 1 and run.summary()["files_rejected"] == 1
    assert run.message() is not None and "readings.csv" in (run.message() or "")


def test_extra_columns_are_reported_and_nan_is_reported_as_nan(tmp_path: Path) -> None:
    c = _contract(tmp_path)
    logs: list[str] = []
    _drop(tmp_path, "x.csv", "sample_id,capture_time,seq,ankle,trunk,battery,firmware\n"
                             "s1,2026-01-01T00:00:00Z,1,NaN,2,3.1,v2\n"
                             "s2,2026-01-01T00:00:01Z,2,1,,3.0,v2\n"
                             "s3,2026-01-01T00:00:02Z,3,1,2,2.9,v2\n")
    df = DropFolder(tmp_path / "drop", tmp_path / "done", tmp_path / "spool", settle_s=5, clock=lambda: NOW,
                    contract=c)
    run = DropRun(df, c, 100, logs.append)
    reasons: dict[str, str] = {}
    for t, part in run.batches():
        assert "battery" not in t.column_names  # not kept: the bundle schema is the contract's
        r = preprocess(t, c, node_id="node-a")
        reasons.update(zip(r.rejects.column("sample_id").to_pylist(), r.rejects.column("detail").to_pylist(),
                           strict=True))
        assert dict(zip(r.rejects.column("sample_id").to_pylist(), r.rejects.column("reason").to_pylist(),
                        strict=True)) == {"s1": "nan", "s2": "missing-field"}
        run.done(part, t.num_rows, r.accepted.num_rows, r.reject_counts)
    assert "nan" in reasons["s1"] and run.summary()["extra_columns"] == {"x.csv": ["battery", "firmware"]}
    assert any("2 columns the contract does not read" in m and "battery" in m for m in logs)
    # 2 of 3 rows rejected: read, and named in the run's message as mostly rejected
    assert run.summary()["files_read"] == 1 and "x.csv: read, 2 of 3 rows rejected" in (run.message() or "")


def test_a_file_whose_every_row_is_rejected_is_not_reported_read(tmp_path: Path) -> None:
    c = _contract(tmp_path)
    _drop(tmp_path, "bad-times.csv", "sample_id,capture_time,seq,ankle,trunk\n"
                                     + "".join(f"s{i},yesterday,{i},1,2\n" for i in range(5)))
    run, _ = _run(tmp_path, c)
    why = (tmp_path / "rejected" / "bad-times.csv.reason.txt").read_text()
    assert why.startswith("all 5 rows rejected at preprocessing: bad-type 5")
    assert run.summary()["files_read"] == 0 and not (tmp_path / "done").exists()


def test_the_reject_ledger_stays_within_its_bound_and_keeps_exact_counts(tmp_path: Path) -> None:
    bound = 256 * 1024
    ledger = Ledger(tmp_path / "l.sqlite", max_bytes=bound, clock=iter(range(10**6)).__next__)
    n, batch = 0, 1000
    for b in range(60):  # 60,000 rejects, each with a detail: far more than 256 KiB
        rows = [(f"b{b}-{i}", "bad-type", f"column 'capture_time': 'x{i}' is not a time") for i in range(batch)]
        ledger.record_many(rows, stage="preprocess")
        n += batch
        assert ledger.used_bytes() <= bound
    assert ledger.counts() == {("preprocess", "bad-type"): n} and ledger.total() == n
    assert sum(ledger.evicted().values()) > n // 2
    newest = ledger.lookup([f"b59-{i}" for i in range(batch)])
    assert len(newest) == batch and not ledger.lookup([f"b0-{i}" for i in range(batch)])  # the oldest went
    ledger.close()
    assert os.path.getsize(tmp_path / "l.sqlite") <= 2 * bound


def test_the_bounded_ledger_names_spool_drops_longest(tmp_path: Path) -> None:
    """Rejected input rows are evicted before samples the spool accepted and then dropped: those stay named."""
    ledger = Ledger(tmp_path / "l.sqlite", max_bytes=128 * 1024, clock=iter(range(10**6)).__next__)
    dropped = [f"kept-{i}" for i in range(300)]
    ledger.record_many([(s, "ttl-expired", "bundle b1") for s in dropped], stage="spool")  # the oldest rows
    for b in range(30):
        ledger.record_many([(f"r{b}-{i}", "bad-type", "not a time") for i in range(1000)], stage="preprocess")
    assert ledger.evicted() and all(stage == "preprocess" for stage, _ in ledger.evicted())
    assert len(ledger.lookup(dropped)) == len(dropped)
    assert ledger.counts()[("preprocess", "bad-type")] == 30_000
    ledger.close()


def test_the_ledger_counts_against_the_spool_cap(tmp_path: Path) -> None:
    from edgehaul.edge.spool import LEDGER_FREE_BYTES, Spool

    s = Spool(tmp_path / "spool", cap_bytes=100 * 2**20, emit=lambda *a, **k: True)
    base = s.usage().used_bytes
    s.ledger.record_many([(f"s{i}", "bad-type", "x" * 200) for i in range(30_000)], stage="preprocess")
    used = s.ledger.used_bytes()
    assert used > LEDGER_FREE_BYTES and s.usage().used_bytes == base + used - LEDGER_FREE_BYTES
    assert s.ledger.max_bytes == 5 * 2**20 and used <= s.ledger.max_bytes
    s.close()


# ---- the property: random files as instruments and people leave them ------------------------------------------

GOOD_HEADER = "sample_id,capture_time,seq,ankle,trunk"


def _good_csv(seed: int, rows: int) -> str:
    return GOOD_HEADER + "\n" + "".join(
        f"f{seed}-{i},2026-01-01T00:00:{i % 60:02d}.{i % 1000:03d}000+00:00,{i},{i % 100},{seed % 100}\n"
        for i in range(rows))


def _bad(kind: str, seed: int, rows: int) -> tuple[str, bytes]:
    """(suffix, bytes) of a file that must be rejected."""
    good = _good_csv(seed, max(rows, 2)).encode()
    if kind == "truncated":
        lines = good.splitlines()
        return ".csv", b"\n".join([*lines[:-1], lines[-1][:12]]) + b"\n"
    if kind == "non-utf8":
        return ".csv", good.replace(f"f{seed}-0".encode(), f"f\xe9{seed}".encode("latin-1"))
    if kind == "wrong-schema":
        return ".csv", b"when,reading\n" + b"".join(b"%d,%d\n" % (i, i) for i in range(rows))
    if kind == "empty":
        return ".csv", b""
    if kind == "bad-parquet":
        return ".parquet", b"PAR1" + os.urandom(32) + b"PAR1"
    if kind == "all-rows-bad":
        return ".csv", (GOOD_HEADER + "\n" + "".join(f"z{seed}-{i},never,{i},1,2\n" for i in range(rows))).encode()
    raise AssertionError(kind)


BAD_KINDS = ["truncated", "non-utf8", "wrong-schema", "empty", "bad-parquet", "all-rows-bad"]
FILES = st.lists(st.tuples(st.sampled_from(["good", "good-parquet", "huge", *BAD_KINDS, "renamed"]),
                           st.integers(1, 40)), min_size=1, max_size=10)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(files=FILES, runs_between=st.integers(1, 3))
@example(files=[("wrong-schema", 1), ("wrong-schema", 1)], runs_between=1)  # twins in one run: both rejected
def test_random_files_every_good_one_read_once_every_bad_one_rejected_no_run_fails(
        tmp_path_factory: pytest.TempPathFactory, files: list[tuple[str, int]], runs_between: int) -> None:
    """Good CSV and Parquet files, a huge one (many batches), broken ones of every sort, and files written under a
    partial name then renamed between runs: over several runs no run raises, every good file's rows are read
    exactly once, every bad file ends in rejected/ with a reason, and nothing is left behind."""
    tmp = tmp_path_factory.mktemp("drops")
    drop = tmp / "drop"
    drop.mkdir()
    want: set[str] = set()
    bad: set[str] = set()
    renames: list[Path] = []
    for i, (kind, rows) in enumerate(files):
        name = f"{i:02d}-{kind}"
        if kind in ("good", "renamed", "huge"):
            n = rows * 300 if kind == "huge" else rows
            text = _good_csv(i, n)
            want |= {f"f{i}-{j}" for j in range(n)}
            path = drop / (f"{name}.csv.part" if kind == "renamed" else f"{name}.csv")
            path.write_text(text)
            if kind == "renamed":
                renames.append(path)
        elif kind == "good-parquet":
            pq.write_table(pa.table({"sample_id": [f"f{i}-{j}" for j in range(rows)],
                                     "capture_time": [1767225600000 + j for j in range(rows)],
                                     "seq": list(range(rows)), "ankle": [1.5] * rows, "trunk": [2.5] * rows,
                                     "extra": ["x"] * rows}), drop / f"{name}.parquet")
            want |= {f"f{i}-{j}" for j in range(rows)}
        else:
            suffix, data = _bad(kind, i, rows)
            (drop / f"{name}{suffix}").write_bytes(data)
            bad.add(f"{name}{suffix}")
    for p in drop.iterdir():
        os.utime(p, (NOW - 60, NOW - 60))
    c = _contract(tmp, "raw: {capture_time: epoch_ms}\n")  # Parquet gives epoch ms, CSV ISO: both read
    got: list[str] = []
    for r in range(runs_between + 1):
        if r == runs_between:  # the writer finishes: its rename, then the next run reads it
            for p in renames:
                p.rename(p.with_suffix(""))
        _, accepted = _run(tmp, c, batch_size=500)
        got += [i for t in accepted for i in t.column("sample_id").to_pylist()]
    assert sorted(got) == sorted(want)  # each good row exactly once
    rejected = tmp / "rejected"
    in_rejected = {p.name for p in rejected.iterdir()} if rejected.exists() else set()
    assert {n for n in in_rejected if not n.endswith(".reason.txt")} == bad
    for name in bad:
        assert (rejected / f"{name}.reason.txt").read_text().strip()
    assert not list(drop.iterdir())


def test_the_raw_files_docs_contracts_shows_read_as_it_says(tmp_path: Path) -> None:
    """docs/CONTRACTS.md's raw CSVs and `raw:` section: the first reads one row and rejects the NaN row as `nan`;
    the readings-only one reads under the derivations the doc declares."""
    import yaml

    from edgehaul.platform.settings import get_settings

    doc = (Path(__file__).parents[2] / "docs" / "CONTRACTS.md").read_text()
    full, readings = re.findall(r"```csv\n(.*?)```", doc, re.S)
    raw_yaml = yaml.safe_load(re.search(r"```yaml\n(raw:\n.*?)```", doc, re.S).group(1))  # type: ignore[union-attr]
    assert raw_yaml["raw"]["derive"] == {"sample_id": "content-hash", "capture_time": "file-time", "seq": "row-order"}
    gait = get_settings().contracts_dir / "daphnet_gait.v1.yaml"
    base = yaml.safe_load(gait.read_text())
    for name, text, extra in [("full", full, None), ("readings", readings, {"derive": raw_yaml["raw"]["derive"]})]:
        d = tmp_path / name
        (d / "contracts").mkdir(parents=True)
        (d / "contracts" / "daphnet_gait.v1.yaml").write_text(yaml.safe_dump({**base, **({"raw": extra} if extra else {})}))
        c = load_contract("daphnet_gait", 1, d / "contracts")
        _drop(d, "x.csv", text)
        run, accepted = _run(d, c)
        ids = [i for t in accepted for i in t.column("sample_id").to_pylist()]
        assert run.summary()["files_read"] == 1, run.summary()
        if name == "full":
            assert ids == ["g-000001"] and run.message() is None  # half rejected is not "most"
        else:
            assert len(ids) == 1 and ids[0].startswith("row-")


@pytest.mark.parametrize(("raw", "error"), [
    ("raw: {capture_time: epoch_ns}\n", "raw.capture_time must be one of"),
    ("raw: {derive: {seq: file-time}}\n", "raw.derive.seq must be one of ['row-order']"),
    ("raw: {derive: {label: row-order}}\n", "raw.derive has unknown keys ['label']"),
    ("raw: {time: iso8601}\n", "raw has unknown keys ['time']"),
])
def test_a_malformed_raw_section_names_its_field(tmp_path: Path, raw: str, error: str) -> None:
    from edgehaul.contracts import ContractInvalid

    with pytest.raises(ContractInvalid, match=re.escape(error)):
        _contract(tmp_path, raw)


def test_a_drop_rejected_event_is_a_level_2_alert() -> None:
    """The automation that pages on rejected drop files: one per node resource, level 2, naming the node and
    the run's message."""
    import uuid

    from edgehaul import events
    from edgehaul.services.automations import DROP_REJECTED_NAME, AlertPolicy, alert_automations

    [a] = [a for a in alert_automations(AlertPolicy(), uuid.uuid4()) if a.name == DROP_REJECTED_NAME]
    assert a.trigger.expect == {events.DROP_REJECTED}  # type: ignore[union-attr]
    body = a.actions[0].body  # type: ignore[union-attr]
    assert '"level": 2' in body and "event.payload.message" in body and "event.payload.node_id" in body
    assert events.DROP_REJECTED in events.NODE_FORWARDED  # a node's alert, forwarded from its outbox


def test_a_file_renamed_or_appended_while_a_run_reads_it_is_read_once_later(tmp_path: Path) -> None:
    """Claimed, then renamed before it is read (a writer's late rename), or appended to while read: neither
    rejected nor recorded; the next run reads it whole, once."""
    c = _contract(tmp_path)
    _drop(tmp_path, "a.csv", _good_csv(1, 5))
    _drop(tmp_path, "b.csv", _good_csv(2, 5))
    df = DropFolder(tmp_path / "drop", tmp_path / "done", tmp_path / "spool", settle_s=5, clock=lambda: NOW,
                    contract=c)
    run = DropRun(df, c, 100)
    (tmp_path / "drop" / "a.csv").rename(tmp_path / "drop" / "a-final.csv")
    for t, part in run.batches():
        with open(tmp_path / "drop" / "b.csv", "a") as f:  # the instrument appends while the node reads
            f.write("f2-5,2026-01-01T00:00:05Z,5,1,2\n")
        os.utime(tmp_path / "drop" / "b.csv", (NOW - 60, NOW - 60))
        run.done(part, t.num_rows, t.num_rows, {})
    assert {o.name: o.outcome for o in run.outcomes.values()} == {"a.csv": "changed", "b.csv": "changed"}
    assert not (tmp_path / "rejected").exists() and df.counts()["read"] == 0
    df.close()
    run2, accepted = _run(tmp_path, c)
    ids = sorted(i for t in accepted for i in t.column("sample_id").to_pylist())
    assert ids == sorted([f"f1-{i}" for i in range(5)] + [f"f2-{i}" for i in range(6)])
    assert run2.summary()["files_read"] == 2 and not list((tmp_path / "drop").iterdir())


@pytest.mark.integration
def test_the_drop_rejected_alert_reaches_the_receiver(stack: object) -> None:
    """Applied like the other alerts, the automation turns a run's edgehaul.drop.rejected event into a level-2
    notification naming the node and the files (the message as the run's state has it)."""
    import uuid

    from edgehaul.edge.drop_folder import emit_drop_rejected
    from edgehaul.services.automations import AlertPolicy, apply_automations
    from tests.prefect_cleanup import delete_automations
    from tests.services.test_automations import Receiver

    r = Receiver()
    applied = []
    try:
        applied = apply_automations(AlertPolicy(), webhook_url=r.url, token="t0k3n")
        node = f"node-{uuid.uuid4().hex[:8]}"
        message = '1 of 2 drop files rejected: cut.csv: not readable as csv: CSV parse error: "Expected 13 columns"'
        r.probe(lambda: emit_drop_rejected(node, message, {"cut.csv": "not readable as csv"},
                                           {"files_read": 1, "files_rejected": 1}),
                lambda b: b.get("node") == node, every=2)
        b = r.wait_for(lambda b: b.get("node") == node)
        assert b["level"] == 2 and b["alert"] == "drop-rejected" and b["message"] == message
        assert "[edgehaul L2] drop-rejected" in b["subject"]
    finally:
        # no alert automation left pointing at a receiver that is gone: every later failure would retry it
        delete_automations([a.id for a in applied])
        r.server.shutdown()
