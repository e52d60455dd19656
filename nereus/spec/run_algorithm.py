"""``run.policy_loss``: which registered policy loss trains the actor (verl's
``actor_rollout_ref.actor.policy_loss.loss_mode``) and the options the losses read, under verl's names
and with verl's defaults (verl/workers/config/actor.py ``PolicyLossConfig``, ``ActorConfig.tau_pos``/
``tau_neg``; the rollout correction of ``bypass_mode`` under ``run.policy_loss.rollout_correction``). The
losses are ``nereus.rl.policy_losses``; this module needs no torch."""

from __future__ import annotations

from dataclasses import dataclass

from nereus.spec.algorithms import POLICY_LOSSES
from nereus.spec.errors import SpecError
from nereus.spec.fields import Fields

# bypass_mode's rollout correction (verl's rollout_correction.loss_type, rollout_is, rollout_rs)
BYPASS_LOSS_TYPES = ("ppo_clip", "reinforce")
ROLLOUT_IS_LEVELS = ("token", "sequence")
ROLLOUT_RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
                      "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")


@dataclass(frozen=True)
class PolicyLossSpec:
    """``run.policy_loss``: ``loss_mode`` and its options (verl's defaults). The clip bounds are
    ``run.clip_ratio``/``clip_ratio_low``/``clip_ratio_high``/``clip_ratio_c``, shared by every loss."""

    loss_mode: str = "vanilla"
    tau_pos: float = 1.0  # SAPO's gate temperatures (A > 0, A <= 0)
    tau_neg: float = 1.05
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1
    dro_beta: float | None = None  # required (> 0) by dro
    loss_type: str = "ppo_clip"  # bypass_mode: ppo_clip or reinforce
    rollout_is: str | None = None  # bypass_mode: token, sequence or none
    rollout_is_threshold: float | str = 2.0  # an upper bound (TIS) or "lower_upper" (IcePop)
    rollout_rs: str | None = None  # bypass_mode's rejection: comma-separated ROLLOUT_RS_OPTIONS
    rollout_rs_threshold: float | str | None = None

    def options(self) -> dict[str, object]:
        """The options under verl's names, as ``nereus.rl.policy_losses`` reads them."""
        return {k: v for k, v in vars(self).items() if k != "loss_mode"}


def _threshold(f: Fields, key: str, default: float | str | None) -> float | str | None:
    """A number, or verl's text spelling (``"0.5_2.0"``, comma-separated per option)."""
    value = f.get(key, (float, str), default)
    if isinstance(value, float) and value <= 0:
        raise SpecError(f.key_path(key), f"{value} must be above 0")
    return value


def _rollout_rs(f: Fields) -> str | None:
    value = f.get("rollout_rs", str, None)
    if value is None or value == "none":
        return None
    for part in value.split(","):
        if part.strip() not in ROLLOUT_RS_OPTIONS:
            raise SpecError(f.key_path("rollout_rs"), f"{part.strip()!r} is not a rejection option; choose from "
                                                      f"{list(ROLLOUT_RS_OPTIONS)}, comma-separated")
    return value


def read_policy_loss(f: Fields, extra_losses: tuple[str, ...] = ()) -> PolicyLossSpec:
    """``run.policy_loss`` (``extra_losses``: names user modules register, ``run.algorithm_modules``)."""
    p = f.sub("policy_loss")
    rc = p.sub("rollout_correction")
    rollout_is = rc.get("rollout_is", str, None, choices=(*ROLLOUT_IS_LEVELS, "none"))
    spec = PolicyLossSpec(
        loss_mode=p.get("loss_mode", str, "vanilla", choices=(*POLICY_LOSSES, *extra_losses)),
        tau_pos=p.get("tau_pos", float, 1.0, minimum=0), tau_neg=p.get("tau_neg", float, 1.05, minimum=0),
        clip_cov_ratio=p.get("clip_cov_ratio", float, 0.0002, minimum=0, maximum=1),
        clip_cov_lb=p.get("clip_cov_lb", float, 1.0), clip_cov_ub=p.get("clip_cov_ub", float, 5.0),
        kl_cov_ratio=p.get("kl_cov_ratio", float, 0.0002, minimum=0, maximum=1),
        ppo_kl_coef=p.get("ppo_kl_coef", float, 0.1), dro_beta=p.get("dro_beta", float, None),
        loss_type=rc.get("loss_type", str, "ppo_clip", choices=BYPASS_LOSS_TYPES),
        rollout_is=None if rollout_is == "none" else rollout_is,
        rollout_is_threshold=_threshold(rc, "rollout_is_threshold", 2.0),
        rollout_rs=_rollout_rs(rc), rollout_rs_threshold=_threshold(rc, "rollout_rs_threshold", None))
    rc.finish()
    p.finish()
    _check(p, rc, spec)
    return spec


def _check(p: Fields, rc: Fields, spec: PolicyLossSpec) -> None:
    """What a loss would refuse at its first step, refused now under the key the user wrote."""
    mode = spec.loss_mode
    if mode == "dro" and (spec.dro_beta is None or spec.dro_beta <= 0):
        raise SpecError(p.key_path("dro_beta"), "dro needs a quadratic-penalty coefficient above 0; set "
                                                "run.policy_loss.dro_beta (e.g. 0.1)")
    for key, loss, ratio in (("clip_cov_ratio", "clip_cov", spec.clip_cov_ratio),
                             ("kl_cov_ratio", "kl_cov", spec.kl_cov_ratio)):
        if mode == loss and not ratio > 0:
            raise SpecError(p.key_path(key), f"{loss} selects this share of the tokens; give a value above 0")
    if mode == "sapo" and not (spec.tau_pos > 0 and spec.tau_neg > 0):
        raise SpecError(p.key_path("tau_pos" if spec.tau_pos <= 0 else "tau_neg"),
                        "SAPO's gate divides by its temperature; give a value above 0")
    if spec.rollout_rs is not None and spec.rollout_rs_threshold is None:
        raise SpecError(rc.key_path("rollout_rs_threshold"), "rollout_rs needs a threshold; set it (e.g. 2.0, or "
                                                             "'0.5_2.0' for a k1 option)")
