"""``dist-ckpt export``: a generation's model tensors as a safetensors release, or with
``--peft`` a PEFT job's adapter as PEFT saves it (see dist_ckpt/export).

Exit codes as for every subcommand: 0 written; 1 the generation does not verify (the
message names the file); 2 usage: an existing --out, an unknown generation, a bad size, an
adapter option without --peft, no adapter config or no such adapter.
"""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

from ..export import (
    DEFAULT_ADAPTER,
    DTYPE_NAMES,
    AdapterError,
    OutputError,
    ReleaseInfo,
    export_adapter,
    export_generation,
)
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
config.json too when the job registered TrainState(contract={"hf_config":
model.config.to_dict()}) (not for a PEFT job): AutoModelForCausalLM.from_pretrained(OUT).

--peft: a PEFT job's adapter alone, for PeftModel.from_pretrained(base, OUT):
OUT/adapter_model.safetensors (the adapter's tensors under PEFT's saved names, adapter name
removed), OUT/adapter_config.json (the contract's "peft_config", registered as
peft_config.to_dict(), or --adapter-config FILE) and OUT/release.json.
"""
DEFAULT_SHARD_BYTES = 5 * 10**9


def size_arg(text: str) -> int:
    """``5GB``, ``256MiB``, ``1000000`` -> bytes (argparse turns the error into exit 2)."""
    match = _SIZE_RE.match(text)
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in _UNITS or float(match.group(1)) * _UNITS[unit] < 1:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: expected e.g. 5GB, 256MiB or 1000000")
    return int(float(match.group(1)) * _UNITS[unit])


def cmd_export(args: argparse.Namespace) -> int:
    adapter_config = _adapter_options(args)
    store = open_root(args.root)
    # as inspect and verify: a newer generation passed over is said, never skipped silently
    generation = default_generation(store) if args.generation is None else checked_generation(
        store, args.generation)
    try:
        if args.peft:
            info = export_adapter(args.root, args.out, generation, adapter_name=args.adapter_name,
                                  adapter_config=adapter_config, dtype=args.dtype, key=key_from_env())
        else:
            info = export_generation(args.root, args.out, generation, dtype=args.dtype, key=key_from_env(),
                                     max_shard_bytes=args.max_shard_size or DEFAULT_SHARD_BYTES)
    except (OutputError, AdapterError) as exc:  # an existing --out, no adapter to export: usage
        raise UsageError(str(exc)) from exc
    if args.json:
        print(json.dumps({"out": info.out_dir, **info.release}, indent=1))
        return 0
    _print_release(info, args.peft)
    return 0


def _adapter_options(args: argparse.Namespace) -> dict[str, Any] | None:
    """The --adapter-config file's JSON object; adapter options without --peft, or
    --max-shard-size with it, are usage errors (2)."""
    if not args.peft:
        if args.adapter_config is not None or args.adapter_name != DEFAULT_ADAPTER:
            raise UsageError("--adapter-config and --adapter-name need --peft")
        return None
    if args.max_shard_size is not None:
        raise UsageError("--max-shard-size does not apply to --peft (an adapter is one file)")
    if args.adapter_config is None:
        return None
    try:
        with open(args.adapter_config, encoding="utf-8") as handle:
            config = json.load(handle)
    except (OSError, ValueError) as exc:
        raise UsageError(f"--adapter-config {args.adapter_config}: {exc}") from exc
    if not isinstance(config, dict):
        raise UsageError(f"--adapter-config {args.adapter_config}: not a JSON object")
    return config


def _print_release(info: ReleaseInfo, peft: bool) -> None:
    if peft:
        print(f"exported adapter {info.release['adapter_name']!r} of {info.generation} to {info.out_dir}: "
              f"{info.tensor_count} tensors, {human_bytes(info.total_bytes)}; adapter_config.json from "
              f"{info.release['adapter_config_source']}")
        return
    shards = [name for name in info.files if name.endswith(".safetensors")]
    print(f"exported {info.generation} to {info.out_dir}: {info.tensor_count} tensors, "
          f"{human_bytes(info.total_bytes)} in {len(shards)} shard(s)")
    for alias, canonical in sorted(info.aliases.items()):
        print(f"  tied: {alias} -> {canonical} (written once)")
    print(f"  config.json: {info.release['config_json']}")


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
    export.add_argument("--max-shard-size", type=size_arg, default=None, metavar="SIZE",
                        help="largest shard file, e.g. 5GB (default) or 256MiB")
    export.add_argument("--peft", action="store_true",
                        help="export a PEFT job's adapter (adapter_model.safetensors, adapter_config.json)")
    export.add_argument("--adapter-config", default=None, metavar="FILE",
                        help="with --peft: the adapter config to write (default: the contract's peft_config)")
    export.add_argument("--adapter-name", default=DEFAULT_ADAPTER, metavar="NAME",
                        help=f"with --peft: the adapter to export (default: {DEFAULT_ADAPTER})")
    export.add_argument("--json", action="store_true", help="machine-readable output (release.json)")
    return export
