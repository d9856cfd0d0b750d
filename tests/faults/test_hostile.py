"""Fault matrix, hostile inputs: no reader of a root crashes with a traceback, hangs or
allocates without bound, whatever the bytes and file types under it.

Each hostile input is planted in a real root (two generations written by the library; the
newest is damaged) or as ``latest.json`` / ``pins.json`` / ``manifest.sig``. Then:

- ``validate()`` / ``inventory()`` raise or report a ``DistCkptError`` subclass whose message
  (or ``path``) names the offending file, and no other exception type escapes;
- ``CheckpointManager.restore()`` falls back to the older valid generation (damage in the
  newest) or is unaffected (damage in the pointer or the pins);
- ``dist-ckpt verify ROOT GEN`` exits 1 (2 for a name that is not a generation), ``ls`` and
  ``inspect`` exit 0, 1 or 2, and nothing prints a Python traceback. ``ls`` lists; it exits 0
  while reporting a damaged generation as ``invalid`` with the reason (docs/cli.md).

Symbolic links: every link below the root is refused, whether it points inside the root or
outside it, and at a file or a directory (the library never writes one; a link can leave the
generation, alias another generation's file, or reach a device such as /dev/zero). Only the
root itself may be a link. A FIFO (or any other non-regular file) is refused from ``lstat``
before anything opens it: opening a FIFO for reading blocks until a writer comes. The FIFO
tests keep a writer ready (``fifo_watch``) so that a regression fails instead of hanging, and
count the opens.

The parsers of the manifest, the latest pointer, the pins and the signature are fuzzed with
hypothesis (arbitrary bytes, structured-but-wrong JSON, mutations of a valid document, deep
nesting): each either parses into a valid object or raises a ``DistCkptError`` subclass.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import pickle
import shutil
import stat
import subprocess
import sys
import threading
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError as PydanticValidationError

from dist_ckpt import CheckpointConfig, CheckpointManager, launcher_api
from dist_ckpt.cli.app import main
from dist_ckpt.errors import (
    DistCkptError,
    SignatureError,
    StorageError,
    UnsafeFileError,
    UnsafeNameError,
    ValidationError,
)
from dist_ckpt.format.inventory import inventory
from dist_ckpt.format.manifest import (
    GLOBAL_STATE_FILE,
    LATEST_NAME,
    MANIFEST_NAME,
    METADATA_FILE,
    FileEntry,
    LatestPointer,
    Manifest,
    check_relative_path,
    parse_generation,
    read_latest_name,
    read_latest_pointer,
)
from dist_ckpt.format.signing import KEY_ENV, SIGNATURE_NAME, sign, verify
from dist_ckpt.format.validate import list_generations, read_manifest, read_verified, validate
from dist_ckpt.lifecycle.retention import PINS_NAME, read_pins
from dist_ckpt.restore.loader import RestoreResult
from dist_ckpt.storage.local import LocalStore
from tests.helpers.local_jobs import make_state, two_generations

GEN1 = "gen-000000000001"
GEN2 = "gen-000000000002"
SHARD = "dcp/__0_0.distcp"
KEY = "hostile-inputs-test-key-0123456789"
FUZZ = settings(max_examples=500, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ---- roots ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hostile-template")
    two_generations(str(root))
    return root


@pytest.fixture(scope="module")
def signed_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hostile-signed")
    two_generations(str(root), hmac_key=KEY)
    return root


@pytest.fixture(autouse=True)
def _no_key_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEY_ENV, raising=False)


def copy_root(template: Path, dest: Path) -> Path:
    shutil.copytree(template, dest, symlinks=True)
    return dest


def manifest_doc(root: Path, gen: str = GEN2) -> dict:
    return json.loads((root / gen / MANIFEST_NAME).read_bytes())


def write_doc(root: Path, doc: dict, gen: str = GEN2) -> None:
    (root / gen / MANIFEST_NAME).write_text(json.dumps(doc, indent=1))


def entry_of(doc: dict, path: str) -> dict:
    return next(f for f in doc["files"] if f["path"] == path)


def replace_with_fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


# ---- FIFOs: a writer comes to any reader, so an opened FIFO returns EOF instead of hanging ----
class FifoWatch:
    """Sees FIFOs opened for reading without ever letting one block: a thread polls each FIFO
    with a non-blocking open for writing, which succeeds only while a reader has it open (or
    waits in ``open``), and closes at once, so that reader sees EOF. ``opened`` counts the
    polls that found a reader (0: nobody opened it)."""

    POLL_S = 0.01

    def __init__(self, paths: list[Path]) -> None:
        self.paths = paths
        self.opened: dict[str, int] = {str(p): 0 for p in paths}
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._serve, args=(p,), daemon=True) for p in paths]

    def _serve(self, path: Path) -> None:
        while not self._stop.wait(self.POLL_S):
            try:
                fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:  # ENXIO: no reader; ENOENT: moved or replaced
                continue
            try:
                replaced = not stat.S_ISFIFO(os.fstat(fd).st_mode)
            finally:
                os.close(fd)
            if replaced:  # the library replaced the FIFO (a new pointer): nothing left to watch
                return
            self.opened[str(path)] += 1

    def __enter__(self) -> FifoWatch:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()

    @property
    def total(self) -> int:
        return sum(self.opened.values())


def fifos_under(root: Path) -> list[Path]:
    return [Path(folder) / name for folder, dirs, names in os.walk(root) for name in names + dirs
            if (Path(folder) / name).is_fifo()]


# ---- the pickle payload: creates a marker file if anything ever unpickles it ------------
class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (open, (self.marker, "w"))


def payload_bytes(marker: Path, size: int) -> bytes:
    data = pickle.dumps(_Payload(str(marker)))
    assert len(data) <= size
    return data + b"\0" * (size - len(data))  # same size as the real file: only a digest tells


# ---- hostile generations ------------------------------------------------------------------
@dataclass
class Case:
    """``plant(root, tmp) -> marker or None`` damages GEN2 of a copy of the template; ``names``
    is the offending file that the error must name; ``error`` the class it must be."""

    plant: Callable[[Path, Path], Path | None]
    names: str
    error: type[DistCkptError] = ValidationError
    signed: bool = False
    inspect_fails: bool = True  # inspect reads the manifest and state/train_state.json only
    digest_only: bool = False  # same size as the real file: ls (sizes only) still lists it committed


def _set_entry(listed: str, /, **changes) -> Callable[[Path, Path], None]:
    def plant(root: Path, tmp: Path) -> None:
        doc = manifest_doc(root)
        entry = entry_of(doc, listed)
        if "sha256" in changes:  # an entry names one algorithm: a sha256 replaces its blake3
            entry.pop("blake3", None)
        entry.update(changes)
        write_doc(root, doc)
    return plant


def _set_field(**changes) -> Callable[[Path, Path], None]:
    def plant(root: Path, tmp: Path) -> None:
        doc = manifest_doc(root)
        doc.update(changes)
        write_doc(root, doc)
    return plant


def _raw_manifest(raw: bytes) -> Callable[[Path, Path], None]:
    def plant(root: Path, tmp: Path) -> None:
        (root / GEN2 / MANIFEST_NAME).write_bytes(raw)
    return plant


def _shard_link_outside(root: Path, tmp: Path) -> None:
    outside = tmp / "outside"
    outside.mkdir()
    shard = root / GEN2 / SHARD
    shutil.move(shard, outside / "shard")  # the same bytes: size and digest would match
    shard.symlink_to(outside / "shard")


def _shard_link_inside(root: Path, tmp: Path) -> None:
    shard = root / GEN2 / SHARD
    shutil.move(shard, root / "stash.distcp")  # inside the root, outside the generation
    shard.symlink_to(Path("..") / ".." / "stash.distcp")


def _shard_link_sibling(root: Path, tmp: Path) -> None:
    shard = root / GEN2 / SHARD
    shutil.move(shard, root / GEN2 / "dcp" / "real.bin")  # inside the generation itself
    shard.symlink_to("real.bin")


def _shard_link_dev_zero(root: Path, tmp: Path) -> None:
    shard = root / GEN2 / SHARD
    shard.unlink()
    shard.symlink_to("/dev/zero")


def _state_dir_link(root: Path, tmp: Path) -> None:
    state = root / GEN2 / "state"
    shutil.move(state, tmp / "state-elsewhere")
    state.symlink_to(tmp / "state-elsewhere", target_is_directory=True)


def _shard_fifo(root: Path, tmp: Path) -> None:
    replace_with_fifo(root / GEN2 / SHARD)


def _shard_fifo_forged(root: Path, tmp: Path) -> None:
    # the manifest says what an empty file is: only the file type check keeps a reader out
    _set_entry(SHARD, size=0, sha256=hashlib.sha256(b"").hexdigest())(root, tmp)
    replace_with_fifo(root / GEN2 / SHARD)


def _state_fifo_forged(root: Path, tmp: Path) -> None:
    _set_entry(GLOBAL_STATE_FILE, size=0, sha256=hashlib.sha256(b"").hexdigest())(root, tmp)
    replace_with_fifo(root / GEN2 / GLOBAL_STATE_FILE)


def _manifest_fifo(root: Path, tmp: Path) -> None:
    replace_with_fifo(root / GEN2 / MANIFEST_NAME)


def _manifest_oversized(root: Path, tmp: Path) -> None:
    os.truncate(root / GEN2 / MANIFEST_NAME, (64 << 20) + 1)  # sparse: refused before reading


def _duplicate_entry(root: Path, tmp: Path) -> None:
    doc = manifest_doc(root)
    doc["files"].append(dict(entry_of(doc, SHARD)))
    write_doc(root, doc)


def _deep_manifest(root: Path, tmp: Path) -> None:
    depth = 100_000
    (root / GEN2 / MANIFEST_NAME).write_bytes(b'{"files": ' + b"[" * depth + b"]" * depth + b"}")


def _non_utf8_manifest(root: Path, tmp: Path) -> None:
    raw = (root / GEN2 / MANIFEST_NAME).read_bytes()
    raw = raw.replace(b'"torch_version": "', b'"torch_version": "\xff\xfe')
    (root / GEN2 / MANIFEST_NAME).write_bytes(raw)


def _pickle_shard(root: Path, tmp: Path) -> Path:
    marker = tmp / "pwned-shard"
    shard = root / GEN2 / SHARD
    shard.write_bytes(payload_bytes(marker, shard.stat().st_size))
    return marker


def _pickle_metadata(root: Path, tmp: Path) -> Path:
    marker = tmp / "pwned-metadata"
    metadata = root / GEN2 / METADATA_FILE
    metadata.write_bytes(payload_bytes(marker, metadata.stat().st_size))
    return marker


def _signature(raw: bytes) -> Callable[[Path, Path], None]:
    def plant(root: Path, tmp: Path) -> None:
        (root / GEN2 / SIGNATURE_NAME).write_bytes(raw)
    return plant


def _signature_fifo(root: Path, tmp: Path) -> None:
    replace_with_fifo(root / GEN2 / SIGNATURE_NAME)


def _signature_link(root: Path, tmp: Path) -> None:
    sig = root / GEN2 / SIGNATURE_NAME
    shutil.move(sig, tmp / "sig")  # the right signature, behind a link
    sig.symlink_to(tmp / "sig")


GENERATION_CASES: dict[str, Case] = {
    "manifest-dotdot-path": Case(_set_entry(SHARD, path=f"../{GEN1}/{SHARD}"), MANIFEST_NAME,
                                 UnsafeNameError),
    "manifest-absolute-path": Case(_set_entry(SHARD, path="/etc/passwd"), MANIFEST_NAME, UnsafeNameError),
    "manifest-data-dir-traversal": Case(_set_field(data_dir=f"../{GEN1}"), MANIFEST_NAME, UnsafeNameError),
    "manifest-absolute-data-dir": Case(_set_field(data_dir="/tmp"), MANIFEST_NAME, UnsafeNameError),
    "manifest-newline-in-name": Case(_set_entry(SHARD, path=f"{SHARD}\n"), MANIFEST_NAME, UnsafeNameError),
    "shard-symlink-outside-root": Case(_shard_link_outside, SHARD, UnsafeFileError, inspect_fails=False),
    "shard-symlink-inside-root": Case(_shard_link_inside, SHARD, UnsafeFileError, inspect_fails=False),
    "shard-symlink-inside-generation": Case(_shard_link_sibling, SHARD, UnsafeFileError,
                                            inspect_fails=False),
    "shard-symlink-dev-zero": Case(_shard_link_dev_zero, SHARD, UnsafeFileError, inspect_fails=False),
    "state-dir-symlink-outside": Case(_state_dir_link, "state", UnsafeFileError),
    "shard-fifo": Case(_shard_fifo, SHARD, UnsafeFileError, inspect_fails=False),
    "shard-fifo-forged-size": Case(_shard_fifo_forged, SHARD, UnsafeFileError, inspect_fails=False),
    "state-fifo-forged-size": Case(_state_fifo_forged, GLOBAL_STATE_FILE, UnsafeFileError),
    "manifest-fifo": Case(_manifest_fifo, MANIFEST_NAME, UnsafeFileError),
    "manifest-oversized": Case(_manifest_oversized, MANIFEST_NAME, UnsafeFileError),
    "huge-declared-size": Case(_set_entry(SHARD, size=2**62), SHARD, inspect_fails=False),
    "huge-declared-state-size": Case(_set_entry(GLOBAL_STATE_FILE, size=2**62), GLOBAL_STATE_FILE),
    "huge-world-size": Case(_set_field(world_size=10**15), MANIFEST_NAME, inspect_fails=False),
    "wrong-type-files-object": Case(_set_field(files={SHARD: 1}), MANIFEST_NAME),
    "wrong-type-size-list": Case(_set_entry(SHARD, size=[1]), MANIFEST_NAME),
    "wrong-type-contract-list": Case(_set_field(contract=["config"]), MANIFEST_NAME),
    "wrong-type-top-level-list": Case(_raw_manifest(b"[1, 2, 3]"), MANIFEST_NAME),
    "created-beyond-year-9999": Case(_set_field(created_unix=1e300), MANIFEST_NAME),
    "duplicate-entries": Case(_duplicate_entry, MANIFEST_NAME),
    "deep-nesting": Case(_deep_manifest, MANIFEST_NAME),
    "non-utf8-manifest": Case(_non_utf8_manifest, MANIFEST_NAME),
    "generation-field-not-a-number": Case(_set_field(generation="gen-00000000000x"), MANIFEST_NAME),
    "pickle-payload-shard": Case(_pickle_shard, SHARD, inspect_fails=False, digest_only=True),
    "pickle-payload-metadata": Case(_pickle_metadata, METADATA_FILE, inspect_fails=False,
                                    digest_only=True),
    "signature-deep-nesting": Case(_signature(b"[" * 4000 + b"]" * 4000), SIGNATURE_NAME, SignatureError,
                                   signed=True),
    "signature-too-deep-for-json": Case(_signature(b"[" * 2000), SIGNATURE_NAME, SignatureError, signed=True),
    "signature-non-utf8": Case(_signature(b'{"alg": "\xff\xfe", "mac": "x"}'), SIGNATURE_NAME,
                               SignatureError, signed=True),
    "signature-wrong-types": Case(_signature(b'{"alg": ["hmac-sha256"], "mac": 5, "key_id": {}}'),
                                  SIGNATURE_NAME, SignatureError, signed=True),
    "signature-oversized": Case(_signature(b" " * 100_000), SIGNATURE_NAME, SignatureError, signed=True),
    "signature-fifo": Case(_signature_fifo, SIGNATURE_NAME, SignatureError, signed=True),
    "signature-symlink": Case(_signature_link, SIGNATURE_NAME, SignatureError, signed=True),
}


def no_traceback(err: str) -> None:
    assert "Traceback" not in err, err


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    no_traceback(err)
    return code, out, err


def restore_from(root: Path, **config) -> RestoreResult:
    with CheckpointManager(CheckpointConfig(root=str(root), **config), make_state()) as mgr:
        return mgr.restore()


@pytest.mark.parametrize("name", list(GENERATION_CASES))
def test_hostile_generation(name: str, template: Path, signed_template: Path, tmp_path: Path,
                            capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    case = GENERATION_CASES[name]
    root = copy_root(signed_template if case.signed else template, tmp_path / "root")
    key = KEY.encode() if case.signed else None
    if case.signed:
        monkeypatch.setenv(KEY_ENV, KEY)
    marker = case.plant(root, tmp_path)
    backend = LocalStore(str(root))
    with FifoWatch(fifos_under(root)) as fifos:
        # the library's validation: the newest generation is refused with a named file
        with pytest.raises(case.error) as caught:
            validate(backend, GEN2, digests=True, key=key)
        assert case.names in str(caught.value) or caught.value.path == case.names, caught.value
        assert caught.value.generation == GEN2
        validate(backend, GEN1, digests=True, key=key)  # the older one is untouched
        infos = {i.name: i for i in inventory(backend, digests=True, key=key)}
        assert infos[GEN2].state == "invalid" and infos[GEN1].state == "committed"
        assert case.names in (infos[GEN2].reason or "") or infos[GEN2].path == case.names

        # the command line: verify exits 1 naming the file, ls lists it invalid, no traceback
        code, out, _ = run_cli(capsys, "verify", str(root), GEN2)
        assert code == 1 and f"{GEN2}: INVALID" in out and case.names in out, out
        code, out, _ = run_cli(capsys, "ls", str(root))
        line = next(line for line in out.splitlines() if GEN2 in line and "latest.json" not in line)
        if case.digest_only:  # docs/cli.md: "ls checks sizes"; `dist-ckpt verify` checks digests
            assert code == 0 and "committed" in line, out
        else:
            assert code == 0 and "invalid" in line and case.names in line, out
        code, out, err = run_cli(capsys, "inspect", str(root), GEN2)
        assert code == (1 if case.inspect_fails else 0), (out, err)

        # restore: falls back to the older generation, never loads the damaged one
        result = restore_from(root, **({"hmac_key": KEY} if case.signed else {}))
        assert result.generation == GEN1, result.rejected
        problem = next(p for p in result.rejected if p.generation == GEN2)
        assert case.names in str(problem), problem
        assert problem.signature == (case.error is SignatureError)
        if case.digest_only:  # refused by its digest, before DCP opened anything of GEN2
            assert "blake3" in str(problem), problem
    assert fifos.total == 0, f"a FIFO was opened: {fifos.opened}"
    if marker is not None:
        assert not marker.exists(), "the pickle payload ran"


def test_deeply_nested_state_file_with_a_forged_digest(template: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """A manifest's digests prove consistency, not trust (that is the signature's job): whoever
    can write the root can list a deeply nested state file with its true sha256. Reading it
    ends in a DistCkptError in inspect, and restore rejects that generation and falls back to
    the older one within the same call."""
    root = copy_root(template, tmp_path / "root")
    raw = b"[" * 100_000 + b"]" * 100_000
    (root / GEN2 / GLOBAL_STATE_FILE).write_bytes(raw)
    _set_entry(GLOBAL_STATE_FILE, size=len(raw), sha256=hashlib.sha256(raw).hexdigest())(root, tmp_path)
    code, _, err = run_cli(capsys, "inspect", str(root), GEN2)
    assert code == 1 and GLOBAL_STATE_FILE in err
    result = restore_from(root)
    assert result.generation != GEN2
    assert [p.generation for p in result.rejected] == [GEN2]
    assert "not valid" in result.rejected[0].reason


def test_pickle_payload_is_live(tmp_path: Path) -> None:
    """The payload of the pickle cases would have run, had anything unpickled it."""
    marker = tmp_path / "marker"
    pickle.loads(payload_bytes(marker, 4096))
    assert marker.exists()


def test_huge_declared_sizes_allocate_nothing(template: Path, tmp_path: Path) -> None:
    root = copy_root(template, tmp_path / "root")
    doc = manifest_doc(root)
    entry_of(doc, SHARD)["size"] = 2**62
    entry_of(doc, GLOBAL_STATE_FILE)["size"] = 2**62
    doc["total_bytes"] = 2**63
    write_doc(root, doc)
    backend = LocalStore(str(root))
    manifest = read_manifest(backend, GEN2)
    tracemalloc.start()
    try:
        with pytest.raises(ValidationError, match="manifest says 4611686018427387904"):
            validate(backend, GEN2, digests=True)
        with pytest.raises(ValidationError, match="manifest says 4611686018427387904"):
            read_verified(backend, GEN2, manifest, GLOBAL_STATE_FILE)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"peak {peak} bytes"


def test_deep_nesting_is_a_validation_error() -> None:
    for raw in (b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 100_000 + b"1" + b"}" * 100_000, b"[" * 100_000):
        with pytest.raises(ValidationError):
            Manifest.from_bytes(raw, generation=GEN2)
        with pytest.raises(PydanticValidationError):
            LatestPointer.model_validate_json(raw)
        with pytest.raises(SignatureError):
            verify(KEY.encode(), b"{}", raw[:4096], generation=GEN2)


@pytest.mark.processes
def test_fifo_shard_verify_in_a_subprocess_exits_1(template: Path, tmp_path: Path) -> None:
    """One case end to end through the installed entry point, in its own process."""
    root = copy_root(template, tmp_path / "root")
    _shard_fifo_forged(root, tmp_path)
    env = {k: v for k, v in os.environ.items() if k != KEY_ENV}
    with FifoWatch(fifos_under(root)) as fifos:
        proc = subprocess.run([sys.executable, "-m", "dist_ckpt.cli", "verify", str(root), GEN2],
                              capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "FIFO" in proc.stdout and SHARD in proc.stdout
    assert fifos.total == 0


# ---- hostile names under the root ----------------------------------------------------------
def test_generation_names_that_are_not_numbers(template: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    root = copy_root(template, tmp_path / "root")
    impostors = ["gen-00000000000x", "gen-" + "\u0663" * 12, "gen-000000000003\n", "gen-0000000000003",
                 "gen--00000000003"]
    for name in impostors:
        shutil.copytree(root / GEN2, root / name)
    os.mkdir(os.path.join(os.fsencode(root), b"gen-\xff\xfe0000000003"))  # not UTF-8
    os.mkdir(os.path.join(os.fsencode(root), b".pending-gen-000000000004-\xff"))
    backend = LocalStore(str(root))
    assert list_generations(backend) == [GEN2, GEN1]
    for name in impostors:
        code, _, err = run_cli(capsys, "verify", str(root), name)
        assert code == 2 and "not a generation name" in err, err
        with pytest.raises(UnsafeNameError):
            validate(backend, name)
    code, out, _ = run_cli(capsys, "ls", str(root))
    assert code == 0 and "gen-00000000000x" not in out
    code, out, _ = run_cli(capsys, "ls", str(root), "--json")
    listed = json.loads(out)["generations"]
    assert code == 0 and [g["name"] for g in listed if g["state"] != "pending"] == [GEN2, GEN1]
    assert ".pending-gen-000000000004-\\xff" in [g["name"] for g in listed]  # printable
    assert restore_from(root).generation == GEN2


def test_unsafe_relative_paths() -> None:
    for bad in ("../x", "/etc/passwd", "a/../../b", "a//b", "a\\b", "", ".", "dcp/x\n", "dcp/\u0661",
                "dcp/\x00", "dcp/ x", "-/x/.."):
        with pytest.raises(UnsafeNameError):
            check_relative_path(bad)
    assert check_relative_path("dcp/__0_0.distcp") == "dcp/__0_0.distcp"


# ---- hostile latest pointer and pins ---------------------------------------------------------
def _pointer(generation: object, next_update: object = 2) -> bytes:
    return json.dumps({"generation": generation, "manifest_sha256": "0" * 64, "manifest_size": 1,
                       "format_version": 1, "next_update": next_update}).encode()


def _latest_fifo(root: Path, tmp: Path) -> None:
    replace_with_fifo(root / LATEST_NAME)


def _latest_link(root: Path, tmp: Path) -> None:
    (tmp / "pointer").write_bytes((root / LATEST_NAME).read_bytes())
    (root / LATEST_NAME).unlink()
    (root / LATEST_NAME).symlink_to(tmp / "pointer")


def _root_file(name: str, raw: bytes) -> Callable[[Path, Path], None]:
    def plant(root: Path, tmp: Path) -> None:
        (root / name).write_bytes(raw)
    return plant


def _pins_fifo(root: Path, tmp: Path) -> None:
    os.mkfifo(root / PINS_NAME)


def _pins_oversized(root: Path, tmp: Path) -> None:
    (root / PINS_NAME).touch()
    os.truncate(root / PINS_NAME, 32 << 20)  # sparse: refused before reading


LATEST_CASES: dict[str, Callable[[Path, Path], None]] = {
    "latest-dotdot": _root_file(LATEST_NAME, _pointer("../../etc")),
    "latest-absolute": _root_file(LATEST_NAME, _pointer("/etc/passwd")),
    "latest-not-a-number": _root_file(LATEST_NAME, _pointer("gen-abcdefghijkl")),
    "latest-update-mismatch": _root_file(LATEST_NAME, _pointer(GEN1, 10**12)),
    "latest-wrong-types": _root_file(LATEST_NAME, _pointer(["gen"], "2")),
    "latest-deep-nesting": _root_file(LATEST_NAME, b"[" * 100_000),
    "latest-non-utf8": _root_file(LATEST_NAME, b'{"generation": "\xff"}'),
    "latest-oversized": _root_file(LATEST_NAME, b" " * (1 << 20) + _pointer(GEN2)),
    "latest-fifo": _latest_fifo,
    "latest-symlink": _latest_link,
}
# what the one reader of the pointer raises for each: callers tell the cases apart by type
LATEST_ERRORS: dict[str, type[Exception]] = {
    "latest-dotdot": UnsafeNameError, "latest-absolute": UnsafeNameError,
    "latest-not-a-number": UnsafeNameError, "latest-oversized": UnsafeFileError,
    "latest-deep-nesting": UnsafeFileError, "latest-fifo": UnsafeFileError,
    "latest-symlink": UnsafeFileError}


@pytest.mark.parametrize("name", list(LATEST_CASES))
def test_hostile_latest_pointer(name: str, template: Path, tmp_path: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
    """The pointer is a hint: a hostile one is ignored (None), never followed or opened."""
    root = copy_root(template, tmp_path / "root")
    LATEST_CASES[name](root, tmp_path)
    backend = LocalStore(str(root))
    with FifoWatch(fifos_under(root)) as fifos:
        assert read_latest_name(backend) is None
        with pytest.raises(LATEST_ERRORS.get(name, ValidationError)) as raised:
            read_latest_pointer(backend)
        assert LATEST_NAME in str(raised.value)
        assert name in LATEST_ERRORS or type(raised.value) is ValidationError  # corrupt
        # the launcher reads the pointer for its log line and free-space estimate: same rule
        assert launcher_api.latest_update(str(root)) is None
        assert launcher_api.newest_generation_bytes(str(root)) is None
        code, out, _ = run_cli(capsys, "ls", str(root))
        assert code == 0 and f"({LATEST_NAME} is missing or unreadable)" in out, out
        code, out, _ = run_cli(capsys, "verify", str(root))
        assert code == 0 and f"{GEN2}: OK" in out
        code, out, _ = run_cli(capsys, "inspect", str(root), GEN2)
        assert code == 0
        with CheckpointManager(CheckpointConfig(root=str(root)), make_state()) as mgr:
            assert mgr.restore().generation == GEN2
            mgr.save(3)  # the next commit replaces the hostile pointer
    assert fifos.total == 0, f"a FIFO was opened for reading: {fifos.opened}"
    assert read_latest_name(backend) == "gen-000000000003"


PINS_CASES: dict[str, Callable[[Path, Path], None]] = {
    "pins-dotdot": _root_file(PINS_NAME, b'{"pins": {"../../etc": "x"}}'),
    "pins-absolute": _root_file(PINS_NAME, b'{"pins": {"/etc/passwd": "x"}}'),
    "pins-not-a-number": _root_file(PINS_NAME, b'{"pins": {"gen-00000000000x": "x"}}'),
    "pins-wrong-types": _root_file(PINS_NAME, b'{"pins": ["gen-000000000001"]}'),
    "pins-label-object": _root_file(PINS_NAME, b'{"pins": {"gen-000000000001": {"a": [1]}}}'),
    "pins-label-lone-surrogate": _root_file(PINS_NAME, b'{"pins": {"gen-000000000001": "\\ud800"}}'),
    "pins-deep-nesting": _root_file(PINS_NAME, b'{"pins": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    "pins-non-utf8": _root_file(PINS_NAME, b'{"pins": {"gen-000000000001": "\xff"}}'),
    "pins-oversized": _pins_oversized,
    "pins-fifo": _pins_fifo,
}


@pytest.mark.parametrize("name", list(PINS_CASES))
def test_hostile_pins(name: str, template: Path, tmp_path: Path,
                      capsys: pytest.CaptureFixture[str]) -> None:
    """A hostile pins.json pins nothing and says so: StorageError, ls exits 1, inspect warns,
    training (restore) goes on."""
    root = copy_root(template, tmp_path / "root")
    PINS_CASES[name](root, tmp_path)
    backend = LocalStore(str(root))
    with FifoWatch(fifos_under(root)) as fifos:
        with pytest.raises(StorageError, match=PINS_NAME):
            read_pins(backend)
        code, _, err = run_cli(capsys, "ls", str(root))
        assert code == 1 and PINS_NAME in err, err
        code, _, err = run_cli(capsys, "inspect", str(root), GEN2)
        assert code == 0 and PINS_NAME in err, err
        code, _, err = run_cli(capsys, "pin", str(root), GEN1)
        assert code == 1 and PINS_NAME in err, err
        assert restore_from(root).generation == GEN2
    assert fifos.total == 0, f"a FIFO was opened for reading: {fifos.opened}"


# ---- fuzzing the parsers -------------------------------------------------------------------
VALID_MANIFEST = Manifest(
    format_version=1, generation=GEN2, next_update=2, tokens_seen=0, world_size=1,
    components=["model", "optimizer"], contract={"config": "v1"}, contract_digest="sha256:" + "0" * 64,
    torch_version="2.13.0", dist_ckpt_version="0.1.0", created_unix=1.7e9, save_duration_s=0.1,
    total_bytes=4, files=[FileEntry(path=p, size=1, sha256="a" * 64, rank=0) for p in
                          (METADATA_FILE, SHARD, "state/rank-00000.json", GLOBAL_STATE_FILE)])
VALID_RAW = VALID_MANIFEST.to_bytes()
VALID_POINTER = LatestPointer.for_manifest(VALID_MANIFEST, VALID_RAW).model_dump_json().encode()
VALID_PINS = json.dumps({"pins": {GEN1: "best", GEN2: "final"}}).encode()
VALID_SIGNATURE = sign(KEY.encode(), VALID_RAW)

NAMES = st.sampled_from(["../x", "/abs", "", ".", "..", GEN1, GEN2, "gen-00000000000x",
                         "gen-" + "\u0661" * 12, f"{GEN1}\n", SHARD, METADATA_FILE, "a\\b", "\ud800",
                         "\x00", "hmac-sha256", "0" * 64, "a" * 64, "resume", "warm_start", "files", "path",
                         "size", "pins"])
TEXT = NAMES | st.text(st.characters(exclude_categories=()), max_size=20)
SCALARS = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
           | st.sampled_from([0, -1, 2**62, 2**63, 10**12]) | st.floats() | TEXT)
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(TEXT, inner, max_size=4), max_leaves=12)
DEEP = st.builds(lambda n, kind: (b"[" * n, b"[" * n + b"]" * n, b'{"a":' * n + b"1" + b"}" * n)[kind],
                 st.integers(1, 200_000), st.integers(0, 2))

SAME_TYPE = {str: TEXT, int: st.integers(-(2**70), 2**70) | st.sampled_from([0, -1, 2**62, 2**63, 10**12]),
             float: st.floats(), bool: st.booleans(), list: st.lists(JSON, max_size=3),
             dict: st.dictionaries(TEXT, TEXT, max_size=3)}


def encode(value: object, ascii_only: bool) -> bytes:
    # lone surrogates come out as invalid UTF-8 without ensure_ascii, as \\udXXX escapes with it
    return json.dumps(value, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


@st.composite
def mutated(draw: st.DrawFn, valid: bytes) -> bytes:
    """A valid document with some values replaced, removed, added or duplicated, then perhaps
    some bytes changed."""
    doc = json.loads(valid)
    for _ in range(draw(st.integers(1, 3))):
        containers = [doc] + [v for v in doc.values() if isinstance(v, dict)]
        containers += [item for v in doc.values() if isinstance(v, list)
                       for item in v if isinstance(item, dict)]
        target = draw(st.sampled_from(containers))
        op = draw(st.sampled_from(["replace", "same-type", "same-type", "delete", "add", "duplicate"]))
        keys = list(target)
        if op == "replace" and keys:
            target[draw(st.sampled_from(keys))] = draw(JSON)
        elif op == "same-type" and keys:  # schema-valid, meaning wrong: paths, names, sizes, times
            key = draw(st.sampled_from(keys))
            target[key] = draw(SAME_TYPE.get(type(target[key]), JSON))
        elif op == "delete" and keys:
            del target[draw(st.sampled_from(keys))]
        elif op == "add":
            target[draw(TEXT)] = draw(JSON)
        else:
            lists = [v for v in doc.values() if isinstance(v, list) and v]
            if lists:
                chosen = draw(st.sampled_from(lists))
                chosen.append(copy.deepcopy(draw(st.sampled_from(chosen))))
    raw = encode(doc, draw(st.booleans()))
    if draw(st.booleans()):
        start = draw(st.integers(0, len(raw)))
        raw = raw[:start] + draw(st.binary(max_size=4)) + raw[start + draw(st.integers(0, 4)):]
    return raw


def hostile_bytes(valid: bytes) -> st.SearchStrategy[bytes]:
    return (st.binary(max_size=200) | mutated(valid) | DEEP
            | st.builds(encode, JSON, st.booleans()))


@FUZZ
@given(hostile_bytes(VALID_RAW))
@example(VALID_RAW)
@example(b"[" * 100_000)
def test_fuzz_manifest_from_bytes(raw: bytes) -> None:
    try:
        manifest = Manifest.from_bytes(raw, generation=GEN2)
    except DistCkptError:
        return
    assert manifest.generation == GEN2
    paths = [f.path for f in manifest.files]
    assert len(paths) == len(set(paths)) and all(check_relative_path(p) for p in paths)
    assert 0 <= manifest.created_unix <= 253_402_300_799


class MemoryFiles:
    """The little of a store the root-file readers use, over a dict (not a local path)."""

    root = "memory://fuzz"

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files

    def url(self, rel: str) -> str:
        return f"{self.root}/{rel}"

    def read_bytes(self, rel: str) -> bytes:
        if rel not in self.files:
            raise FileNotFoundError(rel)
        return self.files[rel]

    def checked_size(self, rel: str, *, limit: int | None = None, sound_dirs: set[str] | None = None) -> int:
        size = len(self.read_bytes(rel))
        if limit is not None and size > limit:
            raise UnsafeFileError(f"{size} bytes, over the {limit} byte bound")
        return size


@FUZZ
@given(hostile_bytes(VALID_POINTER))
@example(VALID_POINTER)
@example(_pointer("../../etc"))
def test_fuzz_latest_pointer(raw: bytes) -> None:
    name = read_latest_name(MemoryFiles({LATEST_NAME: raw}))
    assert name is None or parse_generation(name) is not None
    try:
        pointer = LatestPointer.model_validate_json(raw)
    except PydanticValidationError:  # its callers catch ValueError: nothing else may escape
        assert name is None
    else:
        assert name == pointer.generation and parse_generation(pointer.generation) == pointer.next_update
    try:
        read = read_latest_pointer(MemoryFiles({LATEST_NAME: raw})).generation
    except ValidationError:  # corrupt, or naming no generation: the only errors bytes may cause
        read = None
    assert read == name


@FUZZ
@given(hostile_bytes(VALID_PINS))
@example(VALID_PINS)
def test_fuzz_read_pins(raw: bytes) -> None:
    try:
        pins = read_pins(MemoryFiles({PINS_NAME: raw}))
    except StorageError as exc:
        assert PINS_NAME in str(exc)
        return
    assert all(parse_generation(k) is not None and isinstance(v, str) for k, v in pins.items())
    "".join(pins.values()).encode("utf-8")  # printable


@FUZZ
@given(hostile_bytes(VALID_SIGNATURE), st.one_of(st.just(VALID_RAW), hostile_bytes(VALID_RAW)))
@example(VALID_SIGNATURE, VALID_RAW)
@example(b"[" * 4000, VALID_RAW)
def test_fuzz_signature(signature: bytes, raw: bytes) -> None:
    try:
        verify(KEY.encode(), raw, signature, generation=GEN2)
    except SignatureError:
        return
    assert raw == VALID_RAW and json.loads(signature)["mac"] == json.loads(VALID_SIGNATURE)["mac"]


def test_fuzz_signature_missing() -> None:
    with pytest.raises(SignatureError, match="not signed"):
        verify(KEY.encode(), VALID_RAW, None, generation=GEN2)
