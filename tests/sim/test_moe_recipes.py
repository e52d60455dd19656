"""verl's Megatron MoE recipes (``sim.recipes.MOE_RECIPES``) fill what a published MoE row leaves empty of its
rollout, and an MoE decoder's sparse layers launch more kernels a decode step (``cost.moe``)."""

from __future__ import annotations

import pytest

from nereus.cost.decode import DecodePriors
from nereus.cost.eager import eager_step_overhead_s
from nereus.cost.hardware import Hardware, Priors
from nereus.cost.moe import MOE_MLP_EXTRA_KERNELS, SHARED_EXPERT_KERNELS, decode_kernels_per_layer
from nereus.sim.published_runs import balanced_micro_batch, decodes_eagerly, published_run
from nereus.sim.recipes import MOE_RECIPES, RECIPES, fixed_recipe_tp, moe_recipe
from tests.helpers import published_rows as rows


def test_moe_recipes_are_their_own_table() -> None:
    assert moe_recipe("verl", 30.5).rollout_tp == 4
    assert moe_recipe("verl", 671).rollout_tp == 32
    assert moe_recipe("OpenRLHF", 30.5) is None
    assert all(r.enforce_eager == (r.backend == "megatron") for r in MOE_RECIPES)
    assert not set(MOE_RECIPES) & set(RECIPES)
    assert moe_recipe("verl", 30.5, "fsdp").path.endswith("dapo_30b_a3b_base_math_fsdp.sh")
    assert fixed_recipe_tp(235)[0] == 2  # a dense lookup never lands on an MoE script


def test_an_moe_row_without_rollout_settings_takes_its_recipes() -> None:
    row = rows()["verl_fa30_1"]  # colocated, rollout TP and enforce_eager not stated
    assert not row["rollout_tp"] and not row["enforce_eager"]
    run = published_run(row)
    assert run.plan.placement("actor/generation").layout.tp == 4
    assert decodes_eagerly(row)
    layers = run.job.models["actor"].layers
    kernels = decode_kernels_per_layer(layers, layers, DecodePriors().kernels_per_layer)
    assert kernels == DecodePriors().kernels_per_layer + MOE_MLP_EXTRA_KERNELS
    step = Hardware(run.job.cluster).priors.decode_step_overhead_s
    assert step == pytest.approx(Priors().decode_step_overhead_s + eager_step_overhead_s(layers, kernels))
    assert not decodes_eagerly({**row, "train_backend": "fsdp"})  # verl's FSDP MoE script runs CUDA graphs
    stated = published_run({**row, "rollout_tp": "8", "enforce_eager": "no"})  # the row's own values win
    assert stated.plan.placement("actor/generation").layout.tp == 8
    assert Hardware(stated.job.cluster).priors.decode_step_overhead_s == Priors().decode_step_overhead_s


def test_a_recipe_tp_the_rollout_gpus_do_not_split_into_falls_to_one_that_does() -> None:
    run = published_run(rows()["verl_wsync_7"])  # 30 rollout GPUs, the 30B recipe's TP 4
    assert run.plan.placement("actor/generation").layout.tp == 2


def test_dense_layers_launch_the_dense_kernels() -> None:
    assert decode_kernels_per_layer(28, 0, 10) == 10
    assert decode_kernels_per_layer(61, 58, 10) == pytest.approx(10 + 7 * 58 / 61)


def test_a_shared_expert_launches_its_own_mlp_in_every_sparse_layer() -> None:
    """DeepSeek-V3's one shared expert per sparse layer is a dense MLP beside the fused-MoE call: its eager
    decode step dispatches those kernels too (``SHARED_EXPERT_KERNELS``), Qwen3-30B-A3B's has none."""
    assert decode_kernels_per_layer(61, 58, 10, shared_expert=True) == pytest.approx(
        10 + (MOE_MLP_EXTRA_KERNELS + SHARED_EXPERT_KERNELS) * 58 / 61)
    run = published_run(rows()["verl_dsv3_1"])  # eager, as verl's DeepSeek-V3 script runs
    kernels = decode_kernels_per_layer(61, 58, DecodePriors().kernels_per_layer, shared_expert=True)
    step = Hardware(run.job.cluster).priors.decode_step_overhead_s
    assert step == pytest.approx(Priors().decode_step_overhead_s + eager_step_overhead_s(61, kernels))


def test_an_moe_row_without_offload_takes_its_recipes() -> None:
    row = rows()["verl_fa30_2"]  # Megatron, offload not stated: its script offloads and steps on the host
    assert not row["offload"]
    assert all(r.offload == ("param+optimizer" if r.backend == "megatron" else "none") for r in MOE_RECIPES)
    assert published_run(row).job.options.offload == "param+optimizer"
    assert published_run({**row, "offload": "none"}).job.options.offload == "none"  # the row's own value wins
    assert published_run({**row, "train_backend": "fsdp2"}).job.options.offload == "none"  # the FSDP script's
    dense = rows()["verl_oso_3"]  # a dense verl row without offload has no recipe to take it from
    assert not dense["offload"] and published_run(dense).job.options.offload == "none"


def test_an_moe_row_updates_in_its_recipes_mini_batches() -> None:
    row = rows()["verl_fa30_1"]  # 512 prompts a step; its notes: ppo_mini_batch_size=128, the 30B script's
    assert moe_recipe("verl", 30.5).mini_batch_prompts == 128
    assert published_run(row).job.algorithm.mini_batches == 4
    assert published_run({**row, "arch": "dense", "n_experts": "", "experts_per_token": "", "moe_ffn_hidden": "",
                          "ffn_hidden": "6144"}).job.algorithm.mini_batches == 16  # verl's dense recipes' 32


def test_an_moe_row_micro_batches_at_its_recipes_token_budget_and_recompute() -> None:
    """verl's MoE scripts budget a dynamic micro-batch at one cap (dense DAPO recipes: 2 for training, 3 for
    log-probs), and the DeepSeek-V3 one recomputes every layer: a verl MoE row runs those."""
    assert all(r.budget_per_cap == 1 for r in MOE_RECIPES) and all(r.budget_per_cap == 0 for r in RECIPES)
    assert [r.recompute for r in MOE_RECIPES if r.recompute] == ["full"] and moe_recipe("verl", 671).recompute
    row = rows()["verl_fa30_1"]  # 128 GPUs, 512 x 16 sequences, 4 updates: 16 a rank per update, 64 per pass
    run = published_run(row)
    train, infer = (run.plan.placement(f"actor/{s}").layout for s in ("training", "inference"))
    wl = run.job.workload
    cap, seq = int(row["max_prompt_len"]) + wl.response.max, wl.prompt_length + round(wl.response.mean)
    assert (train.micro_batch_size, infer.micro_batch_size) == (balanced_micro_batch(16, cap, seq),
                                                                balanced_micro_batch(64, cap, seq))
    assert balanced_micro_batch(16, cap, seq) < balanced_micro_batch(16, 2 * cap, seq)  # the budget tells
    assert train.recompute == "none"  # Megatron's default where the script sets none
    deepseek = published_run(rows()["verl_dsv3_1"])
    assert deepseek.plan.placement("actor/training").layout.recompute == "full"
