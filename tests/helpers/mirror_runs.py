"""Running ``tests/helpers/mirror_job.py`` in a subprocess, and what the mirror then holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from dist_ckpt.format.inventory import inventory
from dist_ckpt.storage.objectstore import ObjectStore

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FILES_PER_GENERATION = 4  # one shard, .metadata, train_state.json, rank-00000.json


def run_job(root: str, mirror: str, updates: list[int], faults: dict | None = None,
            hold: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, DIST_CKPT_FAULTS=json.dumps(faults or {}), MIRROR_JOB_HOLD=hold or "")
    return subprocess.run([sys.executable, "-m", "tests.helpers.mirror_job", root, mirror,
                           *map(str, updates)],
                          env=env, capture_output=True, text=True, timeout=120,
                          cwd=REPO)


def remote_states(mirror: str) -> dict[str, str]:
    return {i.name: i.state for i in inventory(ObjectStore(mirror), digests=False)}
