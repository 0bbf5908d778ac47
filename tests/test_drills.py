"""Fault drills (edgehaul_dev.drills): every drill, EDGEHAUL_DRILL_TRIALS trials each (4 in the suite,
50 in `make drills`), zero samples lost and zero duplicated by sample id. Runs against its own
SeaweedFS (the store-down drill stops it)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from edgehaul_dev import drills


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
