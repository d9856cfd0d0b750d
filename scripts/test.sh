#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite: ruff, then pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/ruff check dist_ckpt launch scripts tests
# CI (CI=true) must prove the FUSE power-loss rows ran: tests/faults fail instead of skipping
export DIST_CKPT_REQUIRE_FUSE=${DIST_CKPT_REQUIRE_FUSE:-${CI:+1}}
exec .venv/bin/python -m pytest -q "$@"
