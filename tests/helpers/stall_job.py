"""The example job (scripts/train_example.py) with a rank that stops or lags, for the watchdog tests.

    stall_job.py [--sigstop-at U --sigstop-rank R --marker PATH] [--work-s S]
                 [--slow-rank R --slow-extra-s S] -- EXAMPLE_ARGS...

Each rank calls the example's ``maybe_save(U)`` through a wrapper that first sleeps
``--work-s`` (every rank: the work of an update), then ``--slow-extra-s`` more on
``--slow-rank`` (after its optimizer step, before ``maybe_save``: a straggler), and SIGSTOPs
itself on ``--sigstop-rank`` at update ``--sigstop-at`` when ``--marker`` does not exist yet
(so only in the first start: alive, silent, a hang). The training itself is the example's,
unchanged: a run with these options ends in the same tensors as the plain example.
"""

from __future__ import annotations

import argparse
import os
import runpy
import signal
import sys
import time

from dist_ckpt import CheckpointManager

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                       "scripts", "train_example.py")


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser()
    parser.add_argument("--sigstop-at", type=int, default=None)
    parser.add_argument("--sigstop-rank", type=int, default=1)
    parser.add_argument("--marker", default=None)
    parser.add_argument("--work-s", type=float, default=0.0)
    parser.add_argument("--slow-rank", type=int, default=None)
    parser.add_argument("--slow-extra-s", type=float, default=0.0)
    return parser.parse_args(argv[:split]), argv[split + 1:]


def main() -> None:
    options, example_args = parse(sys.argv[1:])
    original = CheckpointManager.maybe_save

    def maybe_save(self: CheckpointManager, next_update: int, **kwargs):  # type: ignore[no-untyped-def]
        rank = self.comm.rank
        time.sleep(options.work_s)
        if rank == options.slow_rank:
            time.sleep(options.slow_extra_s)
        if next_update == options.sigstop_at and rank == options.sigstop_rank and not (
                options.marker and os.path.exists(options.marker)):
            if options.marker:
                with open(options.marker, "w") as marker:
                    marker.write(f"{time.time()} {os.getpid()}\n")  # when and who stopped
            os.kill(os.getpid(), signal.SIGSTOP)
        return original(self, next_update, **kwargs)

    CheckpointManager.maybe_save = maybe_save  # type: ignore[method-assign]
    sys.argv = [EXAMPLE, *example_args]
    runpy.run_path(EXAMPLE, run_name="__main__")


if __name__ == "__main__":
    main()
