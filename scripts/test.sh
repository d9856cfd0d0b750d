#!/usr/bin/env bash
# Set up (idempotent) and run the tests: ruff, then pytest.
#
#   scripts/test.sh            every test, in two pytest sessions side by side on pytest-xdist
#                              workers: first all but the launcher tests (DIST_CKPT_TEST_WORKERS,
#                              default twice the cores, at most 8: most of a multi-process test's
#                              time is waiting on its ranks), then the launcher tests two at a
#                              time (each starts chains of fresh interpreters; more at once only
#                              stretches every one). What CI runs.
#   scripts/test.sh --quick    the inner loop: tests that start no process (no ranks, torchrun,
#                              interpreter or server), in one process, about half a minute
#
# Any other argument goes to pytest (a path, -k EXPR, -x ...). Every session prints its 25
# slowest tests; one over 60 s fails the run unless marked @pytest.mark.long(reason=...)
# (tests/conftest.py). JUnit reports go to .test-results/. docs/testing.md has the rules.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/ruff check dist_ckpt launch scripts tests
# bytecode once, here: every rank, launcher and CLI process of the suite imports these modules
# (PYTHONDONTWRITEBYTECODE, where set, would have each of them compile its own)
.venv/bin/python -m compileall -q dist_ckpt launch scripts tests >/dev/null
# CI (CI=true) must prove the FUSE power-loss rows ran: tests/faults fail instead of skipping
export DIST_CKPT_REQUIRE_FUSE=${DIST_CKPT_REQUIRE_FUSE:-${CI:+1}}
rm -rf .test-results && mkdir -p .test-results
pytest=(.venv/bin/python -m pytest -q --durations=25)
if [ "${1:-}" = "--quick" ]; then
  shift
  exec "${pytest[@]}" -m "not processes" --junitxml=.test-results/quick.xml "$@"
fi
workers=${DIST_CKPT_TEST_WORKERS:-$(( $(nproc) * 2 > 8 ? 8 : $(nproc) * 2 ))}
status=0
"${pytest[@]}" -n "$workers" -m "not launcher" --junitxml=.test-results/main.xml "$@" || status=$?
# 5: nothing selected (a path or -k without launcher tests) is no failure
"${pytest[@]}" -n 2 -m launcher --junitxml=.test-results/launcher.xml "$@" || {
  code=$?; [ "$code" = 5 ] || status=$code; }
[ "$status" = 5 ] && status=0
exit "$status"
