"""Layouts from the public example scripts of verl and OpenRLHF: what an operator copies to start a run.

Each recipe records the script it comes from (repository, path, the commit read) and the rollout
engine's tensor-parallel size it sets by hand (verl: ``actor_rollout_ref.rollout.tensor_model_parallel_size``;
OpenRLHF: ``--vllm_tensor_parallel_size``). Every script listed trains and runs inference with sharded
data parallelism and no TP/PP (verl's FSDP backend; OpenRLHF's ``--zero_stage 3``), which is what the
baselines model for those stages. The table is in docs/simulator.md ("Recipes").
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Recipe:
    system: str  # "verl" or "OpenRLHF"
    algorithm: str  # "ppo" or "grpo"
    model: str
    params_b: float  # billions of parameters of the script's actor
    rollout_tp: int
    repo: str
    path: str
    commit: str
    # verl's ``actor_rollout_ref.rollout.enforce_eager`` as the script sets it (None: the script leaves it)
    enforce_eager: bool | None = None
    backend: str = "fsdp"  # the training backend the script runs (verl's ``actor.strategy``)
    # the actor's training state the script keeps on the host (``cost.offload.OFFLOADS``)
    offload: str = "none"
    # prompts per PPO mini-batch, one optimizer update (verl's ``actor.ppo_mini_batch_size``)
    mini_batch_prompts: int = 32
    # token budget of a dynamic micro-batch per GPU, in caps (max prompt + max response): verl's
    # ``ppo_max_token_len_per_gpu`` (training) and ``log_prob_max_token_len_per_gpu`` (log-probs) over the cap;
    # 0: the script leaves them to the validation's defaults (``sim.published_runs``)
    budget_per_cap: int = 0
    # Megatron's activation recompute as the script sets it (``override_transformer_config.recompute_granularity``;
    # "": none set)
    recompute: str = ""
    # the share of each rollout GPU's memory the engine may take (``actor_rollout_ref.rollout.
    # gpu_memory_utilization``; 0: the script leaves it)
    gpu_memory_utilization: float = 0.0

    @property
    def url(self) -> str:
        return f"https://github.com/{self.repo}/blob/{self.commit}/{self.path}"


RECIPES: tuple[Recipe, ...] = (
    Recipe("verl", "ppo", "deepseek-llm-7b-chat", 7.0, 4, "volcengine/verl",
           "examples/ppo_trainer/run_deepseek7b_llm.sh", "2ddb493969d9a537ed73758795dd4f75c766f52f"),
    Recipe("verl", "ppo", "Qwen2-7B-Instruct, with a reward model", 7.6, 1, "volcengine/verl",
           "examples/ppo_trainer/run_qwen2-7b_rm.sh", "52485ff335a8f3c0a9a568abc0fb3d91b99ac0a5"),
    Recipe("verl", "grpo", "Qwen2-7B-Instruct", 7.6, 2, "volcengine/verl",
           "examples/grpo_trainer/run_qwen2-7b.sh", "03aefba409c618c7e8a032dfbbde37fb8dc740c7"),
    Recipe("verl", "ppo", "Qwen2.5-32B-Instruct", 32.8, 4, "volcengine/verl",
           "examples/ppo_trainer/run_qwen2.5-32b.sh", "52485ff335a8f3c0a9a568abc0fb3d91b99ac0a5"),
    Recipe("OpenRLHF", "ppo", "Llama-3-8B (actor, critic, reference, reward)", 8.0, 2, "OpenRLHF/OpenRLHF",
           "examples/scripts/train_ppo_llama_ray.sh", "0840b980c1e6ec5171657c641323a040be01a112"),
    Recipe("OpenRLHF", "ppo", "Llama-3-70B-Instruct", 70.6, 2, "OpenRLHF/OpenRLHF",
           "examples/scripts/train_ppo_llama_ray_70b.sh", "77561119a2cc250a288fa73244ab888bdefea97f"),
)


# verl's recipes for Mixture-of-Experts models, kept apart from the dense table above so a dense model's
# recipe TP (and the simulator's recipe baselines) never come from an MoE script. Every Megatron one sets
# ``rollout.enforce_eager=True`` (the rollout decodes without CUDA graphs) and ``offload=True`` for the
# actor's ``megatron.param_offload``, ``grad_offload`` and ``optimizer_offload`` with
# ``optimizer_cpu_offload=True`` at ``optimizer_offload_fraction`` 1 (the update steps on the host); the FSDP
# one sets False and keeps the actor on the GPU (``actor_offload=False``). Their ``train_prompt_mini_bsz``:
# 128, 16, 32 and 32 prompts. All four budget a dynamic micro-batch at one cap (``actor_ppo_max_token_len`` =
# ``infer_ppo_max_token_len`` = max prompt + max response, where verl's dense DAPO recipes take 2 and 3), and
# the DeepSeek-V3 one recomputes every layer in the backward pass (``recompute_granularity=full``,
# ``recompute_method=uniform``, ``recompute_num_layers=1``). Their rollouts take 0.7, 0.85, 0.6 and 0.5 of each
# GPU's memory (``rollout.gpu_memory_utilization``).
MOE_RECIPES: tuple[Recipe, ...] = (
    Recipe("verl", "grpo", "Qwen3-30B-A3B", 30.5, 4, "volcengine/verl",
           "examples/grpo_trainer/run_qwen3moe-30b_megatron_96gb.sh", "c281ea7797624601a1bcb15ac026d0e1c9dd853e",
           enforce_eager=True, backend="megatron", offload="param+optimizer", mini_batch_prompts=128, budget_per_cap=1,
           gpu_memory_utilization=0.7),
    Recipe("verl", "grpo", "Qwen3-235B-A22B", 235.1, 8, "volcengine/verl",
           "examples/grpo_trainer/run_qwen3-235b_megatron_96gb.sh", "f6f910069b2b0812bcd4f20cc5f0be4999fb5440",
           enforce_eager=True, backend="megatron", offload="param+optimizer", mini_batch_prompts=16, budget_per_cap=1,
           gpu_memory_utilization=0.85),
    Recipe("verl", "grpo", "DeepSeek-V3", 671.0, 32, "volcengine/verl",
           "examples/grpo_trainer/run_deepseek671b_math_megatron_96gb.sh", "bd756c15c8873e40cfbb5ef2a4d1d6cadb4ea272",
           enforce_eager=True, backend="megatron", offload="param+optimizer", budget_per_cap=1, recompute="full",
           gpu_memory_utilization=0.6),
    Recipe("verl", "dapo", "Qwen3-30B-A3B-Base", 30.5, 4, "volcengine/verl",
           "verl/experimental/fully_async_policy/shell/dapo_30b_a3b_base_math_fsdp.sh",
           "2bb42bae6078359c3fdc56ba6c7533e76fc05407", enforce_eager=False, budget_per_cap=1,
           gpu_memory_utilization=0.5),
)


def moe_recipe(system: str, params_b: float, backend: str = "megatron") -> Recipe | None:
    """``system``'s MoE recipe nearest in size (log scale) to a model of ``params_b`` billion parameters,
    among its scripts for ``backend`` when it has any; None when the system has none."""
    pool = [r for r in MOE_RECIPES if r.system == system]
    pool = [r for r in pool if r.backend == backend] or pool
    return min(pool, key=lambda r: _size_distance(r, params_b)) if pool else None


def _size_distance(recipe: Recipe, params_b: float) -> float:
    return abs(math.log(recipe.params_b / params_b))


def recipes_for(params_b: float, system: str | None = None, algorithm: str | None = None) -> list[Recipe]:
    """The recipes nearest in model size (log scale): those within 2× of the model, else the nearest
    one. ``system`` and ``algorithm`` narrow the list first (the algorithm only if it leaves any)."""
    pool = [r for r in RECIPES if system is None or r.system == system]
    if not pool:
        raise ValueError(f"no recipe for system {system!r}; known: {sorted({r.system for r in RECIPES})}")
    same_alg = [r for r in pool if r.algorithm == algorithm]
    pool = same_alg or pool
    near = [r for r in pool if _size_distance(r, params_b) <= math.log(2)]
    return near or [min(pool, key=lambda r: _size_distance(r, params_b))]


def fixed_recipe_tp(params_b: float) -> tuple[int, list[Recipe]]:
    """The rollout TP an operator copies for a model of this size: the lower median over every system's
    recipes of that size (for a 7–8B model: TP 1, 2, 2, 4 → 2)."""
    near = recipes_for(params_b)
    tps = sorted(r.rollout_tp for r in near)
    return tps[(len(tps) - 1) // 2], near


def system_recipe_tp(system: str, algorithm: str, params_b: float) -> tuple[int, list[Recipe]]:
    """The rollout TP of ``system``'s recipes nearest in size for ``algorithm``; when two of them differ,
    the larger (fewer, faster engines, the one less likely to run out of KV-cache memory)."""
    near = recipes_for(params_b, system, algorithm)
    nearest = min(_size_distance(r, params_b) for r in near)
    closest = [r for r in near if _size_distance(r, params_b) <= nearest + 0.1]
    return max(r.rollout_tp for r in closest), closest
