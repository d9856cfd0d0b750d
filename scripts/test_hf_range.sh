#!/usr/bin/env bash
# The HF Trainer integration at the low end of the [hf] extra's range (pyproject.toml): its
# override points are private, so the tests run at both ends. scripts/test.sh runs them with
# what `pip install -e '.[test]'` resolves (the newest allowed); this script builds .venv-hf-low
# with the oldest allowed accelerate and runs tests/test_integration_hf.py there. .ci/run calls
# it after the suite (outside the suite's budget); run it after changing dist_ckpt/integrations/hf*.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
LOW="transformers==5.25.0 accelerate==1.6.0"
venv=.venv-hf-low
stamp=$venv/.dist-ckpt-setup
want="$(sha256sum pyproject.toml | cut -c1-16) $LOW"
if ! [ -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  [ -x $venv/bin/python ] || "$PYTHON" -m venv $venv
  $venv/bin/python -m pip install -q --upgrade pip >/dev/null
  $venv/bin/python -c "import torch" 2>/dev/null || \
    $venv/bin/python -m pip install -q "torch==${DIST_CKPT_TORCH_VERSION:-2.13.0}"
  # shellcheck disable=SC2086 - LOW is a list of requirements
  $venv/bin/python -m pip install -q -e '.[test]' $LOW
  echo "$want" > "$stamp"
fi
$venv/bin/python -c "import transformers, accelerate; print('hf range, low end: transformers', \
transformers.__version__, 'accelerate', accelerate.__version__)"
exec $venv/bin/python -m pytest -q -p no:cacheprovider tests/test_integration_hf.py "$@"
