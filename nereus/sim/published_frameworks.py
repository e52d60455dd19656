"""What a published run's framework does that the ``e2e_runs.csv`` schema has no column for: one set of
defaults per framework (``FRAMEWORKS``), the same for every row of it, each from the framework's own code,
scripts or README of the rows' era (cited below). ``sim.published_runs`` asks these when it turns a row into a
job and plan; a framework not listed here takes verl's (``VERL``), as every row did before.

Rules (docs/cost-model.md, "End-to-end RL runs"):

- reward model: a PPO row of OpenRLHF or DeepSpeed-Chat scores its responses with a learned reward model
  of the actor's architecture (OpenRLHF's ``train_ppo_ray --reward_pretrain``, its benchmark notes: "init
  reward model from actor model with same model size"; DeepSpeed-Chat's step 3 loads the step-2 reward
  model), run for every response (an inference stage of its own); verl's rows score by rule (math answers).
- batching: the row's ``dynamic_bsz``, else the framework's default: verl packs micro-batches by token
  budget (its recipes' ``use_dynamic_bsz``); OpenRLHF of the rows' era (~v0.2-0.3, before
  ``--packing_samples``) and DeepSpeed-Chat pad every micro-batch to its longest row
  (``Options.padded_batches``: rows as wide as the step's longest). Without dynamic batching verl still
  removes the padding (``removes_padding``) and takes a fixed count of rows a micro-batch
  (``FIXED_MICRO_BATCH``).
- prompts: DeepSpeed-Chat pads every prompt to ``max_prompt_seq_len`` (its ``DataCollatorRLHF``), so a
  row's prompt is its cap in every stage; the others pad to the batch's longest (the stated mean rule).
- rollout engine ``other``: DeepSpeed-Chat's is DeepSpeed's Hybrid Engine (``deepspeed-he``,
  ``spec.engines``: static batches, no paged KV cache, ranks in lockstep); elsewhere ``other`` is not
  priced. Its generation batch per GPU is the OpenRLHF authors' DeepSpeed-Chat setting
  (``DSCHAT_CALL_PROMPTS``), its TP the hybrid engine's default 1, doubled while the gathered weights
  take more than half a GPU (``framework_rollout_tp``).
- weight sync: colocated, verl's hybrid engine (``hybrid-reshard``) or DeepSpeed-Chat's ZeRO-3 gather
  (``zero3-gather``); on separate GPUs, OpenRLHF's gather-and-broadcast (``gather-broadcast``), NeMo RL's
  bucketed broadcast (``packed-broadcast``, ``cost.verl_weight_sync.packed_broadcast_time``), verl's own
  rule otherwise (``published_runs.disaggregated_sync``).
- PPO mini-batches: verl's recipes' 32 prompts; OpenRLHF's benchmark settings' train_batch_size 128, which
  its DeepSpeed-Chat comparison shared.
- offload: the row's ``offload`` column (``Options.offload``, priced in ``cost.offload``): the state it
  names lives on the host, not beside the rollout's KV cache, and costs its transfers; an offloaded
  optimizer steps on the host (DeepSpeed, Megatron) or, in verl's FSDP workers, is swapped in for the GPU.
  A verl MoE row that leaves it empty takes its recipe's (``sim.recipes``: every Megatron one offloads
  parameters, gradients and the optimizer, which steps on the host), and its PPO mini-batch is its
  recipe's. A colocated NeMo RL row that leaves it empty takes what NeMo RL's Megatron worker does on
  every colocated run (``NEMO_RL_COLOCATED_OFFLOAD``): parameters offloaded between stages, the optimizer
  swapped in for the update.
- GPU pools of a disaggregated row that leaves ``gen_gpus`` / ``train_gpus`` empty: OpenRLHF's example
  scripts and benchmark notes of the table's commit put the reference, reward model, critic, actor and
  vLLM engines on GPU groups of their own in the ratio 1:1:2:2:2 (``OPENRLHF_POOLS``); each model's stages
  are placed on its group. verl and DeepSpeed-Chat publish no such default: their rows are skipped.
- training throughput: OpenRLHF's and DeepSpeed-Chat's training stages run Hugging Face models under
  DeepSpeed ZeRO-2/3 with gradient checkpointing and Adam offload, measured by the OpenRLHF authors on A800s
  at a fraction of the GPU's peak (``TRAINING_EFFICIENCY``), which prices their GEMMs in place of the
  ``gemm_efficiency`` prior (``Options.training_efficiency``). verl's Megatron training of an MoE model
  runs at the fraction its own published MFU gives (``VERL_MEGATRON_MOE_TRAINING_EFFICIENCY``); verl's other
  rows keep the prior.
- rollout memory: the row's ``gpu_memory_utilization`` (vLLM's and verl's key: the share of each rollout
  GPU's memory the engine takes for its weights, activations and KV cache, ``cost.hardware.kv_cache_budget``),
  else a verl MoE row's recipe's (``sim.recipes``), else its framework's for the row's placement
  (``NEMO_RL_MEMORY_UTILIZATION``), else the cost model's prior (0.9 of what is free).
- generate calls: OpenRLHF's actor ranks each hand their engine ``--micro_rollout_batch_size`` prompts per
  call and wait for it before the next (``OPENRLHF_CALL_PROMPTS``), so an engine decodes static batches of
  the calls in flight (``Options.rollout_call_sequences``, ``cost.static_decode``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from nereus.cost.offload import OFFLOADS
from nereus.sim.published_arch import is_moe, model_size_b
from nereus.sim.published_cells import as_written, count, engine_named, enum, named_in, number, squashed, text
from nereus.sim.recipes import Recipe, moe_recipe
from nereus.spec.engines import ENGINE_TRAITS, PRICING_ENGINE
from nereus.spec.job import JobSpec


@dataclass(frozen=True)
class FrameworkDefaults:
    """A framework's answers to what the schema leaves out (module docstring, one line each)."""

    name: str
    learned_reward: bool = False  # PPO scores with a reward model of the actor's architecture
    dynamic_batch: bool = True  # micro-batches packed by token budget; False: a fixed count of rows each
    # rows at their own length in a micro-batch that is not packed by token budget; False: padded to the longest
    removes_padding: bool = False
    prompt_at_cap: bool = False  # every prompt padded to the prompt cap
    other_engine: str = ""  # what rollout_engine 'other' means ("": not priced)
    colocated_sync: str = "hybrid-reshard"
    disaggregated_sync: str = ""  # "": verl's rule (published_runs.disaggregated_sync)
    # shares of the GPUs of the rollout ("generation") and of each model when a disaggregated row gives no pools
    pools: tuple[tuple[str, float], ...] = ()
    # prompts each actor rank hands the rollout per generate call, waiting for it, by the model size (billion
    # parameters) of the framework's example scripts: (size, prompts) pairs, the nearest size's; () = no calls
    call_prompts: tuple[tuple[float, int], ...] = ()
    # prompts per PPO mini-batch (one optimizer update; the schema has no column for it)
    mini_batch_prompts: int = 32
    # rollout TP a row without one starts from (0: verl's recipes', ``sim.recipes``), doubled while the
    # gathered bf16 weights take more than half a GPU's memory (``framework_rollout_tp``)
    rollout_tp: int = 0
    # rollout TP of the framework's own scripts by model size (billion parameters): (size, TP) pairs, the
    # nearest size's; () = none (``rollout_tp``, else verl's recipes)
    script_rollout_tp: tuple[tuple[float, int], ...] = ()
    # fraction of the GPU's peak its training stages' GEMMs reach (0: the cost model's prior), measured
    training_efficiency: float = 0.0
    # the same for its Megatron training of a Mixture-of-Experts model (0: ``training_efficiency``)
    megatron_moe_training_efficiency: float = 0.0
    # the trainer's host state of a colocated row that leaves ``offload`` empty ("": none)
    colocated_offload: str = ""
    # what of its host state the framework moves through newly allocated pageable memory, by the row's
    # ``train_backend`` as written: (backend, kind) pairs (``Options.pageable_offload``; () = none of it)
    pageable_offload: tuple[tuple[str, str], ...] = ()
    # the training's activation recompute by the model size of the framework's recipes: (size, "full" |
    # "none") pairs, the nearest size's; () = the backend's default (``sim.published_runs``)
    recompute: tuple[tuple[float, str], ...] = ()
    # the rollout engine's ``gpu_memory_utilization`` by the row's placement: (placement, share) pairs, where
    # the framework's own configs set one for every run of that placement; () = the cost model's prior
    memory_utilization: tuple[tuple[str, float], ...] = ()


# OpenRLHF's benchmark settings, which its comparison with DeepSpeed-Chat used for both: rollout_batch_size
# 1024, train_batch_size 128 (OpenRLHF/OpenRLHF docs, "OpenRLHF Benchmark", Hyperparameter).
OPENRLHF_TRAIN_BATCH = 128
# OpenRLHF's GPU groups at the table's commit (391e1de4, 2024-05-18): examples/scripts/train_ppo_llama_ray_70b.sh
# gives the reference 2, the reward model 2, the critic 4, the actor 4 GPUs and the vLLM engines 2 x TP2, and its
# benchmark notes (docs, "OpenRLHF Benchmark") list ray+vllm runs at ref:reward:critic:actor:vllm = 1:1:2:2:2.
OPENRLHF_POOLS = (("generation", 0.25), ("actor", 0.25), ("critic", 0.25), ("reference", 0.125), ("reward", 0.125))
# --micro_rollout_batch_size of the same commit's scripts: 16 in train_ppo_llama_ray.sh (Llama-2-7B), 8 in
# train_ppo_llama_ray_slurm.sh (Llama-2-13B), 2 in train_ppo_llama_ray_70b.sh. Each actor rank generates that many
# prompts per call to its vLLM engine (openrlhf/trainer/ppo_utils/experience_maker.py, RemoteExperienceMaker:
# ``ray.get(llm.generate.remote(...))``, then the experience's forward passes, then the next micro-batch).
OPENRLHF_CALL_PROMPTS = ((6.74, 16), (13.0, 8), (69.0, 2))
# The vLLM engines' TP of the same scripts: train_ppo_llama_ray_70b.sh sets --vllm_tensor_parallel_size 2; the 7B
# and 13B scripts set none, so they take examples/train_ppo_ray.py's default, 1.
OPENRLHF_ROLLOUT_TP = ((6.74, 1), (13.0, 1), (69.0, 2))
# DeepSpeed-Chat's generation batch per GPU in the OpenRLHF authors' runs of it (the benchmark notes above:
# 8 for Llama-2-7B, 2 for 13B); its Hybrid Engine gathers a TP group's prompts into one batch. Its TP starts
# at the hybrid engine's default inference_tp_size, 1 (DeepSpeed config ``hybrid_engine``).
DSCHAT_CALL_PROMPTS = ((6.74, 8), (13.0, 2))
# Measured training throughput, a fraction of the A800's 312 TFLOP/s dense bf16 peak (nereus/spec/hardware.csv),
# from the OpenRLHF benchmark notes (https://github.com/OpenRLHF/OpenRLHF/blob/dbdd43b0899b069a276fbc8813c6769011975806/benchmark/README.md:
# 8-16 A800-SXM-80GB, Llama-2, 1,024 prompts, 1,024 + 1,024-token caps, train_batch_size 128, ZeRO with Adam offload
# and gradient checkpointing, deepspeed 0.13.2). Its "Training TFLOPs" is openrlhf/utils/perf.py's
# print_throughput_step3: actor + critic FLOPs by Megatron's formula with the recompute forward (factor 4), every
# sequence at the caps, over the measured training latency times every GPU of the run. Divided here by the GPUs
# that train instead and pooled over the framework's runs (their FLOPs over their training GPU-seconds):
# - OpenRLHF (ray+vllm; actor and critic train at once on 2 + 2 of 8 GPUs, 4 + 4 of 16 for 70B): 7B 403.29 s,
#   13B 967.15 s, 70B 2,699.97 s: 2.37e17 + 4.54e17 + 2.26e18 FLOPs over 27,082 GPU-seconds, 109 TFLOP/s: 0.349
#   (each run alone 0.47, 0.38, 0.34);
# - DeepSpeed-Chat (hybrid engine off; actor ZeRO-2, critic ZeRO-3, --offload; all 8 GPUs train both): 7B
#   492.01 s, 13B 1,218.76 s (60.34 and 46.61 TFLOP/s as printed): 0.162. Its run without offload reached
#   142.01 TFLOP/s (0.455): most of the gap is DeepSpeed's host Adam step, which this figure carries.
TRAINING_EFFICIENCY = {"OpenRLHF": 0.349, "DeepSpeed-Chat": 0.162}
# verl's Megatron training of MoE models, measured by verl itself: its "Qwen3-30B-A3B MOE" table
# (https://github.com/volcengine/verl/blob/b178a3cd56f58b2d502255daba591e92833930a7/docs/perf/dpsk.md) gives the MFU
# of examples/grpo_trainer/run_qwen3moe-30b_megatron_96gb.sh (TP1 EP8, parameters and optimizer offloaded, the
# optimizer stepping on the host) on 8, 16 and 32 96 GB GPUs: 0.40, 0.37, 0.31, 0.356 pooled over their GPU-seconds.
# verl's MFU is its flops counter's FLOPs of the update (verl/utils/flops_counter.py) over the update policy's
# seconds, the GPUs and H20's 148 TFLOP/s. This is the GEMM efficiency at which the cost model's update of those
# three runs gives that pooled MFU (0.428); the prior's 0.75 gives 0.59, 0.59, 0.54. Fitted on these three rows
# only, and reproduced with the held-out check by ``python benchmarks/verl_moe_mfu.py``: DeepSeek-V3 on 96 H20s
# (the same doc's benchmark, MFU 0.19) is priced at 0.181 with it, 0.290 at the prior.
VERL_MEGATRON_MOE_TRAINING_EFFICIENCY = 0.43
# verl: train_prompt_mini_bsz=32 in every DAPO recipe script behind its rows (verl/experimental/
# one_step_off_policy/shell/dapo_7b_math_*.sh, fully_async_policy/shell/dapo_7b_math_fsdp2_*.sh).
# verl's offload of a trained model's weights goes through new pageable pages at every offload
# (``cost.offload``: verl/utils/megatron_utils.py ``offload_megatron_model_to_cpu``, ``.cpu().pin_memory()`` of a
# DDP-wrapped module's buffers; verl/utils/fsdp_utils.py ``offload_fsdp2_model_to_cpu``, ``model.cpu()``); FSDP1's
# ``flat_param_to(cpu, non_blocking=True)`` lands in pinned memory.
VERL_PAGEABLE_OFFLOAD = (("megatron", "param"), ("fsdp2", "param"))
# verl's actors run rows at their own length whether or not they batch by token budget: its Megatron
# backend packs a micro-batch's rows into one THD sequence (``megatron.use_remove_padding: true`` by default,
# verl/trainer/config/_generated_ppo_megatron_trainer.yaml; megatron_actor.py ``data_format="thd"``) and its
# recipe scripts set ``actor_rollout_ref.model.use_remove_padding=True`` for FSDP. Without
# ``use_dynamic_bsz`` a micro-batch is ``ppo_micro_batch_size_per_gpu`` rows (update) and
# ``log_prob_micro_batch_size_per_gpu`` (inference): 2 and 4 in the one-step-off Megatron recipe, which
# leaves its dynamic-batching overrides commented out, marked as not yet supported for Megatron
# (recipe/one_step_off_policy/dapo_7b_math_megatron_colocate.sh of verl PR #2231).
VERL = FrameworkDefaults("verl", removes_padding=True,
                         megatron_moe_training_efficiency=VERL_MEGATRON_MOE_TRAINING_EFFICIENCY,
                         pageable_offload=VERL_PAGEABLE_OFFLOAD)
FIXED_MICRO_BATCH = (2, 4)  # rows a micro-batch without dynamic batching: (update, inference), verl's recipe
# NeMo RL's Megatron policy worker on a colocated run (nemo_rl/models/policy/workers/megatron_policy_worker.py,
# v0.6.0): after the refit it moves the model, its gradient buffers and the optimizer to the host
# (``offload_after_refit``), loads the model back for log-probs (``prepare_for_lp_inference``) and the model and
# optimizer for training (``prepare_for_training``): parameters offloaded between stages, the optimizer swapped
# in for the update on the GPU.
NEMO_RL_COLOCATED_OFFLOAD = "param+optimizer-swap"
# Activation recompute of NeMo RL's performance recipes, which its performance summary names as the runs' configs
# (examples/configs/recipes/llm/performance/, v0.6.0 and later): ``megatron_cfg.activation_checkpointing: true``
# (full recompute) for DeepSeek-V3 (grpo-deepseek-v3-32n8g.yaml, and every DeepSeek-V3 recipe from it),
# Qwen3-235B-A22B (grpo-qwen3-235b-16n8g.yaml) and Llama-3.1-8B (grpo-llama3.1-8b-instruct-2n8g.yaml, 2n4g);
# the defaults' false (examples/configs/grpo_math_1B.yaml) for Qwen3-30B-A3B and Qwen3-32B.
NEMO_RL_RECOMPUTE = ((8.0, "full"), (30.5, "none"), (32.8, "none"), (235.0, "full"), (671.0, "full"))


# NeMo RL's rollout memory (examples/configs/grpo_math_1B.yaml, v0.4.0 and v0.6.0: ``vllm_cfg.
# gpu_memory_utilization: 0.6``), which every colocated performance recipe inherits but the GB200 DeepSeek-V3
# (0.3, grpo-deepseek-v3-32n4g.yaml) and Qwen3-235B-A22B 16-node (0.4, grpo-qwen3-235b-16n4g.yaml) ones, whose
# held-out rows state theirs; every async-1off recipe, its rollout on GPUs of its own, sets 0.8
# (examples/configs/recipes/llm/performance/*-async-1off.yaml).
NEMO_RL_MEMORY_UTILIZATION = (("colocated", 0.6), ("disaggregated", 0.8))


FRAMEWORKS = {squashed(f.name): f for f in (
    VERL,
    FrameworkDefaults("OpenRLHF", learned_reward=True, dynamic_batch=False, disaggregated_sync="gather-broadcast",
                      pools=OPENRLHF_POOLS, call_prompts=OPENRLHF_CALL_PROMPTS, script_rollout_tp=OPENRLHF_ROLLOUT_TP,
                      mini_batch_prompts=OPENRLHF_TRAIN_BATCH, training_efficiency=TRAINING_EFFICIENCY["OpenRLHF"]),
    FrameworkDefaults("DeepSpeed-Chat", learned_reward=True, dynamic_batch=False, prompt_at_cap=True,
                      other_engine="deepspeed-he", colocated_sync="zero3-gather", call_prompts=DSCHAT_CALL_PROMPTS,
                      mini_batch_prompts=OPENRLHF_TRAIN_BATCH, rollout_tp=1,
                      training_efficiency=TRAINING_EFFICIENCY["DeepSpeed-Chat"]),
    FrameworkDefaults("NeMo-RL", colocated_offload=NEMO_RL_COLOCATED_OFFLOAD, disaggregated_sync="packed-broadcast",
                      pageable_offload=(("megatron", "optimizer"),),
                      recompute=NEMO_RL_RECOMPUTE, memory_utilization=NEMO_RL_MEMORY_UTILIZATION),
)}


def named_framework(written: str) -> FrameworkDefaults | None:
    """The framework a ``framework`` cell names: a listed one's name in any case or spacing ('NeMo RL',
    'nemo_rl'), or followed by a version ('verl v0.5', 'OpenRLHF 0.3.1'); None for one not listed."""
    return named_in(written, FRAMEWORKS)


def framework_of(row: dict) -> FrameworkDefaults:
    """The row's framework's defaults; verl's for a framework not listed."""
    return named_framework(text(row, "framework")) or VERL


PLACEMENTS = ("colocated", "disaggregated")


def placement(row: dict) -> str:
    """The row's ``placement``; empty: disaggregated where it states a GPU pool (``gen_gpus`` or
    ``train_gpus``) smaller than ``gpus_total`` (the rollout and the trainer on separate GPUs) or where its
    framework puts each model on GPUs of its own (OpenRLHF: ``FrameworkDefaults.pools``), else colocated."""
    if text(row, "placement"):
        return enum(row, "placement", PLACEMENTS)
    total = count(row, "gpus_total", "the GPU count")
    pools = (count(row, "gen_gpus"), count(row, "train_gpus"))
    split = any(pool is not None and pool < total for pool in pools) or bool(framework_of(row).pools)
    return "disaggregated" if split else "colocated"


def is_verl(row: dict) -> bool:
    """The row names verl (in any spelling ``named_framework`` reads), not a framework priced as verl."""
    return named_framework(text(row, "framework")) is VERL


def update_prompts(row: dict, total: int, samples: int) -> int:
    """Prompts per optimizer update: a verl MoE row's recipe's (``verl_moe_recipe``), else the framework's
    default, or more where that would leave a data-parallel training rank without a sequence. verl asserts
    that a mini-batch covers every DP rank, so a run that ran had at least that many (DP: the trainer's
    GPUs, ``train_gpus`` or all, over a Megatron row's ``train_tp`` x ``train_pp``)."""

    def whole(key: str, default: int) -> int:
        value = (row.get(key) or "").strip()
        return int(value) if value.isdigit() and int(value) > 0 else default

    model_parallel = whole("train_tp", 1) * whole("train_pp", 1) if trains_with_megatron(row) else 1
    ranks = max(1, whole("train_gpus", total) // model_parallel)
    recipe = verl_moe_recipe(row)
    prompts = recipe.mini_batch_prompts if recipe else framework_of(row).mini_batch_prompts
    return max(prompts, -(-ranks // max(1, samples)))


def train_backend(row: dict) -> str:
    """The row's ``train_backend`` as written, lower-case ("" when empty)."""
    return text(row, "train_backend").lower()


def trains_with_megatron(row: dict) -> bool:
    return train_backend(row) == "megatron"


def nearest_size(table: tuple[tuple[float, int], ...], params_b: float) -> int:
    """The value of a (model size in billions, value) table for the size nearest ``params_b``."""
    return min(table, key=lambda pair: abs(pair[0] - params_b))[1]


def framework_recompute(row: dict) -> str:
    """The training's activation recompute the row's framework runs for a model of its size ("" where it
    publishes none: the backend's default)."""
    table, params_b = framework_of(row).recompute, model_size_b(row)
    if not table or params_b is None:
        return ""
    return min(table, key=lambda pair: abs(math.log(pair[0] / params_b)))[1]


def rollout_engine_name(row: dict) -> str | None:
    """The engine whose traits price the row's rollout (``spec.engines``): the row's, ``other`` as its
    framework runs it; None when Nereus declares no such engine."""
    written = text(row, "rollout_engine")
    if not written:
        return PRICING_ENGINE
    if written.lower() == "other":
        return framework_of(row).other_engine or None
    return engine_named(written)


def with_reward_model(row: dict, models: dict, algorithm: str) -> dict:
    """``models`` with the learned reward model a PPO row of the framework runs (the actor's architecture)."""
    if algorithm == "ppo" and framework_of(row).learned_reward:
        return {**models, "reward": models["actor"]}
    return models


def dynamic_batch(row: dict) -> bool:
    """Micro-batches packed by token budget: the row's ``dynamic_bsz``, else its framework's default."""
    if text(row, "dynamic_bsz"):
        return enum(row, "dynamic_bsz", ("yes", "no")) == "yes"
    return framework_of(row).dynamic_batch


def padded(row: dict) -> bool:
    """Micro-batches padded to the longest row: not packed by token budget, by a framework that keeps the
    padding (``FrameworkDefaults.removes_padding``)."""
    return not dynamic_batch(row) and not framework_of(row).removes_padding


def verl_moe_recipe(row: dict) -> Recipe | None:
    """A verl MoE row's recipe, the nearest in size of verl's MoE scripts for the row's training backend
    (``sim.recipes``): what the row leaves empty of its rollout (TP, ``enforce_eager``) and of its offload,
    and its PPO mini-batch, are what that script sets. None for any other row (or one whose size is neither
    stated nor counted from its architecture, ``published_arch.model_size_b``)."""
    params_b = model_size_b(row)
    if not is_verl(row) or not is_moe(row) or params_b is None:
        return None
    return moe_recipe("verl", params_b, "megatron" if trains_with_megatron(row) else "fsdp")


def offload_of(row: dict) -> str | None:
    """The row's ``offload`` (``cost.offload.OFFLOADS``; empty: its verl MoE recipe's, else none), None when it
    is not one of them. An offloaded optimizer steps on the host (DeepSpeed's ZeRO-Offload, Megatron's CPU
    optimizer) except in verl's FSDP workers, which swap its state in for the GPU's update (``optimizer-swap``)."""
    recipe, framework = verl_moe_recipe(row), framework_of(row)
    stated = (row.get("offload") or "").strip().lower()
    colocated = placement(row) == "colocated"
    if not stated and recipe is None and colocated and framework.colocated_offload:
        return framework.colocated_offload
    value = stated or (recipe.offload if recipe else "none")
    if value not in ("none", "param", "optimizer", "param+optimizer"):
        return None
    fsdp = (train_backend(row) or "fsdp") in ("fsdp", "fsdp2")
    if framework_of(row) is VERL and fsdp and "optimizer" in value:
        value += "-swap"
    return value if value in OFFLOADS else None


def framework_rollout_tp(row: dict, weight_bytes: float, gpu_bytes: float, gpus: int, heads: int) -> int:
    """The framework's rollout TP for a row without one (0: none of its own): its scripts' for the nearest
    model size where it lists them, else its default, doubled while the gathered weights would take more than
    half a GPU (the rest holds the trainer's shards and the caches) and the doubled degree still divides the
    rollout's GPUs and the heads."""
    framework, params_b = framework_of(row), model_size_b(row)
    if framework.script_rollout_tp and params_b is not None:
        return nearest_size(framework.script_rollout_tp, params_b)
    tp = framework.rollout_tp
    while tp and weight_bytes / tp > gpu_bytes / 2 and gpus % (2 * tp) == 0 and heads % (2 * tp) == 0:
        tp *= 2
    return tp


def with_calls(job: JobSpec, sequences: int) -> JobSpec:
    """The job with the rollout's generate calls (``call_sequences``) in the options the cost model reads."""
    return replace(job, options=replace(job.options, rollout_call_sequences=sequences))


def unmodelled(row: dict) -> str:
    """Why the row's rollout engine or offload kind cannot be priced ("" when both can)."""
    if rollout_engine_name(row) is None:
        return (f"rollout_engine={as_written(row, 'rollout_engine')!r} of framework "
                f"{as_written(row, 'framework')!r} is not modelled (known: {', '.join(ENGINE_TRAITS)}; 'other' of "
                "DeepSpeed-Chat)")
    if offload_of(row) is None:
        return (f"offload={as_written(row, 'offload')!r} is not modelled "
                "(known: none, param, optimizer, param+optimizer)")
    share = memory_utilization(row)
    if share is not None and not 0 < share <= 1:
        return (f"gpu_memory_utilization={as_written(row, 'gpu_memory_utilization')!r} is not a share of the GPU's "
                "memory: give a number above 0 and at most 1, or leave it empty")
    return ""


def memory_utilization(row: dict) -> float | None:
    """The share of each rollout GPU's memory the row's engine takes (``Options.gpu_memory_utilization``):
    the row's ``gpu_memory_utilization``, else a verl MoE row's recipe's, else its framework's for the row's
    placement; None where none says (the cost model's prior sizes the KV cache)."""
    stated = number(row, "gpu_memory_utilization")
    if stated is not None:
        return stated
    recipe = verl_moe_recipe(row)
    if recipe is not None and recipe.gpu_memory_utilization:
        return recipe.gpu_memory_utilization
    return dict(framework_of(row).memory_utilization).get(placement(row))


def priced_as_framework(row: dict, job: JobSpec) -> JobSpec:
    """The job with its framework's batching, its rollout engine and its offload in the options the cost
    model reads (a row ``unmodelled`` passes)."""
    pageable = dict(framework_of(row).pageable_offload).get(train_backend(row), "none")
    options = replace(job.options, padded_batches=padded(row), rollout_engine=rollout_engine_name(row),
                      offload=offload_of(row), pageable_offload=pageable,
                      training_efficiency=training_efficiency(row, job),
                      gpu_memory_utilization=memory_utilization(row) or 0.0)
    return replace(job, options=options)


def training_efficiency(row: dict, job: JobSpec) -> float:
    """The fraction of peak the row's training GEMMs run at: its framework's Megatron MoE figure for a
    Megatron-trained MoE actor where it has one, else its framework's (0: the cost model's prior)."""
    framework = framework_of(row)
    if trains_with_megatron(row) and job.models["actor"].moe is not None and framework.megatron_moe_training_efficiency:
        return framework.megatron_moe_training_efficiency
    return framework.training_efficiency


def default_pools(row: dict, total: int, models: tuple[str, ...]) -> dict[str, tuple[int, ...]] | None:
    """The GPUs of the rollout ("generation") and of each model of a disaggregated row without pool sizes, by
    its framework's documented split: each its share of ``total`` (the shares of the models the row runs,
    rescaled to all of them), consecutive, the last taking the rest; None when the framework documents none
    or a group would get no GPU."""
    shares = [(name, share) for name, share in framework_of(row).pools if name == "generation" or name in models]
    if not shares or any(m not in dict(shares) for m in models):
        return None
    scale = sum(share for _, share in shares)
    out, start = {}, 0
    for i, (name, share) in enumerate(shares):
        size = total - start if i == len(shares) - 1 else round(total * share / scale)
        if size < 1:
            return None
        out[name], start = tuple(range(start, start + size)), start + size
    return out


def call_sequences(row: dict, params_b: float, samples: int, actor_ranks: int, engines: int) -> int:
    """Sequences an engine replica is handed per generate call (0: all at once): each actor rank's prompts
    per call (the framework's scripts' value for the nearest model size) times their samples, and the calls
    of the actor ranks that share an engine together."""
    table = framework_of(row).call_prompts
    if not table:
        return 0
    prompts = nearest_size(table, params_b)
    return prompts * samples * max(1, actor_ranks // max(1, engines))
