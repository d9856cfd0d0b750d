"""The full release: every model tensor of a generation as Hugging Face style safetensors
shards, with ``model.safetensors.index.json``, ``release.json`` and, when the job registered
its model config (contract field ``hf_config``), ``config.json``, so that
``transformers.AutoModelForCausalLM.from_pretrained(out)`` loads it.

Tied weights: DCP stores a tied parameter under each of its names. A later tensor whose
dtype, shape and bytes equal an earlier one is written once and recorded in ``release.json``
``aliases`` (alias -> canonical name, as safetensors' ``save_model`` drops shared tensors;
``from_pretrained`` ties them again from ``tie_word_embeddings``). When the generation holds
optimizer state, a pair counts as tied only if the optimizer lists the canonical name and
not the alias (an optimizer names a tied parameter once), so untied tensors that happen to
be equal (fresh zero biases) are both written.

A PEFT job's model is the ``PeftModel``: its tensors keep the PEFT names
(``base_model.model.<fqn>``, ``<module>.base_layer.weight``, ``lora_A.<adapter>.weight``),
which no ``from_pretrained`` takes, so no ``config.json`` is written for it
(``release.json`` says why); export its adapter with :func:`dist_ckpt.export.export_adapter`.
"""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from typing import Any

import torch

from .. import progress
from ..format.safetensors_file import byte_view, write_safetensors
from ..restore.loader import load_in_process
from ..storage.local import file_digest
from .source import (
    HF_CONFIG_FIELD,
    LOAD_BATCH_BYTES,
    PEFT_CONFIG_FIELD,
    RELEASE_NAME,
    Entry,
    ExportError,
    ReleaseInfo,
    Source,
    batches,
    contract_config,
    load_batch,
    model_entries,
    open_source,
    param_list_keys,
    parse_dtype,
    provenance,
    refuse_existing,
    verify_files_read,
    write_atomically,
    write_json,
)

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
CONFIG_NAME = "config.json"


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
    cast = parse_dtype(dtype)
    if max_shard_bytes < 1:
        raise ExportError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    out = os.path.abspath(out_dir)
    refuse_existing(out)
    source = open_source(root, generation, storage_options=storage_options, key=key, cache_dir=cache_dir)
    try:
        entries, skipped = model_entries(source.metadata, cast)
        config, config_note = _hf_config(source)
        verify_files_read(source, entries, optimizer_names=True)
        return write_atomically(out, lambda tmp: _write_release(
            source, root, entries, skipped, tmp, out, max_shard_bytes, dtype, config, config_note))
    finally:
        source.close()


def _hf_config(source: Source) -> tuple[dict[str, Any] | None, str]:
    """The ``config.json`` to write (None: none) and what ``release.json`` says about it."""
    try:
        config = contract_config(source, HF_CONFIG_FIELD)
    except ExportError as exc:  # a digest only: the tensors are still worth exporting
        return None, f"not written: {exc}"
    if config is None:
        return None, f"not written: the contract has no {HF_CONFIG_FIELD!r} field"
    if PEFT_CONFIG_FIELD in source.manifest.contract:
        return None, (f"not written: a PEFT job (contract field {PEFT_CONFIG_FIELD!r}) names its tensors as "
                      "the PeftModel does, which from_pretrained does not take; export the adapter "
                      "(dist-ckpt export --peft)")
    return config, f"from contract field {HF_CONFIG_FIELD!r}"


# ---- loading ---------------------------------------------------------------------------------
def _optimizer_params(source: Source) -> set[str] | None:
    """The parameter names the optimizer lists (a tied parameter appears once), or None when
    the generation has no optimizer parameter groups."""
    keys = param_list_keys(source.metadata)
    if not keys:
        return None
    mapping = source.metadata.planner_data
    groups: list[dict[str, Any]] = [{} for _ in range(1 + max(int(mapping[k][2]) for k in keys))]
    for key in keys:
        groups[int(mapping[key][2])]["params"] = None
    load_in_process({"optim": {"param_groups": groups}}, source.reader)
    return {str(name) for group in groups for name in (group.get("params") or [])}


def _shards(entries: list[Entry], max_bytes: int) -> list[list[Entry]]:
    shards: list[list[Entry]] = [[]]
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

    def __init__(self, entries: list[Entry], optimizer_params: set[str] | None) -> None:
        counts = Counter((e.source_dtype, e.shape) for e in entries)
        self.candidates = {sig for sig, n in counts.items() if n > 1}
        self.optimizer_params = optimizer_params
        self.seen: dict[tuple[Any, ...], str] = {}
        self.aliases: dict[str, str] = {}

    def canonical(self, entry: Entry, tensor: torch.Tensor) -> str | None:
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
def _write_shards(source: Source, entries: list[Entry], tmp: str, max_bytes: int,
                  dedup: _Dedup) -> list[tuple[str, list[str], str]]:
    """Write the shards as ``.part-N`` files; return (part file, tensor names, sha256) each."""
    parts = []
    for shard in _shards(entries, max_bytes):
        tensors: dict[str, torch.Tensor] = {}
        for batch in batches(shard, min(LOAD_BATCH_BYTES, max_bytes)):
            loaded = load_batch(source, batch)
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


def _write_release(source: Source, root: str, entries: list[Entry], skipped: list[str], tmp: str,
                   out: str, max_bytes: int, dtype: str | None, config: dict[str, Any] | None,
                   config_note: str) -> ReleaseInfo:
    dedup = _Dedup(entries, _optimizer_params(source))
    weight_map, files = _name_shards(tmp, _write_shards(source, entries, tmp, max_bytes, dedup))
    written = [e for e in entries if e.name in weight_map]
    total = sum(e.nbytes for e in written)
    metadata = {INDEX_NAME: {"metadata": {"total_size": total}, "weight_map": weight_map}}
    if config is not None:
        metadata[CONFIG_NAME] = config
    for name, value in metadata.items():
        write_json(os.path.join(tmp, name), value)
        files[name] = file_digest(os.path.join(tmp, name), "sha256")[1]
    release = {
        **provenance(source, root, "model"), "dtype": dtype, "max_shard_bytes": max_bytes,
        "tensor_count": len(written), "total_bytes": total, "aliases": dedup.aliases,
        "config_json": config_note, "skipped_model_keys": skipped,
        "verified_source_files": sorted(source.verified),
        "files": {name: {"size": os.path.getsize(os.path.join(tmp, name)), "sha256": digest}
                  for name, digest in files.items()},
    }
    write_json(os.path.join(tmp, RELEASE_NAME), release)
    return ReleaseInfo(out, source.name, files, len(written), total, dedup.aliases, release)
