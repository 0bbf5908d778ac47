#!/usr/bin/env bash
# Rotate one identity's S3 key on the local stack (old key refused at once, queued spool data kept):
#   infra/local/rotate_key.sh node-a [--root .edgehaul-stack] [--spool /path/to/node-a/spool]
set -euo pipefail
cd "$(dirname "$0")/../.."
exec .venv/bin/python -m edgehaul_dev.credentials "$@"
