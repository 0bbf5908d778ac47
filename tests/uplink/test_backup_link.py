"""Backup link fail-over against the session's real SeaweedFS: with the primary link down (the link
simulator's outage), urgent bundles go over the backup within its budget, bulk waits for the primary,
and the cost report meters and prices each link's bytes separately."""
from __future__ import annotations

import uuid
from datetime import UTC, datetime
from pathlib import Path

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from edgehaul.blocks import LinkProfile, ObjectStore
from edgehaul.blocks.policies import PriceSheet
from edgehaul.bundles import BundleManifest, write_bundle
from edgehaul.contracts import load_contract
from edgehaul.ops import costs
from edgehaul.uplink.backup import BackupLedger
from edgehaul.uplink.link import SimulatedLink
from edgehaul.uplink.transfer import Drainer, DrainReport, Uplink
from tests.builders import bundle, processed_rows
from tests.doubles import MemorySource

KiB = 1024
NODE = "node-a"


def prof(cap_bytes_per_s: float) -> LinkProfile:
    return LinkProfile(bandwidth_bps=cap_bytes_per_s * 8 / 0.7, chunk_bytes=64 * KiB)


def urgent(n: int, seed: int) -> tuple[bytes, BundleManifest]:
    return write_bundle(processed_rows(n, NODE, seed=seed, start_seq=10_000 * seed, tier="high"),
                        load_contract("landsat_patch"), tier="high")


def primary(down: bool) -> SimulatedLink:
    # Down: one outage covering the whole test (seconds after the link's epoch).
    return SimulatedLink(prof(4_000_000), outages=[(0.0, 1e6)] if down else [], emit_events=False)


def drain(store: ObjectStore, tmp: Path, src: MemorySource, *, primary_down: bool,
          budget: int | None = None) -> DrainReport:
    up = Uplink(store, primary(primary_down), tmp / "primary")
    backup = Uplink(store, SimulatedLink(prof(2_000_000), emit_events=False), tmp / "backup")
    return Drainer(up, src, backup=backup, backup_budget_bytes=budget, attempts=1, emit_events=False,
                   backoff_s=(0.0,)).run(max_seconds=60)


def fill(src: MemorySource, n_urgent: int, n_bulk: int, seed: int = 0) -> tuple[set[str], set[str]]:
    hi, lo = set(), set()
    for i in range(n_urgent):
        data, m = urgent(30 + 10 * i, seed + i)
        src.put(data, m)
        hi.add(m.bundle_id)
    for i in range(n_bulk):
        data, m = bundle(60, NODE, seed=seed + 100 + i, start_seq=500_000 + 10_000 * (seed + i))
        src.put(data, m)
        lo.add(m.bundle_id)
    return hi, lo


def test_primary_down_urgent_goes_over_backup_bulk_waits_then_lands_on_primary(
    store: ObjectStore, tmp_path: Path
) -> None:
    src = MemorySource()
    hi, lo = fill(src, 3, 2)
    rep = drain(store, tmp_path, src, primary_down=True)
    assert {r.bundle_id for r in rep.landed} == hi
    assert {r.link for r in rep.landed} == {"backup"}
    assert set(src.acked) == hi and {e.bundle_id for e in src.pending()} == lo  # bulk still spooled
    assert "LinkDown" in " ".join(rep.failed[b] for b in lo)
    assert rep.bytes_by_link == {"backup": sum(r.nbytes for r in rep.landed)}
    # The node's durable meter: counted once per bundle, across ledger instances (re-runs).
    at = datetime.now(UTC)
    assert BackupLedger(tmp_path / "ledger").add(at, rep.landed) == rep.bytes_by_link["backup"]
    assert BackupLedger(tmp_path / "ledger").add(at, rep.landed) == 0
    assert BackupLedger(tmp_path / "ledger").read(f"{at:%Y-%m}")["bundles"].keys() == hi

    back = drain(store, tmp_path, src, primary_down=False)  # primary back: bulk goes, on the primary
    assert {r.bundle_id for r in back.landed} == lo and {r.link for r in back.landed} == {"primary"}
    assert len(src) == 0


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(budget_frac=st.floats(min_value=0.0, max_value=1.2))
@example(budget_frac=1.0)  # then 0.5, the same seed 0: without a prefix of its own, its bundles were already landed
@example(budget_frac=0.5)
def test_backup_budget_is_never_exceeded_and_refused_urgent_waits(
    store: ObjectStore, tmp_path: Path, budget_frac: float
) -> None:
    # one prefix per example: two examples with the same seed would otherwise land the same bundles, and the second
    # would find them already present (sent again, but not counted as sent bytes)
    store = store.model_copy(update={"prefix": f"{store.prefix}-{uuid.uuid4().hex[:6]}"})
    src = MemorySource()
    seed = int(budget_frac * 1e6) % 1000 * 10
    hi, _ = fill(src, 3, 0, seed=seed)
    sizes = {e.bundle_id: e.manifest.nbytes for e in src.pending()}
    budget = int(budget_frac * sum(sizes.values()))
    rep = drain(store, tmp_path / str(seed), src, primary_down=True, budget=budget)
    sent = rep.bytes_by_link.get("backup", 0)
    assert sent <= budget
    left = {e.bundle_id for e in src.pending()}
    assert {r.bundle_id for r in rep.landed} | left == hi  # nothing lost: landed or still spooled
    assert rep.backup_refusals == len(left)
    # Greedy within the budget: every bundle left behind needed more than what was left of it.
    assert all(sizes[b] > budget - sent for b in left)


def test_cost_report_shows_both_links_bytes_and_costs(store: ObjectStore, tmp_path: Path) -> None:
    src = MemorySource()
    fill(src, 2, 2)
    down = drain(store, tmp_path, src, primary_down=True)
    up = drain(store, tmp_path, src, primary_down=False)
    now = datetime.now(UTC)  # nothing is recorded by hand: the manifests the drains wrote say which link
    backup_bytes, primary_bytes = down.bytes_by_link["backup"], up.bytes_by_link["primary"]
    assert backup_bytes > 0 and primary_bytes > 0
    prices = PriceSheet(uplink_per_gb=0.5, backup_uplink_per_gb=5.0)
    report = costs.build_report(store, prices, f"{now:%Y-%m}", now=now)
    by_meter = {(line["meter"], line["node"]): line for line in report.lines if line["meter"].startswith("uplink")}
    assert by_meter[("uplink", NODE)]["quantity"] == primary_bytes
    assert by_meter[("uplink_backup", NODE)]["quantity"] == backup_bytes
    assert abs(by_meter[("uplink_backup", NODE)]["cost"] - backup_bytes / costs.GB * 5.0) < 1e-12
    md = costs.markdown_summary(report, "s3://x/c.png", "c.png", "s3://x/r.parquet")
    assert "uplink (backup link;" in md
