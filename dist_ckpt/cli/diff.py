"""``dist-ckpt diff A B``: the first component, in causal order, where two generations differ,
then every difference (see diff.py for the order and what is compared)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..diff import (
    COMPONENTS,
    Difference,
    DiffReport,
    Generation,
    diff_generations,
    open_generation,
    split_spec,
)
from ..format.inventory import is_committed
from ..format.signing import key_from_env
from ..storage.base import Store
from .common import Refused, UsageError, checked_generation, open_root_tier
from .inspection import root_generation

DIFF_EPILOG = f"""\
A and B are each a checkpoint ROOT (its newest generation: what latest.json names, or a
newer committed one; a newer one that is invalid is refused, exit 1, never passed over) or
the path or URL of one generation directory, ROOT/gen-NNNNNNNNNNNN; the roots and world
sizes may differ.
Every file is checked against its manifest (size and digest) before it is parsed.

components, in causal order: {", ".join(COMPONENTS)}.
The first differing one is named first: the later ones are often its consequences (other
data or other dropout masks also change the tensors). RNG streams are compared for the
ranks both generations have; the extra ranks of a larger world are listed, not compared.
Tensors compare bitwise; a differing one shows its max absolute and max relative difference
(|a - b| / max(|a|, |b|), per element).

exit status: 0 identical, 1 different (or a file fails its manifest, or ROOT's newest
generation is invalid), 2 usage (a missing root or generation).
--json prints {{"a", "b", "world_sizes", "identical", "first_difference", "components",
"extra_ranks", "differences"}}.
"""

MAX_LINES_PER_COMPONENT = 20  # text output only; --json lists every difference


def add_diff_parser(sub: Any) -> argparse.ArgumentParser:
    cmd = sub.add_parser("diff", help="compare two generations component by component, in causal order",
                         epilog=DIFF_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    cmd.set_defaults(func=cmd_diff)
    cmd.add_argument("a", metavar="A", help="ROOT or ROOT/gen-NNNNNNNNNNNN (path or s3:// URL)")
    cmd.add_argument("b", metavar="B", help="ROOT or ROOT/gen-NNNNNNNNNNNN (path or s3:// URL)")
    cmd.add_argument("--json", action="store_true", help="machine-readable output")
    return cmd


def resolve(spec: str, key: bytes | None) -> Generation:
    """What A or B names; a missing root or generation is a usage error (exit 2)."""
    root, name = split_spec(spec)
    tier = open_root_tier(root)
    store = tier.store
    if name is None:
        name = newest_of(store, spec, key)
    else:
        name = checked_generation(store, name)
    return open_generation(tier, name, key=key)  # a broken generation: ValidationError, exit 1


def newest_of(store: Store, spec: str, key: bytes | None) -> str:
    """ROOT's newest generation, as ``verify ROOT`` chooses it; a newer one with a manifest that
    does not check out (structure, sizes) is refused, never passed over for an older one."""
    try:
        name, newer = root_generation(store, key)
    except UsageError:  # an empty root
        raise UsageError(f"no committed generation under {store.root}") from None
    for other in newer:  # newest first
        if not is_committed(store, other, key):
            raise Refused(f"{spec}: the newest generation {other} is invalid (`dist-ckpt verify "
                          f"{spec}` says why); name one to compare, e.g. {spec.rstrip('/')}/{name}")
    return newer[0] if newer else name


def cmd_diff(args: argparse.Namespace) -> int:
    key = key_from_env()
    report = diff_generations(resolve(args.a, key), resolve(args.b, key))
    if args.json:
        print(json.dumps(report.to_dict(), indent=1))
    else:
        print("\n".join(report_lines(report)))
    return 0 if report.identical else 1


def report_lines(report: DiffReport) -> list[str]:
    lines = [f"A: {report.a} (world size {report.world_sizes[0]})",
             f"B: {report.b} (world size {report.world_sizes[1]})"]
    first = report.first
    lines.append("identical" if first is None else
                 f"first difference: {first.component} ({first.key}): {difference_text(first)}")
    lines.append("components (causal order):")
    for name in COMPONENTS:
        found = report.differing(name)
        verdict = f"{len(found)} of {report.compared[name]} differ" if found else \
            ("same" if report.compared[name] else "empty or not saved")
        lines.append(f"  {name:<10} {verdict}")
        lines += [f"    {d.key}: {difference_text(d)}" for d in found[:MAX_LINES_PER_COMPONENT]]
        if len(found) > MAX_LINES_PER_COMPONENT:
            lines.append(f"    ... {len(found) - MAX_LINES_PER_COMPONENT} more (--json lists all)")
    for side in ("a", "b"):
        if report.extra_ranks[side]:
            lines.append(f"ranks only in {side.upper()} (RNG not compared): "
                         f"{', '.join(map(str, report.extra_ranks[side]))}")
    return lines


def difference_text(d: Difference) -> str:
    if d.max_abs is not None:
        return f"max abs {d.max_abs:.3g}, max rel {d.max_rel:.3g}"
    text = f"{d.a} vs {d.b}"
    return f"{text} ({d.note})" if d.note else text
