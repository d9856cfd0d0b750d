"""Offline tools over generations: retention and pins, DONE records, diff and release export.

They run from the CLI as well as from a job (retention, DONE), and hold no job state.
May import every lower layer; the memory tier, the lifecycle and the manager import them.
"""
