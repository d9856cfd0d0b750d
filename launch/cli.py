"""Entry point of ``python -m launch`` and the ``dist-ckpt-run`` console script.

Exit codes: 0 the run is done (valid DONE) or finished without DONE; 1 a permanent failure
(bad config, contract mismatch, no space, missing script, ...); 2 a usage error; 3 gave up after
``--max-starts`` starts; 4 stopped by the operator (stop file, SIGTERM, SIGINT).
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
