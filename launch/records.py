"""What the launcher says about each start: one line for a person, one JSON line for tools."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass, field

from dist_ckpt.launcher_api import LAUNCH_LOG_NAME


@dataclass
class StartRecord:
    run_id: str
    start: int
    max_starts: int
    nodes: str
    procs_per_node: str
    world_size: int | None = None
    resumed_from: str | None = None  # generation name, "fresh", or None when nobody reported
    resumed_update: int | None = None
    resumed_tier: str | None = None  # the kind of tier it was read from ("memory", "local", ...)
    repaired: str | None = None  # "repaired N file(s) of gen-... from <tier>", None when none was
    rejected: list[str] = field(default_factory=list)  # the restore's rejected generations, with why
    final_update: int | None = None
    updates: int | None = None
    began_unix: float = 0.0
    duration_s: float = 0.0
    backoff_s: float = 0.0
    classification: str = ""
    reason: str = ""
    exit_codes: dict[str, int | None] = field(default_factory=dict)
    memory_bytes: int | None = None  # bytes under the run's shared-memory directory at the end
    # per rank of this node (key: the rank as text): median_s_per_update (own time per update,
    # launch.watchdog), updates_seen, straggler
    ranks: dict[str, dict[str, float | int | bool | None]] = field(default_factory=dict)

    def line(self) -> str:
        resumed = {None: "resume point unknown", "fresh": "fresh start"}.get(
            self.resumed_from, f"resumed from {self.resumed_from}")
        if self.resumed_tier is not None and self.resumed_from not in (None, "fresh"):
            resumed += f" ({self.resumed_tier} tier)"
        if self.rejected:
            resumed += f"; {rejected_summary(self.rejected, newer=self.resumed_from not in (None, 'fresh'))}"
        if self.repaired:
            resumed += f" | {self.repaired}"
        low, _, high = self.nodes.partition(":")
        world = f"{low if high in ('', low) else self.nodes} x {self.procs_per_node}"
        if self.world_size is not None:
            world += f" = {self.world_size} ranks"
        memory = "" if self.memory_bytes is None else f" | memory {self.memory_bytes / (1 << 20):.1f} MiB"
        return (f"[launch] start {self.start}/{self.max_starts} | world {world} | {resumed} | "
                f"{self.duration_s:.1f} s{memory} | {self.classification}: {self.reason}")


def rejected_summary(rejected: list[str], *, newer: bool) -> str:
    """``2 newer rejected: gen-10: why; gen-9: why`` (each reason cut, at most three shown)."""
    shown = "; ".join(r if len(r) <= 160 else r[:157] + "..." for r in rejected[:3])
    more = f"; +{len(rejected) - 3} more" if len(rejected) > 3 else ""
    return f"{len(rejected)}{' newer' if newer else ''} rejected: {shown}{more}"


def emit(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def append(root: str, record: StartRecord) -> None:
    with open(os.path.join(root, LAUNCH_LOG_NAME), "a", encoding="utf-8") as handle:
        handle.write(json.dumps(asdict(record), sort_keys=True) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def summary(records: list[StartRecord], outcome: str) -> str:
    header = ["start", "world", "resumed from", "updates", "seconds", "result", "why"]
    rows = [header] + [[str(r.start), str(r.world_size or f"{r.nodes}x{r.procs_per_node}"),
                        r.resumed_from or "?", "-" if r.updates is None else str(r.updates),
                        f"{r.duration_s:.1f}", r.classification, r.reason] for r in records]
    # the reason is the last column, never cut: a user needs all of it (a fix may be at its end)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
    lines = [f"[launch] {outcome}"]
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row[:-1], widths, strict=True)] + [row[-1]]
        lines.append("[launch]   " + "  ".join(cells).rstrip())
    return "\n".join(lines)
