"""The dist_ckpt benchmark, as phases: every performance target measured in one run.

Run from the repository root: ``.venv/bin/python -m scripts.bench [options]`` (``cli``).
Not a test. The phases, what each measures, the targets and the modules of this package are
described in docs/performance.md ("The phases, their targets and the modules").
"""
