"""edgehaul's Prefect blocks, registered through the `prefect.collections` entry point.

`prefect block register -m edgehaul.blocks` (done by `make demo`/`make deploy`) makes them visible in the UI.
"""

from edgehaul.blocks.object_store import ObjectStore
from edgehaul.blocks.policies import (
    EdgeNode,
    LinkProfile,
    PriceSheet,
    RetentionPolicy,
    RetentionRule,
    TeamQuota,
    TieringPolicy,
)

__all__ = [
    "EdgeNode",
    "LinkProfile",
    "ObjectStore",
    "PriceSheet",
    "RetentionPolicy",
    "RetentionRule",
    "TeamQuota",
    "TieringPolicy",
]
