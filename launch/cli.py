"""Entry point of ``python -m launch`` and the ``dist-ckpt-run`` console script.

Exit codes: 0 the run is done (valid DONE) or finished without DONE; 1 a permanent failure
(bad config, contract mismatch, no space, missing script, an unreachable mirror, ...); 2 a usage
error; 3 gave up: ``--max-starts`` starts, or a crash loop (``--max-no-progress`` failed starts
in a row without a new generation); 4 stopped by the operator (SIGINT), or a preemption that
saved nothing; 75 preempted (SIGTERM, ``--preempt-signal``, the stop file): the workers saved
a generation and stopped; neither success nor failure: start the job again to resume there.
"""

from __future__ import annotations

import os
import sys

from dist_ckpt import launcher_api as api

from .health import script_problem
from .options import LaunchOptions, parse, prog_name
from .rundir import RunDirError, existing_run
from .runner import Launcher

EXIT_USAGE = 2


def main(argv: list[str] | None = None) -> int:
    prog = prog_name(sys.argv[0]) if argv is None else prog_name("")
    options = parse(sys.argv[1:] if argv is None else argv, prog)
    problem = script_problem(options)
    try:
        # a usage error, before anything under the root is created; only a run that is done
        # already says so whatever the script (no start would be made)
        if problem is not None and not _done_already(options):
            print(f"{prog}: {problem}", file=sys.stderr)
            return EXIT_USAGE
        launcher = Launcher(options)
    except RunDirError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return launcher.run()


def _done_already(options: LaunchOptions) -> bool:
    run = existing_run(options.checkpoint_root, fresh=options.fresh, run_id=options.run_id)
    if run is None or not os.path.isdir(run):
        return False
    mirror = api.mirror_run_url(options.mirror, os.path.basename(run)) if options.mirror else None
    return api.find_done([run], contract_digest=None, mirror=mirror) is not None
