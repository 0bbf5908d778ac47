"""Scorer names: which scorers are installed (the shipped ones and the `edgehaul.scorers` entry point group).

Kept apart from `edgehaul.edge.scorer_registry` (which loads and builds scorers) so that a policy block can
refuse an unknown name when it is made without importing the edge stage.
"""

from __future__ import annotations

from functools import cache
from importlib.metadata import EntryPoint, entry_points

ENTRY_POINT_GROUP = "edgehaul.scorers"


class UnknownScorer(ValueError):
    """The policy names a scorer no installed package registers."""


# The shipped scorers, also registered in pyproject.toml: known without the package's metadata (a checkout
# on PYTHONPATH, a stale editable install), so the default policy always works.
BUILTIN = {name: EntryPoint(name=name, value=value, group=ENTRY_POINT_GROUP) for name, value in (
    ("novelty", "edgehaul.edge.scoring:NoveltyScorer.from_context"),
    ("model", "edgehaul.edge.model_scorer:from_context"),
    ("anomaly", "edgehaul.edge.anomaly_scorer:AnomalyScorer.from_context"),
    ("density", "edgehaul.edge.density_scorer:DensityScorer.from_context"))}


@cache
def available_scorers() -> dict[str, EntryPoint]:
    """Scorers by name: the shipped ones, then those registered under the entry point group `edgehaul.scorers`
    by installed packages (read once per process)."""
    return {**BUILTIN, **{ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}}


def check_scorer_name(name: str) -> str:
    if name not in available_scorers():
        raise UnknownScorer(f"scorer {name!r} is not registered (entry point group {ENTRY_POINT_GROUP!r}); "
                            f"installed: {', '.join(sorted(available_scorers())) or 'none'}")
    return name


