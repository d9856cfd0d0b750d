"""Shared building blocks for the tests, kept apart from the tests themselves: the worker
functions that spawned ranks run (``workers``, ``async_workers``), the small local job used by
library tests (``local_jobs``), the launcher helpers (``launchlib``), the moto S3 endpoint behind
the ``s3_endpoint``/``s3_root`` fixtures (``s3``), the checksum-verifying proxy in front of it
(``s3proxy``), and the job scripts that tests start as subprocesses (``*_job.py``, by path or
with ``python -m tests.helpers.<name>``). Test modules import from here, never from each
other; ``tests/test_layout.py`` keeps it that way.
"""
