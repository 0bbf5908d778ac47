"""`python -m edgehaul_dev`: one entry point for the development tools the README and Makefile use.

    python -m edgehaul_dev stack up|down|health   the local stack: Prefect server + SeaweedFS (edgehaul_dev.localstack)
    python -m edgehaul_dev deploy [...]           blocks, pools, deployments, automations, workers (edgehaul_dev.deploy)
    python -m edgehaul_dev demo [...]             the data path end to end on the running stack (edgehaul_dev.demo)
    python -m edgehaul_dev drills [...]           fault drills, N trials each (edgehaul_dev.drills)
    python -m edgehaul_dev verify [...]           the operator's acceptance checklist (edgehaul_dev.verify)
    python -m edgehaul_dev settings               the development settings (edgehaul_dev.settings)

`python -m edgehaul_dev <command> --help` shows the command's own options. Each command is the module's `main`,
imported only when it is called, so `--help` answers at once.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "stack": ("edgehaul_dev.localstack", "the local stack: up | down | health"),
    "deploy": ("edgehaul_dev.deploy", "deploy blocks, pools, deployments, automations and workers"),
    "demo": ("edgehaul_dev.demo", "run the data path end to end on the running stack"),
    "drills": ("edgehaul_dev.drills", "fault drills with loss/duplicate accounting"),
    "verify": ("edgehaul_dev.verify", "the operator's acceptance checklist"),
    "settings": ("edgehaul_dev.settings", "the development settings and their sources"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name.ljust(width)}  {what}" for name, (_, what) in COMMANDS.items()]
    return "usage: python -m edgehaul_dev <command> [options]\n\ncommands:\n" + "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return 0 if args else 2
    if args[0] not in COMMANDS:
        print(f"edgehaul_dev: unknown command {args[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[args[0]][0])
    return int(module.main(args[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
