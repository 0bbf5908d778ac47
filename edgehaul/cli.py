"""The `edgehaul` command: one entry point for the operator tools the README and Makefile use.

    edgehaul stack up|down|health   the local stack: Prefect server + SeaweedFS (edgehaul.localstack)
    edgehaul deploy [...]           blocks, pools, deployments, automations, workers (edgehaul.deploy)
    edgehaul demo [...]             the data path end to end on the running stack (edgehaul.demo)
    edgehaul drills [...]           fault drills, N trials each (edgehaul.drills)
    edgehaul verify [...]           the operations guide's acceptance checklist (edgehaul.verify)

`edgehaul <command> --help` shows the command's own options. Each command is the module's `main`,
imported only when it is called, so `edgehaul --help` answers at once.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "stack": ("edgehaul.localstack", "the local stack: up | down | health"),
    "deploy": ("edgehaul.deploy", "deploy blocks, pools, deployments, automations and workers"),
    "demo": ("edgehaul.demo", "run the data path end to end on the running stack"),
    "drills": ("edgehaul.drills", "fault drills with loss/duplicate accounting"),
    "verify": ("edgehaul.verify", "the operations guide's acceptance checklist"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name.ljust(width)}  {what}" for name, (_, what) in COMMANDS.items()]
    return "usage: edgehaul <command> [options]\n\ncommands:\n" + "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return 0 if args else 2
    if args[0] not in COMMANDS:
        print(f"edgehaul: unknown command {args[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[args[0]][0])
    return int(module.main(args[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
