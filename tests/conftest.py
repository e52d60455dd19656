import os
from pathlib import Path

import pytest
from hypothesis import settings

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
SHARED_DATA = ROOT.parent / "shared" / "data"

settings.register_profile("ci", deadline=None, max_examples=60)
settings.register_profile("dev", deadline=None, max_examples=30)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


@pytest.fixture
def examples() -> Path:
    return EXAMPLES
