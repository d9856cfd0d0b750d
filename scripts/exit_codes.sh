#!/usr/bin/env bash
# Exit codes of N consecutive 2-rank runs of the example job under plain torchrun (no
# launcher, so a teardown abort shows): prints one line per run and the counts.
#   scripts/exit_codes.sh 40 [extra train_example.py args]
# REPO=DIR measures another checkout of this project (its scripts/train_example.py and package).
set -u
runs=${1:?number of runs}; shift
here=$(cd "$(dirname "$0")/.." && pwd)
repo=${REPO:-$here}
python=${PYTHON:-$here/.venv/bin/python}
out=$(mktemp -d /tmp/exit-codes.XXXXXX)
for i in $(seq 1 "$runs"); do
  root="$out/root$i"
  DIST_CKPT_ROOT=$root PYTHONPATH=$repo OMP_NUM_THREADS=1 timeout 180 "$python" -m torch.distributed.run \
    --standalone --nproc-per-node 2 "$repo/scripts/train_example.py" --updates 8 --save-every 2 \
    --async-save "$@" > "$out/run$i.log" 2>&1
  rc=$?
  workers=$(grep -oE "exitcode {2,}: *-?[0-9]+" "$out/run$i.log" | grep -oE -- "-?[0-9]+$" | tr '\n' ',')
  aborts=$(grep -c "terminate called" "$out/run$i.log")
  echo "run $i: torchrun exit $rc, failed workers' exit codes [${workers%,}], terminate messages $aborts"
  rm -rf "$root"
done | tee "$out/summary.txt"
echo "== torchrun exit codes over $runs runs (logs in $out)"
grep -oE "torchrun exit -?[0-9]+" "$out/summary.txt" | sort | uniq -c
