"""Suite-wide fixtures and the suite's own rules (docs/testing.md).

- Every test gets a shared-memory base of its own (``DIST_CKPT_SHM_DIR``, a fresh directory
  in ``/dev/shm``), so memory-tier runs of tests side by side, of two xdist workers or of two
  copies of the suite, never share a run directory.
- Tests that start processes carry the ``processes`` marker; ``scripts/test.sh --quick``
  deselects them. They run first, so that the single-process tests fill the workers' gaps at
  the end instead of one long test starting last.
- A test whose setup, call and teardown together take longer than ``LONG_TEST_S`` fails the
  session unless it is marked ``@pytest.mark.long(reason=...)``.
- ``launcher`` tests hold one of ``LAUNCHER_SLOTS`` machine-wide slots while they run, so two
  copies of the suite side by side never run more of them at once than one suite does.
- Every test's CPU (its worker's and every process it started, ``tests/helpers/cpu.py``) goes
  into its report as the ``cpu_s`` property; the session ends with the CPU of each module.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import fcntl  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
from collections import defaultdict  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from contextlib import contextmanager  # noqa: E402

import pytest  # noqa: E402

LONG_TEST_S = 60.0
# the launcher tests whose workers start as fresh interpreters (docs/testing.md names them)
FULL_CHAIN_MAX = 6
SHM_BASE = "/dev/shm"
# fixtures that start a server process (moto_server, a FUSE filesystem): their tests are
# ``processes`` tests without saying so
SERVER_FIXTURES = frozenset({"s3_endpoint", "s3_root", "require_fuse"})
# launcher tests run at most this many at a time on the machine, whatever number of suites
# runs (scripts/test.sh gives their session as many workers): each is a CPU-bound chain of
# fresh interpreters, and more side by side only stretch every one
LAUNCHER_SLOTS = 2
LAUNCHER_SLOT_PATH = os.path.join(tempfile.gettempdir(), "dist_ckpt-tests-launcher-slot-{}.lock")
CPU_PROPERTY = "cpu_s"
MODULES_SHOWN = 10
_elapsed: dict[str, float] = defaultdict(float)
_module_cpu: dict[str, float] = defaultdict(float)
_cpu_before: dict[str, dict[int, float]] = {}
_long_allowed: set[str] = set()


def pytest_configure(config: pytest.Config) -> None:
    from tests.helpers.launchlib import REFERENCES_ENV

    # one directory of uninterrupted runs for the session (its xdist workers inherit it), unless
    # the caller shares one (scripts/test.sh, between its two sessions)
    if not hasattr(config, "workerinput") and not os.environ.get(REFERENCES_ENV):
        os.environ[REFERENCES_ENV] = tempfile.mkdtemp(prefix="dist_ckpt-references-")
        config.add_cleanup(lambda: shutil.rmtree(os.environ.pop(REFERENCES_ENV), ignore_errors=True))
    config.addinivalue_line("markers", "processes: starts processes (ranks, torchrun, interpreters); "
                                       "deselected by scripts/test.sh --quick")
    config.addinivalue_line("markers", "launcher: runs jobs under python -m launch or torchrun (implies "
                                       "processes); scripts/test.sh runs these in a session of their own")
    config.addinivalue_line("markers", "full_chain(reason): a launcher test whose workers start as fresh "
                                       "interpreters, as the product starts them (the others fork them); "
                                       "the reason names the path only that chain can break")
    config.addinivalue_line("markers", f"long(reason): may take longer than {LONG_TEST_S:.0f} s; "
                                       "the reason says why")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    full_chain: list[str] = []
    for item in items:
        for name in ("long", "full_chain"):
            marker = item.get_closest_marker(name)
            if marker is not None and not (marker.kwargs.get("reason") or marker.args):
                raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.{name} needs reason=")
        if item.get_closest_marker("full_chain") is not None:
            full_chain.append(item.nodeid)
        if SERVER_FIXTURES.intersection(getattr(item, "fixturenames", ())) or item.get_closest_marker(
                "launcher") is not None:
            item.add_marker(pytest.mark.processes)
    if len(full_chain) > FULL_CHAIN_MAX:
        raise pytest.UsageError(f"{len(full_chain)} full_chain tests, at most {FULL_CHAIN_MAX} "
                                f"(docs/testing.md): {full_chain}")
    # processes first, and among them the long ones: a worker that takes an 80 s test at the
    # start of the session is free again long before the end (stable inside each group)
    items.sort(key=lambda item: (item.get_closest_marker("processes") is None,
                                 item.get_closest_marker("long") is None))


@contextmanager
def _launcher_slot(config: pytest.Config) -> Iterator[None]:
    """Hold this worker's machine-wide launcher slot (an flock, released if the holder dies):
    the workers of one suite own distinct slots, so only another suite's launcher test waits."""
    worker = getattr(config, "workerinput", {}).get("workerid", "gw0")
    slot = int(worker.removeprefix("gw") or 0) % LAUNCHER_SLOTS
    with open(LAUNCHER_SLOT_PATH.format(slot), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # blocks while another suite's test holds it
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Around setup, call and teardown, so that waiting for a slot is not the test's time."""
    if item.get_closest_marker("launcher") is None:
        yield
        return
    with _launcher_slot(item.config):
        yield


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    from tests.helpers.cpu import tree_cpu

    _cpu_before[item.nodeid] = tree_cpu()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    before = _cpu_before.pop(item.nodeid, None) if call.when == "teardown" else None
    if before is not None:
        from tests.helpers.cpu import spent, tree_cpu

        outcome.get_result().user_properties.append((CPU_PROPERTY, round(spent(before, tree_cpu()), 2)))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _elapsed[report.nodeid] += report.duration
    for name, value in report.user_properties:
        if name == CPU_PROPERTY:
            _module_cpu[report.nodeid.split("::")[0]] += float(value)
    if "long" in report.keywords:
        _long_allowed.add(report.nodeid)


def _too_long() -> list[tuple[str, float]]:
    return sorted(((nodeid, seconds) for nodeid, seconds in _elapsed.items()
                   if seconds > LONG_TEST_S and nodeid not in _long_allowed),
                  key=lambda pair: -pair[1])


def pytest_terminal_summary(terminalreporter) -> None:
    if _module_cpu:
        costliest = sorted(_module_cpu.items(), key=lambda pair: -pair[1])[:MODULES_SHOWN]
        terminalreporter.write_sep("=", f"CPU of the tests: {sum(_module_cpu.values()):.0f} s in all; "
                                        f"the {len(costliest)} costliest modules")
        for module, seconds in costliest:
            terminalreporter.write_line(f"{seconds:8.1f} s  {module}")
    for nodeid, seconds in _too_long():
        terminalreporter.write_line(f"TOO LONG: {nodeid} took {seconds:.1f} s (limit {LONG_TEST_S:.0f} s; "
                                    "make it shorter or mark it @pytest.mark.long(reason=...))", red=True)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if hasattr(session.config, "workerinput"):
        return  # an xdist worker: its controller sees every report and decides
    if _too_long() and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(autouse=True)
def own_shared_memory():
    """A fresh shared-memory base for the test and everything it starts (inherited through
    the environment), removed afterwards. A private MonkeyPatch, not the test's: an autouse
    fixture is torn down after the test's ``monkeypatch`` has undone what the test patched
    (``os.open``, say), which the removal needs."""
    from dist_ckpt.memory import paths as shm

    base = SHM_BASE if os.path.isdir(SHM_BASE) else None
    directory = tempfile.mkdtemp(prefix="dist_ckpt_tests-", dir=base)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(shm.SHM_DIR_ENV, directory)
        yield directory
    shutil.rmtree(directory)


@pytest.fixture(autouse=True)
def worker_start(request: pytest.FixtureRequest):
    """Launched workers start as fresh interpreters in ``full_chain`` tests, forked from their
    agent in the others (tests/helpers/launchlib.py), unless the run's environment chose."""
    from tests.helpers.launchlib import WORKER_START_ENV

    if request.node.get_closest_marker("full_chain") is None or WORKER_START_ENV in os.environ:
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(WORKER_START_ENV, "fresh")
        yield


@pytest.fixture(scope="session")
def s3_endpoint():
    from tests.helpers.s3 import moto_endpoint

    with moto_endpoint() as endpoint:
        yield endpoint


@pytest.fixture
def s3_root(s3_endpoint) -> str:
    from tests.helpers.s3 import new_bucket

    return f"s3://{new_bucket()}/run"


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.processes)])
def two_gen_root(request: pytest.FixtureRequest, tmp_path):
    """gen-1 and gen-2 of the tiny job under a local root, then under an ``s3://`` root (the
    session's moto server): fault tests that take it run against both kinds of root."""
    from tests.helpers.roots import make_two_gen_root

    if request.param == "s3":
        request.getfixturevalue("s3_endpoint")
    return make_two_gen_root(request.param, str(tmp_path / "root"))


@pytest.fixture
def no_faults():
    """No injected faults before and after the test (``dist_ckpt.faults`` is process-wide)."""
    from dist_ckpt import faults

    faults.configure(None)
    yield
    faults.configure(None)
