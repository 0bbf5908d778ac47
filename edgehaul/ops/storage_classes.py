"""Storage classes and their billing rules, so the mover never pays for a mistake.

S3's colder classes bill a minimum object size and a minimum storage duration: an object of 20 KB
in STANDARD_IA is billed as 128 KB, and one deleted (or moved on) after 10 days in STANDARD_IA is
billed for 30. `check_move` and `check_delete` say whether an action is cost-correct at an injected
`now`; an action the rules forbid is only allowed with a `force_reason`, which is recorded.

Rules (AWS list rules, which S3-compatible stores bill alike or not at all):

| class | minimum billable size | minimum duration | readable at once |
|---|---|---|---|
| STANDARD | - | - | yes |
| STANDARD_IA, ONEZONE_IA | 128 KiB | 30 days | yes |
| GLACIER_IR | 128 KiB | 90 days | yes |
| GLACIER | (40 KiB overhead) | 90 days | no (restore) |
| DEEP_ARCHIVE | (40 KiB overhead) | 180 days | no (restore) |
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

KiB = 1024
DAY = timedelta(days=1)
BELOW_MIN_SIZE = "skipped: below minimum size, merge first"


@dataclass(frozen=True)
class StorageClass:
    name: str
    min_billable_bytes: int  # objects smaller than this are billed as this size
    min_duration_days: int  # leaving the class earlier is billed as if kept this long
    overhead_bytes: int  # billed per object on top of its size (archive index)
    instant_read: bool  # False: a GET needs a restore first (breaks table-format reads)
    rank: int  # colder classes have higher rank


CLASSES: dict[str, StorageClass] = {
    c.name: c
    for c in (
        StorageClass("STANDARD", 0, 0, 0, True, 0),
        StorageClass("STANDARD_IA", 128 * KiB, 30, 0, True, 1),
        StorageClass("ONEZONE_IA", 128 * KiB, 30, 0, True, 1),
        StorageClass("GLACIER_IR", 128 * KiB, 90, 0, True, 2),
        StorageClass("GLACIER", 0, 90, 40 * KiB, False, 3),
        StorageClass("DEEP_ARCHIVE", 0, 180, 40 * KiB, False, 4),
    )
}


def storage_class(name: str | None) -> StorageClass:
    """The rules of a class; listings omit StorageClass (or say e.g. REDUCED_REDUNDANCY) for hot objects."""
    if not name:
        return CLASSES["STANDARD"]
    return CLASSES.get(name, CLASSES["STANDARD"])


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    reason: str  # why not, or "" / the force reason when allowed
    forced: bool = False


def _duration_left(current_class: str | None, class_since: datetime, now: datetime) -> timedelta:
    sc = storage_class(current_class)
    return class_since + sc.min_duration_days * DAY - now


def check_move(
    size: int, current_class: str | None, class_since: datetime, target_class: str, now: datetime,
    force_reason: str | None = None,
) -> Verdict:
    """May an object of `size` bytes, in `current_class` since `class_since`, move to `target_class` at `now`?

    Too small for the target's minimum billable size is never forced: merging is the fix, and a
    forced move would still be billed at 128 KiB.
    """
    if target_class not in CLASSES:
        raise ValueError(f"unknown storage class {target_class!r}; known: {sorted(CLASSES)}")
    target = CLASSES[target_class]
    if size < target.min_billable_bytes:
        return Verdict(False, BELOW_MIN_SIZE)
    # Leaving the current class early costs the same whether the object is moved or deleted.
    return check_delete(current_class, class_since, now, force_reason)


def check_delete(
    current_class: str | None, class_since: datetime, now: datetime, force_reason: str | None = None
) -> Verdict:
    """May an object in `current_class` since `class_since` be deleted at `now` without an early-deletion charge?"""
    left = _duration_left(current_class, class_since, now)
    if left > timedelta(0):
        why = (
            f"skipped: minimum storage duration of {storage_class(current_class).name} not reached "
            f"({left / DAY:.1f} days left)"
        )
        return Verdict(True, f"forced: {force_reason}", forced=True) if force_reason else Verdict(False, why)
    return Verdict(True, "")


def billable_bytes(size: int, class_name: str | None) -> int:
    """Bytes a class bills for one object of `size` bytes."""
    sc = storage_class(class_name)
    return max(size, sc.min_billable_bytes) + sc.overhead_bytes
