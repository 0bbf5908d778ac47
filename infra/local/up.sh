#!/usr/bin/env bash
# Start (or reuse) the local stack and print the env exports to reach it.
set -euo pipefail
cd "$(dirname "$0")/../.."
exec .venv/bin/python -m edgehaul_dev.localstack up "$@"
