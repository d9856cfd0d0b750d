"""Release export: the model of one generation as files other tools load, without a process
group and whatever world size and sharding saved it.

- :func:`export_generation` (``release.py``): every model tensor, unsharded, as Hugging Face
  style safetensors shards plus ``model.safetensors.index.json``, and ``config.json`` when
  the job registered its model config, so that ``AutoModelForCausalLM.from_pretrained(out)``
  loads it.
- :func:`export_adapter` (``adapter.py``): a PEFT job's adapter alone, as
  ``adapter_model.safetensors`` and ``adapter_config.json`` under PEFT's own names, so that
  ``PeftModel.from_pretrained(base, out)`` loads it.

Both write ``release.json``: source root, generation, manifest sha256, contract digest, code
version, tensor count, total bytes, the sha256 and size of every other file. Optimizer, RNG,
data and extras are never exported.

Contract convention (``source.py``): the job passes its configs as contract values,
``TrainState(contract={"hf_config": model.config.to_dict(), "peft_config":
peft_config.to_dict(), ...})``. Every manifest records them (canonical JSON, within 64 KiB
in all), and the export writes its config files from them after checking each against its
digest.

Memory: tensors are loaded in batches of at most ``LOAD_BATCH_BYTES`` (or one tensor when it
is larger) and only the current output shard is held, so the peak is about one output shard
plus one batch, never the whole model (an adapter is written as one file).

Trust: the manifest (and its signature, with ``key``) is checked first; ``dcp/.metadata`` (a
pickle) is deserialised only from bytes whose sha256 matches the manifest, and every
``.distcp`` file that holds a tensor to export (a generation's own, or a shared object an
incremental generation references) is hashed before it is read. For an object-store root
every file is read from a private local copy verified while it downloads (as restore does),
so what is hashed is what is read. A local root is trusted-local data, as for restore.

The output directory appears atomically (written beside its name, then renamed) and is never
overwritten.
"""

from __future__ import annotations

from .adapter import (
    ADAPTER_CONFIG_NAME,
    ADAPTER_WEIGHTS_NAME,
    DEFAULT_ADAPTER,
    AdapterError,
    adapter_keys,
    export_adapter,
)
from .release import CONFIG_NAME, INDEX_NAME, SINGLE_NAME, export_generation
from .source import (
    DTYPE_NAMES,
    HF_CONFIG_FIELD,
    LOAD_BATCH_BYTES,
    PEFT_CONFIG_FIELD,
    RELEASE_NAME,
    ExportError,
    OutputError,
    OutputExists,
    ReleaseInfo,
    code_version,
)

__all__ = [
    "ADAPTER_CONFIG_NAME", "ADAPTER_WEIGHTS_NAME", "CONFIG_NAME", "DEFAULT_ADAPTER", "DTYPE_NAMES",
    "HF_CONFIG_FIELD", "INDEX_NAME", "LOAD_BATCH_BYTES", "PEFT_CONFIG_FIELD", "RELEASE_NAME",
    "SINGLE_NAME", "AdapterError", "ExportError", "OutputError", "OutputExists", "ReleaseInfo",
    "adapter_keys", "code_version", "export_adapter", "export_generation",
]
