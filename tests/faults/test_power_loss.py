"""Fault matrix, power-loss row: cut the power after each persistence point of a save in turn.

"A committed generation is never lost or modified, and a partial one is never trusted."

A single-process job (world size 1, synchronous saves) commits generation 1 durably, then
saves generation 2 through a PowerFS mount (tests/helpers/powerfs.py). A reference save
counts the persistence points of that save (file fsyncs, directory fsyncs, renames): N.
Then for k = 1..N, on a fresh copy of the generation-1 tree: arm the cut after point k,
save generation 2, cut, and restore with a fresh manager on the rebuilt (plain) directory.
Each cut must leave:

* generation 1 present and valid with digests (never lost, never modified);
* a restore that picks generation 1 or 2, which validates with digests
  (``format.validate.validate``) and holds exactly the model tensors saved under that name;
* generation 2 once the cut is after the save's last point (the save had returned), and in
  every cut after the first one that kept it (once durable, never lost again).

The negative control makes the writer non-durable (every ``fsync_dir`` a no-op) and shows
that the same check reports a violation, so the row can fail.

The row prints what it tried; with ``DIST_CKPT_FAULT_REPORT=PATH`` it also appends one JSON
line ``{"row": "power loss", "observed": ..., "cuts": N, ...}`` there (the line format of
``tests/helpers/matrix.py``; the other rows append to the same file).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from dist_ckpt import CheckpointConfig, CheckpointManager, TrainState
from dist_ckpt.format.validate import validate
from dist_ckpt.storage import local as local_storage
from dist_ckpt.tiers import open_tier
from tests.helpers.local_jobs import make_state, step
from tests.helpers.powerfs import PowerFS

pytestmark = pytest.mark.usefixtures("require_fuse")

GEN1 = "gen-000000000001"
GEN2 = "gen-000000000002"
REPORT_ENV = "DIST_CKPT_FAULT_REPORT"


def gen_state(updates: int) -> TrainState:
    """The job's state after ``updates`` training steps (deterministic: make_state seeds)."""
    state = make_state()
    for _ in range(updates):
        step(state)
    return state


def model_tensors(state: TrainState) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in state.model.state_dict().items()}


def normalise(what: str) -> str:
    """A point's path without the random parts (attempt id, tmp suffix)."""
    what = re.sub(r"(\.pending-gen-\d+)-[0-9a-f]+", r"\1-<attempt>", what)
    return re.sub(r"\.[0-9a-f]{8}\.tmp", ".<tmp>.tmp", what)


def config(root: str) -> CheckpointConfig:
    return CheckpointConfig(root=root, async_save=False)


@dataclass
class Cut:
    after: int  # the cut came right after this persistence point of save(gen 2)
    point: str
    save_error: str | None
    restored: str | None = None
    rejected: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)


@dataclass
class Row:
    points: list[tuple[str, str]]  # the reference save's persistence points, normalised
    cuts: list[Cut]
    wall_s: float

    @property
    def violations(self) -> list[str]:
        return [f"cut after point {c.after} ({c.point}): {v}" for c in self.cuts for v in c.violations]

    def report(self) -> dict:
        """One line of the fault-matrix report (the keys of ``tests.helpers.matrix.record``)."""
        kept_from = next((c.after for c in self.cuts if c.restored == GEN2), None)
        observed = (f"{len(self.cuts)} cuts, {len(self.violations)} violations; {GEN2} kept from the cut "
                    f"after point {kept_from} on, {GEN1} before" if kept_from else
                    f"{len(self.cuts)} cuts, {len(self.violations)} violations; {GEN2} never kept")
        return {"row": "power loss", "observed": observed, "detect_s": None, "recover_s": None,
                "cuts": len(self.cuts), "points": [f"{kind} {what}" for kind, what in self.points],
                "restored": {str(c.after): c.restored for c in self.cuts}, "gen2_kept_from": kept_from,
                "violations": self.violations, "wall_s": round(self.wall_s, 1)}


class PowerLossRow:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.template = workdir / "template"  # generation 1, committed on a plain directory
        state = gen_state(1)
        with CheckpointManager(config(str(self.template / "root")), state) as mgr:
            mgr.save(1)
        self.expected = {GEN1: model_tensors(state), GEN2: model_tensors(gen_state(2))}
        self._runs = 0

    def _fresh_backing(self) -> Path:
        self._runs += 1
        backing = self.workdir / f"run-{self._runs:03d}"
        shutil.copytree(self.template, backing)  # the baseline of a mount is durable
        return backing

    def save_gen2(self, backing: Path, arm_after: int | None) -> tuple[list[tuple[str, str]], str | None]:
        """Save generation 2 through a PowerFS over ``backing``, armed after point
        ``arm_after`` of the save (None: never frozen); cut. Returns the save's points and
        its error, if any."""
        with PowerFS(backing) as fs:
            state = gen_state(2)
            error = None
            with CheckpointManager(config(os.path.join(fs.mountpoint, "root")), state) as mgr:
                base = fs.points()
                if arm_after is not None:
                    fs.arm(after=base + arm_after)
                try:
                    mgr.save(2)
                except Exception as exc:  # noqa: BLE001 - a save may fail at a cut; recorded
                    error = f"{type(exc).__name__}: {exc}"
                log = fs.log()[base:]
            fs.cut()
        return [(kind, normalise(what)) for kind, what in log], error

    def check(self, backing: Path, cut: Cut, gen2_required: bool) -> None:
        """The durability promise on one rebuilt directory; violations go into ``cut``."""
        root = str(backing / "root")
        store = open_tier(root).store
        try:
            validate(store, GEN1, digests=True)
        except Exception as exc:  # noqa: BLE001 - a violation, reported with the others
            cut.violations.append(f"committed {GEN1} lost or modified: {exc}")
        state = make_state()
        try:
            with CheckpointManager(config(root), state) as mgr:
                result = mgr.restore()
        except Exception as exc:  # noqa: BLE001
            cut.violations.append(f"restore failed: {type(exc).__name__}: {exc}")
            return
        cut.restored = result.generation
        cut.rejected = [str(problem) for problem in result.rejected]
        if result.generation not in self.expected:
            cut.violations.append(f"restored {result.generation!r}, not {GEN1} or {GEN2}")
            return
        try:
            validate(store, result.generation, digests=True)
        except Exception as exc:  # noqa: BLE001
            cut.violations.append(f"restored {result.generation} does not validate: {exc}")
        restored = model_tensors(state)
        expected = self.expected[result.generation]
        if restored.keys() != expected.keys() or not all(
                torch.equal(restored[name], expected[name]) for name in expected):
            cut.violations.append(f"restored {result.generation} holds other tensors than were saved")
        if gen2_required and result.generation != GEN2:
            cut.violations.append(f"{GEN2} lost: save({GEN2}) had returned, restore found "
                                  f"{result.generation}")

    def run(self) -> Row:
        started = time.monotonic()
        reference, error = self.save_gen2(self._fresh_backing(), None)
        assert error is None, f"the reference save failed: {error}"
        assert reference, "the reference save reached no persistence point"
        cuts: list[Cut] = []
        for after in range(1, len(reference) + 1):
            backing = self._fresh_backing()
            points, error = self.save_gen2(backing, after)
            kind, what = reference[after - 1]
            cut = Cut(after=after, point=f"{kind} {what}", save_error=error)
            if [p[0] for p in points] != [p[0] for p in reference]:
                cut.violations.append(f"this save's points differ from the reference: {points}")
            kept_before = any(c.restored == GEN2 for c in cuts)
            self.check(backing, cut, gen2_required=after == len(reference) or kept_before)
            cuts.append(cut)
            shutil.rmtree(backing, ignore_errors=True)
        return Row(points=reference, cuts=cuts, wall_s=time.monotonic() - started)


NEGATIVE_CONTROL_LABEL = "expected violation (negative control: no directory fsyncs)"


def describe(row: Row, *, label: str = "VIOLATION") -> str:
    """What the row tried; ``label`` heads each violation (the negative control's are its
    expected result, and say so: a green run must not print a bare VIOLATION)."""
    counted = "violations" if label == "VIOLATION" else "expected violations"
    lines = [f"power loss: {len(row.cuts)} cuts (one after each of the {len(row.points)} persistence "
             f"points of save({GEN2})), {len(row.violations)} {counted}, {row.wall_s:.1f} s"]
    for cut in row.cuts:
        rejected = f"; rejected: {'; '.join(cut.rejected)}" if cut.rejected else ""
        lines.append(f"  cut after {cut.after:2d} {cut.point}: restored {cut.restored}{rejected}")
    head = "  VIOLATION " if label == "VIOLATION" else f"  {label}: "
    lines += [head + v for v in row.violations]
    return "\n".join(lines)


@pytest.mark.timeout(150)
def test_power_loss_after_each_persistence_point(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    row = PowerLossRow(tmp_path).run()
    text = describe(row)
    with capsys.disabled():
        print("\n" + text, file=sys.stderr)
    if os.environ.get(REPORT_ENV):  # appended: the other rows of the matrix share the file
        with open(os.environ[REPORT_ENV], "a", encoding="utf-8") as handle:
            handle.write(json.dumps(row.report()) + "\n")
    assert len(row.cuts) == len(row.points) > 0
    assert not row.violations, text
    assert row.cuts[-1].restored == GEN2


@pytest.mark.timeout(150)
def test_power_loss_row_fails_a_writer_without_directory_fsyncs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """Negative control: with every directory fsync a no-op the row must report a violation.
    ``fsync_dir`` is patched where it is defined and in every dist_ckpt module that imported
    it by name (those bound the function at import)."""
    original = local_storage.fsync_dir
    patched = [name for name, module in list(sys.modules.items())
               if name.startswith("dist_ckpt") and getattr(module, "fsync_dir", None) is original]
    assert "dist_ckpt.storage.local" in patched and "dist_ckpt.tiers.rename" in patched
    for name in patched:
        monkeypatch.setattr(sys.modules[name], "fsync_dir", lambda path: None)
    row = PowerLossRow(tmp_path).run()
    text = describe(row, label=NEGATIVE_CONTROL_LABEL)
    with capsys.disabled():
        print("\nnegative control (fsync_dir disabled in " + ", ".join(sorted(patched)) + "): the "
              "violations below are this test's expected result; it passes only if they appear\n" + text,
              file=sys.stderr)
    assert "VIOLATION" not in text
    assert "fsyncdir" not in {kind for kind, _ in row.points}
    assert row.violations, "the power-loss row did not notice a writer that never fsyncs a directory"
    assert any(f"{GEN2} lost" in v for v in row.cuts[-1].violations), text


@pytest.mark.timeout(60)
def test_a_first_save_survives_a_cut_after_creating_its_root(tmp_path: Path) -> None:
    """The first save creates the root (and a parent of it): once save() has returned, its
    generation survives a power cut, directory entries of the new directories included."""
    backing = tmp_path / "backing"
    backing.mkdir()
    with PowerFS(backing) as fs:
        state = gen_state(1)
        with CheckpointManager(config(os.path.join(fs.mountpoint, "new", "root")), state) as mgr:
            mgr.save(1)
        fs.cut()
    root = backing / "new" / "root"
    assert root.is_dir(), f"the power cut lost the root the first save created: {sorted(os.listdir(backing))}"
    validate(open_tier(str(root)).store, GEN1, digests=True)
    restored = make_state()
    with CheckpointManager(config(str(root)), restored) as mgr:
        assert mgr.restore().generation == GEN1
    assert all(torch.equal(restored.model.state_dict()[name], tensor)
               for name, tensor in model_tensors(state).items())
