"""Fault drills: inject a fault at many points, then account for every sample by id.

Each drill runs `trials` independent pipelines (own spool folder, own object-store prefix, own Delta
table) against a SeaweedFS started for the drills (never the session stack); the store-down drill
stops and restarts a second one, so it runs beside the others. A trial drives the product's own entry
points, the ones its flows and tasks call: the edge ingest (`edgehaul.edge.batch.ingest_batch`) and
the spool (`Spool`), the uplink (`Drainer`, `Uplink`, `RetryQueue`), core ingest's steps
(`edgehaul.core.ingest`: read manifests, validate, quarantine, commit) and the trainer
(`edgehaul.training.launch.run`); it injects its fault, lets the pipeline recover the way an
operator's next run would, and then checks by sample id that every sample offered to an edge spool is
in exactly one place (`accounting`). Nothing in this package validates, quarantines, commits or
trains by itself (tests/system/test_drills.py checks that).

Modules: `pipeline` (the product path a trial runs), `accounting` (where is each sample),
`env` (the private SeaweedFS servers, bundle pools, kill -9 workers), one module per drill family
(`edge`, `uplink`, `core`, `training`), `runner` (chains of trials, the CLI) and `report`.

    python -m edgehaul_dev drills [--trials N] [--only NAME ...] [--markdown docs/DRILLS.md]
"""

from edgehaul_dev.drills.accounting import Accounting, account
from edgehaul_dev.drills.env import DrillEnv, PoolBundle, _rows, build_pool
from edgehaul_dev.drills.pipeline import KIND, drain, fast_profile, ingest_landed, open_spool, validate_many
from edgehaul_dev.drills.report import NOTES_HEADING, DrillResult, TrialResult, render_markdown, table_text, with_notes
from edgehaul_dev.drills.runner import DEFAULT_TRIALS, DRILLS, main, run_drills

__all__ = [
    "DEFAULT_TRIALS", "DRILLS", "KIND", "NOTES_HEADING", "Accounting", "DrillEnv", "DrillResult", "PoolBundle",
    "TrialResult", "_rows", "account", "build_pool", "drain", "fast_profile", "ingest_landed", "main", "open_spool",
    "render_markdown", "run_drills", "table_text", "validate_many", "with_notes",
]
