"""The layout checks on CUDA devices with NCCL (``launch.run_world`` picks them when CUDA is present)."""

import pytest
import torch

from nereus.runtime.cluster.launch import run_world
from tests.runtime.common import GQA, MQA, all_layouts
from tests.runtime.parallel.test_layouts import check_layout

pytestmark = [pytest.mark.gpu, pytest.mark.distributed,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA devices")]


def _body(rank: int, world: int) -> None:
    assert torch.distributed.get_backend() == "nccl"
    for layout in all_layouts(world):
        check_layout(MQA, layout)
        if layout.tp != 3:
            check_layout(GQA, layout)


def test_every_layout_on_gpus_with_nccl():
    run_world(_body, min(4, torch.cuda.device_count()), timeout_s=120)
