"""Time a single-controller RL trainer spends moving a stage's batch through its driver process.

verl runs every stage of a step as a call from one driver process to its worker groups: the driver splits
the step's batch by data-parallel rank and hands each worker its share through Ray's object store, then
gathers and concatenates what the workers return (volcengine/verl, verl/single_controller/base/decorator.py,
``Dispatch.DP_COMPUTE_PROTO``'s dispatch and collect functions). The stage timers of verl's trainer wrap
that call (verl/trainer/ppo/ray_trainer.py: ``gen``, ``old_log_prob``, ``ref``, ``values``,
``update_critic``, ``update_actor``), so a published stage time holds the data path as well as the GPU work.

What the driver moves does not shrink with the GPU count: every sequence of the batch, padded to the
configured caps. verl's rollout pads each batch to ``rollout.prompt_length + rollout.response_length``
token slots whatever the responses' lengths (prompts left-padded, responses right-padded:
verl/experimental/agent_loop/agent_loop.py, the ``prompts``/``responses``/``input_ids``/``attention_mask``/
``position_ids`` tensors), and the trainer's stages take and return tensors of that width. The cost is
priced per padded token slot of one stage call: ``CONTROLLER_S_PER_TOKEN_SLOT``.

This is the part of a published colocated log-prob pass that GPU work cannot explain: on the fully-async
table's colocated series (same model, lengths and batch on 32, 64 and 128 H20s) old_log_prob falls as
a + b/N with a ≈ 33 s, a serial cost that more GPUs do not divide.
"""

from __future__ import annotations

# Seconds per padded token slot per stage call through verl's driver. One global constant, fitted together
# with the validation's unstated mean response (``sim.published_runs.UNSTATED_RESPONSE_TOKENS``) on three
# NAMED cells: verl_oso_1's old_log_prob and verl_oso_3's and verl_fa_2's update_actor (docs/cost-model.md,
# "End-to-end RL runs"); every other published cell is reported, not fitted. At roughly 40 bytes a slot
# (the int64 ids, mask and positions and the fp32 values a call carries each way) it is ~160 MB/s of
# serialise, object-store transfer and concatenate on one Python process.
CONTROLLER_S_PER_TOKEN_SLOT = 0.25e-6


def controller_time(sequences: int, padded_tokens: int, per_slot_s: float = CONTROLLER_S_PER_TOKEN_SLOT) -> float:
    """Seconds one stage call spends dispatching and collecting ``sequences`` rows of ``padded_tokens``
    slots through the driver."""
    return sequences * padded_tokens * per_slot_s
