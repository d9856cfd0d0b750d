"""The PEFT adapter release: from a generation of a PEFT job (its model a ``PeftModel``), the
directory ``peft.PeftModel.from_pretrained(base, out)`` loads: ``adapter_model.safetensors``
with only the adapter's tensors under the names PEFT itself saves them with, and
``adapter_config.json``; plus ``release.json`` (provenance, as the full release).

Which tensors, under which names: what ``peft.get_peft_model_state_dict`` returns (peft
0.21), derived here from the generation's tensor names alone, without building the model
(:func:`adapter_keys`). For LoRA (DoRA included):

1. the tensors of other adapters are left out (a segment naming another adapter);
2. everything on a tuner layer but its ``base_layer``: ``<m>.lora_A.<adapter>.weight``, ...
   (a tuner layer is a module with ``lora_A``/``lora_B``/``lora_embedding_*``/
   ``lora_magnitude_vector`` children; one inside a ``modules_to_save`` wrapper is not);
3. biases by ``config["bias"]``: ``all`` every bias, ``lora_only`` each tuner layer's
   ``base_layer.bias``;
4. DoRA: ``lora_magnitude_vector.<adapter>.weight`` is saved without ``.weight``;
5. ``modules_to_save``: ``<w>.modules_to_save.<adapter>.<k>`` saved as ``<w>.<k>``;
6. a targeted embedding (``embed_tokens`` or ``lm_head`` in ``target_modules``): its
   ``base_layer`` tensors too, as PEFT's ``save_embedding_layers="auto"`` does;
7. the adapter name removed: ``lora_A.default.weight`` -> ``lora_A.weight``.

Not covered: other PEFT methods (prompt learning computes its tensors; others are untested)
and trainable tokens (``trainable_token_indices``): refused with ``AdapterError``. PEFT's
"auto" rule that also saves embeddings resized during fine-tuning needs the base model's
original config: not applied. A base-model module named like the adapter is taken for one.

Config: ``adapter_config.json`` is the job's ``peft_config.to_dict()`` registered as contract
field ``peft_config`` (its canonical JSON is in every manifest), or the ``adapter_config``
given, with ``inference_mode`` set as PEFT's ``save_pretrained`` sets it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from .. import progress
from ..format.safetensors_file import write_safetensors
from ..storage.local import file_digest
from .source import (
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
    parse_dtype,
    provenance,
    refuse_existing,
    verify_files_read,
    write_atomically,
    write_json,
)

ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
ADAPTER_CONFIG_NAME = "adapter_config.json"
DEFAULT_ADAPTER = "default"
SUPPORTED_PEFT_TYPES = ("LORA",)
# peft's LoraLayer.adapter_layer_names plus the DoRA magnitude: the children that make a tuner layer
LORA_LAYER_ATTRS = frozenset({"lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B",
                              "lora_magnitude_vector"})
WRAPPER_ATTR = "modules_to_save"  # peft's ModulesToSaveWrapper: a trained copy per adapter
AUX_ATTRS = frozenset({WRAPPER_ATTR, "original_module"})
EMBEDDING_LAYER_NAMES = ("embed_tokens", "lm_head")  # peft.utils.constants.EMBEDDING_LAYER_NAMES
PEFT_PREFIX = "base_model.model."  # a PeftModel's prefix before the base model's own names
ALL_LINEAR = "all-linear"


class AdapterError(ExportError):
    """No adapter can be exported as asked: no config, an unsupported one, or no tensors of
    the named adapter in the generation."""


def export_adapter(root: str, out_dir: str, generation: str | None = None, *,
                   adapter_name: str = DEFAULT_ADAPTER, adapter_config: Mapping[str, Any] | None = None,
                   dtype: str | None = None, storage_options: dict[str, Any] | None = None,
                   key: bytes | None = None, cache_dir: str | None = None) -> ReleaseInfo:
    """Export adapter ``adapter_name`` of a PEFT job's ``generation`` (default: the newest
    committed one) under ``root`` to the new local directory ``out_dir``.

    ``adapter_config`` (a ``PeftConfig.to_dict()``) replaces the contract's ``peft_config``.
    ``dtype``, ``storage_options``, ``key`` and ``cache_dir`` as for ``export_generation``;
    only the files holding adapter tensors are hashed and read.

    Raises ``OutputExists`` when ``out_dir`` exists, ``ValidationError`` when the generation
    does not verify, ``AdapterError`` when there is no usable config or no such adapter.
    """
    cast = parse_dtype(dtype)
    out = os.path.abspath(out_dir)
    refuse_existing(out)
    source = open_source(root, generation, storage_options=storage_options, key=key, cache_dir=cache_dir)
    try:
        config, origin = _adapter_config(source, adapter_config)
        entries = {entry.name: entry for entry in model_entries(source.metadata, cast)[0]}
        saved = adapter_keys(entries, config, adapter_name)
        used = [entries[name] for name in dict.fromkeys(saved.values())]
        verify_files_read(source, used, optimizer_names=False)
        return write_atomically(out, lambda tmp: _write_adapter(
            source, root, tmp, out, used, saved, config, origin, adapter_name, dtype))
    finally:
        source.close()


def _adapter_config(source: Source, given: Mapping[str, Any] | None) -> tuple[dict[str, Any], str]:
    if given is not None:
        config, origin = dict(given), "given"
    else:
        hint = (f"register TrainState(contract={{{PEFT_CONFIG_FIELD!r}: peft_config.to_dict()}}) in the "
                "job, or give the adapter config (--adapter-config FILE)")
        try:
            found = contract_config(source, PEFT_CONFIG_FIELD)
        except ExportError as exc:  # a digest only, or a value over the manifest's bound
            raise AdapterError(f"{exc}; {hint}") from exc
        if found is None:
            raise AdapterError(f"{source.name}: the contract has no {PEFT_CONFIG_FIELD!r} field; {hint}")
        config, origin = found, f"contract field {PEFT_CONFIG_FIELD!r}"
    peft_type = str(config.get("peft_type", "")).upper()
    if peft_type not in SUPPORTED_PEFT_TYPES:
        raise AdapterError(f"PEFT type {config.get('peft_type')!r} ({origin}): only "
                           f"{', '.join(SUPPORTED_PEFT_TYPES)} adapters are exported")
    if config.get("trainable_token_indices") is not None:
        raise AdapterError(f"trainable_token_indices ({origin}): trainable tokens are not exported")
    return config, origin


# ---- which tensors, under which names ------------------------------------------------------------
def adapter_keys(names: Iterable[str], config: Mapping[str, Any],
                 adapter_name: str = DEFAULT_ADAPTER) -> dict[str, str]:
    """PEFT's saved key -> the model state-dict name it is read from, for adapter
    ``adapter_name`` of a model whose state-dict names are ``names`` (in state-dict order)
    and whose adapter config is ``config`` (the rules: module docstring). Several saved keys
    may read one tensor (``bias="all"`` with ``modules_to_save``, as PEFT saves it)."""
    names = list(names)
    found = _adapter_names(names)
    if adapter_name not in found:
        raise AdapterError(f"no tensors of adapter {adapter_name!r} in the generation ("
                           + (f"adapters found: {', '.join(sorted(found))})" if found else
                              "no PEFT adapter tensors at all: is this a PEFT job?)"))
    others = found - {adapter_name}
    kept = [n for n in names if not any(_names_adapter(n, other) for other in others)]
    wrappers = _parents(names, AUX_ATTRS)
    layers = {m for m in _parents(names, LORA_LAYER_ATTRS) if not any(_under(m, w) for w in wrappers)}
    selected = {n: n for n in kept if _on_tuner_layer(n, layers)}
    selected.update(_biases(kept, layers, str(config.get("bias", "none"))))
    dora = f"lora_magnitude_vector.{adapter_name}.weight"
    selected = {(k.removesuffix(".weight") if k.endswith(dora) else k): n for k, n in selected.items()}
    wrapped = f"{WRAPPER_ATTR}.{adapter_name}."
    for name in kept:
        head, sep, rest = name.partition(wrapped)
        if sep and head.endswith("."):  # <w>.modules_to_save.<adapter>.<k> -> <w>.<k>
            selected[f"{head}{rest}"] = name
    if _embedding_targeted(config, names):
        for layer in sorted(m for m in layers if m.rpartition(".")[2] in EMBEDDING_LAYER_NAMES):
            selected.update({n: n for n in kept if _under(n, f"{layer}.base_layer")})
    return {remove_adapter_name(k, adapter_name): n for k, n in selected.items()}


def remove_adapter_name(key: str, adapter_name: str) -> str:
    """PEFT's rule: the adapter name as the last segment, or as the one before the last."""
    if "." not in key:
        return key
    if key.endswith(f".{adapter_name}"):
        return key.removesuffix(f".{adapter_name}")
    head, _, last = key.rpartition(".")
    return f"{head.removesuffix(f'.{adapter_name}')}.{last}"


def _adapter_names(names: list[str]) -> set[str]:
    """The adapters the names hold: the segment after a tuner or wrapper container."""
    found = set()
    for name in names:
        parts = name.split(".")
        found.update(parts[i + 1] for i, part in enumerate(parts[:-1])
                     if part in LORA_LAYER_ATTRS or part == WRAPPER_ATTR)
    return found


def _names_adapter(name: str, adapter: str) -> bool:
    return f".{adapter}." in name or name.endswith(f".{adapter}")


def _parents(names: list[str], attrs: Iterable[str]) -> set[str]:
    """Module paths with a child named one of ``attrs`` that holds a tensor."""
    wanted = set(attrs)
    found = set()
    for name in names:
        parts = name.split(".")
        found.update(".".join(parts[:i]) for i, part in enumerate(parts[:-1]) if part in wanted)
    return found


def _under(name: str, prefix: str) -> bool:
    return prefix == "" or name == prefix or name.startswith(f"{prefix}.")


def _on_tuner_layer(name: str, layers: set[str]) -> bool:
    """On a tuner layer (its nearest one) and not under its ``base_layer``."""
    parts = name.split(".")
    for i in range(len(parts) - 1, -1, -1):
        if ".".join(parts[:i]) in layers:
            return parts[i] != "base_layer"
    return False


def _biases(kept: list[str], layers: set[str], bias: str) -> dict[str, str]:
    if bias == "all":
        return {n: n for n in kept if n == "bias" or n.endswith(".bias")}
    if bias.endswith("_only"):
        wanted = {f"{m}.base_layer.bias" if m else "base_layer.bias" for m in layers}
        return {n: n for n in kept if n in wanted}
    return {}


def _embedding_targeted(config: Mapping[str, Any], names: list[str]) -> bool:
    """PEFT's test: an embedding layer name in ``target_modules`` (a list), or a module of the
    base model ending in one that the pattern matches in full (a string)."""
    targets = config.get("target_modules")
    if isinstance(targets, str):
        if targets == ALL_LINEAR:
            return False
        modules = set()
        for name in names:
            parts = name.removeprefix(PEFT_PREFIX).split(".")
            modules.update(".".join(parts[:i]) for i in range(1, len(parts)))
        return any(re.fullmatch(targets, m) for m in modules
                   if any(re.match(rf"(.*\.)?{e}$", m) for e in EMBEDDING_LAYER_NAMES))
    return bool(targets) and any(e in targets for e in EMBEDDING_LAYER_NAMES)


# ---- writing -----------------------------------------------------------------------------------
def _write_adapter(source: Source, root: str, tmp: str, out: str, used: list[Entry], saved: dict[str, str],
                   config: dict[str, Any], origin: str, adapter_name: str, dtype: str | None) -> ReleaseInfo:
    """One safetensors file (PEFT loads no other layout), the config, ``release.json``."""
    loaded: dict[str, torch.Tensor] = {}
    for batch in batches(used, LOAD_BATCH_BYTES):
        loaded.update(load_batch(source, batch))
        progress.advance(sum(entry.source_nbytes for entry in batch))
    dtypes = {entry.name: entry.dtype for entry in used}
    tensors = {k: loaded[saved[k]].to(dtypes[saved[k]]) for k in sorted(saved)}
    files = {ADAPTER_WEIGHTS_NAME: write_safetensors(os.path.join(tmp, ADAPTER_WEIGHTS_NAME), tensors)}
    # as PEFT's save_pretrained writes it: the config of a loaded, not a trained, adapter
    write_json(os.path.join(tmp, ADAPTER_CONFIG_NAME), {**config, "inference_mode": True}, indent=2)
    files[ADAPTER_CONFIG_NAME] = file_digest(os.path.join(tmp, ADAPTER_CONFIG_NAME), "sha256")[1]
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    release = {
        **provenance(source, root, "peft_adapter"), "adapter_name": adapter_name,
        "adapter_config_source": origin, "dtype": dtype, "tensor_count": len(tensors),
        "total_bytes": total, "source_tensors": saved, "verified_source_files": sorted(source.verified),
        "files": {name: {"size": os.path.getsize(os.path.join(tmp, name)), "sha256": digest}
                  for name, digest in files.items()},
    }
    write_json(os.path.join(tmp, RELEASE_NAME), release)
    return ReleaseInfo(out, source.name, files, len(tensors), total, {}, release)
