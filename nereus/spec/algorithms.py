"""Names of the RL algorithms' interchangeable parts, for spec validation. The functions themselves are
tensor code registered under these names in ``nereus.rl.core``; the names live here so that validating
a spec needs no torch."""

from __future__ import annotations

# Per-token estimators of KL(π‖π_ref) (Schulman 2020, "Approximating KL Divergence"), for the KL reward
# penalty (run.kl_penalty) and the KL loss (run.kl_loss_type): Nereus's canonical names, each with one
# function in nereus.rl.core.KL_ESTIMATORS.
KL_ESTIMATOR_NAMES = ("k1", "k2", "k3", "abs")

# Every spelling the spec accepts -> its canonical estimator. verl's names (verl/trainer/ppo/core_algos.py,
# kl_penalty): "kl" is k1 (log r), "mse" is k2 (½(log r)²), "low_var_kl" is k3, "abs" is |log r|.
KL_ALIASES = {"k1": "k1", "kl": "k1", "k2": "k2", "mse": "k2", "k3": "k3", "low_var_kl": "k3", "abs": "abs"}
KL_KINDS = tuple(KL_ALIASES)

# verl spells the exact full-vocabulary KL "full" and raises NotImplementedError for it; so does Nereus
# (with a spec error), since it needs both models' full distributions at every response token.
KL_UNSUPPORTED = {"full": "the full-vocabulary KL is not implemented (verl raises NotImplementedError for it "
                          "too); use low_var_kl (k3) or kl (k1)"}

# How a [B, R] per-token loss becomes one number (verl's actor.loss_agg_mode / critic.loss_agg_mode; see
# nereus.rl.core.agg_loss for each formula).
LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

# Policy losses (verl's actor.policy_loss.loss_mode; run.policy_loss.loss_mode), each registered under its
# name in nereus.rl.policy_losses with its paper's formula.
POLICY_LOSSES = ("vanilla", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "cispo", "dppo_tv", "dppo_kl",
                 "dro", "bypass_mode")

# Metric sinks (verl's trainer.logger). "file" is verl's name for a JSONL file; "jsonl" is Nereus's.
LOGGERS = ("console", "jsonl", "file", "tensorboard", "wandb", "mlflow")

# Advantage estimators (algorithm.adv_estimator, verl's key and verl's names; each formula and paper is in
# nereus.rl.advantages / nereus.rl.token_baseline): GAE over the critic's values, or a critic-free baseline.
ADVANTAGE_ESTIMATORS = ("gae", "grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "rloo", "opo",
                        "grpo_passk", "gpg", "rloo_vectorized", "grpo_vectorized", "optimal_token_baseline",
                        "tir_optimal_token_baseline", "gdpo")

# The estimator each algorithm uses unless the spec names another.
DEFAULT_ESTIMATOR = {"ppo": "gae", "grpo": "grpo"}

# Estimators that fit a critic's values (the job must train one).
NEEDS_CRITIC = ("gae",)

# Estimators that compare responses to the same prompt: they need samples_per_prompt >= 2 (one sample per
# prompt leaves every group alone; the verl-derived EasyR1 refuses rollout.n == 1 for GRPO too,
# https://github.com/hiyouga/EasyR1 verl/trainer/ray_trainer.py).
NEEDS_GROUPS = ("grpo", "reinforce_plus_plus_baseline", "rloo", "opo", "grpo_passk", "gpg", "rloo_vectorized",
                "grpo_vectorized", "optimal_token_baseline", "tir_optimal_token_baseline", "gdpo")

# Estimators that read an input beyond the step's scores, log-probs and values: ReMax's baseline is the score
# of a greedy response per prompt (an extra generation pass, AdvantageInputs.baseline_scores); the optimal
# token baseline reads Σ_v π(v)² at every response token from the inference pass (sum_pi_squared).
NEEDS_GREEDY_BASELINE = ("remax",)
NEEDS_SUM_PI_SQUARED = ("optimal_token_baseline", "tir_optimal_token_baseline")
