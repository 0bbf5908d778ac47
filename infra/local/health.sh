#!/usr/bin/env bash
# Exit 0 when the Prefect API and the S3 endpoint both answer.
set -euo pipefail
cd "$(dirname "$0")/../.."
exec .venv/bin/python -m edgehaul_dev.localstack health "$@"
