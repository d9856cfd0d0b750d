"""Compare two generations component by component, in causal order.

The order is the order in which one difference causes the next: a changed contract changes
everything; then the counters; then the data position (other batches change the tensors);
then the RNG streams (other dropout masks and noise change the tensors); then the scheduler
and scaler (another learning rate changes the tensors); then extras; then the model and the
optimizer tensors, which every earlier difference also reaches. The first differing
component is therefore the likeliest cause, the later ones its likely consequences.

Every file is checked against its manifest (size and sha256) before it is parsed; the
pickled ``dcp/.metadata`` is unpickled only from bytes whose digest matched. Tensors are
read without a process group, one full tensor per side at a time, by key, so generations
saved at different world sizes and shardings compare directly.
"""

from __future__ import annotations

import hashlib
import io
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)

from . import progress
from .errors import StorageError, ValidationError
from .format.inventory import newest_committed
from .format.manifest import (
    DCP_DIR,
    GLOBAL_STATE_FILE,
    METADATA_FILE,
    Manifest,
    expand_generation_name,
    is_object_path,
    parse_generation,
    rank_state_file,
)
from .format.validate import (
    ObjectVerdicts,
    check_digests,
    check_sizes,
    check_structure,
    read_verified,
)
from .restart import codec
from .restore.loader import load_in_process
from .storage.base import StoreReader
from .tiers import CommitTier, GenerationReader, open_tier

COMPONENTS = ("contract", "counters", "data", "rng", "scheduler", "scaler", "extras", "model",
              "optimizer")
_SHORT = 96  # longer values are shown by digest


# ---- results ------------------------------------------------------------------------------
@dataclass
class Difference:
    """One differing item. ``a``/``b`` are short JSON-able renderings (None: absent on that
    side); tensors carry the largest absolute and relative differences instead."""

    component: str
    key: str
    a: Any = None
    b: Any = None
    max_abs: float | None = None
    max_rel: float | None = None
    note: str | None = None


@dataclass
class DiffReport:
    a: str
    b: str
    world_sizes: tuple[int, int]
    differences: list[Difference] = field(default_factory=list)
    compared: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COMPONENTS, 0))
    extra_ranks: dict[str, list[int]] = field(default_factory=lambda: {"a": [], "b": []})

    @property
    def identical(self) -> bool:
        return not self.differences

    @property
    def first(self) -> Difference | None:
        """The first difference in causal order (component order, then key order)."""
        return self.differences[0] if self.differences else None

    def differing(self, component: str) -> list[Difference]:
        return [d for d in self.differences if d.component == component]

    def to_dict(self) -> dict[str, Any]:
        first = self.first
        return {
            "a": self.a, "b": self.b, "world_sizes": list(self.world_sizes),
            "identical": self.identical,
            "first_difference": None if first is None else _json_safe(asdict(first)),
            "components": {name: {"compared": self.compared[name], "differing": len(self.differing(name))}
                           for name in COMPONENTS},
            "extra_ranks": self.extra_ranks,
            "differences": [_json_safe(asdict(d)) for d in self.differences],
        }


def _json_safe(record: dict[str, Any]) -> dict[str, Any]:
    # NaN and infinities are not JSON: name them instead
    return {k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}


# ---- locating and opening generations ------------------------------------------------------
@dataclass
class Generation:
    """A generation whose manifest, structure and file sizes checked out."""

    tier: CommitTier
    name: str
    manifest: Manifest

    @property
    def store(self) -> StoreReader:
        return self.tier.store

    @property
    def url(self) -> str:
        return self.store.url(self.name)

    def read_json(self, path: str) -> Any:
        raw = read_verified(self.store, self.name, self.manifest, path)
        return codec.loads(raw, what=f"{self.name}/{path}")


def split_spec(spec: str) -> tuple[str, str | None]:
    """``ROOT`` -> (ROOT, None); ``ROOT/gen-NNNNNNNNNNNN`` -> (ROOT, name), the short forms of
    the name too (``ROOT/gen-6``; a bare number is a directory's name, not a generation's)."""
    head, _, tail = spec.rstrip("/").rpartition("/")
    if tail.startswith("gen-"):
        tail = expand_generation_name(tail)
    if parse_generation(tail) is None:
        return spec, None
    if head.endswith(":/") or head.endswith(":"):  # s3://gen-... names a bucket, not a generation
        return spec, None
    return head or ".", tail


def open_generation(tier: CommitTier, name: str, *, key: bytes | None = None) -> Generation:
    """Structure and sizes now; each file's digest when it is read."""
    manifest = check_structure(tier.store, name, key=key)
    check_sizes(tier.store, name, manifest)
    return Generation(tier, name, manifest)


def locate(spec: str, *, key: bytes | None = None) -> Generation:
    """``ROOT`` (its newest committed generation) or the path/URL of a generation directory."""
    root, name = split_spec(spec)
    tier = open_tier(root)
    store = tier.store
    if not store.exists(""):
        raise StorageError(f"checkpoint root {root!r} does not exist")
    if name is None:
        name = newest_committed(store, key)
        if name is None:
            raise ValidationError(f"no committed generation under {store.root}")
    elif not store.exists(name):
        raise ValidationError(f"no generation {name!r} under {store.root}", generation=name)
    return open_generation(tier, name, key=key)


def diff(spec_a: str, spec_b: str, *, key: bytes | None = None) -> DiffReport:
    """Compare two generations named as :func:`locate` takes them."""
    return diff_generations(locate(spec_a, key=key), locate(spec_b, key=key))


def diff_generations(a: Generation, b: Generation) -> DiffReport:
    report = DiffReport(a.url, b.url, (a.manifest.world_size, b.manifest.world_size))
    _add(report, "contract", _compare_mapping("contract", a.manifest.contract, b.manifest.contract))
    global_a, global_b = a.read_json(GLOBAL_STATE_FILE), b.read_json(GLOBAL_STATE_FILE)
    counters = ("next_update", "tokens_seen")
    _add(report, "counters", _compare_mapping("counters", {k: global_a.get(k) for k in counters},
                                               {k: global_b.get(k) for k in counters}))
    _add(report, "data", _compare_mapping("data", global_a.get("data"), global_b.get("data")))
    _add(report, "rng", _compare_rng(report, a, b))
    for name in ("scheduler", "scaler", "extras"):
        _add(report, name, _compare_mapping(name, global_a.get(name), global_b.get(name)))
    for name, count, found in _compare_dcp(a, b):
        report.compared[name] += count
        report.differences.extend(found)
    return report


def _add(report: DiffReport, component: str, result: tuple[int, list[Difference]]) -> None:
    count, found = result
    report.compared[component] += count
    report.differences.extend(found)


# ---- small state: contract, counters, data, scheduler, scaler, extras ------------------------
def _compare_mapping(component: str, a: Any, b: Any) -> tuple[int, list[Difference]]:
    """Per top-level key; a state saved on one side only is one difference."""
    if a is None and b is None:
        return 0, []
    if not isinstance(a, dict) or not isinstance(b, dict):
        same = _same(a, b)
        return 1, [] if same else [Difference(component, "(state)", _short(a), _short(b),
                                              note=None if a is not None and b is not None
                                              else "saved on one side only")]
    found = [Difference(component, str(k), _short(a.get(k)), _short(b.get(k)),
                        note=None if k in a and k in b else f"only in {'A' if k in a else 'B'}")
             for k in _sorted_keys(a, b) if k not in a or k not in b or not _same(a[k], b[k])]
    return len(set(a) | set(b)), found


def _sorted_keys(a: dict, b: dict) -> list[Any]:
    return sorted(set(a) | set(b), key=str)


def _same(a: Any, b: Any) -> bool:
    """Exact equality through the types the JSON codec decodes (tensors bitwise)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and _bitwise_equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype
                and a.shape == b.shape and a.tobytes() == b.tobytes())
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return type(a) is type(b) and a == b


def _short(value: Any) -> Any:
    """A JSON-able rendering: scalars as they are, long values by digest."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    raw = codec.dumps(value)
    if len(raw) <= _SHORT and not isinstance(value, torch.Tensor | np.ndarray):
        return raw.decode("utf-8")
    return f"sha256:{hashlib.sha256(raw).hexdigest()[:12]} ({len(raw)} bytes)"


# ---- RNG ------------------------------------------------------------------------------------
def _compare_rng(report: DiffReport, a: Generation, b: Generation) -> tuple[int, list[Difference]]:
    """Per rank both generations have, per stream; extra ranks are reported apart."""
    world_a, world_b = a.manifest.world_size, b.manifest.world_size
    report.extra_ranks = {"a": list(range(world_b, world_a)), "b": list(range(world_a, world_b))}
    count, found = 0, []
    for rank in range(min(world_a, world_b)):
        streams_a = _rng_streams(a.read_json(rank_state_file(rank)))
        streams_b = _rng_streams(b.read_json(rank_state_file(rank)))
        keys = list(dict.fromkeys([*streams_a, *streams_b]))  # capture order: python first
        count += len(keys)
        found += [Difference("rng", f"rank {rank}: {k}", _short(streams_a.get(k)), _short(streams_b.get(k)),
                             note=None if k in streams_a and k in streams_b
                             else f"only in {'A' if k in streams_a else 'B'}")
                  for k in keys if k not in streams_a or k not in streams_b
                  or not _same(streams_a[k], streams_b[k])]
    return count, found


def _rng_streams(rank_state: Any) -> dict[str, Any]:
    snapshot = rank_state.get("rng") if isinstance(rank_state, dict) else None
    if not isinstance(snapshot, dict):
        raise ValidationError("rank state file holds no RNG snapshot")
    streams = {"python": snapshot.get("python"), "numpy_global": snapshot.get("numpy_global")}
    for name, state in sorted((snapshot.get("numpy_generators") or {}).items()):
        streams[f"numpy_generators.{name}"] = state
    streams["torch_cpu"] = snapshot.get("torch_cpu")
    for device, state in enumerate(snapshot.get("cuda") or []):
        streams[f"cuda.{device}"] = state
    return streams


# ---- tensors ---------------------------------------------------------------------------------
def _component_of(fqn: str) -> str:
    return "optimizer" if fqn.startswith("optim.") else "model"


def _compare_dcp(a: Generation, b: Generation) -> Iterator[tuple[str, int, list[Difference]]]:
    """Model keys first, then optimizer keys; one tensor per side in memory at a time."""
    # two generations of one root share its objects (an incremental frozen base): each
    # object is hashed once for both sides; objects of another root are that root's files
    same_root = a.store.url("").rstrip("/") == b.store.url("").rstrip("/")
    shared = ObjectVerdicts() if same_root and type(a.store) is type(b.store) else None
    with _TensorSource.open(a, shared) as src_a, _TensorSource.open(b, shared) as src_b:
        keys = _sorted_keys(src_a.items, src_b.items)
        for component in ("model", "optimizer"):
            wanted = [k for k in keys if _component_of(k) == component]
            found = [d for d in (_compare_item(component, k, src_a, src_b) for k in wanted) if d]
            yield component, len(wanted), found


def _compare_item(component: str, key: str, src_a: _TensorSource, src_b: _TensorSource) -> Difference | None:
    meta_a, meta_b = src_a.items.get(key), src_b.items.get(key)
    if meta_a is None or meta_b is None:
        return Difference(component, key, _describe(meta_a), _describe(meta_b),
                          note=f"only in {'A' if meta_a is not None else 'B'}")
    if isinstance(meta_a, TensorStorageMetadata) and isinstance(meta_b, TensorStorageMetadata):
        if meta_a.size != meta_b.size or meta_a.properties.dtype != meta_b.properties.dtype:
            return Difference(component, key, _describe(meta_a), _describe(meta_b),
                              note="dtype or shape differs")
        return compare_tensors(component, key, src_a.tensor(key, meta_a), src_b.tensor(key, meta_b))
    if isinstance(meta_a, BytesStorageMetadata) and isinstance(meta_b, BytesStorageMetadata):
        raw_a, raw_b = src_a.raw_bytes(key), src_b.raw_bytes(key)
        if raw_a == raw_b:
            return None
        return Difference(component, key, _short(_safe_unpickle(raw_a)), _short(_safe_unpickle(raw_b)))
    return Difference(component, key, _describe(meta_a), _describe(meta_b), note="tensor on one side only")


def _describe(meta: Any) -> str | None:
    if isinstance(meta, TensorStorageMetadata):
        return f"{str(meta.properties.dtype).removeprefix('torch.')}{list(meta.size)}"
    return None if meta is None else "(non-tensor item)"


def _safe_unpickle(raw: bytes) -> Any:
    """A non-tensor DCP item for display only, through torch's restricted unpickler."""
    try:
        return torch.load(io.BytesIO(raw), weights_only=True)
    except Exception:  # noqa: BLE001 - display only: the raw bytes already told them apart
        return f"sha256:{hashlib.sha256(raw).hexdigest()[:12]} ({len(raw)} bytes)"


def compare_tensors(component: str, key: str, a: torch.Tensor, b: torch.Tensor) -> Difference | None:
    """None when bitwise equal; else the largest absolute and relative difference, where the
    relative difference of an element is |a - b| / max(|a|, |b|)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return Difference(component, key, f"{a.dtype}{list(a.shape)}", f"{b.dtype}{list(b.shape)}",
                          note="dtype or shape differs")
    if _bitwise_equal(a, b):
        return None
    wide = torch.complex128 if a.is_complex() else torch.float64
    x, y = a.to(wide), b.to(wide)
    delta = (x - y).abs()
    scale = torch.maximum(x.abs(), y.abs())
    rel = torch.where(scale > 0, delta / scale.clamp_min(torch.finfo(torch.float64).tiny), 0.0)
    return Difference(component, key, max_abs=float(delta.max()), max_rel=float(rel.max()))


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    # bitwise, not ==: NaN equals NaN of the same payload, -0.0 differs from 0.0
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    flat_a, flat_b = a.detach().cpu().reshape(-1), b.detach().cpu().reshape(-1)
    return torch.equal(flat_a.view(torch.uint8), flat_b.view(torch.uint8)) if a.numel() else True


class _TensorSource:
    """Per-key reads of one generation's DCP checkpoint, from verified bytes only."""

    def __init__(self, generation: Generation, reader: GenerationReader, metadata: Metadata) -> None:
        self.generation = generation
        self.reader = reader
        self.metadata = metadata
        self.items = dict(metadata.state_dict_metadata)

    @classmethod
    @contextmanager
    def open(cls, generation: Generation,
             objects: ObjectVerdicts | None = None) -> Iterator[_TensorSource]:
        """``objects``: verdicts on the root's shared objects, kept across both sides."""
        name, manifest = generation.name, generation.manifest
        reader = generation.tier.open_reader(name, manifest)
        try:
            metadata = reader.read_metadata()
            if not reader.hashes_on_read:
                # files read in place cannot be swapped under a private copy: hash them first
                # (shared objects too: an incremental generation reads its frozen tensors there)
                check_digests(generation.store, name, manifest, [
                    f.path for f in manifest.files
                    if (f.path.startswith(f"{DCP_DIR}/") or is_object_path(f.path))
                    and f.path != METADATA_FILE], objects=objects)
            yield cls(generation, reader, metadata)
        finally:
            reader.close()

    def tensor(self, key: str, meta: TensorStorageMetadata) -> torch.Tensor:
        """The full tensor ``key``, assembled from however many shards hold it."""
        target = {key: torch.empty(meta.size, dtype=meta.properties.dtype)}
        load_in_process(target, self.reader)
        progress.advance(target[key].numel() * target[key].element_size())
        return target[key]

    def raw_bytes(self, key: str) -> bytes:
        """A non-tensor item's stored bytes (compared as bytes, never unpickled unrestricted)."""
        info = next((v for k, v in self.metadata.storage_data.items() if k.fqn == key), None)
        if info is None:
            raise ValidationError(f"{self.generation.name}: DCP metadata has no storage for {key}",
                                  generation=self.generation.name, path=METADATA_FILE)
        dcp_reader = self.reader.storage_reader
        fs = dcp_reader.fs  # type: ignore[attr-defined]
        with fs.create_stream(fs.concat_path(dcp_reader.path, info.relative_path), "rb") as stream:  # type: ignore[attr-defined]
            stream.seek(info.offset)
            return stream.read(info.length)

