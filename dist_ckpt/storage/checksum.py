"""Transport checksums of object uploads: the ``x-amz-checksum-*`` value sent with each body.

A store that verifies them (AWS S3, MinIO) refuses a body that differs from its checksum with
``400 BadDigest``, and reports the stored value on a HEAD with ``ChecksumMode=ENABLED``. They
prove that the bytes sent arrived; the manifest's digest stays the integrity record of a file.

CRC32C comes from the ``crc32c`` package (hardware accelerated, several times SHA256's rate,
and it releases the GIL); without it, SHA256 from hashlib (it releases the GIL too; rates:
docs/performance.md). A multipart upload sends one checksum per part; the object's is then S3's composite:
the checksum of the concatenated raw part checksums, suffixed ``-<number of parts>``.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Callable

try:
    import crc32c as _crc32c
except ImportError:  # the s3 extra pins it; a bare install still verifies, more slowly
    _crc32c = None


def _crc32c_raw(data: bytes | memoryview) -> bytes:
    assert _crc32c is not None
    return _crc32c.crc32c(data).to_bytes(4, "big")


def _sha256_raw(data: bytes | memoryview) -> bytes:
    return hashlib.sha256(data).digest()


_RAW: dict[str, Callable[[bytes | memoryview], bytes]] = {"CRC32C": _crc32c_raw, "SHA256": _sha256_raw}


def default_algorithm() -> str:
    """S3's name of the checksum sent with uploads: ``CRC32C`` where the fast implementation
    is installed, else ``SHA256``."""
    return "CRC32C" if _crc32c is not None else "SHA256"


def raw_checksum(data: bytes | memoryview, algorithm: str) -> bytes:
    try:
        return _RAW[algorithm](data)
    except KeyError:
        raise ValueError(f"unknown transport checksum {algorithm!r} (known: {', '.join(_RAW)})") from None


def encode(raw: bytes) -> str:
    """The base64 form S3 headers and responses carry."""
    return base64.b64encode(raw).decode("ascii")


def composite(part_checksums: list[bytes], algorithm: str) -> str:
    """The checksum S3 reports for a multipart upload of these parts (``COMPOSITE`` type)."""
    return f"{encode(raw_checksum(b''.join(part_checksums), algorithm))}-{len(part_checksums)}"


def matches(stored: str, sent: str) -> bool:
    """Whether a reported checksum is the one sent. For a multipart upload some stores report
    the composite without its ``-<parts>`` suffix on HEAD (moto; AWS adds it), so the bare
    value matches too (base64 has no ``-``)."""
    return stored == sent or ("-" in sent and stored == sent.rsplit("-", 1)[0])


def request_fields(algorithm: str, value: str) -> dict[str, str]:
    """PutObject / UploadPart parameters that send ``value`` (botocore then computes none of its
    own, and sends it as a header)."""
    return {"ChecksumAlgorithm": algorithm, f"Checksum{algorithm}": value}


def reported(response: dict, algorithm: str) -> str | None:
    """The checksum a HeadObject response (``ChecksumMode=ENABLED``) reports, if any."""
    value = response.get(f"Checksum{algorithm}")
    return str(value) if value else None
