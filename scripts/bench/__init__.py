"""The dist_ckpt benchmark, as phases: every performance target measured in one run.

Run from the repository root: ``.venv/bin/python -m scripts.bench [--quick] [--state-mib N]
[--repeats R] [--dir DIR] [--json bench-results.json] [--profile] [--phases P,...] [--compare]
[--steps N] [--profile-cpu]`` (the options: ``cli``).
``--phases`` picks phases (default all; ``restore`` brings ``saves``, whose generation it reads);
``--compare`` is ``--phases compare``. Not a test. Every phase drives the library through its
public API (``CheckpointManager``, ``CheckpointConfig``, ``TrainState``) or, for the simulated
commit, the documented save hooks; nothing in the library is patched.

Phases (2 gloo ranks, ``--state-mib`` MiB of FSDP2 model + AdamW state per rank, ``jobs``):

- ``saves``: rounds of our async ``save()`` (blocking time, and save() -> wait()), a plain copy
  of the rank's local tensors into preallocated buffers, a raw write + fsync of the rank's share
  of the generation bytes, raw DCP ``async_save`` and ``save``, and our sync ``save()``,
  interleaved (order reversed every other round); the first saves are reported apart. Besides
  the slowest rank per repetition, each rank's own medians of async, sync and copy blocking
  and their quotients.
- ``restore``: ``restore()`` at 2 ranks vs a raw read of the same files; ``restore()`` at 3 ranks
  of the 2-rank generation (reshard).
- ``interference``: train step time with no save in flight vs while an async save runs.
- ``memory``: peak RSS while async saves run with ``max_in_flight`` K = 1 and 2.
- ``commit_scale`` (one process): rank 0's commit for 8, 64, 512 and 4096 simulated reports.
- ``heartbeat`` (one rank): the cost per ``heartbeat()`` / ``maybe_save()`` call with nothing
  pending, outside the launcher and under a simulated launcher directory.
- ``compare`` (its own 2-rank run, then a 3-rank one): dist_ckpt side by side with raw DCP on
  the same job and the same tensors (``get_state_dict`` of the model and AdamW). Methods (the
  columns): our async save with the eager snapshot, with the lazy one (only when
  ``"snapshot" in CheckpointConfig.model_fields``), our sync save, ``dcp.save``, default
  ``dcp.async_save``, and ``dcp.async_save`` with a kept
  ``DefaultStager(StagingOptions(use_async_staging=True))`` (the caller waits for
  ``staging_completion`` before the next ``optimizer.step()``); raw DCP runs on a gloo group of
  its own. Rounds (method order reversed every other round) measure per method: ``save()``
  blocking; save to durable; the process's CPU seconds, user + system over every thread
  (``getrusage``), of one save and its completion with no training running, per GiB of the
  rank's state; the training time lost per checkpoint, ``--steps`` (default 8) train steps with
  one save started before the first and waited for after the last, minus as many steps without
  a save (the two runs adjacent, their order alternated); and the plain copy floor. Then, warm
  (nothing dropped from the page cache, for either): verified ``restore()`` against an
  unverified ``dcp.load`` + ``set_state_dict`` of the same generation's ``dcp/`` directory, at 2
  ranks and, in the 3-rank run, resharded 2 -> 3. ``--profile-cpu`` adds, for one more eager
  async save on rank 0, the user/system split per thread and ``py-spy record --native`` stacks
  when py-spy is installed (``cpu_profile``). Every compare run also prints the CPU floor per
  GiB: one copy of the rank's tensors plus one BLAKE3 pass over the copied bytes (this
  thread's CPU, ``compare.floor_series``), and each method's CPU seconds per save.
  ``--job finetune`` (a frozen base of ``--state-mib`` per rank, trainable low-rank adapters;
  ``--kind fsdp|ddp``; issue 28) has three columns: our async eager save with incremental
  generations (the default), the same with ``incremental=False`` (a full save) and raw DCP
  ``async_save``. Bytes written are counted for the saves after the first (the first, which
  writes the base, is reported apart); restores (incremental generation, full generation,
  ``dcp.load`` of a kept DCP save of the same state) each follow an in-place change of every
  tensor and are checked bitwise against the saved tensors; then, unless ``--no-mirror``, the
  mirror bytes uploaded per generation, incremental and full, counted from the listing of a
  moto S3 server the run starts on 127.0.0.1 (``mirror``; raw DCP would upload its bytes
  written).
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
- a progress call (``heartbeat``, ``maybe_save``) with nothing pending < 50 µs

Compare targets (issue 12; ``compare_report.target_specs``), each judged as ``value <= target x
reference`` so that a reference of 0 or less still judges:

- training time lost, our async (eager; lazy) <= 0.5 x DCP async staging's and <= 0.5 x DCP
  default ``async_save``'s
- CPU seconds per GiB saved, our async <= 0.5 x DCP ``async_save``'s
- lazy ``save()`` blocking <= 0.02 s and <= 2 x DCP async staging's; eager blocking <= 1.2 x the
  plain copy
- our sync save <= 0.9 x ``dcp.save``
- verified ``restore()`` <= 1.3 x ``dcp.load`` of the same files, at 2 ranks and resharded 2 -> 3

Issue 28 targets (``compare_report.issue28_specs``, printed as met / not met): fine-tuning job,
after the first generation: bytes written and mirror bytes uploaded per generation <= 1.05 x the
trainable state (adapters + AdamW, replicated tensors once, plus the small state: the
generation's files other than tensor data); incremental ``save()`` blocking and save CPU <= 0.1 x
the ``incremental=False`` save's; incremental time to durable <= 0.1 x DCP ``async_save``'s;
restore of an incremental generation <= 1.1 x a full generation's, tensors bitwise equal. Fully
trainable job: our async eager save's CPU per GiB <= 1.3 x the floor (copy + BLAKE3).

Modules: ``jobs`` (the job and timing helpers, shared with ``bench_s3.py``), ``context`` (a
rank's job), ``rawio`` (raw write/read floors), ``profiling`` (cProfile, including the save
threads via ``threading.setprofile``), one module per phase group (``rss`` is the ``memory``
phase; ``compare_methods`` holds the compared save methods, ``compare_report`` the compare
table, ``mirror`` the moto server and the mirror-bytes count), ``cpu_profile``
(``--profile-cpu``), ``runner`` (which processes run what), ``cli``
(options, output).
"""
