#!/usr/bin/env bash
# Set up (idempotent) and run the tests: ruff, then pytest.
#
#   scripts/test.sh            the whole suite, tests side by side on DIST_CKPT_TEST_WORKERS
#                              pytest-xdist workers (default: cores + 1; most of a multi-process
#                              test's time is waiting on its ranks); what CI runs
#   scripts/test.sh --quick    the inner loop: tests that start no process (no ranks, torchrun,
#                              interpreter or server), in one process, about half a minute
#
# Any other argument goes to pytest (a path, -k EXPR, -x ...). Every run prints the 25 slowest
# tests; one over 60 s fails the run unless marked @pytest.mark.long(reason=...)
# (tests/conftest.py). The JUnit report is written to .test-results/junit.xml.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/ruff check dist_ckpt launch scripts tests
# bytecode once, here: every rank, launcher and CLI process of the suite imports these modules
# (PYTHONDONTWRITEBYTECODE, where set, would have each of them compile its own)
.venv/bin/python -m compileall -q dist_ckpt launch scripts tests >/dev/null
# CI (CI=true) must prove the FUSE power-loss rows ran: tests/faults fail instead of skipping
export DIST_CKPT_REQUIRE_FUSE=${DIST_CKPT_REQUIRE_FUSE:-${CI:+1}}
mkdir -p .test-results
args=(--durations=25 --junitxml=.test-results/junit.xml)
if [ "${1:-}" = "--quick" ]; then
  shift
  exec .venv/bin/python -m pytest -q -m "not processes" "${args[@]}" "$@"
fi
workers=${DIST_CKPT_TEST_WORKERS:-$(( $(nproc) + 1 ))}
exec .venv/bin/python -m pytest -q -n "$workers" --dist worksteal "${args[@]}" "$@"
