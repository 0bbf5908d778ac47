"""A drain by plan: wait for the pass open now (or opening within the drain's contact wait), thin what the passes
cannot carry, and plan the pass before sending (`edgehaul.uplink.pass_plan`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Protocol

from edgehaul.blocks import EdgeNode, LinkProfile
from edgehaul.uplink.pass_plan import (
    Overhead,
    Pass,
    PassPlan,
    Pending,
    pack_bytes_for,
    pass_capacities,
    pending_from_spool,
    plan_passes,
)
from edgehaul.uplink.retry_queue import RetryQueue

log = logging.getLogger(__name__)


class ThinnableSource(Protocol):
    """What planning a pass needs from a spool (edgehaul.edge.spool.Spool satisfies it)."""

    def pending(self) -> Sequence[Any]: ...
    def thin_to(self, capacity_bytes: int, *, salt: str, skip: frozenset[str] = ...,
                pack_bytes: int | None = ...) -> Any: ...


@dataclass(frozen=True)
class PassDrain:
    """How a drain sends in the pass: its plan, the following passes' plans, the value of each pending bundle,
    the link at the pass's own rate and the drain's time cut to the pass's end."""

    plan: PassPlan
    later: list[PassPlan]
    values: dict[str, float]
    profile: LinkProfile
    max_seconds: float


def wait_for_pass(ahead: Sequence[Pass], now: datetime, contact_wait_s: float) -> float | None:
    """Seconds until the next pass opens (0 when one is open), or None when none opens within `contact_wait_s`."""
    wait_s = (ahead[0].start - now).total_seconds() if ahead else float("inf")
    return None if wait_s > contact_wait_s else max(0.0, wait_s)


WIRE_FIT_ROUNDS = 3  # thinnings to fit the wire: the second mostly does (the overhead scales with the rows)


def thin_for_the_wire(spool: ThinnableSource, room: int, waiting: Callable[[], list[Pending]],
                      wire_bytes: Callable[[Pending], int], *, salt: str, skip: frozenset[str],
                      pack_bytes: int | None = None) -> list[Pending]:
    """Thin what waits until its wire bytes fit `room`, and return what waits then. `Spool.thin_to` counts bundle
    bytes, and a pass also carries each bundle's manifest (with plain sample ids, as much again as a small row) and
    idles through its requests' round trips; the plan counts both, and cuts whole bundles where they do not fit (584
    hive rows thinned into one 32 KB pack left a 34.6 KB pass 7% full). So the thinning's target is the room less
    the overhead measured on what the last thinning left, until it fits (each a recorded draw: p multiplied). The
    overhead shrinks with the rows (the manifests' ids), so the bundle bytes scale by room / wire bytes: taking the
    overshoot off them took the overhead off twice (a 35.7 KB hive pass 76% full). The rows kept are packed into
    bundles of up to `pack_bytes` (`pack_bytes_for` the passes)."""
    target, pending = room, []
    for i in range(WIRE_FIT_ROUNDS):
        spool.thin_to(target, salt=salt if i == 0 else f"{salt}|wire-{i}", skip=skip, pack_bytes=pack_bytes)
        pending = waiting()
        wire = sum(wire_bytes(e) for e in pending)
        if wire <= room or target <= 0:
            break
        target = int(sum(e.nbytes for e in pending) * room / wire)
    return pending


def plan_pass_drain(spool: ThinnableSource, queue: RetryQueue, node: EdgeNode, profile: LinkProfile,
                    ahead: list[Pass], now: datetime, *, max_active: int, max_seconds: float) -> PassDrain:
    """Thin what the passes cannot carry before the bundles expire, then plan the pass open at `now`."""
    state_dir = Path(node.spool_dir) / "uplink"
    blocked = queue.blocked_ids()
    # What the passes cannot carry before the bundles expire is thinned at random (inclusion_p updated),
    # never left to be cut by the plan's order; part-sent and retrying bundles stay whole.
    capacities = pass_capacities(ahead, now, now + timedelta(seconds=node.bundle_ttl_seconds),
                                 profile.rate_cap_fraction)
    room = sum(capacities)
    keep_whole = {f.name.removesuffix(".mpu.json") for f in state_dir.glob("*.mpu.json")}
    keep_whole |= blocked | set(queue.due())
    overhead = Overhead(rtt_s=2 * profile.latency_ms / 1000, concurrency=max_active,
                        multipart_threshold_bytes=profile.multipart_threshold_bytes, part_bytes=profile.part_bytes)

    def waiting() -> list[Pending]:
        return pending_from_spool(
            [e for e in spool.pending() if e.bundle_id not in blocked], state_dir,
            multipart_threshold_bytes=profile.multipart_threshold_bytes, part_bytes=profile.part_bytes)

    cap_bps = ahead[0].rate_bps / 8 * profile.rate_cap_fraction
    pending = thin_for_the_wire(spool, room, waiting, lambda e: e.nbytes + overhead.bytes(e, cap_bps),
                                salt=f"pass-{ahead[0].start.isoformat()}", skip=frozenset(keep_whole),
                                pack_bytes=pack_bytes_for(capacities))
    full = plan_passes(pending, ahead, cap_fraction=profile.rate_cap_fraction, overhead=overhead, now=now)
    plan = full.passes[0]
    log.info("pass %s: %d of %d bundles planned, %d bytes of %d at the cap, value %.1f",
             plan.window.start.isoformat(), len(plan.items), len(pending), plan.planned_cost,
             plan.capacity_bytes, plan.planned_value)
    return PassDrain(plan=plan, later=full.passes[1:], values={e.bundle_id: e.value for e in pending},
                     profile=profile.model_copy(update={"bandwidth_bps": plan.window.rate_bps}),  # the pass's own rate
                     max_seconds=min(max_seconds, max(0.001, (plan.window.end - now).total_seconds())))
