"""Commit tiers: where a generation lives and how it becomes committed there.

Owns: the attempt -> publish -> latest protocol of each tier (a POSIX rename tier, an
object-store tier) and the tier registry. May import: ``errors``, ``logs``, ``faults``,
``format``, ``storage``. Nothing outside this package asks which kind a tier is.
"""
