"""Peak RSS of a rank while async saves run with ``max_in_flight`` = 1 and 2 (two saves
back-to-back), against the baseline RSS plus K copies of the rank's state."""

from __future__ import annotations

import ctypes
import os
import shutil
import threading
import time
from typing import Any

from dist_ckpt import CheckpointConfig, CheckpointManager

from . import jobs

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * PAGE


class RssSampler(threading.Thread):
    """Peak resident set size of this process, sampled every ``interval_s``."""

    def __init__(self, interval_s: float = 0.005) -> None:
        super().__init__(daemon=True, name="rss-sampler")
        self.interval_s = interval_s
        self.peak = rss_bytes()
        self.samples = 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.peak = max(self.peak, rss_bytes())
            self.samples += 1
            time.sleep(self.interval_s)

    def stop(self) -> int:
        self._stop_event.set()
        self.join()
        self.peak = max(self.peak, rss_bytes())
        return self.peak


def rank_rss(rank: int, world: int, cfg: dict[str, Any], base: str, slots: int) -> dict[str, Any]:
    """Peak RSS while async saves run with ``max_in_flight=slots`` (two saves back-to-back)."""
    import torch

    torch.set_num_threads(1)
    _, _, state = jobs.build_job(cfg["state_mib"], rank, world)
    state_bytes = jobs.tensor_bytes(jobs.local_tensors(state.tensor_state()))
    root = os.path.join(base, f"memory-{slots}")
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap (model built unsharded) is not baseline
    jobs.barrier()
    baseline = rss_bytes()
    sampler = RssSampler()
    sampler.start()
    config = CheckpointConfig(root=root, async_save=True, max_in_flight=slots, keep_last=2)
    with CheckpointManager(config, state) as mgr:
        for rep in range(cfg["repeats"]):
            jobs.barrier()
            mgr.save(2 * rep + 1)
            mgr.save(2 * rep + 2)  # returns at once when slots == 2; waits for the first when 1
            mgr.wait()
        staging_peak = mgr.staging.peak_bytes if mgr.staging is not None else 0
    peak = sampler.stop()
    jobs.barrier()
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    return {"baseline": baseline, "peak": peak, "state_bytes": state_bytes, "slots": slots,
            "staging_peak": staging_peak, "samples": sampler.samples}
