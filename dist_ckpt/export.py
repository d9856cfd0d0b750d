"""Release export: the model tensors of one generation as Hugging Face style safetensors files.

:func:`export_generation` consolidates the ``model.*`` entries of a generation's DCP
checkpoint (whatever world size and sharding saved it) into unsharded tensors, without a
process group, and writes them as safetensors shards plus ``model.safetensors.index.json``
and ``release.json`` (provenance and the sha256 of every output file). Optimizer, RNG, data
and extras are never read.

Layout of the output directory:

- one shard: ``model.safetensors``; several: ``model-00001-of-0000N.safetensors`` ...;
  ``model.safetensors.index.json`` (``{"metadata": {"total_size"}, "weight_map"}``) is
  written in both cases (one rule: always), so a reader can always start from the index.
- ``release.json``: source root, generation, manifest sha256, contract digest, code version,
  tensor count, total bytes, aliases, the sha256 and size of every other file.

Memory: tensors are loaded in batches of at most ``LOAD_BATCH_BYTES`` (or one tensor when it
is larger) and only the current output shard is held, so the peak is about one output shard
plus one batch, never the whole model.

Trust: the manifest (and its signature, with ``key``) is checked first; ``dcp/.metadata`` (a
pickle) is deserialised only from bytes whose sha256 matches the manifest, and every
``.distcp`` file that holds model tensors (a generation's own, or a shared object an
incremental generation references) is hashed before it is read. For an object-store
root every file is read from a private local copy verified while it downloads (as restore
does), so what is hashed is what is read. A local root is trusted-local data, as for restore.

Tied weights: DCP stores a tied parameter under each of its names. A later tensor whose
dtype, shape and bytes equal an earlier one is written once and recorded in ``release.json``
``aliases`` (alias -> canonical name, as safetensors' ``save_model`` drops shared tensors).
When the generation holds optimizer state, a pair counts as tied only if the optimizer lists
the canonical name and not the alias (an optimizer names a tied parameter once), so untied
tensors that happen to be equal (fresh zero biases) are both written.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from . import progress
from .errors import DistCkptError, ValidationError
from .format.inventory import newest_committed
from .format.manifest import (
    MANIFEST_NAME,
    METADATA_FILE,
    Manifest,
    check_generation_name,
    check_relative_path,
    dcp_entry_path,
)
from .format.safetensors_file import ST_DTYPES, byte_view, write_safetensors
from .format.validate import check_digests, check_sizes, check_structure
from .restore.loader import load_in_process
from .storage.base import Store
from .storage.local import file_digest, fsync_dir, write_durable
from .tiers import CommitTier, GenerationReader, TierOptions, open_tier
from .version import __version__

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
RELEASE_NAME = "release.json"
LOAD_BATCH_BYTES = 256 << 20
DTYPE_NAMES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
               "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}
class ExportError(DistCkptError):
    """The export could not be written (unsupported tensor, bad option, I/O)."""


class OutputError(ExportError):
    """The output directory cannot be used: it exists, or its parent does not."""


class OutputExists(OutputError):
    """The output directory already exists; a release is never overwritten."""


@dataclass
class ReleaseInfo:
    """What :func:`export_generation` wrote; ``release`` is the content of ``release.json``."""

    out_dir: str
    generation: str
    files: dict[str, str]  # file name -> sha256
    tensor_count: int
    total_bytes: int
    aliases: dict[str, str]
    release: dict[str, Any]


@dataclass
class _Entry:
    name: str  # output tensor name: the parameter fqn
    key: str  # DCP key: model.<fqn>
    shape: tuple[int, ...]
    source_dtype: torch.dtype
    dtype: torch.dtype  # written dtype

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * self.dtype.itemsize

    @property
    def source_nbytes(self) -> int:
        return _numel(self.shape) * self.source_dtype.itemsize


@dataclass
class _Source:
    store: Store
    name: str
    manifest: Manifest
    manifest_sha256: str
    reader: GenerationReader
    metadata: Metadata
    verified: list[str] = field(default_factory=list)

    def close(self) -> None:
        self.reader.close()


def export_generation(root: str, out_dir: str, generation: str | None = None, *, dtype: str | None = None,
                      max_shard_bytes: int = 5 * 10**9, storage_options: dict[str, Any] | None = None,
                      key: bytes | None = None, cache_dir: str | None = None) -> ReleaseInfo:
    """Export the model tensors of ``generation`` (default: the newest committed one) under
    ``root`` (a path or object-store URL) to the new local directory ``out_dir``.

    ``dtype`` (``bf16``, ``fp16``, ``fp32``) casts floating tensors only; integer and bool
    tensors keep theirs. Shards hold at most ``max_shard_bytes`` (a larger tensor gets a
    shard of its own). ``key`` is the manifest signing key, when generations are signed;
    ``cache_dir`` the scratch parent for verified object-store copies.

    Raises ``OutputExists`` when ``out_dir`` exists, ``ValidationError`` (naming the file)
    when the generation does not verify, ``ExportError`` for bad options.
    """
    cast = _parse_dtype(dtype)
    if max_shard_bytes < 1:
        raise ExportError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    out = os.path.abspath(out_dir)
    _refuse_existing(out)
    source = _open_source(open_tier(root, TierOptions(storage_options=dict(storage_options or {}))),
                          generation, key, cache_dir)
    try:
        entries, skipped = _model_entries(source.metadata, cast)
        _verify_files_read(source, entries)
        tmp = _new_sibling(out)
        try:
            info = _write_release(source, root, entries, skipped, tmp, out, max_shard_bytes, dtype)
            _publish(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return info
    finally:
        source.close()


# ---- options and output directory ---------------------------------------------------------
def _parse_dtype(dtype: str | None) -> torch.dtype | None:
    if dtype is None:
        return None
    if dtype.lower() not in DTYPE_NAMES:
        raise ExportError(f"unsupported dtype {dtype!r}: choose bf16, fp16 or fp32")
    return DTYPE_NAMES[dtype.lower()]


def _refuse_existing(out: str) -> None:
    if os.path.lexists(out):
        raise OutputExists(f"output directory {out} exists; a release is never overwritten")
    if not os.path.isdir(os.path.dirname(out)):
        raise OutputError(f"parent directory of {out} does not exist")


def _new_sibling(out: str) -> str:
    """A new empty directory beside ``out``, with the mode any new directory gets (0777 less
    the umask): the release is published by renaming it, and tempfile.mkdtemp's 0700 would
    hide it from everyone else."""
    while True:
        tmp = os.path.join(os.path.dirname(out), f".{os.path.basename(out)}.tmp-{uuid.uuid4().hex[:12]}")
        try:
            os.mkdir(tmp)
        except FileExistsError:
            continue
        return tmp


def _publish(tmp: str, out: str) -> None:
    """fsync the directory, then rename it into place (checked again: rename would replace an
    empty directory created meanwhile), then fsync the parent so the rename survives a crash."""
    fsync_dir(tmp)
    _refuse_existing(out)
    os.rename(tmp, out)
    fsync_dir(os.path.dirname(out))


# ---- the source generation -----------------------------------------------------------------
def _open_source(tier: CommitTier, generation: str | None, key: bytes | None,
                 cache_dir: str | None) -> _Source:
    store = tier.store
    name = generation if generation is not None else newest_committed(store, key)
    if name is None:
        raise ValidationError(f"no committed generation under {store.root}")
    check_generation_name(name)
    manifest = check_structure(store, name, key=key)
    check_sizes(store, name, manifest)
    raw = store.read_bytes(f"{name}/{MANIFEST_NAME}")
    if Manifest.from_bytes(raw, generation=name) != manifest:
        raise ValidationError(f"{name}: manifest changed during export", generation=name,
                              path=MANIFEST_NAME)
    reader = tier.open_reader(name, manifest, cache_dir)
    try:
        metadata = reader.read_metadata()  # from bytes that matched the manifest
    except BaseException:
        reader.close()
        raise
    return _Source(store, name, manifest, hashlib.sha256(raw).hexdigest(), reader, metadata,
                   [METADATA_FILE])


def _model_entries(metadata: Metadata, cast: torch.dtype | None) -> tuple[list[_Entry], list[str]]:
    """The model's tensors in state-dict order, and the model keys that are not tensors."""
    mapping = metadata.planner_data or {}
    entries, skipped = [], []
    for key, md in metadata.state_dict_metadata.items():
        path = mapping.get(key, tuple(key.split(".", 1)))
        if not path or path[0] != "model":
            continue
        if not isinstance(md, TensorStorageMetadata) or len(path) != 2:
            skipped.append(key)
            continue
        source = md.properties.dtype
        if source not in ST_DTYPES:
            raise ExportError(f"{key}: dtype {source} has no safetensors equivalent")
        out = cast if cast is not None and source.is_floating_point else source
        entries.append(_Entry(str(path[1]), key, tuple(md.size), source, out))
    if not entries:
        raise ValidationError("the generation holds no model tensors", path=METADATA_FILE)
    return entries, skipped


def _dcp_files(metadata: Metadata, keys: set[str]) -> set[str]:
    """The manifest paths of the files holding ``keys``: ``dcp/<name>``, or ``objects/<name>``
    for a shared object of an incremental generation (``../../objects/<name>`` to DCP)."""
    return {dcp_entry_path(info.relative_path) for index, info in metadata.storage_data.items()
            if index.fqn in keys}


def _verify_files_read(source: _Source, entries: list[_Entry]) -> None:
    """Every file a model tensor (or the optimizer's parameter names) is read from must be
    listed by the manifest; on a local root hash them now (object stores hash on download)."""
    keys = {e.key for e in entries} | set(_param_list_keys(source.metadata))
    files = sorted(_dcp_files(source.metadata, keys))
    for path in files:
        check_relative_path(path)
        if source.manifest.file(path) is None:
            raise ValidationError(f"{source.name}: DCP metadata names {path}, which the manifest "
                                  "does not list", generation=source.name, path=path)
    if not source.reader.hashes_on_read:
        check_digests(source.store, source.name, source.manifest, files)
    source.verified += files


# ---- loading ---------------------------------------------------------------------------------
def _load_batch(source: _Source, batch: list[_Entry]) -> dict[str, torch.Tensor]:
    model = {e.name: torch.empty(e.shape, dtype=e.source_dtype) for e in batch}
    load_in_process({"model": model}, source.reader)
    return model


def _param_list_keys(metadata: Metadata) -> list[str]:
    mapping = metadata.planner_data or {}
    return [key for key, path in mapping.items() if len(path) == 4 and path[0] == "optim"
            and path[1] == "param_groups" and path[3] == "params"
            and isinstance(metadata.state_dict_metadata.get(key), BytesStorageMetadata)]


def _optimizer_params(source: _Source) -> set[str] | None:
    """The parameter names the optimizer lists (a tied parameter appears once), or None when
    the generation has no optimizer parameter groups."""
    keys = _param_list_keys(source.metadata)
    if not keys:
        return None
    mapping = source.metadata.planner_data
    groups: list[dict[str, Any]] = [{} for _ in range(1 + max(int(mapping[k][2]) for k in keys))]
    for key in keys:
        groups[int(mapping[key][2])]["params"] = None
    load_in_process({"optim": {"param_groups": groups}}, source.reader)
    return {str(name) for group in groups for name in (group.get("params") or [])}


def _batches(entries: list[_Entry], budget: int) -> Iterator[list[_Entry]]:
    batch: list[_Entry] = []
    size = 0
    for entry in entries:
        if batch and size + entry.source_nbytes > budget:
            yield batch
            batch, size = [], 0
        batch.append(entry)
        size += entry.source_nbytes
    if batch:
        yield batch


def _shards(entries: list[_Entry], max_bytes: int) -> list[list[_Entry]]:
    shards: list[list[_Entry]] = [[]]
    size = 0
    for entry in entries:
        if shards[-1] and size + entry.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry.nbytes
    return shards


class _Dedup:
    """Finds tied weights: equal dtype, shape and bytes (hashed only where a twin is possible)."""

    def __init__(self, entries: list[_Entry], optimizer_params: set[str] | None) -> None:
        counts = Counter((e.source_dtype, e.shape) for e in entries)
        self.candidates = {sig for sig, n in counts.items() if n > 1}
        self.optimizer_params = optimizer_params
        self.seen: dict[tuple[Any, ...], str] = {}
        self.aliases: dict[str, str] = {}

    def canonical(self, entry: _Entry, tensor: torch.Tensor) -> str | None:
        if (entry.source_dtype, entry.shape) not in self.candidates:
            return None
        sig = (entry.source_dtype, entry.shape, hashlib.sha256(byte_view(tensor)).hexdigest())
        first = self.seen.setdefault(sig, entry.name)
        if first == entry.name or not self._tied(first, entry.name):
            return None
        self.aliases[entry.name] = first
        return first

    def _tied(self, first: str, alias: str) -> bool:
        params = self.optimizer_params
        return params is None or (first in params and alias not in params)


# ---- writing -----------------------------------------------------------------------------------
def _write_shards(source: _Source, entries: list[_Entry], tmp: str, max_bytes: int,
                  dedup: _Dedup) -> list[tuple[str, list[str], str]]:
    """Write the shards as ``.part-N`` files; return (part file, tensor names, sha256) each."""
    parts = []
    for shard in _shards(entries, max_bytes):
        tensors: dict[str, torch.Tensor] = {}
        for batch in _batches(shard, min(LOAD_BATCH_BYTES, max_bytes)):
            loaded = _load_batch(source, batch)
            for entry in batch:
                tensor = loaded.pop(entry.name)
                if dedup.canonical(entry, tensor) is None:
                    tensors[entry.name] = tensor.to(entry.dtype)
                progress.advance(entry.source_nbytes)
        if tensors:
            part = f".part-{len(parts):05d}"
            digest = write_safetensors(os.path.join(tmp, part), tensors)
            parts.append((part, list(tensors), digest))
        del tensors
    return parts


def _name_shards(tmp: str, parts: list[tuple[str, list[str], str]]) -> tuple[dict[str, str], dict[str, str]]:
    """Rename the parts to their final names (the count is known only now: a shard of
    aliases alone is never written); return tensor name -> file name, file name -> sha256."""
    weight_map, digests = {}, {}
    for index, (part, names, digest) in enumerate(parts):
        final = SINGLE_NAME if len(parts) == 1 else f"model-{index + 1:05d}-of-{len(parts):05d}.safetensors"
        os.rename(os.path.join(tmp, part), os.path.join(tmp, final))
        weight_map.update(dict.fromkeys(names, final))
        digests[final] = digest
    return weight_map, digests


def _write_json(path: str, value: Any) -> None:
    write_durable(path, f"{json.dumps(value, indent=1)}\n".encode())


def _write_release(source: _Source, root: str, entries: list[_Entry], skipped: list[str], tmp: str,
                   out: str, max_bytes: int, dtype: str | None) -> ReleaseInfo:
    dedup = _Dedup(entries, _optimizer_params(source))
    weight_map, files = _name_shards(tmp, _write_shards(source, entries, tmp, max_bytes, dedup))
    written = [e for e in entries if e.name in weight_map]
    total = sum(e.nbytes for e in written)
    _write_json(os.path.join(tmp, INDEX_NAME), {"metadata": {"total_size": total}, "weight_map": weight_map})
    files[INDEX_NAME] = file_digest(os.path.join(tmp, INDEX_NAME), "sha256")[1]
    release = {
        "format": "dist_ckpt-release/1", "source_root": _absolute_root(root), "generation": source.name,
        "next_update": source.manifest.next_update, "manifest_sha256": source.manifest_sha256,
        "contract_digest": source.manifest.contract_digest, "contract": source.manifest.contract,
        "code_version": code_version(), "dist_ckpt_version": __version__,
        "torch_version": torch.__version__, "dtype": dtype, "max_shard_bytes": max_bytes,
        "tensor_count": len(written), "total_bytes": total, "aliases": dedup.aliases,
        "skipped_model_keys": skipped, "verified_source_files": sorted(source.verified),
        "created_unix": time.time(),
        "files": {name: {"size": os.path.getsize(os.path.join(tmp, name)), "sha256": digest}
                  for name, digest in files.items()},
    }
    _write_json(os.path.join(tmp, RELEASE_NAME), release)
    return ReleaseInfo(out, source.name, files, len(written), total, dedup.aliases, release)


def _absolute_root(root: str) -> str:
    """``root`` as ``release.json`` records it: a URL as given, a path made absolute (a relative
    one would mean nothing to whoever reads the release elsewhere)."""
    return root if "://" in root else os.path.abspath(root)


def code_version() -> str:
    """``git describe --always --dirty`` of this source tree when dist_ckpt runs from a git
    checkout (the module file is tracked), else the package version."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        subprocess.run(["git", "-C", here, "ls-files", "--error-unmatch", "__init__.py"],
                       check=True, capture_output=True, timeout=10)
        found = subprocess.run(["git", "-C", here, "describe", "--always", "--dirty"], check=True,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return __version__
    return found.stdout.strip() or __version__


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count
