"""``dist-ckpt ls LAUNCHROOT``: the runs a launcher root (``python -m launch --checkpoint-root``)
holds, with each run's newest committed generation and DONE state. The layout's names come from
:mod:`dist_ckpt.launcher_api`, the one module that spells them."""

from __future__ import annotations

from typing import Any

from ..errors import DistCkptError, StorageError
from ..format.inventory import newest_committed
from ..format.manifest import parse_generation
from ..format.validate import list_generations
from ..launcher_api import CURRENT_NAME, LEGACY_RUN_ID, RUNS_DIR, run_root
from ..lifecycle.done import DONE_NAME, check_done
from ..storage.base import StoreReader, open_store, read_bounded
from .common import is_directory, print_table

MAX_CURRENT_BYTES = 4096  # the run id and a newline


def run_ids(store: StoreReader) -> list[str]:
    """The run directories under ``ROOT/runs/`` (none for a root that is no launcher's)."""
    try:
        if not store.exists(RUNS_DIR):
            return []
        return sorted(name for name in store.listdir(RUNS_DIR) if is_directory(store, f"{RUNS_DIR}/{name}"))
    except (OSError, StorageError):
        return []


def current_run(store: StoreReader) -> str | None:
    try:
        raw = read_bounded(store, CURRENT_NAME, MAX_CURRENT_BYTES)
    except (OSError, DistCkptError):
        return None
    return raw.decode("utf-8", errors="replace").strip() or None


def run_record(root: str, run_id: str, key: bytes | None, active: str | None) -> dict[str, Any]:
    path = run_root(root, run_id)
    store = open_store(path)
    try:
        names = list_generations(store)
        newest = newest_committed(store, key)
        done, why = check_done(store, contract_digest=None)
    except (OSError, StorageError, DistCkptError) as exc:  # one unreadable run: say so, list the rest
        return {"run_id": run_id, "path": path, "active": run_id == active, "generations": None,
                "newest": None, "next_update": None, "done": False, "done_generation": None,
                "done_reason": f"unreadable: {exc}"}
    return {"run_id": run_id, "path": path, "active": run_id == active, "generations": len(names),
            "newest": newest, "next_update": None if newest is None else parse_generation(newest),
            "done": done is not None, "done_generation": None if done is None else done.generation,
            "done_reason": None if done is not None or why == f"no {DONE_NAME}" else why}


def run_records(store: StoreReader, key: bytes | None) -> list[dict[str, Any]]:
    """One record per run under a launcher root; empty for any other root."""
    active = current_run(store)
    return [run_record(store.root, run_id, key, active) for run_id in run_ids(store)]


def done_text(record: dict[str, Any]) -> str:
    if record["done"]:
        return f"DONE ({record['done_generation']})"
    return f"not done: {record['done_reason']}" if record["done_reason"] else "not done"


def print_runs(root: str, records: list[dict[str, Any]]) -> None:
    rows = [["", "RUN", "GENERATIONS", "NEWEST COMMITTED", "UPDATE", "DONE"]]
    for rec in records:
        count, update = rec["generations"], rec["next_update"]
        rows.append(["*" if rec["active"] else "", rec["run_id"], "-" if count is None else str(count),
                     rec["newest"] or "(none)", "-" if update is None else str(update), done_text(rec)])
    print(f"launcher root {root}: {len(records)} run(s) under {RUNS_DIR}/")
    print_table(rows)
    if any(rec["active"] for rec in records):
        print(f"* = the active run (named by {CURRENT_NAME})")
    print(f"list one run's generations: dist-ckpt ls {one_run_path(root, records)}")


def one_run_path(root: str, records: list[dict[str, Any]]) -> str:
    chosen = next((rec for rec in records if rec["active"]), records[-1])
    return str(chosen["path"]) if chosen["run_id"] != LEGACY_RUN_ID else root
