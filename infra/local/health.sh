#!/usr/bin/env bash
# Exit 0 when the Prefect API answers and S3 does a real write/read/delete (edgehaul_dev.localstack.s3_roundtrip).
set -euo pipefail
cd "$(dirname "$0")/../.."
exec .venv/bin/python -m edgehaul_dev.localstack health "$@"
