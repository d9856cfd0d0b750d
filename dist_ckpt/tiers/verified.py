"""DCP reads from an object store that deserialise only bytes checked against the manifest.

Validation hashes every object before a generation is chosen, but DCP then downloads the
objects again: a writer of the bucket could swap ``.metadata`` (an unrestricted pickle) or
a shard in between. :class:`VerifiedObjectReader` closes that window. Each file DCP opens
is downloaded once into a private local directory, hashed while it streams, compared with
the manifest's size and digest, and only then read (or unpickled) from that local copy.

Protocol: construct per load on every rank with the generation's trusted manifest; pass it
to ``dcp.load``; call ``close()`` afterwards (the local copies are deleted).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path

from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

from ..digests import hasher
from ..errors import ValidationError
from ..format.manifest import Manifest, dcp_entry_path, is_object_path
from ..format.validate import check_entry
from ..storage.base import StoreReader
from ..storage.objectstore import READ_CHUNK


class _DownloadingFileSystem(FileSystem):
    def __init__(self, store: StoreReader, remote_dir: str, local_dir: str,
                 manifest: Manifest, generation: str) -> None:
        super().__init__()
        self.store = store
        self.remote_dir = remote_dir
        self.local_dir = Path(local_dir)
        self.manifest = manifest
        self.generation = generation
        self.errors: list[ValidationError] = []  # DCP may rewrap them; the caller reports these

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator:
        if "r" not in mode or "+" in mode:
            raise ValidationError("a verified reader never writes", generation=self.generation)
        rel = Path(path).relative_to(self.local_dir).as_posix()
        with open(self.local_copy(rel), "rb") as handle:
            yield handle

    def local_copy(self, rel: str) -> Path:
        where = dcp_entry_path(rel)  # a shared object: its own place in the private copy
        local = self.local_dir / (where if is_object_path(where) else rel)
        if not local.exists():
            self._download(rel, local)
        return local

    def _download(self, rel: str, local: Path) -> None:
        where = dcp_entry_path(rel)
        entry = self.manifest.file(where)
        if entry is None:
            raise self._fail(ValidationError(f"{self.generation}: DCP asked for {where}, which the "
                                             "manifest does not list", generation=self.generation,
                                             path=where))
        digest, received = hasher(entry.algorithm), 0
        partial = local.with_name(local.name + ".partial")
        local.parent.mkdir(parents=True, exist_ok=True)
        remote = where if is_object_path(where) else f"{self.remote_dir}/{rel}"
        with self.store.open_read(remote) as source, open(partial, "wb") as sink:
            while chunk := source.read(READ_CHUNK):
                received += len(chunk)
                if received > entry.size:  # never store more than the manifest allows
                    break
                digest.update(chunk)
                sink.write(chunk)
        try:
            check_entry(self.generation, where, entry, received, digest.hexdigest())
        except ValidationError as exc:
            partial.unlink(missing_ok=True)
            raise self._fail(ValidationError(f"{exc} (changed after validation)",
                                             generation=self.generation, path=where)) from None
        partial.rename(local)

    def _fail(self, error: ValidationError) -> ValidationError:
        self.errors.append(error)
        return error


class VerifiedObjectReader(FileSystemReader):
    """A DCP ``FileSystemReader`` over private local copies verified against ``manifest``
    (a ``GenerationReader`` of the object-store tier)."""

    hashes_on_read = True
    needs_local_copy = False

    def __init__(self, store: StoreReader, generation: str, manifest: Manifest,
                 scratch_parent: str | None = None) -> None:
        if scratch_parent is not None:
            os.makedirs(scratch_parent, exist_ok=True)
        self.local_dir = tempfile.mkdtemp(prefix="dist_ckpt-restore-", dir=scratch_parent)
        super().__init__(self.local_dir)
        self.fs = _DownloadingFileSystem(store, f"{generation}/{manifest.location('dcp')}",
                                         self.local_dir, manifest, generation)
        self.storage_reader = self
        self._metadata: Metadata | None = None
        self.errors = self.fs.errors

    def read_metadata(self, *args, **kwargs) -> Metadata:
        # downloaded and verified once; DCP asks again on every load
        if self._metadata is None:
            self._metadata = super().read_metadata(*args, **kwargs)
        return self._metadata

    def local_copy(self, rel: str) -> tuple[str, bool]:
        """``dcp/<rel>`` downloaded once (hashed while it streams) into the private copy."""
        return os.fspath(self.fs.local_copy(rel)), True

    def close(self) -> None:
        shutil.rmtree(self.local_dir, ignore_errors=True)

