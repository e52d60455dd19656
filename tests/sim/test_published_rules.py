"""Framework rules of the published-runs schema (``nereus.sim.published_frameworks``): what an OpenRLHF or
DeepSpeed-Chat row leaves unsaid (GPU groups, reward model, padding, the Hybrid Engine, generate calls,
offload) follows one stated rule per framework; the rows are priced, with finite predictions."""

from __future__ import annotations

import math

import pytest

from nereus.sim.published_predict import predict
from nereus.sim.published_runs import (
    TRAIN_BUDGET_PER_TOKEN_CAP,
    RowSkipped,
    balanced_micro_batch,
    published_run,
)
from tests.helpers import published_rows as rows


def test_openrlhf_places_each_model_on_its_own_gpus_by_its_scripts_split() -> None:
    run = published_run(rows()["openrlhf_7B"])  # 16 GPUs, pools empty
    gpus = {str(p.model_stage): set(p.gpus) for p in run.plan.placements}
    sizes = {ms: len(g) for ms, g in gpus.items()}
    assert sizes == {"actor/generation": 4, "actor/inference": 4, "actor/training": 4, "critic/inference": 4,
                     "critic/training": 4, "reference/inference": 2, "reward/inference": 2}  # 2:2:2:1:1
    groups = [gpus["actor/generation"], gpus["actor/training"], gpus["critic/training"],
              gpus["reference/inference"], gpus["reward/inference"]]
    assert sum(len(g) for g in groups) == 16 and len(set().union(*groups)) == 16  # disjoint
    assert run.plan.strategy == "disaggregated" and run.plan.weight_sync == "gather-broadcast"
    opts = run.job.options
    assert "reward" in run.job.models and opts.padded_batches and opts.rollout_engine == "vllm"
    engines = run.plan.placement("actor/generation").layout.dp
    assert opts.rollout_call_sequences == 16 * max(1, 4 // engines)  # 16 prompts a call per actor rank
    assert opts.offload == "optimizer" and run.job.algorithm.mini_batches == 1024 // 128
    gen_tp = {run_id: published_run(rows()[run_id]).plan.placement("actor/generation").layout.tp
              for run_id in ("openrlhf_7B", "openrlhf_13B", "openrlhf_70B")}
    assert gen_tp == {"openrlhf_7B": 1, "openrlhf_13B": 1, "openrlhf_70B": 2}  # the scripts' vLLM TP (default 1)
    run13 = published_run(rows()["openrlhf_13B"])  # its script at the table's commit: train_ppo_llama_ray_slurm.sh
    engines = run13.plan.placement("actor/generation").layout.dp
    actor_ranks = run13.plan.placement("actor/training").layout.dp
    assert run13.job.options.rollout_call_sequences == 8 * max(1, actor_ranks // engines)  # 8 prompts a call


def test_a_verl_row_without_pool_sizes_is_still_skipped() -> None:
    row = {**rows()["verl_oso_2"], "gen_gpus": "", "train_gpus": ""}
    with pytest.raises(RowSkipped, match="gen_gpus is empty"):
        published_run(row)


def test_deepspeed_chat_generates_with_the_hybrid_engine() -> None:
    run = published_run(rows()["dschat_7B"])
    opts = run.job.options
    assert opts.rollout_engine == "deepspeed-he" and opts.rollout_call_sequences == 8  # 8 prompts a GPU a call
    assert run.plan.placement("actor/generation").layout.tp == 1  # the hybrid engine's inference_tp_size
    big = published_run(rows()["dschat_70B"]).plan.placement("actor/generation").layout
    assert big.tp == 4  # 138 GB of bf16 weights: doubled until they take at most half an 80 GB GPU
    assert run.plan.strategy == "colocated" and run.plan.weight_sync == "zero3-gather"
    assert run.job.workload.prompt_length == 1024  # prompts padded to max_prompt_seq_len
    with pytest.raises(RowSkipped, match="rollout_engine='other'"):
        published_run({**rows()["verl_oso_3"], "rollout_engine": "other"})  # 'other' means nothing for verl


@pytest.mark.parametrize("run_id", ["openrlhf_7B", "openrlhf_13B", "openrlhf_70B", "dschat_7B", "dschat_13B",
                                    "dschat_70B", "verl_dsv3_1"])
def test_the_rows_are_priced(run_id: str) -> None:
    guess = predict(published_run(rows()[run_id]), "cost")
    assert guess and all(math.isfinite(v) and v > 0 for v in guess.values())


def test_an_unknown_offload_kind_skips_the_row() -> None:
    with pytest.raises(RowSkipped, match="offload='disk'"):
        published_run({**rows()["openrlhf_7B"], "offload": "disk"})


def test_a_megatron_micro_batch_holds_the_per_gpu_budget_whatever_its_tp_and_pp() -> None:
    """verl's Megatron actor packs a micro-batch up to ``ppo_max_token_len_per_gpu`` (times CP only): a TP 2,
    PP 2 row micro-batches as its FSDP twin does, so its pipeline runs several micro-batches an update."""
    row = rows()["verl_oso_3"]  # Megatron TP 2 PP 2 on 16 GPUs: DP 4, 512 x 16 sequences, 16 updates
    run = published_run(row)
    train = run.plan.placement("actor/training").layout
    assert (train.tp, train.pp, train.dp) == (2, 2, 4)
    wl = run.job.workload
    cap, seq = int(row["max_prompt_len"]) + wl.response.max, wl.prompt_length + round(wl.response.mean)
    update_share = run.job.sequences_per_step() // train.dp // run.job.algorithm.mini_batches
    assert train.micro_batch_size == balanced_micro_batch(update_share, TRAIN_BUDGET_PER_TOKEN_CAP * cap, seq)
    assert update_share / train.micro_batch_size > train.pp  # more micro-batches than stages: a small bubble


def test_verl_without_dynamic_batching_keeps_rows_at_their_own_length() -> None:
    """verl removes the padding whether or not it batches by token budget (Megatron's THD packing, its
    scripts' use_remove_padding): a verl row that says dynamic_bsz no takes its recipe's fixed 2 (update)
    and 4 (inference) rows a micro-batch at their own length, not rows padded to the caps; an OpenRLHF
    row of the era still pads."""
    packed = rows()["verl_oso_3"]  # Megatron TP2 PP2, 8,192 sequences at a 10K-token cap
    fixed = {**packed, "run_id": "fixed", "dynamic_bsz": "no"}
    run = published_run(fixed)
    assert not run.job.options.padded_batches
    assert run.plan.placement("actor/training").layout.micro_batch_size == 2
    assert run.plan.placement("actor/inference").layout.micro_batch_size == 4
    by_budget, by_count = predict(published_run(packed), "cost"), predict(run, "cost")
    for column in ("t_old_logprob_s", "t_update_actor_s"):  # the same tokens, in more micro-batches
        assert 0.7 < by_count[column] / by_budget[column] < 1.3
    openrlhf = published_run({**rows()["openrlhf_7B"], "dynamic_bsz": "no"})
    assert openrlhf.job.options.padded_batches
