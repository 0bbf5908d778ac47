"""The names of the blocks each role loads, defined once, and the storage identity each flow runs as.

Every central role has its own ObjectStore block whose credentials are that role's least-privilege
identity (infra/iam/<identity>.json on AWS, `edgehaul_dev.localstack.identities_config` locally);
an edge node's store block is named after the node and may write only its own landing prefix. Flow
defaults, `deployments/prefect.yaml` (tests/platform/test_roles.py keeps it in step), the local stack's
`edgehaul_dev.configure` and the demo all take the names from here. infra/README.md ("Blocks")
has the same table for operators.
"""

from __future__ import annotations

from enum import StrEnum
from typing import NamedTuple


class StoreBlock(StrEnum):
    """ObjectStore block name of each central role."""

    ADMIN = "central"  # operator/admin identity: by hand only, no deployment runs as it
    INGEST = "ingest"  # landing -> curated (+ quarantine), ops (claims, cached results)
    TRAINER = "trainer"  # curated (read), checkpoints and models
    LIFECYCLE = "lifecycle"  # moves between every bucket and the cold tier, no bucket admin

    @property
    def identity(self) -> str:
        """The storage identity (IAM policy / local stack identity) this block's credentials belong to."""
        return "admin" if self is StoreBlock.ADMIN else self.value


def node_store(node: str) -> str:
    """A node's ObjectStore block: named after its EdgeNode block, credentials of that node only."""
    return node


EXAMPLE_NODE = "node-a"  # the flows' default node: the first node of the local stack
DEFAULT_POLICY = "default"  # the LinkProfile, TieringPolicy, RetentionPolicy and PriceSheet flows use by default
DEFAULT_TEAM = "default"  # the team train_model bills by default; TeamQuota blocks are named after their team


class FlowStore(NamedTuple):
    """Which flow parameter names a flow's ObjectStore block, and the role it must run as."""

    param: str
    role: StoreBlock | None  # None: the edge node's own store (`node_store(<node>)`)


FLOW_STORES: dict[str, FlowStore] = {
    "edge_ingest": FlowStore("object_store", None),  # only the model scorer reads with it
    "uplink_drain": FlowStore("object_store", None),
    "core_ingest": FlowStore("store_block", StoreBlock.INGEST),
    "compact_dataset": FlowStore("store_block", StoreBlock.INGEST),
    "train_model": FlowStore("store_block", StoreBlock.TRAINER),
    "publish_model": FlowStore("store_block", StoreBlock.TRAINER),
    "lifecycle_moves": FlowStore("store_block", StoreBlock.LIFECYCLE),
    "cost_report": FlowStore("store_block", StoreBlock.LIFECYCLE),  # reads every bucket, writes ops: no admin needed
    "fleet_report": FlowStore("store_block", StoreBlock.LIFECYCLE),  # reads curated/checkpoints/models, writes ops
}
