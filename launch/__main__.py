"""``python -m launch --checkpoint-root ROOT [launcher options] [torchrun options] script.py ...``"""

from __future__ import annotations

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
