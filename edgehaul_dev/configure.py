"""Save the block documents the flows load, for the local stack (demo, deploy, verify).

Each role gets its own ObjectStore block with its own least-privilege identity, named as in
`edgehaul.platform.roles`: one per node (own landing prefix), `ingest`, `trainer`, `lifecycle`, and
`central` (operator/admin, by hand only). No block holds a key: a role's block names the stack's central
0600 credentials file (`StackState.central_credentials_file`, one profile per role), a node's block the
node's own (`StackState.node_credentials_file`); `blocks apply` (re)writes both from the state file.
See docs/SECURITY.md.

    python -m edgehaul_dev.configure          # against $PREFECT_API_URL, stack in $EDGEHAUL_STACK_DIR
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

from pydantic import SecretStr

from edgehaul.blocks import RetentionRule
from edgehaul.platform.roles import StoreBlock
from edgehaul.services.block_setup import Keys, NodeSpec, Setup, StoreSpec, TeamSpec, apply
from edgehaul_dev import localstack

log = logging.getLogger(__name__)

# role block name -> stack identity
STORE_BLOCKS = {b.value: b.identity for b in StoreBlock}


def register_block_types() -> None:
    """`prefect block register -m edgehaul.blocks`: makes the block types visible in the UI."""
    subprocess.run(
        [str(Path(sys.executable).parent / "prefect"), "block", "register", "-m", "edgehaul.blocks"],
        check=True, capture_output=True, text=True,
    )


def setup_of(state: localstack.StackState, *, team: str = "geo") -> Setup:
    """The local stack as an `edgehaul blocks apply` setup: the product's one way to create the blocks."""
    def keys(identity: str) -> Keys:
        c = state.identities[identity]
        return Keys(access_key_id=SecretStr(c.access_key_id), secret_access_key=SecretStr(c.secret_access_key))

    nodes = [k for k in state.identities if k not in localstack.ROLES]
    root = Path(state.root)
    return Setup(
        store=StoreSpec(endpoint_url=state.s3_endpoint),
        central_credentials_file=str(state.central_credentials_file()),
        identities={**{name: keys(identity) for name, identity in STORE_BLOCKS.items()}, **{n: keys(n) for n in nodes}},
        nodes=[NodeSpec(node_id=n, team=team, node_group="edge-default", spool_dir=str(root / "edge" / n / "spool"),
                        spool_cap_bytes=512 * 1024**2, credentials_file=str(state.node_credentials_file(n)))
               for n in nodes],
        teams=[TeamSpec(team=team, accelerator_hours_per_month=100, storage_bytes=5 * 1024**4)],
        # A LEO-like downlink scaled down so the demo finishes in seconds: 200 Mbit/s, 1% loss.
        link={"bandwidth_bps": 200e6, "latency_ms": 20, "loss_rate": 0.01},
        tiering={"version": "1", "flush_max_samples": 5_000, "flush_max_bytes": 8 * 1024**2},
        retention_rules=[
            RetentionRule(data_class="raw", cold_after_days=30, expire_after_days=365),
            RetentionRule(data_class="features", cold_after_days=90, cold_if_unused_days=60),
            RetentionRule(data_class="model_weights", cold_after_days=180, cold_storage_class="GLACIER_IR"),
            RetentionRule(data_class="logs", cold_after_days=30, expire_after_days=400),
            RetentionRule(data_class="checkpoints", cold_after_days=30, expire_after_days=120),
            RetentionRule(data_class="reports", cold_after_days=60),
        ],
        retention={"keep_latest_versions": 3},
    )


def save_blocks(state: localstack.StackState, *, team: str = "geo") -> dict[str, list[str]]:
    """Create or overwrite every block document the flows' defaults name (through `block_setup.apply`)."""
    return apply(setup_of(state, team=team))


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    state = localstack.StackState.load(localstack.DEFAULT_ROOT)
    if state is None:
        print(f"no stack state in {localstack.DEFAULT_ROOT}; run 'make up' first", file=sys.stderr)
        return 1
    register_block_types()
    saved = save_blocks(state)
    print("blocks saved: " + "; ".join(f"{k}: {', '.join(v)}" for k, v in saved.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
