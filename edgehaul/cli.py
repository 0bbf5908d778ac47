"""The `edgehaul` command: the product's operator commands, in a source checkout or a wheel install.

    edgehaul settings             the effective settings (environment / .env) and where each comes from
    edgehaul store check <block>  probe an S3 endpoint for every feature the product uses; record it
    edgehaul blocks apply <file>  create every block the flows load from one YAML file (docs/STORAGE.md)
    edgehaul automations [...]    create or update the alert automations on the Prefect server
    edgehaul gateway [...]        run the signed webhook gateway (ground stations -> Prefect events)
    edgehaul node init|run        an edge node on its own: its own Prefect server, blocks and schedules
    edgehaul metrics serve [...]  the fleet view (fleet_report's latest) as OpenMetrics on /metrics
    edgehaul quarantine list      quarantined bundles: bundle, node, reason, samples, age (--node, --reason)
    edgehaul quarantine readmit BUNDLE... --reason TEXT [--by NAME]
                                  back to landing for the next core_ingest to validate (audited)
    edgehaul downlink publish --node N... [--model NAME] [--policy BLOCK] [--contract ID]
                                  send the core's model / tiering policy / contract to nodes
    edgehaul downlink sync --node N --state-dir DIR
                                  on a node: fetch, verify and apply its newest update (atomic)
    edgehaul downlink status --state-dir DIR
                                  on a node: the generation in force and its items

`edgehaul <command> --help` shows the command's own options. Each command is a module's `main` (quarantine:
`quarantine_main` below, over `edgehaul.core.quarantine`),
imported only when it is called, so `edgehaul --help` answers at once. The development commands
(local stack, demo, drills, verify) are not part of the product: `python -m edgehaul_dev` in a checkout.
"""

from __future__ import annotations

import argparse
import getpass
import importlib
import sys
from datetime import UTC, datetime

COMMANDS = {
    "settings": ("edgehaul.platform.settings", "the effective settings and their sources"),
    "store": ("edgehaul.ops.store_probe", "check <block>: probe the store's S3 features, print and record them"),
    "blocks": ("edgehaul.services.block_setup", "apply <file>: create every block the flows load from a YAML file"),
    "automations": ("edgehaul.services.automations", "create or update the alert automations"),
    "gateway": ("edgehaul.services.gateway", "run the signed webhook gateway"),
    "node": ("edgehaul.node", "init --config FILE | run --state-dir DIR: an edge node on its own (own Prefect server)"),
    "metrics": ("edgehaul.ops.metrics_endpoint", "serve: the fleet view as OpenMetrics for Prometheus"),
    "quarantine": ("edgehaul.cli", "list | readmit BUNDLE... --reason TEXT: quarantined bundles, audited re-admission"),
    "downlink": ("edgehaul.cli", "publish | sync | status: models, policies and contracts sent to nodes"),
}
VERBS = {"store": "check", "blocks": "apply"}
DEV_COMMANDS = ("stack", "deploy", "demo", "drills", "verify")


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name.ljust(width)}  {what}" for name, (_, what) in COMMANDS.items()]
    return ("usage: edgehaul <command> [options]\n\ncommands:\n" + "\n".join(lines)
            + f"\n\ndevelopment ({', '.join(DEV_COMMANDS)}): python -m edgehaul_dev <command>, in a source checkout")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return 0 if args else 2
    if args[0] in DEV_COMMANDS:
        print(f"edgehaul: {args[0]!r} is a development command: run `python -m edgehaul_dev {args[0]}` "
              "in a source checkout", file=sys.stderr)
        return 2
    if args[0] not in COMMANDS:
        print(f"edgehaul: unknown command {args[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    rest = args[1:]
    verb = VERBS.get(args[0])
    if verb:  # `store check ...`, `blocks apply ...`: one verb each so far
        if not rest or rest[0] != verb:
            print(f"usage: edgehaul {args[0]} {verb} ... (edgehaul {args[0]} {verb} --help)", file=sys.stderr)
            return 2
        rest = rest[1:]
    if args[0] == "quarantine":
        return quarantine_main(rest)
    if args[0] == "downlink":
        return downlink_main(rest)
    module = importlib.import_module(COMMANDS[args[0]][0])
    return int(module.main(rest) or 0)


def _age(iso: str, now: datetime) -> str:
    s = max(0.0, (now - datetime.fromisoformat(iso)).total_seconds())
    return f"{s / 86400:.1f}d" if s >= 86400 else f"{s / 3600:.1f}h" if s >= 3600 else f"{s / 60:.0f}m"


def quarantine_main(argv: list[str]) -> int:
    """`edgehaul quarantine list|readmit`: the operator's view of quarantine (edgehaul.core.quarantine)."""
    from edgehaul.blocks import ObjectStore
    from edgehaul.core import quarantine
    from edgehaul.platform.block_loading import load_block
    from edgehaul.platform.roles import StoreBlock

    ap = argparse.ArgumentParser(prog="edgehaul quarantine", description="List quarantined bundles; re-admit them.")
    ap.add_argument("--store-block", default=StoreBlock.ADMIN.value,
                    help="ObjectStore block (default: the operator's 'central'; re-admission writes landing)")
    sub = ap.add_subparsers(dest="verb", required=True)
    ls = sub.add_parser("list", help="bundle, node, reason, samples, age")
    ls.add_argument("--node", help="only this node's bundles")
    ls.add_argument("--reason", help="only this rejection reason, e.g. expectations")
    ra = sub.add_parser("readmit", help="back to landing, validated again by the next core_ingest")
    ra.add_argument("bundles", nargs="+", metavar="BUNDLE")
    ra.add_argument("--reason", required=True, help="why (the fix), kept in the audit record")
    ra.add_argument("--by", default=getpass.getuser(), help="who asks (default: this user)")
    a = ap.parse_args(argv)
    store = load_block(ObjectStore, a.store_block, param="--store-block")
    if a.verb == "list":
        now = datetime.now(UTC)
        records = quarantine.list_quarantined(store, node=a.node, reason=a.reason)
        print(f"{'bundle':34} {'node':16} {'reason':18} {'samples':>7} {'age':>6}")
        for r in records:
            print(f"{r.bundle_id:34} {r.node_id:16} {r.reason:18} {len(r.sample_ids):7d} {_age(r.quarantined_at, now):>6}")
        print(f"{len(records)} quarantined", file=sys.stderr)
        return 0
    try:
        done = quarantine.readmit(store, a.bundles, why=a.reason, by=a.by)
    except quarantine.QuarantineError as e:
        print(f"edgehaul quarantine readmit: {e}", file=sys.stderr)
        return 1
    for d in done:
        print(f"re-admitted {d.bundle_id} ({d.node_id}) -> {', '.join(d.moved.values())}; audit {d.audit_key}")
    return 0


def downlink_main(argv: list[str]) -> int:
    """`edgehaul downlink publish|sync|status` over `edgehaul.downlink`."""
    import json
    from pathlib import Path

    from edgehaul import downlink
    from edgehaul.blocks import ObjectStore, TieringPolicy
    from edgehaul.contracts import contract_by_id
    from edgehaul.platform.block_loading import load_block
    from edgehaul.platform.roles import StoreBlock

    ap = argparse.ArgumentParser(prog="edgehaul downlink", description="What the core sends to edge nodes.")
    sub = ap.add_subparsers(dest="verb", required=True)
    pub = sub.add_parser("publish", help="publish the next generation for each node")
    pub.add_argument("--node", action="append", required=True, help="node id (repeat for several)")
    pub.add_argument("--model", help="published model name to send (its latest), e.g. landcover")
    pub.add_argument("--policy", help="TieringPolicy block to send (as the node's 'tiering' policy)")
    pub.add_argument("--contract", action="append", default=[], help="contract id to send, e.g. landsat_patch.v1")
    pub.add_argument("--note", default="", help="why, kept in the update")
    pub.add_argument("--store-block", default=StoreBlock.ADMIN.value, help="ObjectStore block that writes ops")
    sy = sub.add_parser("sync", help="on a node: fetch, verify and apply its newest update")
    sy.add_argument("--node", required=True)
    sy.add_argument("--state-dir", required=True, type=Path, help="the node's state dir (its spool dir)")
    sy.add_argument("--store-block", required=True, help="the node's own ObjectStore block")
    st = sub.add_parser("status", help="on a node: the generation in force")
    st.add_argument("--state-dir", required=True, type=Path)
    a = ap.parse_args(argv)
    if a.verb == "status":
        cur = downlink.root(a.state_dir) / "current"
        if not cur.exists():
            print("no update applied yet")
            return 0
        up = downlink.Update.parse((cur / "update.json").read_bytes(), str(cur))
        print(f"generation {up.generation} (published {up.published}) {up.note}")
        for i in up.items:
            print(f"  {i.kind:8} {i.name:24} {i.version:28} {i.size:>10} B  sha256 {i.sha256[:12]}")
        return 0
    store = load_block(ObjectStore, a.store_block, param="--store-block")
    try:
        if a.verb == "sync":
            res = downlink.sync(store, a.node, a.state_dir)
            if res.refused:
                print(f"refused generation {res.refused}: {res.why}", file=sys.stderr)
                return 1
            print(f"applied generation {res.applied}: {', '.join(res.items)}" if res.applied else "up to date")
            return 0
        items: list[tuple[str, downlink.Kind, str, bytes]] = []
        if a.model:
            from edgehaul.training import registry

            pointer, _ = registry.read_json(store, registry.latest_uri(store, a.model))
            items.append((a.model, "model", str(pointer["model_id"]),
                          registry.read_model_bytes(store, str(pointer["model_uri"]))))
        if a.policy:
            pol = load_block(TieringPolicy, a.policy, param="--policy")
            items.append(("tiering", "policy", pol.version, json.dumps(pol.model_dump(mode="json")).encode()))
        for cid in a.contract:
            c = contract_by_id(cid)
            items.append((c.id, "contract", c.id, Path(c.source).read_bytes()))
        if not items:
            ap.error("publish: nothing to send (--model, --policy or --contract)")
        for node in a.node:
            up = downlink.publish_update(store, node, items, note=a.note)
            print(f"{node}: generation {up.generation}: {', '.join(f'{k}/{n}@{v}' for n, k, v, _ in items)}")
    except downlink.DownlinkError as e:
        print(f"edgehaul downlink {a.verb}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
