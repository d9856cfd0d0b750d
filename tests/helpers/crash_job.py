"""A job that always fails (exit 3) before doing anything: for the restart-limit test."""

import sys

sys.exit(3)
