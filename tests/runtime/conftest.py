import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def ray_runtime():
    """One local Ray instance and one 4-worker runtime for the whole session."""
    ray = pytest.importorskip("ray")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    from nereus.runtime.workers import Runtime

    (ROOT / ".tmp").mkdir(exist_ok=True)
    runtime = Runtime(4, temp_dir=ROOT / ".tmp" / "ray", timeout_s=60)
    yield runtime
    runtime.shutdown()
    ray.shutdown()
