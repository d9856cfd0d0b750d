"""``slow_example.py SECONDS [example options]``: scripts/train_example.py with each update
lasting at least SECONDS longer (before its ``maybe_save``), so that "the update reached when
the signal came" is well defined. The arithmetic is the example's: its final state compares
bitwise with ``launchlib.reference`` of the same options."""

from __future__ import annotations

import os
import runpy
import sys
import time

from dist_ckpt import CheckpointManager

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                       "scripts", "train_example.py")


def main() -> None:
    step_s = float(sys.argv.pop(1))
    original = CheckpointManager.maybe_save

    def slow(self, *args, **kwargs):
        time.sleep(step_s)  # the work of a slower update, not a synchronisation
        return original(self, *args, **kwargs)

    CheckpointManager.maybe_save = slow  # type: ignore[method-assign]
    sys.argv[0] = EXAMPLE
    runpy.run_path(EXAMPLE, run_name="__main__")


if __name__ == "__main__":
    main()
