#!/usr/bin/env bash
# Idempotent setup of a local .venv: torch 2.13.0 (CPU wheel) first, then the package with its
# test extras, so that no multi-GB CUDA build of torch is pulled in on a CPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
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
