import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nereus.cost.hardware import Hardware
from nereus.cost.memory import layer_activation_bytes
from nereus.cost.stages import generation_cost, inference_cost, training_cost
from nereus.spec import Layout, ModelStage, ResponseLength
from nereus.spec.model import PRESETS, ModelArch
from tests.helpers import gpt_training_job, ppo_job

ACTOR_TRAIN, ACTOR_GEN = ModelStage("actor", "training"), ModelStage("actor", "generation")


def test_korthikanti_activation_formulas_for_gpt():
    """Per-layer activation bytes equal Korthikanti et al. 2022, Table 2, for a 4h GeLU GPT layer."""
    arch = ModelArch(layers=1, hidden=4096, ffn_hidden=16384, heads=32, kv_heads=32, vocab=51200, mlp="gelu")
    s, b, h, a, t = 2048, 1, 4096, 32, 8
    sbh = s * b * h

    def act(**kw):
        return layer_activation_bytes(arch, Layout(**kw), s, b, "standard")

    assert act(tp=1, recompute="none", sequence_parallel=False) == pytest.approx(sbh * (34 + 5 * a * s / h))
    assert act(tp=t, recompute="none", sequence_parallel=False) == pytest.approx(
        sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    assert act(tp=t, recompute="none", sequence_parallel=True) == pytest.approx(sbh / t * (34 + 5 * a * s / h))
    assert act(tp=t, recompute="selective", sequence_parallel=True) == pytest.approx(sbh * 34 / t)
    assert act(tp=t, recompute="full", sequence_parallel=True) == pytest.approx(2 * sbh / t)


def test_generation_time_is_set_by_the_longest_response():
    job = ppo_job(8)
    hw = Hardware(job.cluster)
    layout = Layout(tp=2, dp=4, recompute="none", zero1=False)
    short_tail = generation_cost(hw, job.with_response(ResponseLength(1024, 4096, sigma=0.3)), ACTOR_GEN, layout)
    long_tail = generation_cost(hw, job.with_response(ResponseLength(1024, 16384, sigma=1.2)), ACTOR_GEN, layout)
    # Same mean length, so the same tokens; a longer tail still takes longer.
    assert long_tail.time() > 1.5 * short_tail.time()
    assert long_tail.detail["longest"] > 2 * short_tail.detail["longest"]


def test_pipeline_bubble_and_interleaving():
    job = gpt_training_job(32, 4096, 32, 64, 8)
    hw = Hardware(job.cluster)
    ms = ModelStage("gpt", "training")
    flat = training_cost(hw, job, ms, Layout(tp=1, pp=8, dp=1, recompute="full", sequence_parallel=False,
                                             zero1=False))
    inter = training_cost(hw, job, ms, Layout(tp=1, pp=8, dp=1, interleave=2, recompute="full",
                                              sequence_parallel=False, zero1=False))
    # (p - 1)/m with p = 8 and m = 64; interleaving halves it (Narayanan et al. 2021, Sec. 2.2).
    assert flat.detail["bubble_fraction"] == pytest.approx(7 / 64)
    assert inter.detail["bubble_fraction"] == pytest.approx(7 / 128)
    assert inter.terms["compute"] < flat.terms["compute"]
    assert inter.terms["pp_comm"] > flat.terms["pp_comm"]


def test_recompute_trades_time_for_memory():
    job = gpt_training_job(24, 2304, 24, 64, 8)
    hw = Hardware(job.cluster)
    ms = ModelStage("gpt", "training")
    costs = {rc: training_cost(hw, job, ms, Layout(tp=2, pp=1, dp=4, recompute=rc, sequence_parallel=True,
                                                   zero1=False)) for rc in ("none", "selective", "full")}
    assert costs["none"].time() < costs["selective"].time() < costs["full"].time()
    assert costs["none"].transient_bytes > costs["selective"].transient_bytes > costs["full"].transient_bytes


def test_zero1_shards_optimizer_state_over_dp():
    job = ppo_job(16)
    hw = Hardware(job.cluster)
    plain = training_cost(hw, job, ACTOR_TRAIN, Layout(tp=2, dp=8, zero1=False))
    zero = training_cost(hw, job, ACTOR_TRAIN, Layout(tp=2, dp=8, zero1=True))
    assert zero.memory["optimizer"] == pytest.approx(plain.memory["optimizer"] / 8)
    assert zero.memory["weights"] == plain.memory["weights"]


ARCH = st.sampled_from([PRESETS["llama3-8b"], PRESETS["qwen2.5-7b"], PRESETS["qwen2.5-0.5b"],
                        ModelArch(48, 6144, 24576, 48, 48, 51200, tied_embeddings=True, mlp="gelu")])


def _job_with(arch: ModelArch):
    job = ppo_job(64)
    return job.__class__(**{**job.__dict__, "models": {m: arch for m in job.models}})


@given(arch=ARCH, stage=st.sampled_from(["generation", "inference", "training"]),
       tp=st.sampled_from([1, 2, 4]), pp=st.sampled_from([1, 2, 4]), dp=st.sampled_from([1, 2, 4]),
       mbs=st.sampled_from([1, 2]), recompute=st.sampled_from(["none", "selective", "full"]),
       sp=st.booleans(), grow=st.sampled_from(["tp", "pp"]))
def test_memory_never_increases_when_tp_or_pp_grows(arch, stage, tp, pp, dp, mbs, recompute, sp, grow):
    job = _job_with(arch)
    hw = Hardware(job.cluster)
    ms = ModelStage("actor", stage)
    fn = {"generation": generation_cost, "inference": inference_cost, "training": training_cost}[stage]
    small = Layout(tp=tp, pp=pp, dp=dp, micro_batch_size=mbs, recompute=recompute, sequence_parallel=sp)
    big = Layout(**{**small.to_dict(), grow: 2 * getattr(small, grow)})
    if arch.layers % big.pp or arch.heads % big.tp:  # only even splits of layers and heads are layouts
        return
    a, b = fn(hw, job, ms, small), fn(hw, job, ms, big)
    assert a is not None and b is not None
    assert b.peak_bytes <= a.peak_bytes * (1 + 1e-9) or math.isclose(b.peak_bytes, a.peak_bytes)


def test_generation_refills_slots_instead_of_repeating_waves():
    """More sequences than the engine's slots add bulk steps at the full batch; the drain to the longest
    response is paid once (continuous batching), not once per 'wave' of the batch."""
    hw = Hardware(ppo_job(8).cluster)
    layout = Layout(tp=1, dp=1, recompute="none", zero1=False)
    one = generation_cost(hw, ppo_job(8, prompts_per_step=1024), ACTOR_GEN, layout).decode
    four = generation_cost(hw, ppo_job(8, prompts_per_step=4096), ACTOR_GEN, layout).decode
    assert one.batch == four.batch < 1024  # the KV cache holds fewer sequences than max_num_seqs
    assert four.bulk_s > 3 * one.bulk_s
    assert four.tail_s < 2 * one.tail_s
    assert four.total_s < 4 * one.total_s


def test_estimate_shows_the_decode_regime_and_bulk_and_tail_time():
    from nereus.cost.plan_cost import estimate_plan
    from nereus.planner.explain import estimate_text
    from nereus.planner.search import search

    job = ppo_job(16)
    hw = Hardware(job.cluster)
    plan = search(hw, job).plan
    text = "\n".join(estimate_text(job, estimate_plan(hw, job, plan), {str(p.model_stage): p.gpus
                                                                      for p in plan.placements}))
    decode = [line for line in text.splitlines() if "decode per replica" in line]
    assert len(decode) == 1 and "bound at batch" in decode[0]
    assert "bulk " in decode[0] and "tail " in decode[0]
    cost = estimate_plan(hw, job, plan).costs["actor/generation"]
    assert cost.decode.regime in decode[0] and cost.decode.regime in ("memory", "compute")


def test_every_weight_sync_a_plan_names_is_priced():
    from nereus.cost.verl_weight_sync import SYNC_TIMES
    from nereus.spec.layout import WEIGHT_SYNCS

    assert set(WEIGHT_SYNCS) == {"direct", *SYNC_TIMES}  # "direct": plan_cost.sync_time, Nereus's own


def test_remax_pays_for_a_greedy_response_per_prompt():
    """ReMax's baseline is a second generation pass of one greedy response per drawn prompt: the stage
    costs that pass's own decode on top of the step's (here n = 4, so about a quarter more tokens, plus
    a second drain to the longest response)."""
    from dataclasses import replace

    from nereus.cost.stages import greedy_responses

    job = ppo_job(8)
    job = replace(job, algorithm=replace(job.algorithm, samples_per_prompt=4))
    remax = replace(job, algorithm=replace(job.algorithm, adv_estimator="remax"))
    hw = Hardware(job.cluster)
    layout = Layout(tp=2, dp=4, recompute="none", zero1=False)
    plain, extra = generation_cost(hw, job, ACTOR_GEN, layout), generation_cost(hw, remax, ACTOR_GEN, layout)
    assert greedy_responses(job) == 0 and greedy_responses(remax) == job.workload.prompts_per_step
    assert extra.time() == pytest.approx(plain.time() + extra.detail["greedy_s"], rel=1e-6)
    assert 0.25 * plain.time() < extra.detail["greedy_s"] < plain.time()
