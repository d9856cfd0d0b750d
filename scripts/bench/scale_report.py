"""The scale phase's printed table (``scale.py`` measures the rows)."""

from __future__ import annotations

from typing import Any

DEFAULT_RANKS = (256, 1024, 4096)  # --ranks of the scale phase

HEADER = ("ranks", "rank 0 commit s", "store req/save", "store MB/save", "max read other/save",
          "max read any/save", "server CPU s/save", "idle req/s (job)", "restore store MB",
          "coll/rank/save", "restore coll/rank", "arrivals s")


def human_bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def table_rows(rows: list[dict[str, Any]]) -> list[list[str]]:
    """One line per case: ``HEADER``'s cells ("-": not measured), then why, if anything was not."""
    out = []
    for row in rows:
        saved, idle, restore = "rank0_commit_s" in row, row.get("idle"), row.get("restore")
        rank0 = row.get("rank0_commit_s", row.get("partial", {}).get("rank0_commit_s"))

        def cell(text: str, measured: bool = saved) -> str:
            return text if measured else "-"

        get = row.get
        cells = [str(row["ranks"]), "-" if rank0 is None else f"{rank0:.3f}",
                 cell(f"{get('store_requests', 0):.0f}"), cell(f"{get('store_bytes', 0) / 1e6:.1f}"),
                 cell(human_bytes(get("max_read_other", 0))), cell(human_bytes(get("max_read_any", 0))),
                 cell(f"{get('server_cpu_s', 0):.2f}"),
                 "-" if idle is None else f"{idle['requests_per_s']:.0f}",
                 "-" if restore is None else f"{restore['store_bytes'] / 1e6:.2f}",
                 cell(human_bytes(row.get("coll_bytes", 0))),
                 "-" if restore is None else human_bytes(restore["coll_bytes_max"]),
                 cell(f"{row.get('arrivals_s', 0):.2f}")]
        if row["not_measured"]:
            cells.append(f"not measured: {row['not_measured']}")
        out.append(cells)
    return out


def print_table(rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    case = rows[0]["case"]
    print(f"\n---- scale: {case['ranks_per_node']} simulated ranks per node, {case['items']} state-dict "
          f"items per rank, {'node-local roots' if case.get('node_local') else 'one shared root'}, "
          f"{case['saves']} saves per case after {case['warmup']} warm-up (medians); "
          f"protocol {rows[0]['protocol']} ({rows[0]['source']}) ----")
    body = table_rows(rows)
    widths = [max(len(HEADER[i]), *(len(r[i]) for r in body)) for i in range(len(HEADER))]
    print("  ".join(h.rjust(w) for h, w in zip(HEADER, widths, strict=True)))
    for cells in body:
        line = "  ".join(c.rjust(w) for c, w in zip(cells, widths, strict=False))
        print(line if len(cells) == len(HEADER) else f"{line}\n      {cells[-1]}")
    print("store bytes are payload (keys and values); 'other' = neither rank 0 nor a node leader; "
          "coll = bytes gloo would move to one rank; arrivals = last rank's first store write "
          "after the save began (scripts/bench/scale.py)")
