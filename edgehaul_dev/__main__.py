"""`python -m edgehaul_dev stack|deploy|demo|drills|verify ...`: the harness's commands."""

from __future__ import annotations

import sys

from edgehaul_dev.cli import main

if __name__ == "__main__":
    sys.exit(main())
