#!/usr/bin/env bash
# Stop the local stack's own processes (by recorded PID) and clean its stale sockets.
set -euo pipefail
cd "$(dirname "$0")/../.."
exec .venv/bin/python -m edgehaul_dev.localstack down "$@"
