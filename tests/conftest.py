import os
import re
from functools import cache
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
    runtime = Runtime(4, temp_dir=ROOT / ".tmp" / "ray", timeout_s=60)
    yield runtime
    runtime.shutdown()
    ray.shutdown()


def _uses_session_ray(item: pytest.Item) -> bool:
    return "ray_runtime" in getattr(item, "fixturenames", ())


# what a test module names when one of its tests may start Ray: the session's runtime, a job or a runtime
# of its own, a child process (a driver, a benchmark, the CLI), a test cluster
STARTS_RAY = re.compile(r"\bray\b|ray_runtime|subprocess|RLJob|Runtime\(|start_local_cluster|main\(\[")


@cache
def _module_may_start_ray(path: str) -> bool:
    return bool(STARTS_RAY.search(Path(path).read_text()))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The fast tier (``make test-fast``: ``-m "not slow"``) leaves out every test that starts processes:
    those marked ``distributed`` and those that use the session's Ray runtime are ``slow`` too.

    One local Ray at a time: a second local Ray instance (a child driver's, a benchmark's, a test
    cluster's) started next to another is slow to come up on a busy machine (its raylet missed Ray's 30 s
    registration wait; a clean-exit driver took 2.5x as long). So every slow test of a module that may start
    Ray is marked ``ray_lane``: ``make test`` runs those in one pytest process, one after another, the tests
    that use the session's Ray last in their usual order, and every other test in a second pytest process
    beside it (``-m "not ray_lane"``)."""
    for item in items:
        if item.get_closest_marker("distributed") or _uses_session_ray(item):
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("slow") and _module_may_start_ray(str(item.path)):
            item.add_marker(pytest.mark.ray_lane)
    items[:] = sorted(items, key=_uses_session_ray)  # stable: each group keeps its order


settings.register_profile("ci", deadline=None, max_examples=60)
settings.register_profile("dev", deadline=None, max_examples=30)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


@pytest.fixture
def examples() -> Path:
    return EXAMPLES
