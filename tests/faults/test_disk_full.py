"""A full disk: the free-space preflight refuses a save that cannot fit, and a save that
runs out of space mid-write fails cleanly, leaving every committed generation intact."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.processes

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_full_disk_refuses_then_fails_cleanly(tmp_path) -> None:
    root = str(tmp_path / "ckpt")
    os.makedirs(root)
    # a private mount namespace: the 3 MiB tmpfs vanishes with the process
    script = (f"mount -t tmpfs -o size=3m tmpfs {root} && "
              f"exec {sys.executable} tests/helpers/space_job.py {root}")
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    proc = subprocess.run(["unshare", "-m", "sh", "-c", script], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(next(line[len("RESULT "):] for line in proc.stdout.splitlines()
                             if line.startswith("RESULT ")))
    committed = result["committed_before"]
    # each generation is about 0.5 MiB: the preflight stops before the tmpfs is full
    assert 3 <= len(committed) <= 5 and result["refused_at"] == len(committed) + 1
    assert "needed" in result["refusal"] and "rank 0" in result["refusal"]
    # without the preflight the write hits ENOSPC: a clean failure, nothing half-visible
    assert result["disk_full_error"] is not None and "No space left" in result["disk_full_error"]
    assert result["unchanged"]
    assert result["entries_after"] == committed + ["latest.json"]
    assert result["restored"] == committed[-1]
