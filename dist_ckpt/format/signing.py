"""Keyed manifest signatures: what makes a manifest trustworthy, not merely consistent.

A sha256 in a manifest proves a file matches that manifest, and nothing more: anyone who
can write the root can write a matching manifest. With a key the job holds (``hmac_key`` in
the config, or ``DIST_CKPT_HMAC_KEY``), the committing rank writes ``manifest.sig`` (HMAC-
SHA256 over the exact manifest bytes) next to the attempt's files *before* the manifest, so
the manifest stays the commit point; readers holding the key reject a generation whose
signature is missing or wrong before they trust any digest in it (and before DCP unpickles
``.metadata``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os

from ..errors import SignatureError

SIGNATURE_NAME = "manifest.sig"
KEY_ENV = "DIST_CKPT_HMAC_KEY"
MAX_SIGNATURE_BYTES = 4096


def key_id(key: bytes) -> str:
    """A short public fingerprint of the key, so a reader can say which key signed."""
    return hashlib.sha256(b"dist_ckpt key id\0" + key).hexdigest()[:16]


def sign(key: bytes, manifest_raw: bytes) -> bytes:
    mac = hmac.new(key, manifest_raw, hashlib.sha256).hexdigest()
    return json.dumps({"alg": "hmac-sha256", "key_id": key_id(key), "mac": mac}).encode()


def verify(key: bytes, manifest_raw: bytes, signature_raw: bytes | None, *, generation: str) -> None:
    """Raise ``SignatureError`` unless ``signature_raw`` signs ``manifest_raw`` under ``key``."""
    if signature_raw is None:
        raise SignatureError(f"{generation} is not signed and a signing key is configured",
                              generation=generation, path=SIGNATURE_NAME)
    try:
        if not isinstance(signature_raw, bytes | bytearray) or len(signature_raw) > MAX_SIGNATURE_BYTES:
            raise ValueError("oversized")
        record = json.loads(signature_raw)  # non-UTF-8 bytes: UnicodeDecodeError, a ValueError
        if not isinstance(record, dict):
            raise TypeError("not a JSON object")
        alg, mac, signer = record["alg"], record["mac"], record.get("key_id", "?")
        if not isinstance(alg, str) or not isinstance(mac, str) or not isinstance(signer, str):
            raise TypeError("alg, mac and key_id are not strings")
        if len(mac) != 64 or not all(c in "0123456789abcdef" for c in mac):
            raise ValueError("the mac is not 64 lowercase hex digits")
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        # RecursionError: deeply nested JSON (json.loads recurses once per level)
        raise SignatureError(f"{generation}: {SIGNATURE_NAME} is unreadable",
                              generation=generation, path=SIGNATURE_NAME) from exc
    if alg != "hmac-sha256":
        raise SignatureError(f"{generation}: unsupported signature algorithm {alg[:40]!r}",
                              generation=generation, path=SIGNATURE_NAME)
    expected = hmac.new(key, manifest_raw, hashlib.sha256).hexdigest()
    if not hmac.compare_digest(expected.encode("ascii"), mac.encode("ascii")):
        why = "signed with another key" if signer != key_id(key) else "manifest changed after signing"
        raise SignatureError(f"{generation}: manifest signature does not verify ({why})",
                              generation=generation, path=SIGNATURE_NAME)


def key_from_env() -> bytes | None:
    value = os.environ.get(KEY_ENV)
    return value.encode("utf-8") if value else None
