#!/usr/bin/env bash
# Idempotent setup of a local .venv: torch 2.13.0 (CPU wheel) first, then the package with its
# test extras, so that no multi-GB CUDA build of torch is pulled in on a CPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# the power-loss tests mount a FUSE filesystem: libfuse3 (Debian fuse3) where it is missing
if ! ldconfig -p 2>/dev/null | grep -q libfuse3.so; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get install -y -q fuse3 >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q fuse3 >/dev/null 2>&1; } \
      || echo "setup: could not install fuse3; the power-loss tests will be skipped" >&2
  else
    echo "setup: libfuse3 is missing (apt-get install fuse3); the power-loss tests will be skipped" >&2
  fi
fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
stamp=.venv/.dist-ckpt-setup
want="$(sha256sum pyproject.toml | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && .venv/bin/python -c "import torch, dist_ckpt" 2>/dev/null; then
  exit 0
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/python -m pip install -q "torch==${DIST_CKPT_TORCH_VERSION:-2.13.0}"
fi
.venv/bin/python -m pip install -q -e '.[test]'
echo "$want" > "$stamp"
