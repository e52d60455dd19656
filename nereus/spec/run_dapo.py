"""``run.filter_groups`` and ``run.overlong_buffer``: the two sampling-side parts of the DAPO recipe (Yu et
al. 2025, arXiv:2503.14476), named as verl's ``algorithm.filter_groups.*`` and
``reward_model.overlong_buffer.*``.

- Dynamic sampling (DAPO Sec. 3.2): groups whose responses all have the same ``metric`` (every response
  right, or every one wrong) have zero group-relative advantage and teach nothing; they are dropped and
  the step generates further batches of prompts until ``prompts_per_step`` groups are kept
  (``max_num_gen_batches`` batches at most; 0: no limit, as verl's non-positive values).
- Overlong reward shaping (DAPO Sec. 3.4, eq. 13): a response longer than the maximum response length
  less ``len`` tokens loses up to ``penalty_factor`` of its score, linearly over the last ``len`` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from nereus.spec.errors import SpecError
from nereus.spec.fields import MAX_STEPS, Fields

if TYPE_CHECKING:
    from nereus.spec.run import RunSpec

# verl's filter metrics: the rule reward's accuracy (a score > 0 counts as right), the score the advantages
# read (rule reward + overlong penalty), and verl's per-sequence names for it (a score sits on the last token,
# so the sequence sum is the score; seq_final_reward adds the in-reward KL penalty, see check_dapo)
FILTER_METRICS = ("acc", "score", "seq_reward", "seq_final_reward")


@dataclass(frozen=True)
class FilterGroupsSpec:
    """``run.filter_groups`` (verl's ``algorithm.filter_groups``)."""

    enable: bool = False
    metric: str = "acc"
    max_num_gen_batches: int = 0  # generation batches a step may draw at most; 0: no limit

    @property
    def limit(self) -> int | None:
        """The most generation batches a step may draw (None: no limit)."""
        return self.max_num_gen_batches if self.max_num_gen_batches > 0 else None


@dataclass(frozen=True)
class OverlongBufferSpec:
    """``run.overlong_buffer`` (verl's ``reward_model.overlong_buffer``): ``len`` is DAPO's L_cache."""

    enable: bool = False
    len: int = 0
    penalty_factor: float = 1.0


def read_filter_groups(f: Fields) -> FilterGroupsSpec:
    """``run.filter_groups``: ``enable``, ``metric``, ``max_num_gen_batches`` (non-positive: no limit)."""
    spec = FilterGroupsSpec(enable=f.get("enable", bool, False),
                            metric=f.get("metric", str, "acc", choices=FILTER_METRICS),
                            max_num_gen_batches=max(0, f.get("max_num_gen_batches", int, 0, minimum=-MAX_STEPS,
                                                             maximum=MAX_STEPS)))
    f.finish()
    return spec


def read_overlong_buffer(f: Fields, max_response: int) -> OverlongBufferSpec:
    """``run.overlong_buffer``: ``enable``, ``len`` (1 to ``max_response``, the workload's maximum response
    length) and ``penalty_factor`` (>= 0)."""
    spec = OverlongBufferSpec(enable=f.get("enable", bool, False),
                              len=f.get("len", int, 0, minimum=0, maximum=MAX_STEPS),
                              penalty_factor=f.get("penalty_factor", float, 1.0, minimum=0))
    f.finish()
    if spec.enable and spec.len < 1:
        quarter = max(1, max_response // 4)
        raise SpecError(f.key_path("len"), f"{spec.len}: give the buffer's length in tokens, at least 1 (DAPO "
                                           f"uses a quarter of the maximum response length, here {quarter})")
    if spec.len > max_response:
        raise SpecError(f.key_path("len"), f"{spec.len} exceeds the maximum response length ({max_response}, "
                                           f"workload.response_length.max); give at most {max_response}")
    return spec


def check_dapo(run: RunSpec, samples_per_prompt: int, models: tuple[str, ...]) -> None:
    """``run.filter_groups`` against the rest of the job: groups need siblings, the rows of a step must be
    the ones generated this step from its own draws, and the metric must be known before inference."""
    fg = run.filter_groups
    if not fg.enable:
        return
    key = "run.filter_groups.enable"
    if samples_per_prompt < 2:
        raise SpecError(key, f"filters groups of responses to one prompt, and algorithm.samples_per_prompt is "
                             f"{samples_per_prompt}: give it at least 2, or set enable: false")
    others = {"run.async.enabled": run.async_mode.on, "run.rollout.tail_batching": run.rollout_tail is not None,
              "run.rollout.partial_rollout": run.rollout_partial is not None,
              "run.rollout.levers": run.rollout_levers == "auto"}
    for name, on in others.items():
        if on:
            raise SpecError(key, f"dynamic sampling with {name} is not supported (both choose which generated rows "
                                 "a step trains): turn one off")
    if fg.metric != "acc" and "reward" in models:
        raise SpecError("run.filter_groups.metric", f"{fg.metric!r} would need the reward model's scores before "
                        "inference; filter on 'acc' (the rule reward) or remove the reward model")
    if fg.metric == "seq_final_reward" and run.kl_coef > 0 and not run.use_kl_loss:
        raise SpecError("run.filter_groups.metric", "'seq_final_reward' includes the in-reward KL penalty, known "
                        "only after inference; use 'score' or 'acc'")


def check_keep_rate(keep_rate: float, run: RunSpec | None) -> None:
    """``workload.filter_keep_rate`` (the expected share of generated groups dynamic sampling keeps) prices
    dynamic sampling: a job that runs must have it on (``run.filter_groups.enable``)."""
    if not 0 < keep_rate <= 1:
        raise SpecError("workload.filter_keep_rate", f"{keep_rate} is not a share; give a value in (0, 1] "
                                                     "(1: every group kept, no dynamic sampling)")
    if keep_rate < 1 and run is not None and not run.filter_groups.enable:
        raise SpecError("workload.filter_keep_rate", f"{keep_rate} prices dynamic sampling, which this run does "
                                                     "not do: set run.filter_groups.enable: true or remove the key")
