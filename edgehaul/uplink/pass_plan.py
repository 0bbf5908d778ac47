"""Contact windows planned by value: which spooled bundles each predicted pass carries.

A node in contact with the ground only during passes (start, duration, rate, as a ground-station
schedule predicts them) plans each pass before it starts:
1. urgent (tier high) bundles first, in priority order (best sample, then oldest), as long as they fit;
2. then the non-urgent bundles with the largest total value (a bundle's value is its manifest's
   `value_sum`) that fits what is left of the pass at the rate cap: a 0/1 knapsack, solved by dynamic
   programming over the pass cut into 4096 units (sizes rounded up, so a plan never exceeds the pass)
   and greedily by value per byte with a fill of smaller bundles; the better of the two is kept (the
   DP's rounding can lose a tight fit), the greedy one alone where the DP table would be too big;
3. a resumable bundle (a multipart upload with saved state: its parts survive a cut) may fill the
   tail of a pass with whole parts and finish in a later pass; any other bundle is never split;
4. what does not fit waits for the next pass (re-planned from the spool when that pass comes).

Capacity of a pass = duration x rate x rate-cap fraction; every bundle also costs an overhead
(`Overhead`): its manifest's bytes (shaped like the data) and the link time its request round trips
leave idle (HEAD, PUT or create/parts/complete, manifest PUT), shared by the concurrent transfers.

Pure functions and dataclasses; no Prefect, no I/O except `load_passes` (YAML) and
`pending_from_spool` (reads multipart resume state).
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import yaml

if TYPE_CHECKING:
    from edgehaul.blocks.policies import LinkProfile

Method = Literal["auto", "dp", "greedy"]
# Largest DP table (items x capacity units) planned exactly; above it the greedy fill is used.
DP_MAX_CELLS = 20_000_000
DP_UNITS = 4096  # capacity resolution of the DP: a pass is cut into this many units at most


class PassScheduleError(ValueError):
    """A pass schedule file or entry is malformed; the message names the file and the entry."""


@dataclass(frozen=True)
class Pass:
    """One predicted contact window: when it opens, how long it lasts, its link rate (bits/s)."""

    start: datetime
    duration_s: float
    rate_bps: float

    @property
    def end(self) -> datetime:
        return self.start + timedelta(seconds=self.duration_s)

    def capacity_bytes(self, cap_fraction: float, *, now: datetime | None = None) -> int:
        """Data-plane bytes the pass carries at the rate cap (only its remaining part when it is open)."""
        seconds = self.duration_s
        if now is not None and now > self.start:
            seconds = max(0.0, (self.end - now).total_seconds())
        return int(seconds * self.rate_bps / 8 * cap_fraction)


def _aware(t: Any, where: str) -> datetime:
    if isinstance(t, str):
        try:
            t = datetime.fromisoformat(t.replace("Z", "+00:00"))
        except ValueError as e:
            raise PassScheduleError(f"{where}: start {t!r} is not an ISO time") from e
    if not isinstance(t, datetime):
        raise PassScheduleError(f"{where}: start {t!r} is not a time")
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)


def parse_passes(doc: Any, *, source: str = "pass schedule") -> list[Pass]:
    """Passes from a parsed schedule: `{"passes": [{"start", "duration_s", "rate_bps"}, ...]}` (or the list)."""
    items = doc.get("passes") if isinstance(doc, dict) else doc
    if not isinstance(items, list):
        raise PassScheduleError(f"{source}: expected a list of passes under 'passes'")
    out = []
    for i, it in enumerate(items):
        where = f"{source} pass #{i}"
        if not isinstance(it, dict) or not {"start", "duration_s", "rate_bps"} <= it.keys():
            raise PassScheduleError(f"{where}: needs start, duration_s and rate_bps, got {it!r}")
        try:
            duration, rate = float(it["duration_s"]), float(it["rate_bps"])
        except (TypeError, ValueError) as e:
            raise PassScheduleError(f"{where}: duration_s and rate_bps must be numbers") from e
        if duration <= 0 or rate <= 0:
            raise PassScheduleError(f"{where}: duration_s ({duration}) and rate_bps ({rate}) must be > 0")
        out.append(Pass(_aware(it["start"], where), duration, rate))
    out.sort(key=lambda p: p.start)
    for a, b in itertools.pairwise(out):
        if b.start < a.end:
            raise PassScheduleError(f"{source}: passes at {a.start.isoformat()} and {b.start.isoformat()} overlap")
    return out


def load_passes(path: str | Path) -> list[Pass]:
    """A node's predicted passes from a YAML file (see `parse_passes`)."""
    p = Path(path)
    try:
        doc = yaml.safe_load(p.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise PassScheduleError(f"pass schedule {p}: cannot read it: {e}") from e
    return parse_passes(doc, source=f"pass schedule {p}")


def upcoming(passes: Sequence[Pass], now: datetime) -> list[Pass]:
    """Passes not over yet: the first is the current one when it is open."""
    return [p for p in passes if p.end > now]


@dataclass(frozen=True)
class Pending:
    """A spooled bundle as the planner sees it."""

    bundle_id: str
    tier: str
    value: float  # manifest value_sum: what landing the bundle is worth
    max_value: float  # its best sample (orders urgent bundles)
    nbytes: int  # bytes still to send (a started multipart upload: the parts the server lacks)
    created_at: str = ""
    manifest_bytes: int = 0
    resumable: bool = False  # a multipart upload with saved state: may be split across passes
    total_bytes: int = 0  # the whole bundle (0: nbytes)

    @property
    def urgent(self) -> bool:
        return self.tier == "high"

    @property
    def size(self) -> int:
        return self.total_bytes or self.nbytes


@dataclass(frozen=True)
class Overhead:
    """Per-bundle cost on top of its bytes, in data-plane bytes at the cap.

    Requests per bundle as `transfer.Uplink.send` makes them: a HEAD (skipped by small urgent
    bundles), one PUT or create + one per part + complete, and the manifest PUT. The link carries
    nothing for a transfer during its round trips; with `concurrency` transfers sharing the link the
    others fill part of that time, so each round trip costs rtt x cap / concurrency. A verify HEAD
    is not counted: servers that return MD5 ETags (SeaweedFS, AWS without SSE-KMS) prove the bytes
    in the PUT's own answer.
    """

    rtt_s: float = 0.0
    concurrency: int = 2
    multipart_threshold_bytes: int = 16 * 1024 * 1024
    part_bytes: int = 8 * 1024 * 1024

    def parts(self, nbytes: int) -> int:
        return max(1, math.ceil(nbytes / self.part_bytes))

    def requests(self, e: Pending, *, nbytes: int | None = None, completes: bool = True) -> int:
        """Requests to send `nbytes` of e (default: the rest of it); `completes`: the piece that finishes it."""
        n = e.nbytes if nbytes is None else nbytes
        if e.size < self.multipart_threshold_bytes:
            return (1 if e.urgent else 2) + 1  # [HEAD] + PUT + manifest PUT
        # HEAD + create (or list_parts when resuming) + parts [+ complete + manifest PUT]
        return 2 + self.parts(n) + (2 if completes else 0)

    def bytes(self, e: Pending, cap_bytes_per_s: float, *, nbytes: int | None = None, completes: bool = True) -> int:
        idle = self.requests(e, nbytes=nbytes, completes=completes) * self.rtt_s * cap_bytes_per_s
        return (e.manifest_bytes if completes else 0) + math.ceil(idle / max(1, self.concurrency))


@dataclass(frozen=True)
class Planned:
    """One bundle (or a resumable bundle's piece) in a pass."""

    bundle_id: str
    nbytes: int  # bundle bytes sent in this pass
    overhead_bytes: int
    value: float  # value this pass delivers: the bundle's, or 0 for a piece that does not finish it
    urgent: bool
    completes: bool = True

    @property
    def cost(self) -> int:
        return self.nbytes + self.overhead_bytes


@dataclass
class PassPlan:
    window: Pass
    capacity_bytes: int
    items: list[Planned] = field(default_factory=list)

    @property
    def planned_bytes(self) -> int:
        """Bundle bytes planned (without overhead)."""
        return sum(p.nbytes for p in self.items)

    @property
    def planned_cost(self) -> int:
        return sum(p.cost for p in self.items)

    @property
    def planned_value(self) -> float:
        return sum(p.value for p in self.items)

    @property
    def fill(self) -> float:
        return self.planned_cost / self.capacity_bytes if self.capacity_bytes else 0.0

    @property
    def bundle_ids(self) -> list[str]:
        return [p.bundle_id for p in self.items]

    def summary(self) -> dict[str, Any]:
        return {
            "start": self.window.start.isoformat(), "duration_s": self.window.duration_s,
            "rate_bps": self.window.rate_bps, "capacity_bytes": self.capacity_bytes,
            "planned_bundles": len(self.items), "planned_bytes": self.planned_bytes,
            "planned_overhead_bytes": self.planned_cost - self.planned_bytes,
            "planned_value": round(self.planned_value, 3), "fill": round(self.fill, 4),
        }


@dataclass
class Plan:
    passes: list[PassPlan]
    waits: list[str]  # bundles not finished by any planned pass (a split bundle's rest included)

    @property
    def value(self) -> float:
        return sum(p.planned_value for p in self.passes)


def _density(e: Pending, cost: int) -> float:
    return e.value / max(1, cost)


def _knapsack_dp(items: list[tuple[Pending, int]], capacity: int) -> list[int]:
    """Indexes of the items of largest total value with total cost <= capacity (costs rounded up
    to units, so the answer is feasible; exact up to that rounding)."""
    unit = max(1, math.ceil(capacity / DP_UNITS))
    cap_u = capacity // unit
    weights = [math.ceil(c / unit) for _, c in items]
    dp = np.zeros(cap_u + 1)
    take = np.zeros((len(items), cap_u + 1), dtype=bool)
    for i, ((e, _), w) in enumerate(zip(items, weights, strict=True)):
        if w > cap_u or e.value <= 0:
            continue
        cand = dp[: cap_u + 1 - w] + e.value
        better = cand > dp[w:] + 1e-12
        take[i, w:] = better
        dp[w:] = np.where(better, cand, dp[w:])
    chosen, c = [], cap_u
    for i in range(len(items) - 1, -1, -1):
        if take[i, c]:
            chosen.append(i)
            c -= weights[i]
    return chosen[::-1]


def _knapsack_greedy(items: list[tuple[Pending, int]], capacity: int) -> list[int]:
    """By value per byte, skipping what does not fit so smaller bundles fill the rest; the single most
    valuable bundle alone wins if it is worth more (the classic bound: at least half the optimum)."""
    order = sorted(range(len(items)), key=lambda i: -_density(*items[i]))
    chosen, used = [], 0
    for i in order:
        if used + items[i][1] <= capacity:
            chosen.append(i)
            used += items[i][1]
    fits = [i for i in range(len(items)) if items[i][1] <= capacity]
    best = max(fits, key=lambda i: items[i][0].value, default=None)
    if best is not None and items[best][0].value > sum(items[i][0].value for i in chosen):
        return [best]
    return chosen


def _select(items: list[tuple[Pending, int]], capacity: int, method: Method) -> list[int]:
    if not items or capacity <= 0:
        return []
    greedy = _knapsack_greedy(items, capacity)
    if method == "greedy" or (method == "auto" and len(items) * min(DP_UNITS, capacity) > DP_MAX_CELLS):
        return greedy
    dp = _knapsack_dp(items, capacity)
    if method == "dp":
        return dp
    # Both are feasible; the DP's rounding can lose a tight fit the greedy plan found.
    return max(dp, greedy, key=lambda ix: sum(items[i][0].value for i in ix))


def pass_capacities(passes: Sequence[Pass], now: datetime, until: datetime, cap_fraction: float) -> list[int]:
    """Bytes each pass carries between now and `until` at the rate cap (a pass open now: its rest; a pass
    running past `until`: up to it); the passes that carry none are left out."""
    out = []
    for p in passes:
        a, b = max(p.start, now), min(p.end, until)
        if b > a:
            out.append(int((b - a).total_seconds() * p.rate_bps / 8 * cap_fraction))
    return out


def capacity_until(passes: Sequence[Pass], now: datetime, until: datetime, cap_fraction: float) -> int:
    """Bytes the passes carry between now and `until` at the rate cap. What waits beyond it must be thinned, not
    cut by drain order."""
    return sum(pass_capacities(passes, now, until, cap_fraction))


PACKS_PER_PASS = 4  # with several passes ahead, a thinning's packs are at most a quarter of the smallest
PACK_MAX_BYTES = 64 << 20  # and never larger: a pack is built in memory, and a core refuses what a contract caps


def pack_bytes_for(capacities: Sequence[int]) -> int | None:
    """The largest bundle a thinning packs for these passes: one pass, its whole capacity (a pass of small rows
    pays one bundle's fixed part, not one per 16 rows); several, a `PACKS_PER_PASS`th of the smallest, so the plan
    can fill each with whole bundles; at most `PACK_MAX_BYTES`. None where no pass is ahead."""
    if not capacities:
        return None
    return min(PACK_MAX_BYTES, capacities[0] if len(capacities) == 1 else max(1, min(capacities) // PACKS_PER_PASS))


MONTH_S = 30 * 86400.0
PLAN_HEADROOM = 0.9  # plan a tenth under the link: retries, manifests and control traffic share it
# A node with passes draws more than a pass carries, and the pass thins the surplus (`Spool.thin_to`: a recorded
# draw of fixed size, p updated, the rest to the raw store): a pass can take rows off, never add the rows a draw
# left out. Sized for a Poisson draw, which at exactly the pass's bytes falls short half the time, by about 1/sqrt(n)
# of n rows (digits at 2%: ten rows a pass, a third short at one sd); DRAW_SURPLUS_Z sds cover it 19 times in 20.
# The budgeted draw is now of fixed size per batch (`tiering.draw_fixed`), far nearer its expectation; the surplus
# stays as measured with it, and the pass thins what is over at random.
DRAW_SURPLUS_Z = 1.645
# A budget_share is a share of full-row bytes (uncompressed); a bundle's zstd Parquet carries a row in fewer. Where
# a node has not measured how many (`wire_ratio`), this margin (gait 0.87x, Landsat 0.89x in 16-row packs).
BUNDLE_WIRE_MARGIN = 1.15


def draw_surplus(rows_per_pass: float, wire_ratio: float | None = None) -> float:
    """How many times a pass's bytes, in full-row bytes, a node with passes plans to draw: the rows a pass's bytes
    buy once packed (`wire_ratio`: a full row's bytes over a packed row's, measured by the node; else
    `BUNDLE_WIRE_MARGIN`) times 1 + z / sqrt(the rows a pass carries). Large for a pass of a few rows (ten rows:
    1.52x the ratio), near the ratio for thousands (1.04x at 1,500). Packed to the pass, a digits row costs 0.45x
    its full row: a margin of 1.15 drew half of what the pass carries."""
    ratio = BUNDLE_WIRE_MARGIN if wire_ratio is None else wire_ratio
    return ratio * (1.0 + DRAW_SURPLUS_Z / math.sqrt(max(rows_per_pass, 1.0)))


def pass_rows(carries: Sequence[int], row_bytes: float | None) -> float | None:
    """The rows a planned pass carries on average (`PLAN_HEADROOM` of its bytes, in full rows of `row_bytes`);
    None without passes or a row size."""
    if not carries or not row_bytes:
        return None
    return PLAN_HEADROOM * sum(carries) / len(carries) / row_bytes


def _carries(profile: LinkProfile, passes: Sequence[Pass], now: datetime | None, horizon_s: float) -> list[int]:
    """Bytes each pass open within the horizon from now carries at the rate cap."""
    start = now or datetime.now(UTC)
    end = start + timedelta(seconds=horizon_s)
    return [p.capacity_bytes(profile.rate_cap_fraction, now=start) for p in passes if start < p.end and p.start < end]


def planned_pass_rows(profile: LinkProfile, passes: Sequence[Pass], row_bytes: float | None, *,
                      now: datetime | None = None, horizon_s: float = 86400.0,
                      wire_row_bytes: float | None = None) -> float | None:
    """`pass_rows` of the passes `planned_share` plans with: in packed rows where the node measured one's bytes."""
    return pass_rows(_carries(profile, passes, now, horizon_s), wire_row_bytes or row_bytes)


def planned_share(
    profile: LinkProfile, *, raw_bytes_per_s: float, passes: Sequence[Pass] = (), now: datetime | None = None,
    horizon_s: float = 86400.0, measured_bytes_per_s: float | None = None, backup: LinkProfile | None = None,
    row_bytes: float | None = None, wire_row_bytes: float | None = None,
) -> float:
    """The share of what a node observes (its full-row bytes per second) that its links can carry: what a
    tiering policy's `budget_share` should be. The carry rate is the predicted passes' capacity over the horizon
    when a schedule is given, else the profile's rate cap (times its contact duty cycle), replaced by the measured
    data-plane rate when one is known, less its loss rate; a backup link adds its monthly budget spread over the
    month. Planned with `PLAN_HEADROOM`, in (0, 1]. With passes and `row_bytes` (a full row's mean bytes), times
    `draw_surplus` of the rows a pass carries: the pass thins the surplus (only a pass drain thins; a node without
    passes plans the link itself, as what it draws over waits in the spool); with `wire_row_bytes` too (a row's
    bytes packed, measured: `tasks.edge.observed_rate`), the rows counted in those and the surplus at their ratio."""
    if raw_bytes_per_s <= 0:
        raise ValueError(f"raw_bytes_per_s must be > 0, got {raw_bytes_per_s}")
    surplus = 1.0
    if passes:
        carries = _carries(profile, passes, now, horizon_s)
        carried = sum(carries)
        rate = carried / horizon_s
        rows = pass_rows(carries, wire_row_bytes or row_bytes)
        if rows is not None:
            surplus = draw_surplus(rows, row_bytes / wire_row_bytes if row_bytes and wire_row_bytes else None)
    else:
        rate = profile.rate_cap_bytes_per_s if measured_bytes_per_s is None else measured_bytes_per_s
        if profile.contact_period_s and profile.contact_duration_s:
            rate *= profile.contact_duration_s / profile.contact_period_s
    rate *= 1.0 - profile.loss_rate
    if backup is not None and backup.monthly_budget_bytes:
        rate += backup.monthly_budget_bytes / MONTH_S
    return float(min(1.0, max(1e-6, surplus * PLAN_HEADROOM * rate / raw_bytes_per_s)))


def plan_pass(
    pending: Sequence[Pending], window: Pass, *, cap_fraction: float, overhead: Overhead,
    method: Method = "auto", now: datetime | None = None,
) -> tuple[PassPlan, list[Pending]]:
    """Plan one pass; returns the plan and what is left for later passes (a split bundle's rest included)."""
    cap_bps = window.rate_bps / 8 * cap_fraction
    plan = PassPlan(window, window.capacity_bytes(cap_fraction, now=now))
    left = plan.capacity_bytes
    taken: set[str] = set()
    urgent = sorted((e for e in pending if e.urgent), key=lambda e: (-e.max_value, str(e.created_at)))
    for e in urgent:
        cost = e.nbytes + overhead.bytes(e, cap_bps)
        if cost <= left:
            plan.items.append(Planned(e.bundle_id, e.nbytes, cost - e.nbytes, e.value, True))
            taken.add(e.bundle_id)
            left -= cost
    # Non-urgent bundles only after every urgent one that fits: the knapsack gets what urgency left.
    rest = [e for e in pending if not e.urgent]
    items = [(e, e.nbytes + overhead.bytes(e, cap_bps)) for e in rest]
    picked = set(_select(items, left, method))
    left -= sum(items[i][1] for i in picked)
    # Fill what the knapsack left (its rounding, bundles of no value) with the densest that still fit.
    for i in sorted(set(range(len(items))) - picked, key=lambda i: (-_density(*items[i]), str(items[i][0].created_at))):
        if items[i][1] <= left:
            picked.add(i)
            left -= items[i][1]
    chosen = [items[i] for i in picked]
    # Within the pass, densest first: if the pass is cut short, the most value per byte has landed.
    chosen.sort(key=lambda it: (-_density(*it), str(it[0].created_at)))
    for e, cost in chosen:
        plan.items.append(Planned(e.bundle_id, e.nbytes, cost - e.nbytes, e.value, False))
        taken.add(e.bundle_id)
    remaining = [e for e in pending if e.bundle_id not in taken]
    # A resumable bundle fills the tail with whole parts (a part cut mid-way would be re-sent).
    for e in sorted((e for e in remaining if e.resumable), key=lambda e: -e.value / max(1, e.size)):
        k = min(left // overhead.part_bytes, overhead.parts(e.nbytes) - 1)  # the whole rest did not fit
        while k > 0 and k * overhead.part_bytes + overhead.bytes(
                e, cap_bps, nbytes=k * overhead.part_bytes, completes=False) > left:
            k -= 1  # each part's request costs a round trip too
        if k <= 0:
            continue
        piece = int(k * overhead.part_bytes)
        cost = piece + overhead.bytes(e, cap_bps, nbytes=piece, completes=False)
        plan.items.append(Planned(e.bundle_id, piece, cost - piece, 0.0, e.urgent, completes=False))
        left -= cost
        remaining = [replace(r, nbytes=r.nbytes - piece) if r.bundle_id == e.bundle_id else r for r in remaining]
    return plan, remaining


def plan_passes(
    pending: Sequence[Pending], passes: Sequence[Pass], *, cap_fraction: float, overhead: Overhead,
    method: Method = "auto", now: datetime | None = None,
) -> Plan:
    """Plan each pass in turn with what the earlier ones left; what no pass finishes waits."""
    left = list(pending)
    out = []
    for w in passes:
        pp, left = plan_pass(left, w, cap_fraction=cap_fraction, overhead=overhead, method=method, now=now)
        out.append(pp)
    return Plan(out, [e.bundle_id for e in left])


def pending_from_spool(entries: Iterable[Any], state_dir: Path | None, *, multipart_threshold_bytes: int,
                       part_bytes: int) -> list[Pending]:
    """Planner entries from spool entries (`transfer.PendingEntry`): value from the manifest, and
    resumable with the bytes still to send when a multipart resume state is saved under `state_dir`."""
    out = []
    for e in entries:
        m = e.manifest
        nbytes, resumable = int(m.nbytes), False
        if state_dir is not None and m.nbytes >= multipart_threshold_bytes:
            st = _resume_state(state_dir / f"{m.bundle_id}.mpu.json", m.sha256, part_bytes)
            if st is not None:
                resumable = True
                nbytes = max(0, nbytes - len(st.get("parts", {})) * part_bytes)
        out.append(Pending(
            bundle_id=m.bundle_id, tier=str(getattr(e, "tier", None) or m.tier), value=float(m.value_sum),
            max_value=float(m.max_value), nbytes=nbytes, created_at=str(m.created_at),
            manifest_bytes=len(m.to_json()), resumable=resumable, total_bytes=int(m.nbytes),
        ))
    return out


def _resume_state(path: Path, sha256: str, part_bytes: int) -> dict[str, Any] | None:
    try:
        st = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(st, dict) or st.get("sha256") != sha256 or st.get("part_bytes") != part_bytes:
        return None  # stale or from another part size: the upload starts over
    return st
