"""Names of the RL algorithms' interchangeable parts, for spec validation. The functions themselves are
tensor code registered under these names in ``nereus.rl.core``; the names live here so that validating
a spec needs no torch."""

from __future__ import annotations

# Per-token estimators of KL(π‖π_ref) (Schulman 2020, "Approximating KL Divergence"), for the KL
# reward penalty (run.kl_penalty) and the KL loss (run.kl_loss_type).
KL_KINDS = ("k1", "k2", "k3")

# Advantage estimators (algorithm.adv_estimator, verl's key): GAE over the critic's values, or
# GRPO's group-normalised outcome scores (no critic).
ADVANTAGE_ESTIMATORS = ("gae", "grpo")

# The estimator each algorithm uses unless the spec names another.
DEFAULT_ESTIMATOR = {"ppo": "gae", "grpo": "grpo"}

# Estimators that fit a critic's values (the job must train one).
NEEDS_CRITIC = ("gae",)
