"""verl's keys for its engines, parallelism, profiling and the trainers Nereus does not have, with what
Nereus does with each (merged into ``nereus.spec.verl_keys.TABLE``; docs/rl.md, "Command-line overrides").

Every key that verl's own example scripts set (``tests/data/verl_examples.json``) is here or in
``verl_keys``. Keys that only tune how verl's engines use time or memory (kernels, fusions, offloading,
compilation, weight loading, profilers, checkpoint formats) are ignored with a shared reason; the parallel
degrees become the model-stages' layouts (``nereus.spec.verl_layouts``); features Nereus does not have
(LoRA, multi-turn tools, vision inputs, context or expert parallelism, verl's SFT and offline-generation
trainers) are refused with theirs, passing where the value is the one meaning "off".

``PREFIXES`` gives one fate to every key under a path (``actor_rollout_ref.actor.profiler.*``): verl's
sections whose keys all share it.
"""

from __future__ import annotations

from nereus.spec.verl_key_kinds import VerlKey, derived, ignored, mapped, refused
from nereus.spec.verl_layouts import DEGREES

_A, _R, _REF, _C = "actor_rollout_ref.actor", "actor_rollout_ref.rollout", "actor_rollout_ref.ref", "critic"
_M = "actor_rollout_ref.model"
_ROLES = (_A, _REF, _C)

_MICRO = ignored("the micro-batch size is part of each model-stage's layout (run.layouts '...,micro_batch_size=N' "
                 "or the planner's); losses are aggregated over the whole mini-batch, so it changes no result")
_ENGINE = ignored("an implementation choice of verl's engines (kernels, fusions, compilation, weight loading and "
                  "transfer, prefetching): it changes time or memory, not results; Nereus's engine makes its own")
_OFFLOAD = ignored("offloading weights, gradients or optimizer state to the CPU changes memory, not results; Nereus "
                   "plans each model-stage's layout to fit memory without offloading")
_FSDP = ignored("an option of verl's FSDP workers; Nereus runs each model-stage under its own TP/PP/DP layout "
                "(ZeRO-1 by default), planned to fit memory")
_MEGATRON = ignored("an option of verl's Megatron workers (offloading, checkpoint format, model bridge, transformer "
                    "overrides: fusions, recomputation, MoE dispatch); Nereus's engine runs the layout's degrees "
                    "itself")
_PRECISION = ignored("Nereus's precision: bf16 weights on GPUs, fp32 on CPU workers (options.weight_bytes), fp32 "
                     "gradient accumulation (options.grad_bytes)")
_PROFILE = ignored("verl's profilers, tracing and engine statistics; Nereus writes its own step metrics and "
                   "per-stage times (docs/rl.md, 'Output')")
_CHECKPOINT = ignored("verl's checkpoint formats and retention; Nereus writes its own checkpoints in "
                      "run.checkpoint.dir (nereus run --resume)")
_REMOTE_CODE = ignored("Nereus reads a checkpoint's config and weights itself and runs no code from it")
_LORA = refused("LoRA adapters are not implemented: Nereus trains every weight", 0)
_VISION = refused("vision-language inputs are not supported (text-only decoders)", False)
_ETP = refused("tensor parallelism inside experts different from the attention's is not in the runtime (experts "
               "split by the layout's tp); 1 is the only degree", 1)
_ROLLOUT_EP = refused("expert parallelism in generation is not in the native engine (its experts are replicated "
                      "over the rollout's ranks); 1 is the only degree", 1)
_CP = refused("context parallelism is not in the runtime (long sequences split by TP with sequence parallelism)", 1)
_MULTI_TURN = refused("multi-turn rollouts with tools or interactions are not implemented (one response per "
                      "prompt)", False)
_SFT = refused("a key of verl's SFT trainer (verl.trainer.fsdp_sft_trainer, sft_trainer): nereus run trains RL "
               "jobs; supervised steps are its warm-start (run.warmstart)")
_OFFLINE_GEN = refused("a key of verl's offline generation (verl.trainer.main_generation), which Nereus does not "
                       "have")


def _each(suffix: str, fate: VerlKey, roles: tuple[str, ...] = _ROLES) -> dict[str, VerlKey]:
    return {f"{role}.{suffix}": fate for role in roles}


ENGINE_KEYS: dict[str, VerlKey] = {
    # ----- parallel degrees: the model-stages' layouts (verl_layouts) ---------------------------------------
    **{key: derived(f"run.layouts.{stages[0]}", f"{field} of {', '.join(stages)}")
       for key, (stages, field) in DEGREES.items()},
    **_each("megatron.context_parallel_size", _CP),
    **_each("megatron.expert_tensor_parallel_size", _ETP),
    f"{_R}.expert_parallel_size": _ROLLOUT_EP,
    # ----- the vLLM engine's scheduler ----------------------------------------------------------------------
    f"{_R}.enable_chunked_prefill": mapped("run.rollout.enable_chunked_prefill", "the vLLM engine's; the native "
                                                                                "engine prefills a prompt whole"),
    f"{_R}.max_num_batched_tokens": mapped("run.rollout.max_num_batched_tokens", "the vLLM engine's; the native "
                                                                                "engine has no token budget"),
    f"{_R}.max_model_len": ignored("the engine's context is set from the workload's prompt and response lengths"),
    f"{_R}.mode": ignored("verl's choice between in-process and server rollouts; both sample the same responses "
                          "(Nereus's own one-step asynchrony is run.async)"),
    f"{_R}.calculate_log_probs": ignored("the engines always record each sampled token's log-prob "
                                         "(algorithm.recompute_old_log_prob says whether training recomputes them)"),
    f"{_R}.over_sample_rate": refused("verl's cut of the slowest responses is not implemented (Nereus's tail "
                                      "levers: run.rollout.tail_batching, partial_rollout)", 0),
    f"{_R}.val_kwargs.top_k": refused("held-out sampling has no top-k (run.rollout.val_kwargs: n, temperature, "
                                      "top_p, do_sample)", -1, 0),
    f"{_R}.multi_turn.enable": _MULTI_TURN,
    f"{_R}.enable_rollout_routing_replay": mapped("run.router_replay", "the native engine records each token's "
                                                                     "experts, training replays them"),
    f"{_A}.router_replay.mode": refused("Nereus replays the rollout's routing (verl's R3) as "
                                        f"{_R}.enable_rollout_routing_replay (run.router_replay) says; "
                                        "to turn it off set that false", "R3"),
    **{f"{_R}.{k}": _ENGINE for k in ("layered_summon", "load_format", "multi_stage_wake_up", "skip_tokenizer_init")},
    f"{_R}.disable_log_stats": _PROFILE,
    # ----- micro-batches and token budgets: packed sequences (spec.packing) ---------------------------------
    **_each("log_prob_use_dynamic_bsz", mapped("run.packing.dynamic_bsz", "one value for every model"), (_R, _REF)),
    **_each("log_prob_max_token_len_per_gpu", mapped("run.packing.log_prob_max_token_len_per_gpu",
                                                     "the actor's and reference's inference"), (_R, _REF)),
    **_each("log_prob_micro_batch_size", _MICRO, (_R, _REF)),
    f"{_C}.use_dynamic_bsz": mapped("run.packing.dynamic_bsz", "one value for every model"),
    f"{_C}.ppo_max_token_len_per_gpu": mapped("run.packing.critic_max_token_len_per_gpu"),
    f"{_C}.forward_max_token_len_per_gpu": mapped("run.packing.forward_max_token_len_per_gpu"),
    "reward_model.micro_batch_size_per_gpu": _MICRO,
    "trainer.balance_batch": ignored("verl reorders a step's rows to even out tokens per data-parallel rank, for "
                                     "time; Nereus keeps the step's order"),
    # ----- engines: kernels, precision, offloading ----------------------------------------------------------
    **_each("use_torch_compile", _ENGINE, (_A, _REF)),
    **_each("entropy_checkpointing", _ENGINE, (_A, _REF)),
    **_each("entropy_from_logits_with_chunking", _ENGINE, (_A, _REF)),
    f"{_A}.use_prefix_grouper": ignored("computes a group's shared prompt once: time only"),
    f"{_A}.calculate_sum_pi_squared": ignored("computed in the actor's old-log-prob pass when "
                                              "algorithm.adv_estimator needs it (optimal_token_baseline)"),
    f"{_REF}.strategy": ignored("Nereus's own engine (TP/PP/DP layouts) replaces verl's fsdp/megatron workers"),
    f"{_M}.use_fused_kernels": _ENGINE,
    f"{_M}.use_shm": _ENGINE,
    f"{_M}.torch_dtype": _PRECISION,
    f"{_M}.enable_activation_offload": _OFFLOAD,
    f"{_M}.trust_remote_code": _REMOTE_CODE,
    "critic.model.trust_remote_code": _REMOTE_CODE,
    "data.trust_remote_code": _REMOTE_CODE,
    "actor_rollout_ref.hybrid_engine": ignored("verl's colocated actor and rollout; Nereus places each model-stage "
                                               "on the workers of its layout's ranks"),
    "actor_rollout_ref.nccl_timeout": ignored("Nereus's collectives and calls have their own deadlines"),
    "reward_model.model.fsdp_config.param_offload": _FSDP,
    "reward_model.model.use_remove_padding": ignored("the reward model packs as the actor and critic do "
                                                     "(run.packing.enable); packing changes time, not results"),
    # ----- features Nereus does not have -------------------------------------------------------------------
    f"{_M}.lora_rank": _LORA,
    f"{_M}.lora_alpha": _LORA,
    f"{_M}.lora_adapter_path": _LORA,
    f"{_M}.target_modules": _LORA,
    f"{_M}.exclude_modules": _LORA,
    f"{_A}.freeze_vision_tower": _VISION,
    "data.image_key": _VISION,
    "algorithm.use_pf_ppo": refused("policy-filtered PPO's sample reweighting is not implemented", False),
    # verl's rollout correction: bypass mode is the bypass_mode policy loss; the IS settings go to it, or to the
    # asynchronous mode's correction (run.async) without it
    "algorithm.rollout_correction.bypass_mode": derived("run.policy_loss.loss_mode",
                                                        "true: the bypass_mode loss, the rollout's log-probs as the "
                                                        "old ones (algorithm.recompute_old_log_prob false)"),
    **{f"algorithm.rollout_correction.{k}": derived("run.policy_loss.rollout_correction." + k,
                                                    "with bypass_mode; else run.async." + k + " (the asynchronous "
                                                    "mode's correction); null is none")
       for k in ("rollout_is", "rollout_is_threshold")},
    **{f"algorithm.rollout_correction.{k}": mapped("run.policy_loss.rollout_correction." + k, "bypass_mode's")
       for k in ("loss_type", "rollout_rs", "rollout_rs_threshold")},
    "algorithm.rollout_correction.rollout_is_batch_normalize": refused("importance weights are not normalised "
                                                                       "per batch (its mean would differ "
                                                                       "between micro-batches)", False),
    # ----- data, trainer ------------------------------------------------------------------------------------
    "data.dataloader_num_workers": ignored("the driver reads the data once, before the first step"),
    "data.filter_overlong_prompts_workers": ignored("the driver reads the data once, before the first step"),
    "data.val_batch_size": ignored("held-out prompts are generated in the batches the engine chooses"),
    "data.gen_batch_size": ignored("dynamic sampling (run.filter_groups) draws generation batches of "
                                   "data.train_batch_size prompts; a larger batch only changes how many draws a "
                                   "step makes"),
    "data.custom_cls.path": refused("rows are read by Nereus's reader of verl's parquet layout; custom dataset "
                                    "classes are not supported"),
    "data.custom_cls.name": refused("rows are read by Nereus's reader of verl's parquet layout; custom dataset "
                                    "classes are not supported"),
    "trainer.device": refused("Nereus runs on CUDA GPUs or on CPU workers", "cuda"),
    "trainer.log_val_generations": ignored("held-out accuracy is logged, not sample generations"),
    "trainer.resume_from_path": refused("resume with nereus run JOB --resume --out DIR (the folder's latest "
                                        "checkpoint)"),
    **{f"trainer.max_{w}ckpt_to_keep": _CHECKPOINT for w in ("", "actor_", "critic_")},
    # verl's SFT trainer and offline generation: keys outside its PPO trainer's sections
    **{f"data.{k}": _SFT for k in ("micro_batch_size", "micro_batch_size_per_gpu", "max_length", "pad_mode",
                                   "response_key", "prompt_dict_keys", "response_dict_keys",
                                   "max_token_len_per_gpu", "use_dynamic_bsz")},
    **{f"data.{k}": _OFFLINE_GEN for k in ("path", "n_samples", "output_path")},
}

# path prefix -> the fate of every key under it
PREFIXES: dict[str, VerlKey] = {
    **{f"{role}.profiler.": _PROFILE for role in _ROLES},
    "global_profiler.": _PROFILE,
    f"{_R}.prometheus.": _PROFILE,
    f"{_R}.trace.": _PROFILE,
    **{f"{role}.megatron.": _MEGATRON for role in _ROLES},
    **{f"{role}.fsdp_config.": _FSDP for role in (_A, _REF, "critic.model")},
    **{f"{role}.optim.override_optimizer_config.": _OFFLOAD for role in (_A, _C)},
    **{f"{role}.checkpoint.": _CHECKPOINT for role in (_A, _C)},
    "checkpoint.": _CHECKPOINT,
    f"{_R}.checkpoint_engine.": _ENGINE,
    f"{_R}.engine_kwargs.": ignored("arguments of verl's sglang, vLLM and TensorRT-LLM servers; Nereus's vLLM "
                                    "engine takes its settings from run.rollout (docs/vllm.md)"),
    f"{_M}.fused_kernel_options.": _ENGINE,
    f"{_M}.lora.": _LORA,
    f"{_M}.mtp.": refused("multi-token prediction is not implemented", False),
    f"{_M}.override_config.": refused("the model's config is read from its checkpoint unchanged"),
    f"{_R}.multi_turn.": _MULTI_TURN,
    "algorithm.pf_ppo.": refused("policy-filtered PPO's sample reweighting is not implemented"),
    "data.apply_chat_template_kwargs.": refused("the chat template is applied with its defaults"),
    "data.sampler.": refused("prompts are drawn in a seeded shuffled order per epoch (run.seed); custom samplers "
                             "are not supported"),
    "data.multiturn.": _SFT,
    "reward_model.sandbox_fusion.": refused("code-execution rewards are not built in; a reward function "
                                            "(custom_reward_function.path) may call a sandbox"),
    "model.": _SFT,
    "optim.": _SFT,
    "engine.": _SFT,
    "rollout.": _OFFLINE_GEN,
}

# top-level sections of verl's trainers (beyond the PPO trainer's) whose keys are read here
SECTIONS = ("global_profiler", "checkpoint", "model", "optim", "engine", "rollout")
