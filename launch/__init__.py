"""The torchrun launcher: ``python -m launch`` runs a job with a bounded restart policy.

See :mod:`launch.runner` for the loop and :mod:`launch.policy` for how a start is classified.
"""
