"""Capture and restore of every random source of one rank.

Covered: Python ``random``, NumPy's legacy global RNG, named ``numpy.random.Generator``
objects the user registers, torch CPU, and each CUDA device when CUDA is initialised.
Restore is the last step of a restore, so that constructing objects does not consume the
restored streams.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from ..errors import ValidationError

RNG_SCHEMA = 1


def capture(generators: dict[str, np.random.Generator]) -> dict[str, Any]:
    """Snapshot every random source of this rank (all ranks call this for themselves)."""
    cuda_states: list[torch.Tensor] = []
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda_states = [s.clone() for s in torch.cuda.get_rng_state_all()]
    return {
        "schema": RNG_SCHEMA,
        "python": random.getstate(),
        "numpy_global": np.random.get_state(legacy=False),
        "numpy_generators": {name: gen.bit_generator.state for name, gen in generators.items()},
        "torch_cpu": torch.get_rng_state().clone(),
        "cuda": cuda_states,
    }


def restore(snapshot: dict[str, Any], generators: dict[str, np.random.Generator]) -> None:
    """Put every random source of this rank back to ``snapshot``."""
    if snapshot.get("schema") != RNG_SCHEMA:
        raise ValidationError(f"unknown RNG schema {snapshot.get('schema')!r}")
    saved_generators = snapshot["numpy_generators"]
    missing = sorted(set(generators) - set(saved_generators))
    if missing:
        raise ValidationError(f"checkpoint has no state for numpy generator(s) {missing}")
    random.setstate(_as_python_state(snapshot["python"]))
    np.random.set_state(snapshot["numpy_global"])
    for name, gen in generators.items():
        gen.bit_generator.state = saved_generators[name]
    torch.set_rng_state(snapshot["torch_cpu"])
    cuda_states = snapshot.get("cuda") or []
    if cuda_states and torch.cuda.is_available():
        for device, state in enumerate(cuda_states[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(state, device)


def derived(snapshot: dict[str, Any], rank: int) -> dict[str, Any]:
    """RNG state for a rank that did not exist when the checkpoint was taken.

    The new rank's streams are seeded from the saved rank 0 Python stream and the new rank
    number: deterministic, distinct per rank, and statistically (not bitwise) continued.
    """
    seeder = random.Random()
    seeder.setstate(_as_python_state(snapshot["python"]))
    seed = seeder.getrandbits(63) ^ (rank * 0x9E3779B97F4A7C15 & (2**63 - 1))
    py_rng = random.Random(seed)
    torch_gen = torch.Generator().manual_seed(seed)
    generators = {
        name: getattr(np.random, state["bit_generator"])(seed + index).state
        for index, (name, state) in enumerate(sorted(snapshot["numpy_generators"].items()))
    }
    legacy = np.random.RandomState(seed % 2**32)
    return {
        "schema": RNG_SCHEMA,
        "python": py_rng.getstate(),
        "numpy_global": legacy.get_state(legacy=False),
        "numpy_generators": generators,
        "torch_cpu": torch_gen.get_state(),
        "cuda": [],
    }


def _as_python_state(state: Any) -> tuple:
    version, internal, gauss = state
    return (version, tuple(internal), gauss)
