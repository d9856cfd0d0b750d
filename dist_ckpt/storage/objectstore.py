"""An fsspec store for object stores (S3 through s3fs), where nothing can be renamed.

The commit protocol over it lives in ``dist_ckpt.tiers.objectstore``. Credentials and
endpoint come from the usual AWS variables (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...)
or ``storage_options``.
"""

from __future__ import annotations

import asyncio
import errno
import os
import threading
from collections import deque
from concurrent.futures import Future, wait
from typing import IO, Any, BinaryIO

import fsspec
import fsspec.asyn

from .. import logs
from ..digests import hasher
from ..errors import StorageError, UnsafeFileError
from .checksum import composite, default_algorithm, encode, raw_checksum, reported, request_fields

log = logs.get(__name__)
READ_CHUNK = 8 << 20
S3_PROTOCOLS = ("s3", "s3a")
PART_SIZE = 50 << 20  # s3fs's: a file under twice this goes up in one PUT, as s3fs sends it
MAX_PARTS = 10_000  # S3's limit per multipart upload
SINGLE_PUT_LIMIT = 5 << 30  # S3's limit of one PUT
ABORT_WAIT_S = 60.0


class ObjectStore:
    """A store over an fsspec URL; keys are ``<root>/<rel>``."""

    def __init__(self, root: str, storage_options: dict[str, Any] | None = None, *,
                 checksums: bool = True) -> None:
        self.root = root.rstrip("/")
        self.storage_options = dict(storage_options or {})
        try:
            self.fs, self.base = fsspec.core.url_to_fs(
                self.root, use_listings_cache=False, skip_instance_cache=True, **self.storage_options)
        except (ImportError, ValueError) as exc:
            raise StorageError(f"cannot open {self.root}: {exc}") from exc
        self.protocol = self.fs.protocol[0] if isinstance(self.fs.protocol, tuple) else self.fs.protocol
        # uploads carry a transport checksum that the store verifies (S3's API only)
        self.sends_checksums = checksums and self.protocol in S3_PROTOCOLS
        self.checksum_algorithm = default_algorithm()
        self.part_size = PART_SIZE
        self.parts_in_flight = 4  # per file: bounds the memory of a large upload to 4 parts
        # bytes this process put into the store through this instance (every write below
        # counts its body once, whatever the retries inside s3fs): what a mirror costs
        self.bytes_sent = 0
        self._sent_lock = threading.Lock()

    def _sent(self, size: int) -> None:
        with self._sent_lock:  # uploads run on a pool of threads
            self.bytes_sent += size

    def _key(self, rel: str) -> str:
        return f"{self.base}/{rel}".rstrip("/") if rel else self.base

    def _bucket_key(self, rel: str) -> tuple[str, str]:
        bucket, _, key = self._key(rel).partition("/")
        return bucket, key

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

    def digest(self, rel: str, algorithm: str) -> str:
        digest = hasher(algorithm)
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

    def local_path(self, rel: str) -> None:
        """No local filesystem below an object store."""
        return None

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
        self._sent(os.path.getsize(local_path))

    def put_bytes(self, rel: str, data: bytes) -> None:
        self.fs.pipe_file(self._key(rel), data, **self._small_checksum(data))
        self._sent(len(data))

    def _small_checksum(self, data: bytes) -> dict[str, str]:
        """Checksum parameters for a body s3fs sends in one PUT (small: a signature, a pointer)."""
        if not self.sends_checksums or len(data) >= self.part_size:
            return {}
        algorithm = self.checksum_algorithm
        return request_fields(algorithm, encode(raw_checksum(data, algorithm)))

    def put_file_checksummed(self, local_path: str, rel: str) -> str:
        """Upload ``local_path`` with a transport checksum on every request body (a verifying
        store refuses a damaged one: ``BadDigest``); returns the object's checksum as a HEAD
        with checksums enabled reports it (:meth:`head_checksum`). S3 only (``sends_checksums``).

        The checksum is computed on the bytes in memory that are then sent, never on a second
        read of the file."""
        bucket, key = self._bucket_key(rel)
        algorithm = self.checksum_algorithm
        size = os.path.getsize(local_path)
        part_size = max(self.part_size, -(-size // MAX_PARTS))
        with open(local_path, "rb") as handle:
            if size < min(SINGLE_PUT_LIMIT, 2 * part_size):
                data = handle.read()
                value = encode(raw_checksum(data, algorithm))
                self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data,
                                **request_fields(algorithm, value))
                self._sent(len(data))
                return value
            value = self._put_parts(handle, bucket, key, part_size)
            self._sent(size)
            return value

    def _put_parts(self, handle: BinaryIO, bucket: str, key: str, part_size: int) -> str:
        """A multipart upload, each part with its checksum; up to ``parts_in_flight`` parts are
        sent while the next is read and hashed. Aborted on any failure."""
        algorithm = self.checksum_algorithm
        upload_id = self.fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key,
                                    ChecksumAlgorithm=algorithm, ChecksumType="COMPOSITE")["UploadId"]
        in_flight: deque[tuple[int, str, Future]] = deque()
        parts: list[dict[str, Any]] = []
        raws: list[bytes] = []

        def settle_oldest() -> None:
            number, value, future = in_flight.popleft()
            etag = future.result()["ETag"]
            parts.append({"PartNumber": number, "ETag": etag, f"Checksum{algorithm}": value})

        try:
            while chunk := handle.read(part_size):
                raws.append(raw_checksum(chunk, algorithm))
                number, value = len(raws), encode(raws[-1])
                call = self.fs._call_s3("upload_part", Bucket=bucket, Key=key, UploadId=upload_id,
                                        PartNumber=number, Body=chunk, **request_fields(algorithm, value))
                in_flight.append((number, value, asyncio.run_coroutine_threadsafe(call, self.fs.loop)))
                if len(in_flight) >= self.parts_in_flight:
                    settle_oldest()
            while in_flight:
                settle_oldest()
            self.fs.call_s3("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id,
                            MultipartUpload={"Parts": parts})
        except BaseException:
            self._abort_parts(in_flight, bucket, key, upload_id)
            raise
        return composite(raws, algorithm)

    def _abort_parts(self, in_flight: deque[tuple[int, str, Future]], bucket: str, key: str,
                     upload_id: str) -> None:
        for _, _, future in in_flight:
            future.cancel()
        # parts still arriving after the abort could outlive it: let them end first
        wait([future for _, _, future in in_flight], timeout=ABORT_WAIT_S)
        try:
            self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
        except Exception:  # noqa: BLE001 - the pruner aborts what is left (abort_uploads)
            log.warning("cannot abort the multipart upload of %s/%s", bucket, key, exc_info=True)

    def head_checksum(self, rel: str) -> tuple[int, str | None]:
        """The size of ``rel`` and the transport checksum the store recorded (None where the
        store reports none), from one HEAD."""
        bucket, key = self._bucket_key(rel)
        response = self.fs.call_s3("head_object", Bucket=bucket, Key=key, ChecksumMode="ENABLED")
        return int(response["ContentLength"]), reported(response, self.checksum_algorithm)

    def create_exclusive(self, rel: str, data: bytes) -> None:
        """Create ``rel`` only if it does not exist (conditional create on S3).

        Raises ``FileExistsError`` when another writer created it first. Stores other than S3
        get a check-then-write, which is not atomic.
        """
        key = self._key(rel)
        if self.protocol in S3_PROTOCOLS:
            bucket, _, object_key = key.partition("/")
            try:
                self.fs.call_s3("put_object", Bucket=bucket, Key=object_key, Body=data, IfNoneMatch="*",
                                **self._small_checksum(data))
            except FileExistsError as exc:
                raise FileExistsError(f"{self.url(rel)} already exists (another writer created it)") from exc
            self._sent(len(data))
            return
        if self.fs.exists(key):
            raise FileExistsError(f"{self.url(rel)} already exists")
        self.fs.pipe_file(key, data)
        self._sent(len(data))

    # ---- what moving a generation aside needs (``dist_ckpt.tiers.rejected_store``) -------
    def find(self, rel: str) -> list[str]:
        """Every object below ``rel``, as names relative to the root, sorted."""
        prefix = f"{self.base}/"
        try:
            keys = self.fs.find(self._key(rel))
        except FileNotFoundError:
            return []
        return sorted(key.removeprefix(prefix) for key in keys if key.startswith(prefix))

    def copy(self, source: str, target: str) -> None:
        """Copy one object inside the store (server side where the store can)."""
        self.fs.copy(self._key(source), self._key(target))

    def read_tagged(self, rel: str, limit: int) -> tuple[bytes, str | None]:
        """``rel``'s bytes and the entity tag of exactly those bytes (one GET on S3; None
        where the store has no tags). ``FileNotFoundError`` when missing; ``UnsafeFileError``
        when over ``limit`` bytes (refused unread)."""
        if self.protocol not in S3_PROTOCOLS:
            self.checked_size(rel, limit=limit)
            raw = self.read_bytes(rel)
            if len(raw) > limit:  # it grew after the check
                raise UnsafeFileError(f"{self.url(rel)}: {len(raw)} bytes, over the {limit} byte bound")
            return raw, None
        bucket, key = self._bucket_key(rel)

        async def get() -> tuple[bytes, str]:
            response = await self.fs._call_s3("get_object", Bucket=bucket, Key=key)
            async with response["Body"] as body:
                if int(response["ContentLength"]) > limit:
                    raise UnsafeFileError(f"{self.url(rel)}: {response['ContentLength']} bytes, over "
                                          f"the {limit} byte bound (refused unread)")
                return await body.read(), response["ETag"]

        return fsspec.asyn.sync(self.fs.loop, get)

    def remove_if_tagged(self, rel: str, tag: str | None) -> bool:
        """Remove the object ``rel`` only while it still has entity tag ``tag`` (a conditional
        delete on S3: an object created again since, with other bytes, is never removed).
        Returns False when it is gone or holds other bytes. Stores without tags (``tag``
        None) get an unconditional delete."""
        if tag is None or self.protocol not in S3_PROTOCOLS:
            existed = self.exists(rel)
            self.remove_tree(rel)
            return existed
        bucket, key = self._bucket_key(rel)
        try:
            self.fs.call_s3("delete_object", Bucket=bucket, Key=key, IfMatch=tag)
        except FileNotFoundError:
            return False
        except OSError as exc:  # s3fs: PreconditionFailed is EINVAL
            if exc.errno == errno.EINVAL:
                return False
            raise
        return True

    def abort_uploads(self, rel: str) -> int:
        """Abort unfinished multipart uploads below ``rel`` (pruner only); returns the count."""
        if self.protocol not in S3_PROTOCOLS:
            return 0
        bucket, _, prefix = self._key(rel).partition("/")
        listing = self.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix)
        uploads = listing.get("Uploads") or []
        for upload in uploads:
            self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=upload["Key"],
                            UploadId=upload["UploadId"])
        return len(uploads)
