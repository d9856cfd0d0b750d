"""A real S3 endpoint for tests: moto_server on 127.0.0.1 with a free port."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

from dist_ckpt.testing import free_port


@contextmanager
def moto_endpoint() -> Iterator[str]:
    port = free_port()
    server = os.path.join(os.path.dirname(sys.executable), "moto_server")
    proc = subprocess.Popen([server, "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    try:
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("moto_server did not start") from None
                time.sleep(0.05)  # polling a port that is coming up, bounded by the deadline
        with mock.patch.dict(os.environ, {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
                                          "AWS_SECRET_ACCESS_KEY": "testing",
                                          "AWS_DEFAULT_REGION": "us-east-1"}):
            yield endpoint
    finally:
        proc.terminate()
        proc.wait(timeout=10)



def new_bucket() -> str:
    import fsspec

    name = f"ckpt-{uuid.uuid4().hex[:10]}"
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    fs.mkdir(name)
    return name
