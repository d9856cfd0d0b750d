"""Writing one safetensors file straight from tensors' memory, and checking it reads back.

The format: an 8-byte little-endian header length, a JSON header (dtype, shape, byte offsets
per tensor, padded to 8 bytes), then the tensors' bytes in header order.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from typing import Any

import torch

from ..errors import StorageError

ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
              torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
              torch.float8_e5m2: "F8_E5M2", torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64"}



def byte_view(tensor: torch.Tensor) -> Any:
    """The tensor's bytes as a numpy uint8 view (no copy for a contiguous tensor)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


def write_safetensors(path: str, tensors: dict[str, torch.Tensor]) -> str:
    """Write one safetensors file straight from the tensors' memory (safetensors' own
    ``save_file`` copies every tensor into a bytes object first: twice the shard) and
    return its sha256."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": ST_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # the format pads the header to 8-byte alignment
    digest = hashlib.sha256()
    with open(path, "xb") as handle:
        for chunk in (struct.pack("<Q", len(raw)), raw, *(byte_view(t) for t in tensors.values())):
            digest.update(chunk)
            handle.write(chunk)
        handle.flush()
        os.fsync(handle.fileno())
    check_readable(path, tensors)
    return digest.hexdigest()


def check_readable(path: str, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors import safe_open  # the reference reader parses our header (no data read)

    with safe_open(path, framework="pt") as handle:
        if set(handle.keys()) != set(tensors):
            raise StorageError(f"{path}: safetensors reads other tensor names than were written")
