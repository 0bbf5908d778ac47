#!/usr/bin/env bash
# Start (or reuse) the local stack and print the env exports to reach it (`--env-file F`: into F, 0600;
# they hold the admin key and the Prefect API auth string, see docs/SECURITY.md).
set -euo pipefail
cd "$(dirname "$0")/../.."
exec .venv/bin/python -m edgehaul_dev.localstack up "$@"
