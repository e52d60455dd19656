"""Levers that shorten the generation tail, priced on the decode model (pure functions, typed values).

- ``speculative``: draft-and-verify decoding sized to the live batch (lossless: the step stays on-policy);
- ``lengths``: response lengths of GRPO groups whose siblings are alike (prompt-level correlation);
- ``tail_batching``: over-launch, keep the first groups that finish, defer the rest to long rounds;
- ``partial_rollout``: a per-step token budget, unfinished responses carried to the next step;
- ``async_split``: generation of step k+s overlapping training of step k on a split of the GPUs.

Nothing here simulates a run: each model prices one configuration from its typed inputs, for the
planner, the controller's inside-the-step rule and the simulator's sequence-level ground truth to call.
"""
