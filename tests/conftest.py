import os
import threading
from pathlib import Path

import pytest
from hypothesis import settings

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
# internal-error tracebacks of the suite (nereus.cli.traceback_folder) stay in the checkout, not ~/.cache
os.environ.setdefault("NEREUS_CACHE_DIR", str(ROOT / ".tmp" / "nereus-cache"))


@pytest.fixture(scope="session")
def ray_runtime():
    """One local Ray instance and one 4-worker runtime for the whole session (runtime and RL tests)."""
    ray = pytest.importorskip("ray")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    from nereus.runtime.cluster.workers import Runtime

    if ray.is_initialized():  # Runtime would join that Ray, started without the local instance's settings
        pytest.fail("Ray was started before the session's runtime: a test that calls Ray needs `ray_runtime`")

    (ROOT / ".tmp").mkdir(exist_ok=True)
    # a temp folder of its own: the benchmarks' smoke tests run beside it on ``.tmp/ray`` (``beside_ray``),
    # and each Ray worker makes its instance's temp folder world-writable as it starts (``make_private``)
    runtime = Runtime(4, temp_dir=ROOT / ".tmp" / "ray-session", timeout_s=60)
    yield runtime
    runtime.shutdown()
    ray.shutdown()


def _uses_session_ray(item: pytest.Item) -> bool:
    return "ray_runtime" in getattr(item, "fixturenames", ())


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The fast tier (``make test-fast``: ``-m "not slow"``) leaves out every test that starts processes:
    those marked ``distributed`` and those that use the session's Ray runtime are ``slow`` too.

    Every slow test that starts processes (one not marked ``rayless`` may start or use a local Ray
    instance; one marked ``distributed`` runs a gloo world) joins one pytest-xdist group (``--dist
    loadgroup``), so they run one at a time in one worker while the single-process tests run beside them
    in the other: a second local Ray instance (a child driver's, a benchmark's, a test cluster's) started
    next to another is slow to come up on a busy machine (its raylet missed Ray's 30 s registration wait; a
    clean-exit driver took 2.5x as long), and process groups that exchange many messages slow down most
    beside other processes. In that group the tests that use the session's Ray run last, in their usual
    order, so no other instance starts beside it; the vLLM tests first among them (``vllm``): each engine
    is a process that imports vLLM (10–30 s of CPU), and they slowed most (65 s alone, 120–196 s busy)
    where the other worker ran gloo worlds or a Ray instance of its own, which it does later.

    The gloo worlds that start no Ray (``distributed`` and ``rayless``) join a second group: they run one
    at a time too, in the other worker, after its single-process tests (``QUEUE_RANK``). Serial with
    the Ray tests they made that group the suite's whole length (about 800 of 825 s, the other worker idle
    after 280 s); a Ray test mostly waits on start-up and messages, so a gloo world beside it slows it
    less than the queue did.

    A test marked ``beside_ray`` (it starts its own Ray instance in a child process and checks only that
    instance) joins a third group, queued last: the other worker takes it once its gloo worlds are done,
    while the Ray group runs the tests on the session's Ray. Left in the Ray group, the benchmark smoke
    test so marked kept the other worker idle for a third of the suite."""
    grouped = config.pluginmanager.hasplugin("xdist")  # its marker exists only where it is loaded
    groups: dict[str, str] = {}  # nodeid -> its xdist group
    for item in items:
        distributed, rayless = item.get_closest_marker("distributed"), item.get_closest_marker("rayless")
        if distributed or _uses_session_ray(item):
            item.add_marker(pytest.mark.slow)
        if not grouped or not item.get_closest_marker("slow"):
            continue
        if distributed and rayless:
            groups[item.nodeid] = "gloo"
        elif item.get_closest_marker("beside_ray"):
            groups[item.nodeid] = "ray-beside"
        elif distributed or not rayless:
            groups[item.nodeid] = "ray"
        if item.nodeid in groups:
            item.add_marker(pytest.mark.xdist_group(groups[item.nodeid]))
    # stable: each group keeps its order, but for the vLLM tests, first on the session's Ray
    items[:] = sorted(items, key=lambda item: (QUEUE_RANK[groups.get(item.nodeid)], _uses_session_ray(item),
                                               item.get_closest_marker("vllm") is None))


# Where a test goes in pytest-xdist's queue (``pytest_configure`` keeps the collection's order), by its
# group: the Ray group first (it is the suite's length; the tests that use the session's Ray last within
# it), then the single-process tests, then the gloo worlds. The other worker takes the single-process tests
# while the Ray group starts its own instances, and the gloo worlds once they are done: a test starting a
# Ray instance slowed most beside a 4-rank gloo world (the recovery benchmark's smoke test 54 s alone,
# 152 s there on a busy host), less beside one single-process test. Last, the tests that start their own
# Ray beside the session's (``beside_ray``): the other worker's share of the Ray group's length.
QUEUE_RANK = {"ray": 0, None: 1, "gloo": 2, "ray-beside": 3}


RAY_DAEMONS = ("raylet", "gcs_server")  # what every local Ray instance starts (``/proc/<pid>/stat``'s name)


def _ray_daemons_below(root: int) -> list[int]:
    """Pids of the Ray daemons whose parent chain reaches process ``root`` (Linux ``/proc``)."""
    parents, daemons = {}, []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # ended meanwhile
            continue
        name, rest = stat[stat.index("(") + 1: stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        parents[int(entry.name)] = int(rest[1])  # "pid (name) state ppid ...": a name may hold spaces
        if name in RAY_DAEMONS:
            daemons.append(int(entry.name))
    found = []
    for pid in daemons:
        ancestor = parents.get(pid, 0)
        while ancestor > 1 and ancestor != root:
            ancestor = parents.get(ancestor, 0)
        if ancestor == root:
            found.append(pid)
    return found


@pytest.fixture(autouse=True)
def _rayless_starts_no_ray(request: pytest.FixtureRequest):
    """A test marked ``rayless`` fails if a Ray instance starts below this process while it runs (looked
    for every half second and at its end): the mark lets it run beside the Ray tests, so it must hold."""
    if request.node.get_closest_marker("rayless") is None or not Path("/proc/self/stat").exists():
        yield
        return
    # daemons already running (the session's Ray, when one process runs every test) are not this test's
    before = set(_ray_daemons_below(os.getpid()))
    seen: set[int] = set()
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.5):
            seen.update(_ray_daemons_below(os.getpid()))

    watcher = threading.Thread(target=watch, name="rayless-watch", daemon=True)
    watcher.start()
    yield
    done.set()
    watcher.join()
    seen.update(_ray_daemons_below(os.getpid()))
    seen -= before
    if seen:
        pytest.fail(f"{request.node.nodeid} is marked rayless but started Ray (daemon pids {sorted(seen)}): "
                    "drop its rayless mark")


# pytest 9.2 ignores how pytest-xdist 3.8 marks a grouped test (pytest-xdist issue 1386): the Ray tests
# would silently spread over both workers, so such a pair is refused (pyproject.toml's dev extra pins pytest)
LOADGROUP_BROKEN_FROM = (9, 2)
LOADGROUP_BROKEN = ("pytest-xdist's --dist loadgroup does not group tests on pytest >= 9.2 (pytest-xdist issue "
                    "1386): install the dev extra's pytest (pip install 'pytest<9.2')")


def pytest_configure(config: pytest.Config) -> None:
    release = tuple(int(p) for p in pytest.__version__.split(".")[:2])
    if config.getoption("dist", "no") != "loadgroup":
        return
    if release >= LOADGROUP_BROKEN_FROM:
        raise pytest.UsageError(LOADGROUP_BROKEN)
    config.option.loadscopereorder = False  # groups in the order ``QUEUE_RANK`` gives, not by size


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    """A pytest-xdist worker under ``--dist loadgroup`` checks that the Ray group holds (a grouped test's
    id carries its group), whatever the versions."""
    if getattr(session.config.option, "loadgroup", False) and any(
            item.get_closest_marker("xdist_group") and "@" not in item.nodeid for item in session.items):
        raise pytest.UsageError(LOADGROUP_BROKEN)


settings.register_profile("ci", deadline=None, max_examples=60)
settings.register_profile("dev", deadline=None, max_examples=30)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


@pytest.fixture
def examples() -> Path:
    return EXAMPLES
