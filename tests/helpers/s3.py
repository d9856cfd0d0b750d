"""A real S3 endpoint for tests and benchmarks: a moto server on 127.0.0.1, in a process of
its own, on a port the kernel chose.

Call order: the parent enters :func:`moto_endpoint` (it sets ``AWS_ENDPOINT_URL`` and test
credentials, which processes started inside inherit), creates buckets with
:func:`new_bucket`, and leaves it to stop the server.
"""

from __future__ import annotations

import importlib.util
import os
import select
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0

# The server binds port 0 and prints the port it got: a port drawn free and handed to
# ``moto_server -p`` is closed until the server binds it, and another listener of a busy suite
# can take it in between (the endpoint would then be someone else's). It runs until its stdin
# closes: when the parent leaves the context, or dies.
_SERVE = """
import sys
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
print(server.get_host_and_port()[1], flush=True)
sys.stdin.read()
server.stop()
"""


def moto_available() -> bool:
    return importlib.util.find_spec("moto") is not None


def _read_port(proc: subprocess.Popen) -> int:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], START_TIMEOUT_S)
    line = proc.stdout.readline() if ready else ""
    if not line.strip().isdigit():
        raise RuntimeError(f"the moto server did not start within {START_TIMEOUT_S:.0f} s "
                           f"(exit code {proc.poll()})")
    return int(line)


@contextmanager
def moto_endpoint() -> Iterator[str]:
    """Yields ``http://127.0.0.1:<port>`` with the environment pointing boto/s3fs at it."""
    proc = subprocess.Popen([sys.executable, "-c", _SERVE], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        endpoint = f"http://127.0.0.1:{_read_port(proc)}"
        with mock.patch.dict(os.environ, {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
                                          "AWS_SECRET_ACCESS_KEY": "testing",
                                          "AWS_DEFAULT_REGION": "us-east-1"}):
            yield endpoint
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=STOP_TIMEOUT_S)


def new_bucket(prefix: str = "ckpt") -> str:
    import fsspec

    name = f"{prefix}-{uuid.uuid4().hex[:10]}"
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    fs.mkdir(name)
    return name
