"""Which dataset version a training run trains: the newest, once, so training always catches up.

Commits arrive faster than training finishes. The training deployment queues its runs (concurrency 1,
ENQUEUE: a run is never cancelled), and each run, when it starts, trains the newest committed version
rather than the one its trigger named; a run that finds the newest version already trained by a
registered model of the same name ends at once, saying which model covers it. So after a burst of
commits the next run trains the newest, the runs queued behind it cost a second each, and no version
is left untrained because a run was busy.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

NOTHING_TO_TRAIN = "nothing to train"  # how a covered run's final state message begins (the UI's run list)


@dataclass(frozen=True)
class TrainingPlan:
    version: int | None  # the version to train; None: nothing to do (`reason` says why)
    requested: int | None
    latest: int
    reason: str
    covered_by: str | None = None  # with version None: the model already trained on the newest version

    @property
    def superseded(self) -> bool:
        return self.requested is not None and self.requested < self.latest and self.version == self.latest


def plan_version(requested: int | None, latest: int, trained: Mapping[int, str], *, catch_up: bool) -> TrainingPlan:
    """`trained`: dataset version -> id of a registered model already trained on it (same model name).

    With `catch_up`, an older requested version is replaced by `latest`, and a version already trained
    is not trained again. Without it the requested version is trained as asked (an operator's deliberate
    retrain of an old version)."""
    if requested is not None and not 0 <= requested <= latest:
        raise ValueError(f"dataset version {requested} requested; the dataset has versions 0..{latest}")
    if not catch_up:
        target = latest if requested is None else requested
        return TrainingPlan(target, requested, latest, f"v{target} as requested")
    target = latest
    if target in trained:
        return TrainingPlan(None, requested, latest,
                            f"v{target} (the newest) is already trained by model {trained[target]}; nothing to do",
                            covered_by=trained[target])
    if requested is not None and requested < latest:
        return TrainingPlan(target, requested, latest,
                            f"v{requested} requested, v{latest} is the newest: training v{latest}")
    return TrainingPlan(target, requested, latest, f"v{target}, the newest")
