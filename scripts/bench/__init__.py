"""The dist_ckpt benchmark, as phases: every performance target measured in one run.

Run: ``.venv/bin/python scripts/bench.py [--quick] [--state-mib N] [--repeats R] [--dir DIR]
[--json bench-results.json] [--profile]`` (also ``python -m scripts.bench`` from the repository
root, or ``python scripts/bench``). Not a test. Every phase drives the library through its
public API (``CheckpointManager``, ``CheckpointConfig``, ``TrainState``) or, for the simulated
commit, the documented save hooks; nothing in the library is patched.

Phases (2 gloo ranks, ``--state-mib`` MiB of FSDP2 model + AdamW state per rank, ``jobs``):

- ``saves``: rounds of our async ``save()`` (blocking time, and save() -> wait()), a plain copy
  of the rank's local tensors into preallocated buffers, a raw write + fsync of the rank's share
  of the generation bytes, raw DCP ``async_save`` and ``save``, and our sync ``save()``,
  interleaved (order reversed every other round); the first saves are reported apart.
- ``restore``: ``restore()`` at 2 ranks vs a raw read of the same files; ``restore()`` at 3 ranks
  of the 2-rank generation (reshard).
- ``interference``: train step time with no save in flight vs while an async save runs.
- ``memory``: peak RSS while async saves run with ``max_in_flight`` K = 1 and 2.
- ``commit_scale`` (one process): rank 0's commit for 8, 64, 512 and 4096 simulated reports.
- ``report``: the timing table (slowest rank per repetition unless a row says otherwise), the
  memory table, each ratio next to its target (PASS / MISS), and the JSON document.

Targets (``report.TARGETS``):

- stall, async ``save()`` blocking / sync ``save()`` blocking <= 0.10
- staging efficiency, async blocking / plain copy <= 1.5
- write efficiency, commit throughput / raw write + fsync throughput >= 0.85
- our async blocking / DCP ``async_save`` blocking <= 0.25
- our async end-to-end / DCP sync ``save`` <= 1.2
- restore efficiency, restore throughput / raw read throughput >= 0.8
- reshard overhead, restore at 3 ranks / at 2 ranks <= 1.25
- interference, step with a save in flight / idle step <= 1.10
- peak RSS with K saves in flight / (baseline + K x state) <= 1.10, K = 1 and 2
- rank-0 commit of 4096 reports < 1 s

Modules: ``jobs`` (the job and timing helpers, shared with ``bench_async.py`` and
``bench_s3.py``), ``context`` (a rank's job), ``rawio`` (raw write/read floors), ``profiling``
(cProfile, including the save threads via ``threading.setprofile``), one module per phase group,
``runner`` (which processes run what), ``cli`` (options, output).
"""
