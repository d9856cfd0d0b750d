"""``dist-ckpt export``: a generation's model tensors as a safetensors release (see export.py).

Exit codes as for every subcommand: 0 written; 1 the generation does not verify (the
message names the file); 2 usage: an existing --out, an unknown generation, a bad size.
"""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

from ..export import DTYPE_NAMES, OutputError, export_generation
from ..format.signing import key_from_env
from .common import UsageError, checked_generation, human_bytes, open_root
from .inspection import default_generation

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")

EXPORT_EPILOG = """\
writes OUT/model.safetensors (one shard) or OUT/model-00001-of-0000N.safetensors ...,
always OUT/model.safetensors.index.json (Hugging Face layout), and OUT/release.json (source
root as an absolute path or URL, generation, manifest sha256, contract digest, code version,
aliases of tied weights, the sha256 of every file). OUT must not exist: it is written beside
it and renamed into place; it takes the umask like any new directory.
Sizes: 5GB = 5*10**9 bytes, 256MiB = 256*2**20 bytes. Only the model is exported.
"""


def size_arg(text: str) -> int:
    """``5GB``, ``256MiB``, ``1000000`` -> bytes (argparse turns the error into exit 2)."""
    match = _SIZE_RE.match(text)
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in _UNITS or float(match.group(1)) * _UNITS[unit] < 1:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: expected e.g. 5GB, 256MiB or 1000000")
    return int(float(match.group(1)) * _UNITS[unit])


def cmd_export(args: argparse.Namespace) -> int:
    store = open_root(args.root)
    # as inspect and verify: a newer generation passed over is said, never skipped silently
    generation = default_generation(store) if args.generation is None else checked_generation(
        store, args.generation)
    try:
        info = export_generation(args.root, args.out, generation, dtype=args.dtype,
                                 max_shard_bytes=args.max_shard_size, key=key_from_env())
    except OutputError as exc:  # an existing --out or a missing parent: a usage problem
        raise UsageError(str(exc)) from exc
    if args.json:
        print(json.dumps({"out": info.out_dir, **info.release}, indent=1))
        return 0
    shards = [name for name in info.files if name.endswith(".safetensors")]
    print(f"exported {info.generation} to {info.out_dir}: {info.tensor_count} tensors, "
          f"{human_bytes(info.total_bytes)} in {len(shards)} shard(s)")
    for alias, canonical in sorted(info.aliases.items()):
        print(f"  tied: {alias} -> {canonical} (written once)")
    return 0


def add_export_parser(sub: Any) -> argparse.ArgumentParser:
    export = sub.add_parser("export", help="write a generation's model as safetensors (a release)",
                            epilog=EXPORT_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    export.set_defaults(func=cmd_export)
    export.add_argument("root", metavar="ROOT", help="checkpoint root (path or s3:// URL)")
    export.add_argument("generation", metavar="GEN", nargs="?",
                        help="generation name (default: the newest committed one)")
    export.add_argument("--out", required=True, metavar="DIR", help="new output directory (must not exist)")
    export.add_argument("--dtype", choices=sorted(DTYPE_NAMES), default=None,
                        help="cast floating tensors (integer and bool tensors keep their dtype)")
    export.add_argument("--max-shard-size", type=size_arg, default=5 * 10**9, metavar="SIZE",
                        help="largest shard file, e.g. 5GB (default) or 256MiB")
    export.add_argument("--json", action="store_true", help="machine-readable output (release.json)")
    return export
