"""What both exports share: the source generation opened and checked before a byte of it is
read, its model tensors loaded in bounded batches, the contract values a release takes its
config files from, the provenance ``release.json`` records, and the output directory
written beside its final name and renamed into place.

Call order (one process, no process group): :func:`open_source` (manifest, sizes, the DCP
metadata from bytes that matched the manifest), :func:`model_entries`,
:func:`verify_files_read` for the entries to be read, :func:`load_batch` per
:func:`batches`, then :func:`write_atomically` around the writing, and ``Source.close``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from ..errors import DistCkptError, ValidationError
from ..format.inventory import newest_committed
from ..format.manifest import (
    MANIFEST_NAME,
    METADATA_FILE,
    Manifest,
    check_generation_name,
    check_relative_path,
    dcp_entry_path,
)
from ..format.safetensors_file import ST_DTYPES
from ..format.validate import check_digests, check_sizes, check_structure
from ..restart.contract import field_digest
from ..restore.loader import load_in_process
from ..storage.base import Store
from ..storage.local import fsync_dir, write_durable
from ..tiers import GenerationReader, TierOptions, open_tier
from ..version import __version__

RELEASE_NAME = "release.json"
RELEASE_FORMAT = "dist_ckpt-release/1"
LOAD_BATCH_BYTES = 256 << 20
DTYPE_NAMES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
               "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}
# the contract fields a release takes its config files from (the job's convention:
# TrainState(contract={"hf_config": model.config.to_dict(), "peft_config": lora.to_dict()}))
HF_CONFIG_FIELD = "hf_config"
PEFT_CONFIG_FIELD = "peft_config"


class ExportError(DistCkptError):
    """The export could not be written (unsupported tensor, bad option, I/O)."""


class OutputError(ExportError):
    """The output directory cannot be used: it exists, or its parent does not."""


class OutputExists(OutputError):
    """The output directory already exists; a release is never overwritten."""


@dataclass
class ReleaseInfo:
    """What an export wrote; ``release`` is the content of ``release.json``."""

    out_dir: str
    generation: str
    files: dict[str, str]  # file name -> sha256
    tensor_count: int
    total_bytes: int
    aliases: dict[str, str]
    release: dict[str, Any]


@dataclass
class Entry:
    name: str  # the parameter fqn
    key: str  # DCP key: model.<fqn>
    shape: tuple[int, ...]
    source_dtype: torch.dtype
    dtype: torch.dtype  # written dtype

    @property
    def nbytes(self) -> int:
        return numel(self.shape) * self.dtype.itemsize

    @property
    def source_nbytes(self) -> int:
        return numel(self.shape) * self.source_dtype.itemsize


@dataclass
class Source:
    store: Store
    name: str
    manifest: Manifest
    manifest_sha256: str
    reader: GenerationReader
    metadata: Metadata
    verified: list[str] = field(default_factory=list)

    def close(self) -> None:
        self.reader.close()


# ---- options and output directory ---------------------------------------------------------
def parse_dtype(dtype: str | None) -> torch.dtype | None:
    if dtype is None:
        return None
    if dtype.lower() not in DTYPE_NAMES:
        raise ExportError(f"unsupported dtype {dtype!r}: choose bf16, fp16 or fp32")
    return DTYPE_NAMES[dtype.lower()]


def refuse_existing(out: str) -> None:
    if os.path.lexists(out):
        raise OutputExists(f"output directory {out} exists; a release is never overwritten")
    if not os.path.isdir(os.path.dirname(out)):
        raise OutputError(f"parent directory of {out} does not exist")


def write_atomically(out: str, write: Callable[[str], ReleaseInfo]) -> ReleaseInfo:
    """``write(tmp)`` into a new sibling of ``out``, then publish it as ``out``; nothing is
    left behind when it fails."""
    tmp = _new_sibling(out)
    try:
        info = write(tmp)
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return info


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
    refuse_existing(out)
    os.rename(tmp, out)
    fsync_dir(os.path.dirname(out))


def write_json(path: str, value: Any, indent: int = 1) -> None:
    write_durable(path, f"{json.dumps(value, indent=indent)}\n".encode())


# ---- the source generation -----------------------------------------------------------------
def open_source(root: str, generation: str | None, *, storage_options: dict[str, Any] | None,
                key: bytes | None, cache_dir: str | None) -> Source:
    """The generation (default: the newest committed one) with its manifest checked
    (structure, signature with ``key``, sizes) and its DCP metadata read from bytes that
    matched the manifest."""
    tier = open_tier(root, TierOptions(storage_options=dict(storage_options or {})))
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
    return Source(store, name, manifest, hashlib.sha256(raw).hexdigest(), reader, metadata,
                  [METADATA_FILE])


def model_entries(metadata: Metadata, cast: torch.dtype | None) -> tuple[list[Entry], list[str]]:
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
        entries.append(Entry(str(path[1]), key, tuple(md.size), source, out))
    if not entries:
        raise ValidationError("the generation holds no model tensors", path=METADATA_FILE)
    return entries, skipped


def _dcp_files(metadata: Metadata, keys: set[str]) -> set[str]:
    """The manifest paths of the files holding ``keys``: ``dcp/<name>``, or ``objects/<name>``
    for a shared object of an incremental generation (``../../objects/<name>`` to DCP)."""
    return {dcp_entry_path(info.relative_path) for index, info in metadata.storage_data.items()
            if index.fqn in keys}


def verify_files_read(source: Source, entries: list[Entry], *, optimizer_names: bool) -> None:
    """Every file the ``entries`` (and, with ``optimizer_names``, the optimizer's parameter
    names) are read from must be listed by the manifest; on a local root hash them now
    (object stores hash on download)."""
    keys = {e.key for e in entries} | (set(param_list_keys(source.metadata)) if optimizer_names else set())
    files = sorted(_dcp_files(source.metadata, keys))
    for path in files:
        check_relative_path(path)
        if source.manifest.file(path) is None:
            raise ValidationError(f"{source.name}: DCP metadata names {path}, which the manifest "
                                  "does not list", generation=source.name, path=path)
    if not source.reader.hashes_on_read:
        check_digests(source.store, source.name, source.manifest, files)
    source.verified += files


def contract_config(source: Source, name: str) -> dict[str, Any] | None:
    """The JSON object the job registered as contract field ``name``, from the manifest's
    ``contract_values``; None when the contract has no such field. ``ExportError`` when the
    field holds no object (a digest string, or a value over the manifest's bound) or its
    value does not match its digest."""
    digest = source.manifest.contract.get(name)
    if digest is None:
        return None
    value = (source.manifest.contract_values or {}).get(name)
    if not isinstance(value, dict):
        raise ExportError(f"{source.name}: contract field {name!r} holds "
                          + ("no value in the manifest (over its bound, or saved by an older version)"
                             if value is None else "a digest, not a config object"))
    if field_digest(value) != digest:
        raise ValidationError(f"{source.name}: contract value {name!r} does not match its digest",
                              generation=source.name, path=MANIFEST_NAME)
    return value


# ---- loading ---------------------------------------------------------------------------------
def load_batch(source: Source, batch: list[Entry]) -> dict[str, torch.Tensor]:
    model = {e.name: torch.empty(e.shape, dtype=e.source_dtype) for e in batch}
    load_in_process({"model": model}, source.reader)
    return model


def param_list_keys(metadata: Metadata) -> list[str]:
    mapping = metadata.planner_data or {}
    return [key for key, path in mapping.items() if len(path) == 4 and path[0] == "optim"
            and path[1] == "param_groups" and path[3] == "params"
            and isinstance(metadata.state_dict_metadata.get(key), BytesStorageMetadata)]


def batches(entries: list[Entry], budget: int) -> Iterator[list[Entry]]:
    batch: list[Entry] = []
    size = 0
    for entry in entries:
        if batch and size + entry.source_nbytes > budget:
            yield batch
            batch, size = [], 0
        batch.append(entry)
        size += entry.source_nbytes
    if batch:
        yield batch


# ---- provenance --------------------------------------------------------------------------------
def provenance(source: Source, root: str, kind: str) -> dict[str, Any]:
    """The fields every ``release.json`` starts with: where the tensors came from and which
    code wrote them."""
    return {
        "format": RELEASE_FORMAT, "kind": kind, "source_root": _absolute_root(root),
        "generation": source.name, "next_update": source.manifest.next_update,
        "manifest_sha256": source.manifest_sha256, "contract_digest": source.manifest.contract_digest,
        "contract": source.manifest.contract, "code_version": code_version(),
        "dist_ckpt_version": __version__, "torch_version": torch.__version__,
        "created_unix": time.time(),
    }


def _absolute_root(root: str) -> str:
    """``root`` as ``release.json`` records it: a URL as given, a path made absolute (a relative
    one would mean nothing to whoever reads the release elsewhere)."""
    return root if "://" in root else os.path.abspath(root)


def code_version() -> str:
    """``git describe --always --dirty`` of this source tree when dist_ckpt runs from a git
    checkout (the module file is tracked), else the package version."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        subprocess.run(["git", "-C", here, "ls-files", "--error-unmatch", "__init__.py"],
                       check=True, capture_output=True, timeout=10)
        found = subprocess.run(["git", "-C", here, "describe", "--always", "--dirty"], check=True,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return __version__
    return found.stdout.strip() or __version__


def numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count
