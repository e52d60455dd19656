"""Generation with a static batch: an engine without a paged KV cache (``EngineTraits.paged_kv`` False,
Hugging Face-style ``generate``; DeepSpeed-Chat's Hybrid Engine).

Such an engine takes its share of the step's prompts in batches of at most ``batch`` rows; a batch starts
only when the previous one has ended, and every row of it steps until the batch's longest response ends:
Hugging Face's ``generate`` stops a batch when every row has met its end token or the length cap, and keeps
computing the rows that have (transformers, ``GenerationMixin``: ``unfinished_sequences`` masks their
tokens, the forward still runs on the whole batch). Every row's KV cache is allocated for the full length
(prompt + the response cap), so the memory left beside the weights sets ``batch``
(``cost.stages.generation_cost``). One batch of ``b`` rows therefore costs its prefill plus
E[longest of b responses] decode steps at batch ``b`` (``ResponseLength.longest``), at the mean context of
those steps; the same step model (``cost.decode``) prices each step as the continuous-batching model does.
"""

from __future__ import annotations

import math

from nereus.cost.decode import DecodePhases, Replica, prefill_time, step_model
from nereus.spec.engines import engine_traits
from nereus.spec.job import Options
from nereus.spec.response import ResponseLength


def decodes_static(options: Options) -> bool:
    """The rollout decodes static batches: its engine has no paged KV cache, or each generate call is
    waited for to its end before the next (``Options.rollout_call_sequences``)."""
    return bool(options.rollout_call_sequences) or not engine_traits(options.rollout_engine).paged_kv


def static_batch_phases(r: Replica, prompt: float, sequences: int, batch: int, resp: ResponseLength,
                        lockstep: int = 1) -> DecodePhases:
    """``sequences`` responses generated in batches of at most ``batch`` rows, one batch after another;
    ``lockstep`` replicas step together, each batch until the longest row of all of theirs ends (an engine
    whose ranks stay in step, ``EngineTraits.lockstep``)."""
    n = max(1, sequences)
    b = max(1, min(batch, n))
    batches = math.ceil(n / b)
    steps = resp.longest(b * max(1, lockstep))  # a batch runs until its (or its peers') longest row ends
    step = step_model(r).step(b, prompt + steps / 2)
    decode_steps = batches * steps
    terms = dict.fromkeys(("compute", "memory", "tp_comm", "overhead"), 0.0)
    for kind, seconds in step.by_kind().items():
        terms[kind] = terms.get(kind, 0.0) + decode_steps * seconds
    prefill = prefill_time(r, n * prompt, prompt)
    terms["compute"] += prefill
    return DecodePhases(b, n, prefill, decode_steps * step.total, 0.0, decode_steps, 0.0, step.bound, step.total,
                        step.total, (), terms)
