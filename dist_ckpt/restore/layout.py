"""Does a generation's tensor layout fit the job's objects? Checked before anything loads.

Compares the flattened keys of the live state (the load template) with DCP's metadata of
the generation: keys the job has that were not saved, saved keys the job lacks (within the
top-level parts the job loads: ``model``, ``optim``), and keys whose global shape or dtype
differ. A renamed, added or removed parameter, or a changed shape or dtype, is refused with
``LayoutMismatch`` listing them, so a failed restore never leaves half-loaded objects.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ..errors import LayoutMismatch


def check_layout(generation: str, metadata: Metadata, template: dict[str, Any]) -> None:
    expected, _ = flatten_state_dict(template)
    saved = metadata.state_dict_metadata
    loaded_parts = {key.split(".", 1)[0] for key in expected}
    missing, mismatched = [], {}
    for key, value in sorted(expected.items()):
        if not isinstance(value, torch.Tensor):
            continue
        entry = saved.get(key)
        if not isinstance(entry, TensorStorageMetadata):
            missing.append(key)
            continue
        saved_form = (tuple(entry.size), entry.properties.dtype)
        current_form = (tuple(value.shape), value.dtype)
        if saved_form != current_form:
            mismatched[key] = (_form(*saved_form), _form(*current_form))
    unexpected = sorted(key for key, entry in saved.items() if isinstance(entry, TensorStorageMetadata)
                        and key.split(".", 1)[0] in loaded_parts and key not in expected)
    if missing or unexpected or mismatched:
        raise LayoutMismatch(generation, missing, unexpected, mismatched)


def _form(shape: tuple[int, ...], dtype: torch.dtype | None) -> str:
    return f"{tuple(shape)} {str(dtype).removeprefix('torch.')}"
