"""A node's files are its owner's alone: state dir, spool and everything a node writes (on main at e80770e
the state dir and spool were 0755, readable by every user of the host)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path


def _loose(root: Path) -> list[str]:
    return [f"{p.relative_to(root)} {stat.S_IMODE(p.stat().st_mode):04o}" for p in [root, *root.rglob("*")]
            if not p.is_symlink() and p.stat().st_mode & 0o077]


def test_a_node_process_leaves_nothing_readable_by_others(tmp_path: Path) -> None:
    root = tmp_path / "node"
    (root / "spool").mkdir(parents=True, mode=0o755)
    (root / "spool").chmod(0o755)
    root.chmod(0o755)
    (root / "node.json").write_text("{}")
    (root / "node.json").chmod(0o644)  # what an earlier version left
    # the node process: the same call `edgehaul node run` makes first, then what its runs write
    code = textwrap.dedent(f"""
        import os
        from pathlib import Path
        from edgehaul.node import owner_only
        from edgehaul.blocks import EdgeNode
        from edgehaul.edge.outbox import node_outbox
        from edgehaul.edge.spool import Spool
        from edgehaul import events
        root = Path({str(root)!r})
        owner_only(root, umask=True)
        box = node_outbox(root / "spool", "node-a")
        box.append(events.LINK_STATS, {{"level": 1}})
        Spool.from_block(EdgeNode(node_id="node-a", spool_dir=str(root / "spool")))
        (root / "logs").mkdir()
        (root / "logs" / "server.log").write_text("x")
    """)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)
    created = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
    assert "spool/outbox.sqlite" in created and "logs/server.log" in created and len(created) > 4, created
    assert _loose(root) == []
