"""``dist-ckpt rehearse ROOT [GEN] --script train.py``: run the job's own script once against a
generation, in rehearsal mode, and report whether it survived.

The script runs under torchrun with ``DIST_CKPT_ROOT=ROOT`` and ``DIST_CKPT_REHEARSE=GEN``:
its ``CheckpointManager.restore()`` rehearses the generation (every component checked, see
:mod:`dist_ckpt.rehearse`) into the objects the script built, the script trains one update,
and its next ``save``/``maybe_save``/``finish`` writes nothing: the updated state's digest is
recorded in ``ROOT/rehearsals.json`` and the workers exit 0. Local roots and object stores.
A rehearsal passes only after at least one update: a script that saved at the generation's own
update, or ended before its next save, fails in ``update`` (exit 1), and its record unlocks no
retention.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from typing import Any

from ..format.manifest import parse_generation
from ..restore.rehearse import NO_UPDATE, REHEARSE_ENV, read_rehearsals, record_passed
from .common import Refused, UsageError, checked_generation, open_root


def cmd_rehearse(args: argparse.Namespace) -> int:
    store = open_root(args.root)
    target = "newest" if args.generation is None else checked_generation(store, args.generation)
    if not os.path.isfile(args.script):
        raise UsageError(f"script not found: {args.script}")
    before = read_rehearsals(store)
    env = dict(os.environ, DIST_CKPT_ROOT=args.root, **{REHEARSE_ENV: target})
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(args.nproc_per_node), args.script, *shlex.split(args.script_args)]
    completed = subprocess.run(command, env=env, check=False)
    fresh = {name: record for name, record in read_rehearsals(store).items()
             if before.get(name) != record}
    return report(args, completed.returncode, fresh)


def report(args: argparse.Namespace, returncode: int, fresh: dict[str, dict[str, Any]]) -> int:
    if not fresh:
        raise Refused(f"the script exited {returncode} without rehearsing (did it call "
                      f"CheckpointManager.restore() and then save, maybe_save or finish?)")
    name, record = next(iter(fresh.items()))
    ok = record_passed(record)
    idle = record.get("updates") == 0  # the script saved at the generation's own update
    # no update ran: the script's save came too early or never, or an older record passed
    # without the digest of an update (a failure in another component is not this problem)
    untrained = not ok and (idle or record.get("component") == "update" or bool(record.get("passed")))
    if args.json:
        print(json.dumps({"generation": name, "exit_code": returncode, **record, "passed": ok,
                          **({"problem": "no update ran"} if untrained else {})}))
    elif idle:
        update = parse_generation(name)
        print(f"{name}: rehearsal ran NO update: the script saved at update {update}, the "
              f"generation's own, right after the restore, so nothing was trained (let the "
              f"script run past update {update}, e.g. through --script-args)")
    elif ok:
        print(f"{name}: rehearsal passed; state digest after {record['updates']} update(s) "
              f"{record['digest']}")
    else:
        print(f"{name}: rehearsal FAILED in {record.get('component', 'update')}: "
              f"{record.get('reason', NO_UPDATE)}")
    return 0 if ok and returncode == 0 else 1


def add_rehearse_parser(sub: Any) -> argparse.ArgumentParser:
    rehearse = sub.add_parser("rehearse", help="prove a generation restorable with the job's script",
                              description=__doc__.splitlines()[0])
    rehearse.set_defaults(func=cmd_rehearse)
    rehearse.add_argument("root", metavar="ROOT", help="checkpoint root (path or s3:// URL)")
    rehearse.add_argument("generation", metavar="GEN", nargs="?", help="default: the newest that validates")
    rehearse.add_argument("--script", required=True, help="the training script (as given to torchrun)")
    rehearse.add_argument("--nproc-per-node", type=int, default=1, help="ranks to rehearse with")
    rehearse.add_argument("--json", action="store_true", help="machine-readable output")
    rehearse.add_argument("--script-args", default="", metavar="'ARGS'",
                          help="the script's arguments, one shell-quoted string")
    return rehearse
