"""``python -m scripts.bench`` (from the repository root): run the benchmark (see __init__)."""

import os
import sys

# one import name for the package however it is started (``bench``, with scripts/ on the path):
# the rank functions the spawned processes unpickle then live in the same modules everywhere
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
