"""Fault drills (edgehaul_dev.drills): every drill, EDGEHAUL_DRILL_TRIALS trials each (4 in the suite,
50 in `make drills`), zero samples lost and zero duplicated by sample id. Runs against its own
SeaweedFS (the store-down drill stops it). The drill code is read with `ast` to check that it drives
the product's own entry points and holds no copy of a product stage."""

from __future__ import annotations

import ast
import os
import uuid
from pathlib import Path

import pytest

import edgehaul
from edgehaul_dev import drills
from edgehaul_dev.drills import pipeline

DRILL_FILES = sorted(Path(drills.__file__).parent.glob("*.py"))
PRODUCT = Path(edgehaul.__file__).parent

# What a drill trial must call, and the product module each name must come from: the functions and
# classes the flows' tasks run (edge ingest, spool, uplink, core ingest's steps, the trainer's launch).
ENTRY_POINTS = {
    "ingest_batch": "edgehaul.edge.batch",
    "Spool": "edgehaul.edge.spool",
    "Drainer": "edgehaul.uplink.transfer",
    "Uplink": "edgehaul.uplink.transfer",
    "RetryQueue": "edgehaul.uplink.retry_queue",
    "ingest.read_manifests": "edgehaul.core.ingest",
    "ingest.unreadable": "edgehaul.core.ingest",
    "ingest.validate_landed_many": "edgehaul.core.ingest",
    "ingest.quarantine_rejected": "edgehaul.core.ingest",
    "ingest.commit_validated": "edgehaul.core.ingest",
    "launch.run": "edgehaul.training.launch",
    "trainer.TrainConfig": "edgehaul.training.trainer",
    "CheckpointStore": "edgehaul.training.checkpoints",
}

# Names whose use in the drills would mean a stage done by hand: Delta writes, GE runs, quarantine
# moves or commits below core ingest's steps, a training loop of their own.
FORBIDDEN = {
    "write_deltalake", "DeltaTable", "deltalake", "great_expectations", "run_expectations", "run_expectations_batch",
    "commit_bundles", "ValidatedBundle", "quarantine_bundle", "read_bundle", "claim_bundles", "preprocess",
    "assign", "Batcher", "backward", "zero_grad", "optim", "torch.optim", "state_dict", "load_state_dict", "torch.save",
}
ALLOWED = {("env.py", "preprocess")}  # the pool fixtures (`_rows`): bundles with chosen tiers, written once


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else node.attr
    return ""


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _calls(tree: ast.AST) -> set[str]:
    return {_dotted(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}


def _imports(tree: ast.AST) -> dict[str, str]:
    """Local name -> the module it was imported from (`from m import x`: x -> m; `import m`: m -> m)."""
    out = {}
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and n.module:
            for a in n.names:
                out[a.asname or a.name] = n.module
                out[f"{n.module}.{a.name}"] = n.module
        elif isinstance(n, ast.Import):
            for a in n.names:
                out[a.asname or a.name] = a.name
    return out


def _refs(tree: ast.AST) -> set[str]:
    """Every name and dotted attribute the code uses (called, or handed on as a callable)."""
    return {_dotted(n) for n in ast.walk(tree) if isinstance(n, ast.Name | ast.Attribute)}


def _names(tree: ast.AST) -> set[str]:
    """Every identifier and attribute used, and every name and module imported (dotted and by part)."""
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.update({n.attr, _dotted(n)})
        elif isinstance(n, ast.ImportFrom):
            mod = n.module or ""
            out.update({mod, mod.split(".")[0], *(a.name for a in n.names)})
        elif isinstance(n, ast.Import):
            out.update({p for a in n.names for p in (a.name, a.name.split(".")[0])})
    return out


def test_the_drills_call_the_products_entry_points() -> None:
    used: set[str] = set()
    imported: dict[str, str] = {}
    for f in DRILL_FILES:
        tree = _parse(f)
        used |= _refs(tree)
        imported |= _imports(tree)
    for name, module in ENTRY_POINTS.items():
        assert name in used, f"no drill calls {name} ({module})"
        head = name.split(".")[0]
        source = imported.get(head, "")
        assert source == module or f"{source}.{head}" == module, f"{name} comes from {source!r}, not {module}"


def test_the_drills_hold_no_copy_of_a_product_stage() -> None:
    for f in DRILL_FILES:
        found = {n for n in _names(_parse(f)) & FORBIDDEN if (f.name, n) not in ALLOWED}
        assert not found, f"{f.name} uses {sorted(found)}: a stage done by hand instead of the product's entry point"


def test_the_core_tasks_and_the_drills_share_one_implementation() -> None:
    # Each core ingest task's body is the plain function the drills call; the edge task runs the
    # edge ingest_batch; the training task launches through launch.run.
    bodies = {n.name: _calls(n) for n in ast.walk(_parse(PRODUCT / "tasks" / "core.py"))
              if isinstance(n, ast.FunctionDef)}
    assert "ingest.read_manifests" in bodies["read_manifests_task"]
    assert "ingest.validate_landed_many" in bodies["validate_bundles_task"]
    assert "ingest.quarantine_rejected" in bodies["quarantine_task"]
    assert "ingest.commit_validated" in bodies["commit_task"]
    edge = _parse(PRODUCT / "tasks" / "edge.py")
    assert _imports(edge).get("run_batch") == "edgehaul.edge.batch" and "run_batch" in _calls(edge)
    train = _parse(PRODUCT / "tasks" / "train.py")
    assert _imports(train).get("run") == "edgehaul.training.launch" and "run" in _calls(train)
    # the drills' validator delegates to the product's (memoised), it does not check anything itself
    assert "validate_bundles" in _calls(next(n for n in ast.walk(_parse(Path(pipeline.__file__)))
                                              if isinstance(n, ast.FunctionDef) and n.name == "validate_many"))


def test_the_ast_checks_catch_a_copy(tmp_path: Path) -> None:
    # The checks above must be able to fail: a drill that commits with deltalake and trains by hand.
    bad = tmp_path / "bad.py"
    bad.write_text("from deltalake import write_deltalake\n"
                   "def drill(t, opt, loss):\n    write_deltalake('s3://x', t)\n    loss.backward()\n    opt.step()\n")
    tree = _parse(bad)
    assert {"write_deltalake", "deltalake", "backward"} <= _names(tree) & FORBIDDEN
    assert "ingest.commit_validated" not in _calls(tree)


def test_accounting_flags_lost_and_duplicated_samples() -> None:
    a = drills.Accounting(4, 2, 0, 1, 0, lost=["s3"], duplicated=["s1"])
    r = a.result()
    assert (r.samples_in, r.accounted, r.lost, r.duplicated) == (4, 2, 1, 1)
    assert any("lost 1" in p for p in r.problems) and any("duplicated 1" in p for p in r.problems)


def test_validation_memo_revalidates_changed_bytes(tmp_path: Path) -> None:
    # The drills memoise validation on content: a flipped byte must be a new key with its own verdict.
    good = drills.build_pool(tmp_path, [(40, "normal", None)])
    assert len(good) == 1
    data, m = good[0].data(), good[0].manifest
    i = len(data) // 2
    bad = data[:i] + bytes([data[i] ^ 0x10]) + data[i + 1:]
    first, again, flipped = drills.validate_many([(data, m), (data, m), (bad, m)])
    assert first.success and again == first
    assert not flipped.success and flipped.reason == "checksum", flipped
    # a truncated copy is another key again, with its own verdict
    assert pipeline.validate_many([(bad[:-1], m)])[0].reason == "checksum"


SUITE_TRIALS = 4


def test_a_regenerated_report_keeps_the_hand_written_notes() -> None:
    notes = f"{drills.NOTES_HEADING}\n\n| run | lost |\n|---|---|\n| 14:27 | 0 |\n"
    new = drills.with_notes("# Fault drills\n\nnew table\n", "# Fault drills\n\nold table\n\n" + notes)
    assert new.startswith("# Fault drills\n\nnew table\n") and new.endswith(notes) and "old table" not in new
    assert drills.with_notes("report\n", None) == "report\n"
    assert drills.with_notes("report\n", "# an older report without notes\n") == "report\n"


@pytest.mark.integration
def test_every_drill_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    # The suite runs a few trials per drill to fit CI's budget; `make drills` runs the full 50.
    trials = int(os.environ.get("EDGEHAUL_DRILL_TRIALS", SUITE_TRIALS))
    results = drills.run_drills(trials, root=tmp_path, progress=print)
    table = drills.table_text(results)
    print(table)
    (tmp_path / "drills.txt").write_text(table + "\n")
    (tmp_path / "DRILLS.md").write_text(drills.render_markdown(results, trials))
    assert [r.name for r in results] == list(drills.DRILLS)
    for r in results:
        w = r.row
        assert w["trials"] >= trials, w
        assert w["samples_in"] > 0 and w["accounted"] == w["samples_in"], w
        assert w["lost"] == 0 and w["duplicated"] == 0, (w, r.problems[:5])
        assert r.problems == [], (r.name, r.problems[:5])
        assert w["hit"] >= max(1, trials // 4), f"{r.name}: the fault struck mid-operation in only {w['hit']} trials"


def test_control_plane_checks_catch_a_lost_a_doubled_and_a_fresh_looking_alert(tmp_path: Path) -> None:
    # The control_plane_down drill's own verdict must be able to fail: central missing an outage alert,
    # holding one twice, out of seq order, or an hours-late alert not labelled stale.
    from edgehaul.edge.outbox import Outbox
    from edgehaul_dev.drills import control_plane as cp

    central = cp.Central()
    ok = {"_stale": "true", "age_s": 3 * 3600.0}
    central.got = [("e", {"seq": 1, "alert_id": "a", **ok}, uuid.uuid4()),
                   ("e", {"seq": 3, "alert_id": "b", **ok}, uuid.uuid4()),
                   ("e", {"seq": 2, "alert_id": "b", "_stale": "false", "age_s": 5.0}, uuid.uuid4())]
    box = Outbox(tmp_path / "o.sqlite", "node-a")
    problems = cp._check_events(central, {"a": 0.0, "b": 0.0, "c": 0.0}, ["a", "b", "c"], box)
    assert any("1 alerts never reached central (1 raised in the outage): ['c']" in p for p in problems), problems
    assert any("more than once: ['b']" in p for p in problems)
    assert any("out of seq order" in p for p in problems)
    assert any("not labelled stale" in p for p in problems)
    central.got = central.got[:2]
    assert cp._check_events(central, {"a": 0.0, "b": 0.0}, ["a", "b"], box) == []


@pytest.mark.integration
def test_control_plane_down_drill_quick(tmp_path: Path) -> None:
    # The drill alone in its quick form: samples all accounted for, every outage alert central exactly once.
    trials = int(os.environ.get("EDGEHAUL_DRILL_TRIALS", SUITE_TRIALS))
    (r,) = drills.run_drills(trials, only=["control_plane_down"], root=tmp_path, progress=print)
    w, c = r.row, r.counts
    assert w["trials"] == trials and w["lost"] == 0 and w["duplicated"] == 0 and r.problems == [], r.problems[:5]
    assert w["samples_in"] > 0 and w["accounted"] == w["samples_in"] and w["hit"] == trials, w
    assert c["alerts_in_outage"] > 0 and c["outage_alerts_central_once"] == c["alerts_in_outage"], c
