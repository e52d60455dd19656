"""``benchmarks/moe_ep.py`` without Ray: the jobs it runs are the example's with only the actor's layouts
changed, accepted as `nereus run` accepts them, and its weight comparison can fail."""

import importlib.util

import torch

from nereus.spec.job import load_job
from tests.conftest import ROOT


def _bench():
    spec = importlib.util.spec_from_file_location("moe_ep", ROOT / "benchmarks" / "moe_ep.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_ep_job_differs_from_the_dp_job_only_in_the_actors_ep(tmp_path):
    bench = _bench()
    data = bench.tiny_checkpoint(tmp_path / "data", "qwen3_moe")
    jobs = {}
    for mode in ("dp", "ep"):
        out = tmp_path / mode / "out"
        out.mkdir(parents=True)
        jobs[mode] = load_job(bench.job_file(data, out, mode, 2))
    dp, ep = (jobs[m].run.layouts for m in ("dp", "ep"))
    assert {k: v.ep for k, v in ep.items()} == {"actor/generation": 1, "actor/inference": 2,
                                                "reference/inference": 1, "actor/training": 2}
    assert all(v.ep == 1 for v in dp.values())
    assert {k: (v.tp, v.pp, v.dp, v.micro_batch_size) for k, v in dp.items()} == {
        k: (v.tp, v.pp, v.dp, v.micro_batch_size) for k, v in ep.items()}
    a = {"w": torch.tensor([1.0, -2.0]), "z": torch.zeros(2)}
    assert bench.rel_diff(a, a) == 0.0
    assert abs(bench.rel_diff({"w": torch.tensor([1.0, -2.1]), "z": torch.zeros(2)}, a) - 0.1 / 2.1) < 1e-6
