"""The fault-injection matrix: run it (or a named subset) and print one table.

Usage: .venv/bin/python scripts/fault_matrix.py [ROW-SUBSTRING ...] [--json] [--list]

Each row names the tests under ``tests/faults/`` that inject that fault. The script runs
them in one pytest session with ``DIST_CKPT_FAULT_REPORT`` set (the tests append what they
observed and how long detection and recovery took, see ``tests/helpers/matrix.py``), then
prints, per row: fault, injection point, expected, observed, pass/fail, time to detect,
time to recover. ``--json`` prints the same rows as JSON. The exit status is 0 only when
every selected row passed. Not part of the test run (the tests themselves run in CI).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from dataclasses import asdict, dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
F = "tests/faults"


@dataclass
class Row:
    fault: str
    injection: str
    expected: str
    tests: list[str]
    observed: str = ""
    result: str = "not run"
    detect_s: float | None = None
    recover_s: float | None = None
    counts: dict[str, int] = field(default_factory=dict)


ROWS = [
    Row("missing shard at save", "one rank writes nothing / its report never arrives (blocked point)",
        "no manifest; previous latest untouched; every rank raises CommitError naming the rank",
        [f"{F}/test_ranks.py::test_slow_late_crashed_and_missing_ranks"]),
    Row("missing shard after commit", "a shard file deleted (local and s3:// roots)",
        "verify exits 1 naming the file; restore falls back and lists the reason",
        [f"{F}/test_corruption.py::test_missing_shard_after_commit"]),
    Row("slow rank under / over the deadline", "delay inside one rank's writer",
        "commits late / fails cleanly; the next save commits in the same processes",
        [f"{F}/test_ranks.py::test_slow_late_crashed_and_missing_ranks"]),
    Row("slow disk that stays slow", "every write request of one rank takes 1 s, from the middle "
        "of a save on", "each save fails at its deadline; the rank abandons the doomed writes; "
        "training is held at most about the deadline plus one request per save",
        [f"{F}/test_slow_disk.py"]),
    Row("rank SIGKILLed at each phase", "staging, start of write, mid-write, before / after its report",
        "no survivor held past the deadline; previous generation restores; orphan removed",
        [f"{F}/test_kill.py::test_rank_killed_at_each_phase"]),
    Row("rank 0 SIGKILLed during the commit", "collected, before manifest, before / after rename, "
        "before latest", "a restart sees the old or the new generation, complete, never a mix",
        [f"{F}/test_kill.py::test_rank0_killed_at_each_commit_point"]),
    Row("rank SIGKILLed at each node-protocol step", "4 ranks in nodes of 2: the second node's "
        "leader before / after it posts its node's key; rank 0 after the node keys and after "
        "claiming the commit", "every survivor records one verdict; the restart restores the "
        "previous generation or the new one complete; nothing committed lost",
        [f"{F}/test_kill.py::test_rank_killed_at_each_node_protocol_step"]),
    Row("publish outlasting the deadline", "rank 0 held before / after it claims the commit, "
        "until the other node's leader reached its deadline", "failed everywhere (the leader's "
        "claim came first) or committed everywhere (rank 0's did); never split",
        [f"{F}/test_kill.py::test_a_publish_outlasting_the_deadline_has_one_verdict"]),
    Row("power loss at every persistence point", "FUSE power-loss filesystem: cut after each "
        "fsync / rename / directory fsync of a save",
        "restore yields a complete, verified generation, at least the last save that returned",
        [f"{F}/test_power_loss.py", f"{F}/test_powerfs.py"]),
    Row("disk full", "small quota: free-space preflight and ENOSPC mid-write",
        "the save fails with the cause; older generations intact; retention prunes nothing",
        [f"{F}/test_disk_full.py"]),
    Row("corrupted bytes", "bit flip and truncation in a shard, manifest.json, .metadata, state "
        "files, latest.json (on an s3:// root: .metadata, manifest.json)",
        "a clear error naming the file; fallback; never a silent load",
        [f"{F}/test_corruption.py::test_damaged_file_is_named_and_skipped",
         f"{F}/test_corruption.py::test_damaged_latest_pointer_is_a_warning_not_a_choice"]),
    Row("rejected generation blocks its update", "a damaged newest generation on a local and an "
        "s3:// root; the move aside cut short after each step (marker, copy, manifest delete, "
        "cleanup); a late mover racing a save of the same update",
        "moved to ROOT/rejected/ with its reason, never deleted; the update saves again; nothing "
        "committed lost; a manifest saved again is never deleted",
        [f"{F}/test_local_faults.py::test_corrupt_newest_shard_falls_back",
         f"{F}/test_quarantine_store.py"]),
    Row("damaged file, good copy elsewhere", "bit flip in / removal of a shard or .metadata of "
        "the newest local generation, the S3 mirror holding it intact; a bit flip in an in-memory "
        "shard, the root holding the same save",
        "that generation restored (not its predecessor), the file and its source named, the damaged "
        "copy kept under rejected/; no good copy, or only a re-save: the fallback as before",
        [f"{F}/test_repair.py",
         "tests/test_memory_tier.py::test_bit_flip_in_memory_is_repaired_from_the_root"]),
    Row("latest pointer to a missing generation", "generation directory removed",
        "fallback to the newest valid one, with a warning; never a silent fresh start",
        [f"{F}/test_corruption.py::test_latest_pointer_to_a_missing_generation"]),
    Row("concurrent writers on one root", "two jobs, same root, same and different generations; "
        "two attempts of one generation in every tier", "the loser gets GenerationExists; nothing mixed",
        [f"{F}/test_prune_and_writers.py::test_two_jobs_on_one_root",
         f"{F}/test_object_store_faults.py::test_two_writers_one_generation",
         "tests/test_tiers.py::test_concurrent_writers_one_wins_nothing_mixes"]),
    Row("partial remote upload", "uploader killed mid-upload; truncated object",
        "not recorded as remote-complete; restore from the mirror takes the previous one",
        [f"{F}/test_partial_upload.py"]),
    Row("crash during prune", "SIGKILL after a manifest removal / between two deletions; on an "
        "incremental root also between the deletions and the sweep, after the sweep's list, after "
        "each object renamed aside and each object removed",
        "every kept generation valid, with digests, and every object it references there; the "
        "half-deleted one never listed as committed; the next prune sweeps what is left",
        [f"{F}/test_prune_and_writers.py::test_prune_killed_mid_way",
         f"{F}/test_incremental_prune_faults.py"]),
    Row("power loss during an incremental save", "FUSE power-loss filesystem: cut after each "
        "persistence point of a save that installs shared objects (the first save, a rewrite over "
        "installed names, a save reusing one object and installing another)",
        "every generation committed before valid with digests; the cut one absent or committed and "
        "valid; every referenced object there; restore gives the newest bitwise",
        [f"{F}/test_incremental_power_loss.py"]),
    Row("changed world size", "save at N ranks, restore at M",
        "gathered tensors bitwise equal; sampler exactly-once",
        [f"{F}/test_world_size.py"]),
    Row("changed model contract", "parameter renamed / added / removed, shape or dtype, config digest",
        "refused before anything is mutated, listing missing / unexpected / mismatched keys",
        [f"{F}/test_contract_change.py"]),
    Row("ranks disagree at restore", "3 ranks: one with another contract, one with a model of "
        "another shape, one whose read fails (restore.read)",
        "every rank raises the same RestoreRefused naming the refusing rank within 10 s; "
        "no rank waits in a collective of the load",
        [f"{F}/test_restore_agreement.py"]),
    Row("every committed generation rejected", "a bit flipped in every generation's shard, no other "
        "tier; a shared object damaged in one or both of its copies (incremental)",
        "NoValidGeneration naming them, nothing moved aside; "
        "on_all_rejected='fresh' starts over; one damaged copy: the newest generation repaired",
        [f"{F}/test_all_rejected.py", "tests/test_incremental_copies.py"]),
    Row("object swapped after validation", "a shard, .metadata or state file replaced between "
        "selection and load", "never deserialised; falls back to the previous generation in the same call",
        [f"{F}/test_object_store_faults.py::test_object_swapped_after_validation_is_never_deserialised"]),
    Row("hostile inputs", "traversal, links, FIFOs, huge sizes, wrong types, duplicates, deep "
        "nesting, pickles, bad names, non-UTF-8; fuzzed parsers",
        "a DistCkptError subclass (CLI exit 1 or 2); no traceback, hang or unbounded allocation",
        [f"{F}/test_hostile.py"]),
    Row("stop at interpreter exit", "normal job end with saves in flight, 20 runs",
        "exit code 0 every time", [f"{F}/test_exit.py"]),
]


def run_tests(rows: list[Row], report: str, junit: str) -> int:
    targets = sorted({test for row in rows for test in row.tests})
    env = dict(os.environ, DIST_CKPT_FAULT_REPORT=report)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
               *targets]
    return subprocess.run(command, cwd=REPO, env=env, stdout=sys.stderr).returncode


def outcomes(junit: str) -> dict[str, tuple[str, float]]:
    """Node id -> (passed / failed / skipped, seconds), from pytest's JUnit XML."""
    found = {}
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        path = case.get("classname", "").replace(".", "/") + ".py"
        node = f"{path}::{case.get('name')}"
        state = "passed"
        if case.find("failure") is not None or case.find("error") is not None:
            state = "failed"
        elif case.find("skipped") is not None:
            state = "skipped"
        found[node] = (state, float(case.get("time", 0)))
    return found


def fill(row: Row, results: dict[str, tuple[str, float]], records: list[dict]) -> None:
    mine = {node: value for node, value in results.items()
            if any(node == test or node.startswith(test.rstrip("/") + ("[" if "::" in test else "::"))
                   or node.startswith(test + "::") for test in row.tests)}
    states = [state for state, _ in mine.values()]
    row.counts = {state: states.count(state) for state in sorted(set(states))}
    row.result = "PASS" if states and all(s == "passed" for s in states) else "FAIL"
    seen = [r for r in records if r.get("row") == row.fault]
    distinct = list(dict.fromkeys(r["observed"] for r in seen))
    shown = "; ".join(text if len(text) <= 160 else text[:157] + "..." for text in distinct[:2])
    more = f" (+{len(distinct) - 2} more cases)" if len(distinct) > 2 else ""
    row.observed = shown + more if seen else f"{states.count('passed')}/{len(states)} tests passed"
    detects = [r["detect_s"] for r in seen if r.get("detect_s") is not None]
    recovers = [r["recover_s"] for r in seen if r.get("recover_s") is not None]
    row.detect_s = max(detects) if detects else None
    row.recover_s = max(recovers) if recovers else max((t for _, t in mine.values()), default=None)


def print_table(rows: list[Row]) -> None:
    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f} s"

    header = ["fault", "injection", "expected", "observed", "result", "detect", "recover"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        cells = [row.fault, row.injection, row.expected, row.observed,
                 f"{row.result} ({row.counts.get('passed', 0)}/{sum(row.counts.values())})",
                 seconds(row.detect_s), seconds(row.recover_s)]
        print("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rows", nargs="*", help="substrings of row names (default: every row)")
    parser.add_argument("--json", action="store_true", help="machine-readable rows")
    parser.add_argument("--list", action="store_true", help="list the rows and their tests, run nothing")
    args = parser.parse_args()
    rows = [r for r in ROWS if not args.rows or any(s.lower() in r.fault.lower() for s in args.rows)]
    if not rows:
        parser.error(f"no row matches {args.rows}")
    if args.list:
        for row in rows:
            print(f"{row.fault}: {' '.join(row.tests)}")
        return 0
    with tempfile.TemporaryDirectory() as scratch:
        report, junit = os.path.join(scratch, "report.jsonl"), os.path.join(scratch, "junit.xml")
        run_tests(rows, report, junit)
        records = []
        if os.path.exists(report):
            with open(report, encoding="utf-8") as handle:
                records = [json.loads(line) for line in handle if line.strip()]
        results = outcomes(junit) if os.path.exists(junit) else {}
    for row in rows:
        fill(row, results, records)
    cuts = next((r.get("cuts") for r in records if r.get("row") == "power loss"), None)
    if args.json:
        print(json.dumps({"rows": [asdict(r) for r in rows], "power_cuts": cuts}, indent=1))
    else:
        print_table(rows)
        if cuts is not None:
            print(f"\npower cuts tried: {cuts}")
    return 0 if all(r.result == "PASS" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
