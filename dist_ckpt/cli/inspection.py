"""``dist-ckpt inspect`` and ``verify``: one generation's manifest and saved state, and
its integrity (sizes and digests of every file), with one rule for the default generation."""

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, datetime
from typing import Any

from ..errors import StorageError, ValidationError
from ..format.inventory import newest_committed
from ..format.manifest import (
    GLOBAL_STATE_FILE,
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    parse_generation,
    read_latest_name,
)
from ..format.signing import KEY_ENV, key_from_env
from ..format.validate import (
    ObjectVerdicts,
    list_generations,
    read_manifest,
    read_verified,
    validate,
)
from ..lifecycle.retention import read_pins
from ..replay.record import read_mirror_state
from ..restart import codec
from ..storage.base import Store, StoreReader
from ..tiers import CommitTier
from .common import (
    PROG,
    UsageError,
    checked_generation,
    error,
    human_bytes,
    latest_warnings,
    open_root,
    open_root_tier,
    warn,
)


def default_generation(store: Store) -> str:
    """What ``inspect`` and ``verify`` look at without GEN: the newest committed generation
    (structure and sizes check out), or the newest of any state when none is committed."""
    names = list_generations(store)
    if not names:
        raise UsageError(f"no generation under {store.root}")
    name = newest_committed(store, key_from_env())
    if name is None:
        return names[0]
    if name != names[0]:  # say so: an exit 0 must not hide that something newer is broken
        newer = names[:names.index(name)]
        print(f"{PROG}: note: newer {', '.join(newer)} not committed or invalid; using {name}",
              file=sys.stderr)
    return name


def root_generation(store: StoreReader, key: bytes | None) -> tuple[str, list[str]]:
    """What ``verify ROOT`` and ``diff ROOT`` look at: the generation ``latest.json`` names
    (when it is there), else the newest committed one, else the newest of any state; and,
    newest first, the newer generation directories that hold a manifest (committed-looking).
    A damaged newest generation is never skipped silently: the caller checks those too."""
    names = list_generations(store)
    if not names:
        raise UsageError(f"no generation under {store.root}")
    latest = read_latest_name(store)
    if latest is None or latest not in names:
        latest = newest_committed(store, key) or names[0]
    floor = parse_generation(latest) or 0
    newer = [name for name in names if (parse_generation(name) or 0) > floor
             and store.exists(f"{name}/{MANIFEST_NAME}")]
    return latest, newer


def manifest_summary(manifest: Manifest, latest: str | None) -> list[tuple[str, str]]:
    created = datetime.fromtimestamp(manifest.created_unix, tz=UTC).isoformat()
    contract = ", ".join(f"{k}={v}" for k, v in sorted(manifest.contract.items())) or "(empty)"
    mark = " (latest)" if manifest.generation == latest else ""
    shared = sum(f.size for f in manifest.objects)
    # an incremental generation: what is its own and what it references (ls: OWN, SHARED)
    split = [("own_bytes", f"{manifest.total_bytes - shared} ({human_bytes(manifest.total_bytes - shared)})"),
             ("referenced_bytes", f"{shared} ({human_bytes(shared)}) in {len(manifest.objects)} "
                                  "shared objects")] if manifest.objects else []
    return [
        ("generation", manifest.generation + mark),
        ("kind", manifest.kind),
        ("next_update", str(manifest.next_update)),
        ("tokens_seen", str(manifest.tokens_seen)),
        ("world_size", str(manifest.world_size)),
        ("torch_version", manifest.torch_version),
        ("dist_ckpt_version", manifest.dist_ckpt_version),
        ("components", ", ".join(manifest.components) or "(none)"),
        ("contract", contract),
        ("contract_digest", manifest.contract_digest),
        ("files", str(len(manifest.files))),
        ("total_bytes", f"{manifest.total_bytes} ({human_bytes(manifest.total_bytes)})"),
        *split,
        ("save_duration_s", f"{manifest.save_duration_s:.3f}"),
        ("created", created),
    ]


def saved_state(store: Store, name: str, manifest: Manifest) -> dict[str, Any]:
    """The data position (sampler state) and the extras' keys from ``state/train_state.json``."""
    raw = read_verified(store, name, manifest, GLOBAL_STATE_FILE)
    state = codec.loads(raw, what=f"{name}/{GLOBAL_STATE_FILE}")
    extras = state.get("extras") if isinstance(state, dict) else None
    if not isinstance(state, dict) or not isinstance(extras, dict | None):
        raise ValidationError(f"{name}/{GLOBAL_STATE_FILE} is not a train state", generation=name,
                              path=GLOBAL_STATE_FILE)
    return {"data_position": state.get("data"), "extras_keys": sorted(map(str, extras or {}))}


def tier_of(tier: CommitTier, name: str) -> dict[str, Any]:
    """Where ``name`` lives. For a root with a mirror, only what ``mirror.json`` says (the
    last completed upload, skipped and failed ones): inspect does not list the mirror."""
    state = read_mirror_state(tier.store)
    if not state.get("mirror"):
        return {"name": tier.kind, "mirror": None, "mirror_record": None}
    record = ("completed" if state.get("last_completed") == name
              else "skipped" if name in state.get("skipped", [])
              else "failed" if name in state.get("failed", []) else "not recorded")
    return {"name": tier.kind, "mirror": state["mirror"], "mirror_record": record,
            "mirror_last_completed": state.get("last_completed")}


def tier_text(tier: dict[str, Any]) -> str:
    record = tier["mirror_record"]
    if record is None:
        return tier["name"]
    if record == "completed":
        return f"local + mirror {tier['mirror']} (mirror.json: last completed upload)"
    if record in ("skipped", "failed"):
        return f"local only (mirror.json: upload to {tier['mirror']} {record})"
    return (f"local; mirror.json does not record it as completed in {tier['mirror']} (last "
            f"completed: {tier['mirror_last_completed'] or 'none'}; `dist-ckpt ls` asks the mirror)")


def inspect_details(tier: CommitTier, name: str, manifest: Manifest,
                    warnings: list[str]) -> tuple[dict[str, Any], str | None]:
    """What inspect adds to the manifest; the second item is why the state file is unusable."""
    store = tier.store
    problem = None
    try:
        details = saved_state(store, name, manifest)
    except (ValidationError, OSError) as exc:
        details, problem = {"data_position": None, "extras_keys": []}, str(exc)
    try:
        details["pin"] = read_pins(store).get(name)
    except StorageError as exc:  # a corrupt pins.json must not hide the manifest
        details["pin"] = None
        warnings.append(str(exc))
    details["tier"] = tier_of(tier, name)
    return details, problem


def position_text(position: Any) -> str:
    if position is None:
        return "(no sampler state saved)"
    if isinstance(position, dict):
        return ", ".join(f"{key}={value}" for key, value in position.items())
    return json.dumps(position, default=repr)


def cmd_inspect(args: argparse.Namespace) -> int:
    tier = open_root_tier(args.root)
    store = tier.store
    name = default_generation(store) if args.generation is None else \
        checked_generation(store, args.generation)
    manifest = read_manifest(store, name, key=key_from_env())  # ValidationError -> exit 1
    latest = read_latest_name(store)
    warnings = latest_warnings(store, latest)
    details, problem = inspect_details(tier, name, manifest, warnings)
    if args.json:
        out = {**manifest.model_dump(mode="json"), "latest": name == latest, **details,
               "state_error": problem, "warnings": warnings}
        print(json.dumps(out, indent=1, default=repr))
    else:
        for message in warnings:
            warn(message)
        lines = manifest_summary(manifest, latest) + [
            ("data_position", problem or position_text(details["data_position"])),
            ("extras", ", ".join(details["extras_keys"]) or "(none)"),
            ("pin", details["pin"] or "(not pinned)"),
            ("tier", tier_text(details["tier"]))]
        for key, value in lines:
            print(f"{key:<18} {value}")
    if problem is not None:  # the manifest was shown, but this generation cannot be restored
        error(problem)
        return 1
    return 0


def verify_result(store: Store, name: str, key: bytes | None,
                  objects: ObjectVerdicts | None = None) -> dict[str, Any]:
    """One generation's full check. ``objects``: verdicts on shared objects shared by the
    generations of one command (each object hashed once, a damaged one failing every
    generation that lists it)."""
    try:
        manifest = validate(store, name, digests=True, key=key, objects=objects)
    except ValidationError as exc:
        return {"generation": name, "ok": False, "reason": str(exc), "path": exc.path}
    except OSError as exc:
        return {"generation": name, "ok": False, "reason": f"unreadable: {exc}",
                "path": getattr(exc, "filename", None)}
    shared = f" ({len(manifest.objects)} shared objects)" if manifest.objects else ""
    reason = f"{len(manifest.files)} files{shared}, {manifest.total_bytes} bytes, digests verified"
    if key is not None:
        reason += f", signature verified (key from {KEY_ENV})"
    return {"generation": name, "ok": True, "reason": reason, "path": None}


def object_report(store: Store, names: list[str], objects: ObjectVerdicts,
                  key: bytes | None) -> dict[str, Any]:
    """After ``verify_result`` ran for ``names`` with ``objects``: every shared object their
    readable manifests list, checked (a generation stops at its first bad file, so an object
    it did not reach is checked here, still once), and each damaged object once, with every
    generation under the root that references it (checked here or not), newest first."""
    listing: dict[str, list[str]] = {}
    entries: dict[tuple[str, int, str, str], tuple[str, FileEntry]] = {}
    checked = set(names)
    for name in list_generations(store):
        try:
            manifest = read_manifest(store, name, key=key)
        except (ValidationError, OSError):
            continue  # its own result says why; it references nothing we can name
        for entry in manifest.objects:
            listing.setdefault(entry.path, []).append(name)
            if name in checked:
                entries.setdefault(ObjectVerdicts.key(entry), (name, entry))
    for name, entry in entries.values():
        try:
            objects.check(store, name, entry)
        except ValidationError:
            pass  # recorded in its verdict
    damaged = [{"path": path, "reason": reason, "generations": listing.get(path, [])}
               for path, reason in sorted(objects.damaged().items())]
    return {"checked": len(objects.verdicts), "hashed": objects.hashed, "damaged": damaged}


def print_objects(report: dict[str, Any]) -> None:
    for item in report["damaged"]:
        print(f"damaged shared object {item['path']}: {item['reason']}")
        print(f"  referenced by {len(item['generations'])} generation(s), each INVALID: "
              f"{', '.join(item['generations'])}")
    if report["checked"]:
        print(f"{report['checked']} shared object(s) checked, each read once; "
              f"{len(report['damaged'])} damaged")


def print_verify(result: dict[str, Any]) -> None:
    if result["ok"]:
        print(f"{result['generation']}: OK ({result['reason']})")
        return
    print(f"{result['generation']}: INVALID: {result['reason']}")
    if result["path"]:
        print(f"  offending file: {result['path']}")


def cmd_verify(args: argparse.Namespace) -> int:
    store = open_root(args.root)
    if sum((args.all, args.newest_valid, args.generation is not None)) > 1:
        raise UsageError("give one of GEN, --all and --newest-valid")
    if args.all:
        return verify_all(store, args)
    key = key_from_env()
    if args.generation is None and not args.newest_valid:
        return verify_root(store, args, key)
    name = default_generation(store) if args.generation is None else \
        checked_generation(store, args.generation)
    objects = ObjectVerdicts()
    result = verify_result(store, name, key, objects)
    report = object_report(store, [name], objects, key)
    if args.json:
        print(json.dumps({**result, "objects": report}))
    else:
        print_verify(result)
        print_objects(report)
    return 0 if result["ok"] else 1


def verify_root(store: Store, args: argparse.Namespace, key: bytes | None) -> int:
    """``verify ROOT``: the generation ``root_generation`` names and every newer one with a
    manifest; exit 0 only if all of them are valid."""
    name, newer = root_generation(store, key)
    objects = ObjectVerdicts()  # newer generations share the frozen base: hashed once
    newer_results = [verify_result(store, other, key, objects) for other in newer]
    result = verify_result(store, name, key, objects)
    all_ok = result["ok"] and all(other["ok"] for other in newer_results)
    warnings = latest_warnings(store, read_latest_name(store))  # a pointer at what is gone
    report = object_report(store, [*newer, name], objects, key)
    if args.json:
        print(json.dumps({**result, "newer": newer_results, "all_ok": all_ok, "warnings": warnings,
                          "objects": report}))
        return 0 if all_ok else 1
    for message in warnings:
        warn(message)
    for checked in [*newer_results, result]:  # newest first, as ls lists them
        print_verify(checked)
    print_objects(report)
    broken = [other["generation"] for other in newer_results if not other["ok"]]
    if broken:
        print(f"{', '.join(broken)}: newer than {name} and invalid; `dist-ckpt verify ROOT "
              f"--newest-valid` checks the newest valid generation alone")
    return 0 if all_ok else 1


def verify_all(store: Store, args: argparse.Namespace) -> int:
    names = list_generations(store)
    if not names:
        raise UsageError(f"no generation under {store.root}")
    key = key_from_env()
    objects = ObjectVerdicts()  # one pass over the root: each shared object hashed once
    results = [verify_result(store, name, key, objects) for name in names]
    report = object_report(store, names, objects, key)
    valid = sum(result["ok"] for result in results)
    if args.json:
        print(json.dumps({"ok": valid == len(results), "generations": results, "objects": report},
                         indent=1))
    else:
        for result in results:
            print_verify(result)
        print_objects(report)
        print(f"{valid} of {len(results)} generation(s) valid")
    return 0 if valid == len(results) else 1
