"""A default process group of one rank in the test's own process, for code that calls collectives on a
one-rank layout: a hash store, so no port and no process. Import the ``world`` fixture into a test module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist


@pytest.fixture(scope="module")
def world() -> Iterator[None]:
    """A default group of one rank in this process, destroyed after the module's tests."""
    if dist.is_initialized():
        pytest.skip("a default process group exists in this process already")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
