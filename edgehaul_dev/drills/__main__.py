"""`python -m edgehaul_dev.drills [...]`: the same as `python -m edgehaul_dev drills [...]`."""

from edgehaul_dev.drills.runner import main

raise SystemExit(main())
