#!/usr/bin/env bash
# Set up (idempotent) and run the tests: ruff, then pytest.
#
#   scripts/test.sh            every test, in two pytest sessions side by side on pytest-xdist
#                              workers: the launcher tests two at a time (each starts a chain of
#                              launcher, torchrun agent and workers), beside all the others on
#                              DIST_CKPT_TEST_WORKERS workers (default twice the cores, at most 8:
#                              most of a multi-process test's time is waiting on its ranks). The
#                              launcher session's output follows the other's. What CI runs.
#   scripts/test.sh --quick    the inner loop: tests that start no process (no ranks, torchrun,
#                              interpreter or server), in one process, well under a minute
#
# Any other argument goes to pytest (a path, -k EXPR, -x ...). Every session prints its 25
# slowest tests and the CPU of its costliest test modules; one test over 60 s fails the run
# unless marked @pytest.mark.long(reason=...) (tests/conftest.py). JUnit reports go to
# .test-results/. docs/testing.md has the rules and the budget.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/ruff check dist_ckpt launch scripts tests
# bytecode once, here: every rank, launcher and CLI process of the suite imports these modules
# (PYTHONDONTWRITEBYTECODE, where set, would have each of them compile its own)
.venv/bin/python -m compileall -q dist_ckpt launch scripts tests >/dev/null
# pytest caches its rewritten test modules beside that bytecode (where PYTHONDONTWRITEBYTECODE is
# set, every pytest process would rewrite every test module itself)
unset PYTHONDONTWRITEBYTECODE
# CI (CI=true) must prove the FUSE power-loss rows ran: tests/faults fail instead of skipping
export DIST_CKPT_REQUIRE_FUSE=${DIST_CKPT_REQUIRE_FUSE:-${CI:+1}}
rm -rf .test-results && mkdir -p .test-results
pytest=(.venv/bin/python -m pytest -q --durations=25)
if [ "${1:-}" = "--quick" ]; then
  shift
  exec "${pytest[@]}" -m "not processes" --junitxml=.test-results/quick.xml "$@"
fi
# the uninterrupted runs that launcher tests compare with, computed once for both sessions
DIST_CKPT_TEST_REFERENCES=$(mktemp -d -t dist_ckpt-references-XXXXXX)
export DIST_CKPT_TEST_REFERENCES
# one collection first: it caches the rewritten modules for the workers of both sessions, which
# would otherwise all rewrite them at once
.venv/bin/python -m pytest --collect-only -q -p no:cacheprovider >/dev/null 2>&1 || true
workers=${DIST_CKPT_TEST_WORKERS:-$(( $(nproc) * 2 > 8 ? 8 : $(nproc) * 2 ))}
# the launcher session in the background, its output kept for after the other's
"${pytest[@]}" -n 2 -m launcher --junitxml=.test-results/launcher.xml "$@" \
  > .test-results/launcher.log 2>&1 &
launcher_pid=$!
trap 'kill "$launcher_pid" 2>/dev/null || true; rm -rf "$DIST_CKPT_TEST_REFERENCES"' EXIT
status=0
"${pytest[@]}" -n "$workers" -m "not launcher" --junitxml=.test-results/main.xml "$@" || status=$?
launcher_status=0
wait "$launcher_pid" || launcher_status=$?
trap - EXIT
rm -rf "$DIST_CKPT_TEST_REFERENCES"
echo "================ the launcher tests (their own session, run beside the above) ================"
cat .test-results/launcher.log
# 5: nothing selected (a path or -k that names no test of a session) is no failure
[ "$status" = 5 ] && status=0
[ "$launcher_status" = 5 ] && launcher_status=0
[ "$status" = 0 ] && status=$launcher_status
exit "$status"
