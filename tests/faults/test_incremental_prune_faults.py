"""Fault matrix, "crash during prune" on an incremental root: ``dist-ckpt prune`` SIGKILLed at
each step of a prune that deletes generations and then sweeps shared objects.

The root (tests/helpers/incremental_faults.py): gen 1 with the original frozen base; base1
changed in place before gens 2 and 3, so each of gens 1, 2, 3 holds its own base1 object;
gen 4 reuses gen 3's. base2's object is shared by all four. ``--keep-last 2`` drops gens 1
and 2: two generations deleted, then two objects swept, while base2's object (referenced by
the dropped and the kept generations) and base1's newest must stay.

Each case kills the CLI at one step (the ``after``-th hit of a point): after a manifest
removal, after each generation deletion (the second one is the moment between the
deletions and the sweep), after the sweep's list, after an object is renamed aside, after
each object removal. Then every generation the root lists as committed validates with
digests (the kept ones always), a second prune finishes the job (exactly the kept
generations and their objects remain, no aside file), and restore gives gen 4 bitwise.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dist_ckpt.format.manifest import generation_name
from dist_ckpt.lifecycle.retention import prune
from dist_ckpt.tiers import open_tier
from tests.helpers.incremental_faults import (
    build,
    check_committed,
    object_refs,
    objects_on_disk,
    restored,
    same,
)
from tests.helpers.matrix import record, timed

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
G = generation_name
KEPT = [G(3), G(4)]
CASES = [  # (point, hits let through first)
    ("prune.manifest_removed", 0), ("prune.manifest_removed", 1),
    ("prune.between", 0), ("prune.between", 1),  # the second: between the deletions and the sweep
    ("prune.objects_listed", 0),
    ("prune.object_aside", 0), ("prune.object_aside", 1),
    ("prune.object_removed", 0), ("prune.object_removed", 1),
]


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("incremental-prune") / "root"
    saved = build(str(root), [1, -2, -3, 4])
    return root, saved


@pytest.mark.processes
@pytest.mark.parametrize(("point", "after"), CASES, ids=[f"{p}-{a}" for p, a in CASES])
def test_incremental_prune_killed_at_each_step(template, tmp_path: Path, point: str, after: int) -> None:
    root = str(tmp_path / "root")
    shutil.copytree(template[0], root)
    refs = object_refs(root)
    kept_objects = refs[G(3)] | refs[G(4)]
    dropped_only = (refs[G(1)] | refs[G(2)]) - kept_objects
    assert len(dropped_only) == 2 and len(kept_objects) == 2
    assert refs[G(1)] & kept_objects  # base2's object: referenced by dropped and kept alike

    env = dict(os.environ, PYTHONPATH=REPO,
               DIST_CKPT_FAULTS=json.dumps({point: {"kill": True, "after": after}}))
    killed = subprocess.run([sys.executable, "-m", "dist_ckpt.cli", "prune", root, "--keep-last", "2"],
                            env=env, timeout=120, capture_output=True, text=True)
    assert killed.returncode == -9, killed.stderr  # the point was reached and the kill struck

    listed = check_committed(root)  # every generation still listed as committed is valid
    assert set(KEPT) <= set(listed)
    assert kept_objects <= objects_on_disk(root)  # referenced bytes are never swept
    left_over = sorted(p for p in objects_on_disk(root) - kept_objects)

    _, recover_s = timed(lambda: prune(open_tier(root), keep_last=2))
    assert check_committed(root) == KEPT
    assert objects_on_disk(root) == kept_objects  # the rest swept, no aside file left
    name, tensors = restored(root)
    assert name == G(4) and same(tensors, template[1][G(4)])
    record("crash during prune", observed=f"incremental root, SIGKILL at {point} (hit {after + 1}): "
           f"kept {KEPT} valid with their objects, {len(left_over)} unreferenced file(s) left for "
           "the next prune", recover_s=round(recover_s, 3), point=point, after=after)
