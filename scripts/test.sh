#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite: ruff, then pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/ruff check dist_ckpt launch scripts tests
exec .venv/bin/python -m pytest -q "$@"
