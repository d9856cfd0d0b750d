"""An fsspec store for object stores (S3 through s3fs), where nothing can be renamed.

The commit protocol over it lives in ``dist_ckpt.tiers.objectstore``. Credentials and
endpoint come from the usual AWS variables (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...)
or ``storage_options``.
"""

from __future__ import annotations

import hashlib
from typing import IO, Any

import fsspec

from .. import logs
from ..errors import StorageError, UnsafeFileError

log = logs.get(__name__)
READ_CHUNK = 8 << 20


class ObjectStoreBackend:
    """Backend over an fsspec URL; keys are ``<root>/<rel>``."""

    def __init__(self, root: str, storage_options: dict[str, Any] | None = None) -> None:
        self.root = root.rstrip("/")
        self.storage_options = dict(storage_options or {})
        try:
            self.fs, self.base = fsspec.core.url_to_fs(
                self.root, use_listings_cache=False, skip_instance_cache=True, **self.storage_options)
        except (ImportError, ValueError) as exc:
            raise StorageError(f"cannot open {self.root}: {exc}") from exc
        self.protocol = self.fs.protocol[0] if isinstance(self.fs.protocol, tuple) else self.fs.protocol

    def _key(self, rel: str) -> str:
        return f"{self.base}/{rel}".rstrip("/") if rel else self.base

    def url(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def exists(self, rel: str) -> bool:
        return bool(self.fs.exists(self._key(rel)))

    def listdir(self, rel: str) -> list[str]:
        key = self._key(rel)
        try:
            entries = self.fs.ls(key, detail=False)
        except FileNotFoundError:
            if not rel and not self.fs.exists(self.base.split("/")[0]):
                raise StorageError(f"no such bucket or root: {self.root}") from None
            return []
        return sorted({e.rstrip("/").rsplit("/", 1)[-1] for e in entries if e.rstrip("/") != key})

    def read_bytes(self, rel: str) -> bytes:
        return self.fs.cat_file(self._key(rel))

    def size(self, rel: str) -> int:
        return int(self.fs.info(self._key(rel))["size"])

    def sha256(self, rel: str) -> str:
        digest = hashlib.sha256()
        with self.open_read(rel) as handle:
            while chunk := handle.read(READ_CHUNK):
                digest.update(chunk)
        return digest.hexdigest()

    def checked_size(self, rel: str, *, limit: int | None = None,
                     sound_dirs: set[str] | None = None) -> int:
        size = self.size(rel)  # objects are bytes: no links, FIFOs or devices
        if limit is not None and size > limit:
            raise UnsafeFileError(f"{size} bytes, over the {limit} byte bound (refused unread)")
        return size

    def tree_size(self, rel: str) -> int:
        try:
            return int(self.fs.du(self._key(rel)))
        except FileNotFoundError:
            return 0

    def remove_tree(self, rel: str) -> None:
        try:
            self.fs.rm(self._key(rel), recursive=True)
        except FileNotFoundError:
            pass

    def open_read(self, rel: str) -> IO[bytes]:
        return self.fs.open(self._key(rel), "rb", block_size=READ_CHUNK)

    # ---- writes ------------------------------------------------------------------------
    def put_file(self, local_path: str, rel: str) -> None:
        self.fs.put_file(local_path, self._key(rel))

    def put_bytes(self, rel: str, data: bytes) -> None:
        self.fs.pipe_file(self._key(rel), data)

    def create_exclusive(self, rel: str, data: bytes) -> None:
        """Create ``rel`` only if it does not exist (conditional create on S3).

        Raises ``FileExistsError`` when another writer created it first. Stores other than S3
        get a check-then-write, which is not atomic.
        """
        key = self._key(rel)
        if self.protocol in ("s3", "s3a"):
            bucket, _, object_key = key.partition("/")
            try:
                self.fs.call_s3("put_object", Bucket=bucket, Key=object_key, Body=data, IfNoneMatch="*")
            except FileExistsError as exc:
                raise FileExistsError(f"{self.url(rel)} already exists (another writer created it)") from exc
            return
        if self.fs.exists(key):
            raise FileExistsError(f"{self.url(rel)} already exists")
        self.fs.pipe_file(key, data)

    def abort_uploads(self, rel: str) -> int:
        """Abort unfinished multipart uploads below ``rel`` (pruner only); returns the count."""
        if self.protocol not in ("s3", "s3a"):
            return 0
        bucket, _, prefix = self._key(rel).partition("/")
        listing = self.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix)
        uploads = listing.get("Uploads") or []
        for upload in uploads:
            self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=upload["Key"],
                            UploadId=upload["UploadId"])
        return len(uploads)
