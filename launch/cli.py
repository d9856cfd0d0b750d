"""Entry point of ``python -m launch`` and the ``dist-ckpt-run`` console script.

Exit codes: 0 the run is done (valid DONE) or finished without DONE; 1 a permanent failure
(bad config, contract mismatch, no space, missing script, an unreachable mirror, ...); 2 a usage
error; 3 gave up: ``--max-starts`` starts, or a crash loop (``--max-no-progress`` failed starts
in a row without a new generation); 4 stopped by the operator (SIGINT), or a preemption that
saved nothing; 75 preempted (SIGTERM, ``--preempt-signal``, the stop file): the workers saved
a generation and stopped; neither success nor failure: start the job again to resume there.
"""

from __future__ import annotations

import sys

from .options import parse
from .rundir import RunDirError
from .runner import Launcher

EXIT_USAGE = 2


def main(argv: list[str] | None = None) -> int:
    options = parse(sys.argv[1:] if argv is None else argv)
    try:
        launcher = Launcher(options)
    except RunDirError as exc:
        print(f"python -m launch: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return launcher.run()
