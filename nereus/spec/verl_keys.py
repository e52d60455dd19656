"""verl's command-line keys and what Nereus does with each (docs/rl.md, "Command-line overrides"): every key
that verl's own example scripts set (``tests/data/verl_examples.json``, all 139 scripts under verl's
``examples/``) and the common keys of ``verl/trainer/config/ppo_trainer.yaml`` is, in this table or in
``verl_keys_engines`` (engines, parallel degrees, profilers; ``PREFIXES`` for whole sections; ``lookup``
reads both),

- **mapped**: set to the Nereus key of the same meaning (``target``), the value checked there;
- **ignored**: it only tunes how verl's engines use memory or time (FSDP offload, micro-batch sizes, vLLM's
  memory share, padding removal), which Nereus decides per model-stage layout with the same results; a
  one-line note says so;
- **refused**: it asks for something Nereus does not do, with the reason; values in ``accept`` mean what
  Nereus already does and pass (``data.truncation=error``, ``actor_rollout_ref.model.lora_rank=0``).

A few keys need more than a renaming (``nereus.spec.overrides``: ``ppo_mini_batch_size`` becomes a number of
mini-batches, ``custom_reward_function.path``/``name`` one ``run.reward_function``, the parallel degrees
the model-stages' layouts); they are ``derived``.
"""

from __future__ import annotations

from nereus.spec.verl_key_kinds import DERIVED, IGNORED, MAPPED, REFUSED, VerlKey
from nereus.spec.verl_key_kinds import ignored as _ignored
from nereus.spec.verl_key_kinds import mapped as _mapped
from nereus.spec.verl_key_kinds import refused as _refused
from nereus.spec.verl_keys_engines import ENGINE_KEYS, PREFIXES
from nereus.spec.verl_keys_engines import SECTIONS as ENGINE_SECTIONS

__all__ = ["DERIVED", "IGNORED", "MAPPED", "REFUSED", "PREFIXES", "TABLE", "VERL_SECTIONS", "VerlKey", "lookup"]


_A, _R, _REF, _C = "actor_rollout_ref.actor", "actor_rollout_ref.rollout", "actor_rollout_ref.ref", "critic"
_MICRO = _ignored("the micro-batch size is part of each model-stage's layout (run.layouts '...,micro_batch_size=N' "
                  "or the planner's); losses are aggregated over the whole mini-batch, so it changes no result")
_FSDP = _ignored("Nereus has no FSDP: each model-stage runs under its own TP/PP/DP layout with ZeRO-1, planned to "
                 "fit memory, and nothing is offloaded")
_PADDING = _mapped("run.packing.enable", "packed sequences (spec.packing); one value for actor and critic")
_RECOMPUTE = VerlKey(DERIVED, "options.recompute", "true: full recomputation (verl checkpoints every layer), false: "
                                                  "none; one value for actor and critic")
_ONE_VALUE = "one value for actor and critic (a different critic value is refused)"
# verl's actor_rollout_ref.actor.policy_loss.* options the registered losses read (run.policy_loss.*)
_POLICY_LOSS_OPTIONS = ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef", "dro_beta")

TABLE: dict[str, VerlKey] = {
    # ----- algorithm ------------------------------------------------------------------------------------
    "algorithm.adv_estimator": _mapped("algorithm.adv_estimator", "verl's registered names (docs/rl.md)"),
    "algorithm.gamma": _mapped("run.gamma"),
    "algorithm.lam": _mapped("run.lam"),
    "algorithm.norm_adv_by_std_in_grpo": _mapped("run.norm_adv_by_std_in_grpo"),
    "algorithm.kl_penalty": _mapped("run.kl_penalty", "verl's default kl = Nereus's k1"),
    "algorithm.kl_ctrl.kl_coef": VerlKey(DERIVED, "run.kl_coef", "used only under use_kl_in_reward=true (or a job "
                                                                 "whose run.kl_coef is on), in any order"),
    "algorithm.use_kl_in_reward": VerlKey(DERIVED, "run.kl_coef", "false sets run.kl_coef=0; true sets "
                                                                  "kl_ctrl.kl_coef, else the job's, else verl's 0.001"),
    "algorithm.kl_ctrl.type": _mapped("run.kl_ctrl.type", "fixed, or adaptive (Ziegler et al. 2019, "
                                                          "arXiv:1909.08593)"),
    "algorithm.kl_ctrl.target_kl": _mapped("run.kl_ctrl.target_kl", "adaptive only"),
    "algorithm.kl_ctrl.horizon": _mapped("run.kl_ctrl.horizon", "adaptive only"),
    "algorithm.filter_groups.enable": _mapped("run.filter_groups.enable", "DAPO's dynamic sampling"),
    "algorithm.filter_groups.metric": _mapped("run.filter_groups.metric"),
    "algorithm.filter_groups.max_num_gen_batches": _mapped("run.filter_groups.max_num_gen_batches",
                                                           "0 or less: no limit"),
    # ----- data -----------------------------------------------------------------------------------------
    "data.train_files": _mapped("run.data.train", "one file or a list"),
    "data.val_files": _mapped("run.data.val", "one file or a list"),
    "data.train_batch_size": _mapped("workload.prompts_per_step"),
    "data.max_prompt_length": _mapped("workload.prompt_length"),
    "data.max_response_length": _mapped("workload.response_length.max", "the curriculum may lower it early on"),
    "data.filter_overlong_prompts": _mapped("run.data.filter_overlong_prompts",
                                            "false: an overlong prompt is an error naming its row"),
    "data.truncation": _refused("Nereus never truncates a prompt: a row longer than data.max_prompt_length is an "
                                "error naming it (verl's 'error'), or dropped with data.filter_overlong_prompts",
                                "error"),
    "data.return_raw_chat": _ignored("every row keeps its chat messages; the reward model scores the actor's "
                                     "tokens (a reward model with another tokenizer is not supported)"),
    "data.shuffle": _refused("prompts are always drawn in a seeded shuffled order per epoch (run.seed)", True),
    "data.prompt_key": _refused("rows hold their messages under 'prompt', verl's default", "prompt"),
    "data.reward_fn_key": _refused("the reward is routed by 'data_source', verl's default", "data_source"),
    # ----- actor, rollout, reference --------------------------------------------------------------------
    "actor_rollout_ref.model.path": VerlKey(DERIVED, "models.actor.path",
                                            "also models.reference.path when the job has a reference (verl's "
                                            "reference is the actor's starting model)"),
    "actor_rollout_ref.model.use_remove_padding": _PADDING,
    "actor_rollout_ref.model.enable_gradient_checkpointing": _RECOMPUTE,
    f"{_A}.strategy": _ignored("Nereus's own engine (TP/PP/DP layouts) replaces verl's fsdp/megatron workers"),
    f"{_A}.optim.lr": _mapped("run.actor_lr", "verl 1e-6 for 7B models; Nereus's tiny examples use 3e-4"),
    f"{_A}.optim.lr_warmup_steps": _mapped("run.lr_warmup_steps", _ONE_VALUE + "; -1 defers to the ratio"),
    f"{_A}.optim.lr_warmup_steps_ratio": _mapped("run.lr_warmup_steps_ratio", _ONE_VALUE),
    f"{_A}.optim.weight_decay": _mapped("run.weight_decay", _ONE_VALUE + "; AdamW's decoupled decay"),
    f"{_A}.optim.clip_grad": _mapped("run.grad_clip", _ONE_VALUE),
    f"{_A}.optim.lr_scheduler_type": _mapped("run.lr_scheduler_type", _ONE_VALUE + "; constant or cosine"),
    f"{_A}.optim.warmup_style": _mapped("run.lr_scheduler_type", "verl's older name of lr_scheduler_type"),
    f"{_A}.optim.lr_decay_style": _mapped("run.lr_scheduler_type", "Megatron's name of lr_scheduler_type"),
    f"{_A}.optim.min_lr_ratio": _mapped("run.min_lr_ratio", _ONE_VALUE + "; cosine only"),
    f"{_A}.optim.num_cycles": _mapped("run.num_cycles", _ONE_VALUE + "; cosine only"),
    f"{_A}.grad_clip": _mapped("run.grad_clip", _ONE_VALUE + "; verl's default 1.0"),
    f"{_A}.ppo_mini_batch_size": VerlKey(DERIVED, "algorithm.mini_batches",
                                         "in prompts, as verl's: algorithm.mini_batches = train_batch_size / "
                                         "ppo_mini_batch_size (which must divide it)"),
    f"{_A}.ppo_micro_batch_size_per_gpu": _MICRO,
    f"{_A}.ppo_micro_batch_size": _MICRO,
    f"{_A}.use_dynamic_bsz": _mapped("run.packing.dynamic_bsz", "token-budget micro-batches, packed"),
    f"{_A}.ppo_max_token_len_per_gpu": _mapped("run.packing.max_token_len_per_gpu", "read with use_dynamic_bsz"),
    f"{_A}.ppo_epochs": _mapped("algorithm.epochs"),
    f"{_A}.clip_ratio": _mapped("run.clip_ratio", "0.2"),
    f"{_A}.clip_ratio_low": _mapped("run.clip_ratio_low", "defaults to clip_ratio"),
    f"{_A}.clip_ratio_high": _mapped("run.clip_ratio_high", "defaults to clip_ratio"),
    f"{_A}.clip_ratio_c": _mapped("run.clip_ratio_c", "3.0"),
    f"{_A}.loss_agg_mode": _mapped("run.loss_agg_mode", "token-mean; the critic uses the same"),
    f"{_A}.policy_loss.loss_mode": _mapped("run.policy_loss.loss_mode", "vanilla (the clipped loss) by default"),
    **{f"{_A}.policy_loss.{o}": _mapped(f"run.policy_loss.{o}") for o in _POLICY_LOSS_OPTIONS},
    f"{_A}.tau_pos": _mapped("run.policy_loss.tau_pos", "SAPO's"),
    f"{_A}.tau_neg": _mapped("run.policy_loss.tau_neg", "SAPO's"),
    f"{_A}.entropy_coeff": _mapped("run.entropy_coeff", "0"),
    f"{_A}.use_kl_loss": _mapped("run.use_kl_loss", "false"),
    f"{_A}.kl_loss_coef": _mapped("run.kl_loss_coef", "0.001"),
    f"{_A}.kl_loss_type": _mapped("run.kl_loss_type", "verl's default low_var_kl = Nereus's k3"),
    f"{_A}.fsdp_config.param_offload": _FSDP,
    f"{_A}.fsdp_config.optimizer_offload": _FSDP,
    f"{_REF}.fsdp_config.param_offload": _FSDP,
    f"{_REF}.log_prob_micro_batch_size_per_gpu": _MICRO,
    f"{_R}.name": _mapped("run.rollout.engine", "native (Nereus's default) or vllm (docs/vllm.md); verl's sglang "
                                                "and hf are refused by the value check"),
    f"{_R}.n": _mapped("algorithm.samples_per_prompt", "GRPO needs >= 2"),
    f"{_R}.temperature": _mapped("run.temperature"),
    f"{_R}.top_p": _mapped("run.top_p"),
    f"{_R}.val_kwargs.n": _mapped("run.rollout.val_kwargs.n", "responses per held-out prompt (with do_sample)"),
    f"{_R}.val_kwargs.temperature": _mapped("run.rollout.val_kwargs.temperature"),
    f"{_R}.val_kwargs.top_p": _mapped("run.rollout.val_kwargs.top_p"),
    f"{_R}.val_kwargs.do_sample": _mapped("run.rollout.val_kwargs.do_sample", "false: greedy (the default)"),
    f"{_R}.top_k": _mapped("run.top_k", "-1 or 0: off"),
    f"{_R}.do_sample": _refused("rollouts always sample (greedy decoding is for evaluation)", True),
    f"{_R}.max_num_seqs": _mapped("run.rollout.slots", "sequences per replica in continuous batching; Nereus's "
                                                       "default 0 keeps the fixed batch"),
    f"{_R}.gpu_memory_utilization": _mapped("run.rollout.gpu_memory_utilization", "the vLLM engine's share; the "
                                                                                 "native engine sizes each "
                                                                                 "sequence's cache to it"),
    f"{_R}.log_prob_micro_batch_size_per_gpu": _MICRO,
    f"{_R}.enforce_eager": _mapped("run.rollout.enforce_eager", "the vLLM engine's"),
    f"{_R}.free_cache_engine": _ignored("caches live only while their sequence generates"),
    # ----- critic ---------------------------------------------------------------------------------------
    "critic.model.path": _mapped("models.critic.path", "a causal LM gets a zero value head"),
    "critic.model.use_remove_padding": _PADDING,
    "critic.model.enable_gradient_checkpointing": _RECOMPUTE,
    "critic.model.fsdp_config.param_offload": _FSDP,
    "critic.model.fsdp_config.optimizer_offload": _FSDP,
    "critic.optim.lr": _mapped("run.critic_lr"),
    "critic.optim.lr_warmup_steps": _mapped("run.lr_warmup_steps", _ONE_VALUE),
    "critic.optim.lr_warmup_steps_ratio": _mapped("run.lr_warmup_steps_ratio", _ONE_VALUE),
    "critic.optim.weight_decay": _mapped("run.weight_decay", _ONE_VALUE),
    "critic.optim.clip_grad": _mapped("run.grad_clip", _ONE_VALUE),
    "critic.optim.lr_scheduler_type": _mapped("run.lr_scheduler_type", _ONE_VALUE),
    "critic.optim.warmup_style": _mapped("run.lr_scheduler_type", _ONE_VALUE),
    "critic.optim.min_lr_ratio": _mapped("run.min_lr_ratio", _ONE_VALUE),
    "critic.optim.num_cycles": _mapped("run.num_cycles", _ONE_VALUE),
    "critic.grad_clip": _mapped("run.grad_clip", _ONE_VALUE),
    "critic.cliprange_value": _mapped("run.value_clip", "0.5"),
    "critic.ppo_micro_batch_size_per_gpu": _MICRO,
    "critic.ppo_mini_batch_size": VerlKey(DERIVED, "algorithm.mini_batches", "must equal the actor's"),
    "critic.ppo_epochs": _mapped("algorithm.epochs", _ONE_VALUE),
    # ----- reward model and reward function -------------------------------------------------------------
    "reward_model.enable": VerlKey(DERIVED, "models.reward", "must agree with the job: true needs models.reward, "
                                                             "false a job without one"),
    "reward_model.model.path": _mapped("models.reward.path", "a *ForSequenceClassification checkpoint"),
    "reward_model.overlong_buffer.enable": _mapped("run.overlong_buffer.enable", "DAPO's overlong reward shaping"),
    "reward_model.overlong_buffer.len": _mapped("run.overlong_buffer.len"),
    "reward_model.overlong_buffer.penalty_factor": _mapped("run.overlong_buffer.penalty_factor"),
    # verl's DAPO reward manager reads the same settings from its reward_kwargs
    "reward_model.reward_kwargs.overlong_buffer_cfg.enable": _mapped("run.overlong_buffer.enable"),
    "reward_model.reward_kwargs.overlong_buffer_cfg.len": _mapped("run.overlong_buffer.len"),
    "reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor": _mapped("run.overlong_buffer.penalty_factor"),
    "reward_model.reward_kwargs.overlong_buffer_cfg.log": _ignored("the overlong penalty's step metrics are always "
                                                                   "written"),
    "reward_model.reward_kwargs.max_resp_len": _ignored("the overlong buffer ends at data.max_response_length "
                                                        "(workload.response_length.max), what verl's scripts set"),
    "reward_model.reward_manager": _refused("Nereus scores with verl's default rule per data_source (naive) plus "
                                            "the overlong penalty where run.overlong_buffer is on (dapo)",
                                            "naive", "dapo"),
    "reward_model.use_reward_loop": _ignored("the reward model runs as a model-stage (reward/inference) under its "
                                             "own layout"),
    "reward_model.num_workers": _ignored("the reward model's workers are its reward/inference layout's"),
    "reward_model.rollout.name": _ignored("the reward model is a scorer run by Nereus's engine, not a served model"),
    "reward_model.rollout.gpu_memory_utilization": _ignored("memory is planned per model-stage layout"),
    "reward_model.rollout.tensor_model_parallel_size": _ignored("the reward/inference layout sets its TP"),
    "reward_model.rollout.prompt_length": _ignored("the reward model scores the packed prompt and response"),
    "reward_model.rollout.response_length": _ignored("the reward model scores the packed prompt and response"),
    "custom_reward_function.path": VerlKey(DERIVED, "run.reward_function", "with .name: run.reward_function: "
                                                                           "'path:name'"),
    "custom_reward_function.name": VerlKey(DERIVED, "run.reward_function", "verl's default compute_score"),
    "custom_reward_function.reward_kwargs": _refused("a reward function is called with verl's four arguments "
                                                     "only", {}),
    # ----- trainer --------------------------------------------------------------------------------------
    "trainer.total_training_steps": _mapped("run.steps", "wins over trainer.total_epochs, as in verl"),
    "trainer.total_epochs": _mapped("run.total_epochs", "steps = epochs x (train rows // train_batch_size)"),
    "trainer.save_freq": VerlKey(DERIVED, "run.checkpoint.every", "-1 (no checkpoints in verl): 0, only the "
                                                                  "final checkpoint"),
    "trainer.test_freq": VerlKey(DERIVED, "run.eval_every", "held-out accuracy every N steps and at the end; "
                                                            "-1 (never in verl): 0, only at the end"),
    "trainer.val_before_train": _ignored("the starting accuracy is always measured (the summary's warm-start "
                                         "accuracy)"),
    "trainer.critic_warmup": _mapped("run.critic_warmup", "steps that train only the critic"),
    "trainer.logger": _mapped("run.logger", "file = Nereus's jsonl"),
    "trainer.project_name": _ignored("wandb and mlflow runs go to the project 'nereus', named by "
                                     "trainer.experiment_name"),
    "trainer.experiment_name": _mapped("name", "the job's name (wandb/mlflow run name)"),
    "trainer.default_local_dir": _mapped("run.checkpoint.dir"),
    "trainer.nnodes": VerlKey(DERIVED, "cluster.nodes", "and run.workers = nnodes x n_gpus_per_node (the job "
                                                        "file's for the one not given); refused under "
                                                        "run.adapt.availability"),
    "trainer.n_gpus_per_node": VerlKey(DERIVED, "cluster.gpus_per_node", "and run.workers, as trainer.nnodes"),
    "trainer.resume_mode": _refused("resume with `nereus run JOB --resume` (from the run folder's latest "
                                    "checkpoint)", "disable"),
    "trainer.use_legacy_worker_impl": _ignored("verl's choice between its worker implementations"),
    "ray_init.num_cpus": _ignored("Nereus starts its own local Ray with run.workers workers (or joins one: "
                                  "nereus run --address)"),
}

# engines, parallel degrees, profilers and the trainers Nereus does not have: a second module, one table
TABLE.update({k: v for k, v in ENGINE_KEYS.items() if k not in TABLE})

# Top-level sections of verl's config: a key under one of them that is not in TABLE is refused by name.
VERL_SECTIONS = ("actor_rollout_ref", "data", "critic", "reward_model", "trainer", "custom_reward_function",
                 "ray_init", *ENGINE_SECTIONS)


def lookup(key: str) -> VerlKey | None:
    """What Nereus does with the verl key ``key``: its row of ``TABLE``, else that of the longest
    ``PREFIXES`` path it lies under (every key under ``actor_rollout_ref.actor.profiler.``); None if neither."""
    if key in TABLE:
        return TABLE[key]
    under = [p for p in PREFIXES if key.startswith(p)]
    return PREFIXES[max(under, key=len)] if under else None
