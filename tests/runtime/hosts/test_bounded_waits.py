"""Bounded work: a join Ray cannot place fails fast with the reason and the runtime keeps its
workers (the `nereus scale 6` hang on a 4-CPU Ray); a join that cannot start is given up, not waited on;
a call that never answers reaches the driver as ``WaitTimeout`` naming the operation."""

from __future__ import annotations

import json
import threading

import pytest

ray = pytest.importorskip("ray")

from nereus.runtime.hosts.nodes import PlacementError  # noqa: E402
from nereus.runtime.hosts.waits import WaitTimeout, get_within  # noqa: E402

pytestmark = pytest.mark.distributed


@ray.remote(num_cpus=0)
class Stuck:
    """An actor whose ``block`` never returns (it waits on an event nobody sets)."""

    def __init__(self) -> None:
        self.never = threading.Event()

    def pid(self) -> int:
        return 0

    def block(self) -> None:
        self.never.wait()


def _world_works(rt) -> None:
    """A model loads on every worker and its log-probs match the single-process model's: collectives work."""
    import torch

    from nereus.runtime.model.decoder import build_model
    from nereus.spec.layout import Layout
    from tests.runtime.common import GQA

    n = len(rt.workers)
    model = build_model(GQA, seed=1)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    rt.load("bounded/probe", GQA, Layout(dp=n, micro_batch_size=1, recompute="none", sequence_parallel=False),
            state=state)
    try:
        tokens = torch.randint(0, GQA.arch.vocab, (n, 6), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            want = torch.log_softmax(model(tokens), -1)[:, :-1].gather(-1, tokens[:, 1:, None]).squeeze(-1)
        torch.testing.assert_close(rt.logprobs("bounded/probe", tokens), want, rtol=1e-4, atol=2e-5)
    finally:
        rt.release("bounded/probe")


def test_growing_beyond_what_ray_can_place_fails_fast_and_keeps_the_workers(ray_runtime):
    total = int(ray.cluster_resources()["CPU"])
    have = len(ray_runtime.workers)
    with pytest.raises(PlacementError, match=rf"cannot grow to {total + 2} workers: Ray has {total} CPUs and each "
                                             rf"worker needs 1, so at most {total} fit; the run keeps its {have}"):
        ray_runtime.resize(total + 2)
    assert len(ray_runtime.workers) == have and ray_runtime.lost_workers() == []
    _world_works(ray_runtime)


def test_a_join_that_cannot_start_is_given_up(ray_runtime):
    """The cluster has room for 4 workers in all, but a blocker holds the CPU a fourth would take: the new
    actor never starts, the join is abandoned with the reason and the three workers keep working."""
    ray_runtime.resize(3)
    blocker = Stuck.options(num_cpus=1).remote()
    ray.get(blocker.pid.remote())
    saved = ray_runtime.start_timeout_s
    try:
        ray_runtime.start_timeout_s = 2.0  # the new actor can never start here: any deadline is reached
        with pytest.raises(PlacementError, match="1 of 1 new worker.s. did not start within 2 s"):
            ray_runtime.resize(4)
        assert len(ray_runtime.workers) == 3 and ray_runtime.lost_workers() == []
        _world_works(ray_runtime)
    finally:
        ray_runtime.start_timeout_s = saved
        ray.kill(blocker)
        ray_runtime.resize(4)  # the session's runtime, as other tests expect it


def test_a_call_that_never_answers_reaches_the_driver(ray_runtime):
    from nereus.runtime.recovery.failover import Failover

    stuck = Stuck.remote()
    try:
        with pytest.raises(WaitTimeout, match="block: 1 of 1 workers did not answer within 1 s"):
            get_within([stuck.block.remote()], 1.0, "block")
        with pytest.raises(WaitTimeout, match="1 of 1 worker calls did not answer within 1 s"):
            Failover().get([stuck], [stuck.block.remote()], timeout_s=1.0)
    finally:
        ray.kill(stuck)


def test_scale_request_that_cannot_be_placed_is_dropped_and_the_run_continues(ray_runtime, tmp_path):
    """`nereus scale 6` reaches the backend of a run on a 4-CPU Ray: it says why, stays on its workers and
    does not try again at the next step."""
    from nereus.run.backend import RuntimeBackend
    from tests.run.jobs import tiny_job

    job = tiny_job("grpo", str(tmp_path), layouts={}, adapt={"availability": [{"step": 0, "workers": 4}]})
    said: list[str] = []
    backend = RuntimeBackend(job, ray_runtime, {}, None, [], None, said.append)
    backend.scale_file = tmp_path / "scale.json"
    want = int(ray.cluster_resources()["CPU"]) + 2
    backend.scale_file.write_text(json.dumps({"workers": want}))
    assert backend.cluster(0).num_gpus == len(ray_runtime.workers) == 4
    assert any(f"cannot grow to {want} workers" in line for line in said)
    said.clear()
    assert backend.cluster(1).num_gpus == 4 and said == []


def test_scale_beyond_the_runs_ray_is_refused_at_once(tmp_path, capsys):
    """`nereus scale N` reads the CPUs of the run's local Ray (ray_session.json) and refuses a size that
    cannot fit before writing any request."""
    from nereus.cli import main
    from nereus.runtime.hosts.raylocal import SESSION

    (tmp_path / "init").mkdir()
    (tmp_path / SESSION).write_text(json.dumps({"num_cpus": 4}))
    assert main(["scale", "6", "--dir", str(tmp_path)]) == 2
    assert "started a local Ray with 4 CPUs, one per worker: at most 4 workers fit, asked for 6" in \
        capsys.readouterr().err
    assert not (tmp_path / "scale.json").exists()
    assert main(["scale", "4", "--dir", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "scale.json").read_text()) == {"workers": 4}
