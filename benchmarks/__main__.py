"""`make bench`: run every benchmarks/bench_*.py `main()` in turn and collect their output.

    python -m benchmarks            # all
    python -m benchmarks edge core  # only bench_edge.py and bench_core.py
    python -m benchmarks value --help  # what a benchmark measures and its flags (runs nothing)
Set EDGEHAUL_BENCH_QUICK=1 for the short variants.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import time
import traceback
from pathlib import Path


def main(argv: list[str]) -> int:
    here = Path(__file__).parent
    every = sorted(m.name for m in pkgutil.iter_modules([str(here)]) if m.name.startswith("bench_"))
    names = [n for n in every if n.removeprefix("bench_") in argv] if argv else every
    if "-h" in argv or "--help" in argv:
        # A benchmark reads its flags itself and would start a run (an hour or more for some) on any other.
        print(__doc__)
        if names:
            for name in names:
                print(f"=== {name} ===\n{importlib.import_module(f'benchmarks.{name}').__doc__}")
        else:
            print("benchmarks:", " ".join(n.removeprefix("bench_") for n in every))
        return 0
    failed = []
    for name in names:
        print(f"\n=== {name} ===", flush=True)
        t0 = time.perf_counter()
        try:
            importlib.import_module(f"benchmarks.{name}").main()
        except Exception:
            traceback.print_exc()
            failed.append(name)
        print(f"--- {name}: {time.perf_counter() - t0:.1f} s", flush=True)
    if failed:
        print(f"\nfailed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
