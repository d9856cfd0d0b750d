import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest


@pytest.fixture(scope="session")
def s3_endpoint():
    from tests.helpers.s3 import moto_endpoint

    with moto_endpoint() as endpoint:
        yield endpoint


@pytest.fixture
def s3_root(s3_endpoint) -> str:
    from tests.helpers.s3 import new_bucket

    return f"s3://{new_bucket()}/run"


@pytest.fixture
def no_faults():
    """No injected faults before and after the test (``dist_ckpt.faults`` is process-wide)."""
    from dist_ckpt import faults

    faults.configure(None)
    yield
    faults.configure(None)
