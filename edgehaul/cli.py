"""The `edgehaul` command: the product's operator commands, in a source checkout or a wheel install.

    edgehaul settings             the effective settings (environment / .env) and where each comes from
    edgehaul store check <block>  probe an S3 endpoint for every feature the product uses; record it
    edgehaul blocks apply <file>  create every block the flows load from one YAML file (docs/STORAGE.md)
    edgehaul automations [...]    create or update the alert automations on the Prefect server
    edgehaul gateway [...]        run the signed webhook gateway (ground stations -> Prefect events)

`edgehaul <command> --help` shows the command's own options. Each command is a module's `main`,
imported only when it is called, so `edgehaul --help` answers at once. The development commands
(local stack, demo, drills, verify) are not part of the product: `python -m edgehaul_dev` in a checkout.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "settings": ("edgehaul.platform.settings", "the effective settings and their sources"),
    "store": ("edgehaul.ops.store_probe", "check <block>: probe the store's S3 features, print and record them"),
    "blocks": ("edgehaul.platform.block_setup", "apply <file>: create every block the flows load from a YAML file"),
    "automations": ("edgehaul.platform.automations", "create or update the alert automations"),
    "gateway": ("edgehaul.platform.gateway", "run the signed webhook gateway"),
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
    module = importlib.import_module(COMMANDS[args[0]][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
