"""Settings of the development harness (local stack, demo, drills), beside the product's own.

Same rules as `edgehaul.platform.settings` (typed, described, `EDGEHAUL_*`, `.env`, a bad value names
the variable); the product never reads these. `python -m edgehaul_dev.settings` prints them.
"""

from __future__ import annotations

import sys
from pathlib import Path

from pydantic import Field, PositiveInt, SecretStr
from pydantic_settings import SettingsConfigDict

from edgehaul.platform.settings import ENV_FILE, EnvSettings, SettingsError, cached, describe, load, print_table


class DevSettings(EnvSettings):
    model_config = SettingsConfigDict(
        env_prefix="EDGEHAUL_", env_file=ENV_FILE, env_ignore_empty=True, extra="ignore", frozen=True,
    )

    stack_dir: Path = Field(
        default_factory=lambda: Path.cwd() / ".edgehaul-stack",
        description="Folder of the local stack: data, logs, PIDs, state.json with generated credentials "
                    "(the Makefile sets it to <checkout>/.edgehaul-stack).")
    prefect_port: int = Field(
        default=4200, ge=0, le=65535,
        description="Prefect server port of `stack up` (0: a free port). Set it, with EDGEHAUL_S3_PORT, for a "
                    "second stack on the same host; SeaweedFS's internal ports are always chosen free.")
    s3_port: int = Field(default=8333, ge=0, le=65535, description="S3 (SeaweedFS) port of `stack up` (0: a free port).")
    prefect_db_url: SecretStr | None = Field(
        default=None, description="Database of the stack's Prefect server, e.g. postgresql+asyncpg://... "
                                  "(unset: SQLite in the stack folder).")
    api_auth: bool = Field(default=True, description="0: `stack up` on a fresh stack leaves the Prefect API open "
                                                     "(no auth string; not recommended, docs/SECURITY.md).")
    demo_samples: PositiveInt = Field(default=20_000, description="Samples per node of `demo`.")
    drill_trials: PositiveInt | None = Field(
        default=None, description="Trials per fault drill (unset: 50 for `drills`, 4 in the test suite).")
    drill_parallel: PositiveInt = Field(default=8, description="Drill trials run at once.")


dev_settings = cached(DevSettings)


def main(argv: list[str] | None = None) -> int:
    try:
        print_table(describe(load(DevSettings)))
    except SettingsError as e:
        print(f"edgehaul_dev settings: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
