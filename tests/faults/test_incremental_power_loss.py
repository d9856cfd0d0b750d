"""Fault matrix, power loss during an incremental save: the power cut after each persistence
point of a save that installs shared objects (tests/helpers/powerfs.py, as in
test_power_loss.py), on a fine-tuning job at world size 1 (tests/helpers/incremental_faults.py).

Three saves are cut, each after every one of its points in turn (N points: N cuts):

* ``first``: the first save into an empty root: ``objects/`` is created, both base objects
  installed;
* ``rewrite``: a fresh job (no ledger) saves over a root whose gen 1 holds the same base: every
  object is written anew and installed over the name that gen 1 references;
* ``reuse``: the same job saves again after changing base1 in place: base2 is reused (not
  written), base1's new object installed.

After each cut: every generation committed before the cut save validates with digests; the
cut one is either absent (not committed) or committed and valid with digests, and present
once the cut is after its last point or after a cut that already kept it; every object a
committed generation lists is there, and no copy of one is left inside a generation's
directory; restore yields the newest of them, bitwise.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from dist_ckpt.format.manifest import generation_name
from tests.helpers.finetune_jobs import Job, manager
from tests.helpers.incremental_faults import (
    Tensors,
    build,
    change_base,
    check_committed,
    model_tensors,
    object_refs,
    objects_on_disk,
    restored,
    same,
)
from tests.helpers.matrix import record
from tests.helpers.powerfs import PowerFS

pytestmark = pytest.mark.usefixtures("require_fuse")
G = generation_name


@dataclass
class Case:
    template: list[int]  # saved on a plain directory first (durable baseline)
    unarmed: list[int]  # saved through the mount by the job before the cut save
    cut: int  # the update of the save that is cut (negative: change base1 first)

    @property
    def name(self) -> str:
        return G(abs(self.cut))


CASES = {"first": Case([], [], 1), "rewrite": Case([1], [], 2), "reuse": Case([1], [2], -3)}


@dataclass
class Outcome:
    points: list[tuple[str, str]]
    violations: list[str] = field(default_factory=list)
    kept_from: int | None = None


def save_through(backing: Path, case: Case, arm_after: int | None) -> tuple[list[tuple[str, str]],
                                                                          dict[str, Tensors]]:
    """The case's saves through a PowerFS over ``backing``, the last one armed ``arm_after``
    points in (None: never frozen), then the cut. Returns the cut save's points and the
    tensors each generation saved by this job holds."""
    saved: dict[str, Tensors] = {}
    with PowerFS(backing) as fs:
        job = Job("plain", 0, 1)
        for _ in range(max(case.template, default=0)):
            job.step()  # the same history as the template's job
        with manager(job, os.path.join(fs.mountpoint, "root")) as mgr:
            for update in [*case.unarmed, case.cut]:
                job.step()
                if update < 0:
                    change_base(job)
                base = fs.points()
                if update == case.cut and arm_after is not None:
                    fs.arm(after=base + arm_after)
                try:
                    mgr.save(abs(update))
                    mgr.wait()
                except Exception:  # noqa: BLE001 - a save may fail past a cut; the check judges
                    pass
                saved[G(abs(update))] = model_tensors(job)
            log = fs.log()[base:]
        fs.cut()
    return log, saved


def check(root: str, case: Case, saved: dict[str, Tensors], required: bool) -> tuple[bool, list[str]]:
    """The promise on one rebuilt root; returns (the cut generation is committed, violations)."""
    problems: list[str] = []
    before = [G(u) for u in case.template + case.unarmed]
    try:
        committed = check_committed(root)
    except Exception as exc:  # noqa: BLE001 - a violation, reported with the others
        return False, [f"a committed generation does not validate: {exc}"]
    problems += [f"committed {name} lost" for name in before if name not in committed]
    extra = set(committed) - set(before) - {case.name}
    problems += [f"unexpected generation {name}" for name in sorted(extra)]
    kept = case.name in committed
    if required and not kept:
        problems.append(f"{case.name} lost: its save had returned, or an earlier cut kept it")
    missing = set().union(*object_refs(root, committed).values()) - objects_on_disk(root)
    problems += [f"referenced object missing: {path}" for path in sorted(missing)]
    for gen in committed:  # objects live in ROOT/objects only: no durable copy left behind
        stray = os.path.join(root, gen, "objects")
        if os.path.isdir(stray) and os.listdir(stray):
            problems.append(f"{gen}/objects holds copies of installed objects: {os.listdir(stray)}")
    name, tensors = restored(root)
    newest = committed[-1] if committed else None
    if name != newest:
        problems.append(f"restored {name}, not the newest committed {newest}")
    elif name is not None and not same(tensors, saved[name]):
        problems.append(f"restored {name} holds other tensors than were saved")
    return kept, problems


@pytest.mark.timeout(120)
@pytest.mark.parametrize("which", list(CASES))
def test_incremental_save_cut_at_each_persistence_point(tmp_path: Path, which: str) -> None:
    case = CASES[which]
    started = time.monotonic()
    template = tmp_path / "template"
    (template / "root").mkdir(parents=True)  # the root itself exists durably (as in test_power_loss)
    saved_before = build(str(template / "root"), case.template) if case.template else {}
    runs = 0

    def fresh() -> Path:
        nonlocal runs
        runs += 1
        backing = tmp_path / f"run-{runs:03d}"
        shutil.copytree(template, backing)
        return backing

    reference, _ = save_through(fresh(), case, None)
    kinds = [kind for kind, _ in reference]
    assert "rename" in kinds and any("objects" in what for _, what in reference), reference
    outcome = Outcome(points=reference)
    for after in range(1, len(reference) + 1):
        backing = fresh()
        points, saved = save_through(backing, case, after)
        if [p[0] for p in points] != kinds:
            outcome.violations.append(f"cut {after}: the save's points differ from the reference")
        required = after == len(reference) or outcome.kept_from is not None
        kept, problems = check(str(backing / "root"), case, {**saved_before, **saved}, required)
        if kept and outcome.kept_from is None:
            outcome.kept_from = after
        kind, what = reference[after - 1]
        outcome.violations += [f"cut after point {after} ({kind} {what}): {p}" for p in problems]
        shutil.rmtree(backing, ignore_errors=True)
    assert not outcome.violations, "\n".join(outcome.violations)
    assert outcome.kept_from is not None
    record("power loss during an incremental save",
           observed=f"{which}: {len(reference)} cuts, 0 violations; {case.name} kept from the cut "
           f"after point {outcome.kept_from} ({' '.join(reference[outcome.kept_from - 1])}) on",
           recover_s=None, cuts=len(reference), case=which,
           points=[f"{kind} {what}" for kind, what in reference], wall_s=round(time.monotonic() - started, 1))
