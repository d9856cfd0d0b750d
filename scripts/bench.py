"""The dist_ckpt benchmark (entry point; the phases live in the ``scripts/bench`` package).

Usage: .venv/bin/python scripts/bench.py [--quick] [--state-mib N] [--repeats R] [--dir DIR]
                                         [--json bench-results.json] [--profile]
                                         [--phases P,...] [--compare] [--steps N] [--profile-cpu]

See scripts/bench/__init__.py for what each phase measures and the targets. Not a test.
"""

import os
import sys

# scripts/ first: ``import bench`` is the package scripts/bench/ (a package wins over bench.py)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
