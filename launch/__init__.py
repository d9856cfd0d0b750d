"""The torchrun launcher with a bounded restart policy (requirements section 6).

Not implemented yet: this package is reserved for ``python -m launch`` in a later issue.
"""
