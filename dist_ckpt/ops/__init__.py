"""Offline tools over generations: diff and release export.

They run from the CLI (and from Python) over roots, and hold no job state. Retention and
DONE run inside the job: they live in ``lifecycle/``.
May import every lower layer; the CLI and the public names import them.
"""
