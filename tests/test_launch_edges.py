"""Issue 29, launcher items 1 to 6, without starting workers: abbreviated options, a root that
is a file, a run that is done already, the start line's update count, memory words only with
the memory tier, and permanent reasons in full with the launcher's fix. Issue 27, item 6: the
launcher's last line when it persists memory at breakpoint, or refuses a damaged generation."""

from __future__ import annotations

import os

import pytest

from dist_ckpt import CheckpointConfig, CheckpointManager
from dist_ckpt.launcher_api import CURRENT_NAME, latest_generation, run_root
from dist_ckpt.memory.paths import root_digest
from launch import agent, memory_dir, policy, records
from launch.cli import main
from launch.options import build_parser, parse, prog_name
from launch.runner import Launcher
from tests.helpers.handmade import flip_byte, write_generation
from tests.helpers.local_jobs import make_state, step


@pytest.mark.parametrize("abbreviated", [["--max-start", "2"], ["--backof", "1"],
                                         ["--nproc-per-nod", "2"]])
def test_an_abbreviated_option_is_a_usage_error(abbreviated, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(["--checkpoint-root", "/r", "--standalone", *abbreviated, "train.py"])
    assert exc.value.code == 2
    assert abbreviated[0] in capsys.readouterr().err


def test_a_usage_error_from_torchrun_is_permanent_with_exit_2(capsys) -> None:
    result: dict = {}
    assert agent._parse(["--no-such-option", "1", "train.py"], result) is None
    assert "--no-such-option" in result["usage"]
    assert capsys.readouterr().err.count("usage:") == 1  # torchrun's usage, printed once
    verdict = policy.classify(run_root="/nonexistent", reports={}, result=result, agent_rc=2,
                              stop_reason=None, mirror=None)
    assert verdict.kind == policy.USAGE and "--no-such-option" in verdict.reason
    assert policy.USAGE in policy.ENDS_THE_LOOP


def test_a_checkpoint_root_that_is_a_file_is_one_line_and_exit_2(tmp_path, capsys) -> None:
    root = tmp_path / "file"
    root.write_text("")
    assert main(["--checkpoint-root", str(root), "--standalone", "train.py"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"python -m launch: --checkpoint-root {root} is not a directory"]


def _done_run(launch_root: str) -> str:
    run = run_root(launch_root, "0001")
    os.makedirs(run)
    with open(os.path.join(launch_root, CURRENT_NAME), "w", encoding="utf-8") as handle:
        handle.write("0001\n")
    state = make_state()
    with CheckpointManager(CheckpointConfig(root=run), state) as mgr:
        step(state)
        return mgr.finish(1).generation


def test_a_done_run_says_so_at_once_without_starting(tmp_path, capsys) -> None:
    generation = _done_run(str(tmp_path))
    # the script does not exist: any start would fail its preflight; none is made
    code = main(["--checkpoint-root", str(tmp_path), "--standalone", "missing.py"])
    err = capsys.readouterr().err
    assert code == 0
    assert f"run 0001 is done: DONE for {generation}" in err and "--fresh starts a new run" in err
    assert "start 1/" not in err and "not found" not in err


def _launcher(tmp_path) -> Launcher:
    return Launcher(parse(["--checkpoint-root", str(tmp_path), "--standalone", "train.py"]))


def test_the_start_counts_the_newest_generation_of_any_tier(tmp_path) -> None:
    launcher = _launcher(tmp_path)
    record = records.StartRecord(run_id="0001", start=1, max_starts=3, nodes="1", procs_per_node="1")
    reports = {0: {"rank": 0, "resumed_from": "fresh", "next_update": 0, "committed_update": 900},
               1: {"rank": 1, "resumed_from": "fresh", "next_update": 0}}
    launcher._describe(record, reports, None)  # the root has no generation: memory is ahead
    assert record.final_update == 900 and record.updates == 900


def test_the_start_line_says_what_restore_repaired(tmp_path) -> None:
    launcher = _launcher(tmp_path)
    said = "repaired 1 file(s) of gen-000000000002 from mirror"
    record = records.StartRecord(run_id="0001", start=2, max_starts=3, nodes="1", procs_per_node="1")
    launcher._describe(record, {0: {"rank": 0, "resumed_from": "gen-000000000002", "next_update": 2,
                                    "resumed_tier": "local", "repaired": said}}, None)
    assert f"resumed from gen-000000000002 (local tier) | {said} | " in record.line()
    plain = records.StartRecord(run_id="0001", start=2, max_starts=3, nodes="1", procs_per_node="1")
    launcher._describe(plain, {0: {"rank": 0, "resumed_from": "gen-000000000002", "next_update": 2,
                                   "repaired": None}}, None)
    assert "repaired" not in plain.line()


def test_memory_words_only_with_the_memory_tier(tmp_path) -> None:
    launcher = _launcher(tmp_path)
    off = records.StartRecord(run_id="0001", start=1, max_starts=3, nodes="1", procs_per_node="1")
    launcher._describe(off, {0: {"rank": 0, "memory_tier": False}}, None)
    assert off.memory_bytes is None and "memory" not in off.line()
    assert not launcher._memory_tier_used
    on = records.StartRecord(run_id="0001", start=2, max_starts=3, nodes="1", procs_per_node="1")
    launcher._describe(on, {0: {"rank": 0, "memory_tier": True}}, None)
    assert on.memory_bytes is not None and "| memory " in on.line()


def test_a_contract_mismatch_names_fresh_and_the_summary_keeps_the_whole_reason() -> None:
    message = ("experiment contract changed in field(s): lr; pass allow_contract_change=True "
               "to restore anyway")
    reason = policy.permanent_reason({0: {"rank": 0, "failure": {
        "error": "ContractMismatch", "message": message, "permanent": True}}})
    assert reason is not None and reason.endswith("allow_contract_change=True to restore anyway; "
                                                  "or start a new run with --fresh")
    record = records.StartRecord(run_id="0001", start=1, max_starts=3, nodes="1",
                                 procs_per_node="1", classification="permanent", reason=reason)
    assert reason in records.summary([record], "permanent: ... (exit 1)")


def test_the_last_line_says_what_was_persisted_from_memory(tmp_path, capsys) -> None:
    """The launcher about to exit, its memory ahead of the root: persisted, then removed; a
    damaged generation is not persisted and the line says why."""
    launcher = _launcher(tmp_path)
    launcher._memory_tier_used = True
    for update, damaged in ((3, False), (5, True)):
        launcher._memory = memory_dir.claim(launcher.run_id, launcher.run_dir)
        memory = os.path.join(launcher._memory.path, root_digest(launcher.run_dir))
        name = write_generation(memory, update).generation
        if damaged:
            flip_byte(memory, name, "dcp/__0_0.distcp")
        directory = launcher._memory.path
        launcher._leave_memory()
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert not os.path.exists(directory)
        if not damaged:
            assert last == (f"[launch] persisted {name} from memory to {launcher.run_dir} before "
                            f"removing in-memory checkpoints {directory}")
            assert latest_generation(launcher.run_dir) == name
        else:
            assert last.startswith(f"[launch] {name} not persisted: {name}: file dcp/__0_0.distcp "
                                   "does not match its manifest entry")
            assert last.endswith(f"; removed in-memory checkpoints {directory}")
            assert latest_generation(launcher.run_dir) == "gen-000000000003"


# ---- issue 40 item 14: usage errors before anything is created --------------------------------
def test_an_option_typo_says_what_was_meant(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(["--checkpoint-root", "/r", "--standalone", "--max-start", "2", "train.py"])
    assert exc.value.code == 2
    assert "--max-start (did you mean --max-starts?)" in capsys.readouterr().err


@pytest.mark.parametrize("nproc", ["0", "-1", "many"])
def test_no_workers_is_a_usage_error(nproc, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(["--checkpoint-root", "/r", "--standalone", "--nproc-per-node", nproc, "train.py"])
    assert exc.value.code == 2 and f"--nproc-per-node {nproc}: a positive number" in capsys.readouterr().err
    assert parse(["--checkpoint-root", "/r", "--nproc-per-node", "auto", "train.py"]).torchrun.nproc_per_node


def test_a_missing_script_is_a_usage_error_before_anything_is_created(tmp_path, capsys) -> None:
    root = tmp_path / "root"
    assert main(["--checkpoint-root", str(root), "--standalone", str(tmp_path / "nope.py")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"python -m launch: training script not found: {tmp_path / 'nope.py'}"]
    assert not root.exists()  # no run directory, no current, no log


def test_the_console_script_names_itself() -> None:
    assert prog_name("/venv/bin/dist-ckpt-run") == "dist-ckpt-run"
    assert prog_name("/repo/launch/__main__.py") == "python -m launch"
    usage = build_parser(prog_name("/venv/bin/dist-ckpt-run")).format_usage()
    assert usage.startswith("usage: dist-ckpt-run ")
