"""One fault test, two kinds of root: a local directory and an ``s3://`` prefix (moto).

``TwoGenRoot`` holds gen-1 and gen-2 of the tiny job in ``local_jobs`` (``latest.json`` ->
gen-2) and offers what a fault test does to a root, the same way on both kinds: damage or
remove a listed file of a generation, list what was moved aside. The ``two_gen_root``
fixture (tests/conftest.py) gives one of each kind.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass

from dist_ckpt.format.manifest import MANIFEST_NAME, REJECTED_DIR, Manifest, generation_name
from dist_ckpt.storage.base import Store, open_store
from dist_ckpt.storage.objectstore import ObjectStore
from tests.helpers.local_jobs import two_generations

GEN1, GEN2 = generation_name(1), generation_name(2)


@dataclass
class TwoGenRoot:
    kind: str  # "local" or "s3"
    url: str
    store: Store

    def object(self, generation: str, rel: str) -> str:
        """Where a file of ``generation`` lies below the root (an object store keeps the files
        of a generation inside its attempt's prefix)."""
        if rel == MANIFEST_NAME:
            return f"{generation}/{rel}"
        manifest = Manifest.from_bytes(self.store.read_bytes(f"{generation}/{MANIFEST_NAME}"),
                                       generation=generation)
        return f"{generation}/{manifest.location(rel)}"

    def damage(self, generation: str, rel: str, how: str) -> None:
        """``truncate`` to half, or ``bitflip`` one byte in the middle."""
        where = self.object(generation, rel)
        data = bytearray(self.store.read_bytes(where))
        if how == "truncate":
            data = data[: len(data) // 2]
        else:
            data[len(data) // 2] ^= 0x01
        self.store.put_bytes(where, bytes(data))

    def remove(self, generation: str, rel: str) -> None:
        self.store.remove_tree(self.object(generation, rel))

    def rejected_entries(self) -> list[str]:
        return self.store.listdir(REJECTED_DIR) if self.store.exists(REJECTED_DIR) else []


_S3_TEMPLATES: dict[str, ObjectStore] = {}  # endpoint -> a root holding the two generations


def make_two_gen_root(kind: str, local_dir: str) -> TwoGenRoot:
    """gen-1 and gen-2 under a fresh root of ``kind``: ``local_dir``, or (s3) a new bucket on
    the endpoint the environment names, filled by a server-side copy of a template root that
    this process saved once on that endpoint (a save against moto costs far more than a copy;
    the bytes are the same)."""
    if kind != "s3":
        two_generations(local_dir)
        return TwoGenRoot(kind, local_dir, open_store(local_dir))
    from tests.helpers.s3 import new_bucket

    endpoint = os.environ.get("AWS_ENDPOINT_URL", "")
    if endpoint not in _S3_TEMPLATES:
        template = ObjectStore(f"s3://{new_bucket()}/template")
        two_generations(template.root)
        _S3_TEMPLATES[endpoint] = template
    source = _S3_TEMPLATES[endpoint]  # its client is set up already: one copy request per object
    bucket = f"ckpt-{uuid.uuid4().hex[:10]}"
    source.fs.mkdir(bucket)
    names = source.find("")
    source.fs.copy([f"{source.base}/{n}" for n in names], [f"{bucket}/run/{n}" for n in names])
    url = f"s3://{bucket}/run"
    return TwoGenRoot(kind, url, ObjectStore(url))
