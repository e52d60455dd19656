"""Ring collectives' latency follows NCCL's own model: only the steps that cross a node boundary pay the
network's latency (``Hardware.ring_latency``, NVIDIA/nccl src/graph/tuning.cc), checked against the step
counts worked out by hand for rings inside a node, over two nodes and over one rank a node."""

import pytest

from nereus.cost.hardware import Hardware
from nereus.spec.cluster import ClusterSpec, gpu_presets


def hardware(nodes: int = 4, per_node: int = 8) -> Hardware:
    return Hardware(ClusterSpec(gpu=gpu_presets()["H100"], nodes=nodes, gpus_per_node=per_node))


def test_a_ring_inside_a_node_pays_nvlink_latency_on_every_step():
    hw = hardware()
    intra = hw.priors.intra_latency_s
    assert hw.all_reduce_time(0.0, 8) == pytest.approx(14 * intra)  # 2(n-1) steps
    assert hw.all_gather_time(0.0, 8) == pytest.approx(7 * intra)  # n-1 steps


def test_a_ring_over_two_nodes_crosses_them_twice_in_an_all_reduce_and_once_in_an_all_gather():
    hw = hardware()
    intra, inter = hw.priors.intra_latency_s, hw.priors.inter_latency_s
    assert hw.nodes_spanned(16, 1) == 2
    assert hw.all_reduce_time(0.0, 16) == pytest.approx(28 * intra + 2 * inter)  # 30 steps, 2(k-1) cross
    assert hw.all_gather_time(0.0, 16) == pytest.approx(14 * intra + 1 * inter)  # 15 steps, k-1 cross


def test_one_rank_a_node_crosses_on_every_step():
    hw = hardware()
    inter = hw.priors.inter_latency_s
    assert hw.nodes_spanned(4, 8) == 4
    assert hw.all_reduce_time(0.0, 4, stride=8) == pytest.approx(6 * inter)
    assert hw.all_gather_time(0.0, 4, stride=8) == pytest.approx(3 * inter)


def test_bytes_still_travel_at_the_group_bandwidth():
    hw = hardware()
    nbytes = 1e9
    bw = hw.group_bandwidth(16, 1)
    assert hw.all_reduce_time(nbytes, 16) - hw.all_reduce_time(0.0, 16) == pytest.approx(2 * 15 / 16 * nbytes / bw)
