#!/usr/bin/env bash
# Set up (idempotent) and run the demo: a 2-rank FSDP2 job on gloo saves and stops, then a
# 3-rank job resumes from the newest valid generation and checks the loaded tensors; then the
# launcher runs the example job, one worker is SIGKILLed, and the launcher restarts it to DONE.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
root=${DEMO_ROOT:-demo-run}
rm -rf "$root"
run() { .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node "$1" scripts/demo_train.py --root "$root" "${@:2}"; }
echo "== phase 1: 2 ranks train 6 updates, saving every 3, then stop"
run 2 --until 6 --save-every 3
echo "== phase 2: 3 ranks resume and train to update 9"
run 3 --until 9 --save-every 3
.venv/bin/dist-ckpt ls "$root/ckpt"
echo "== phase 3: python -m launch; a worker is SIGKILLed at update 10; the launcher restarts the job"
echo "   (planned: torchrun logs the kill as 'failed (exitcode: -9)', the other rank says a peer left)"
.venv/bin/python -m launch --checkpoint-root "$root/launch" --backoff 2 --standalone --nproc-per-node 2 \
  scripts/train_example.py --updates 24 --save-every 4 --crash-at 10 --crash-marker "$root/launch/crashed"
.venv/bin/dist-ckpt ls "$root/launch/runs/$(cat "$root/launch/current")"
echo "== verify: sizes and digests of the run's newest generation (exit 1 if it is damaged)"
.venv/bin/dist-ckpt verify "$root/launch/runs/$(cat "$root/launch/current")"
cat <<NEXT
== what to try next
- a longer job under the launcher, and kill -9 one of the worker pids it prints: README, "Running a job under the launcher"
- flip a byte in a shard under $root/launch/runs/*/gen-*/dcp/ and run dist-ckpt verify again: docs/cli.md
- the fault-injection matrix, one table of what breaks and what survives: .venv/bin/python scripts/fault_matrix.py
NEXT
