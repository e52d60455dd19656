"""Generation with a KV cache under any layout: variable-length prompts (left-padded), temperature and
top-p sampling or greedy decoding, sequences stopping at EOS.

Each DP replica generates for its rows of the prompt list. Per step the token ids enter the first pipeline
stage, hidden states pass stage to stage, and the last stage gathers the vocabulary shards over TP, samples
(every TP rank identically: same logits, same seeded generator) and broadcasts the tokens back over the
pipeline group. Pipeline stages take turns on one batch (no micro-batching during decode).

With ``SamplingParams.slots`` > 0, ``generate`` and ``generate_with_logprobs`` run the continuous-batching
engine instead (``decode_engine``: that many sequences at a time, per-sequence caches and sampling
streams; docs/generation.md). Both paths are reproducible; their sampled tokens differ (other streams).
"""

from __future__ import annotations

import torch

from nereus.runtime.comm.faults import FaultHook
from nereus.runtime.engines.answers import ReplicaRollout
from nereus.runtime.engines.native.decode_engine import generate_continuous
from nereus.runtime.engines.native.fixed_decode import FixedDecode, left_pad
from nereus.runtime.engines.sampling import SamplingParams, sample
from nereus.runtime.parallel.sharded import ShardedModel

__all__ = ["SamplingParams", "generate", "generate_with_logprobs", "left_pad", "reference_generate", "sample"]


@torch.no_grad()
def generate(sm: ShardedModel, prompts: list[list[int]], params: SamplingParams) -> list[list[int]] | None:
    """New tokens per prompt of this rank's replica (EOS included when reached), on every rank."""
    if params.slots:
        return [toks for toks, _ in generate_continuous(sm, prompts, params, params.slots).rows]
    return FixedDecode(sm, prompts, params).run().rows


@torch.no_grad()
def generate_with_logprobs(sm: ShardedModel, prompts: list[list[int]], params: SamplingParams,
                           faults: FaultHook | None = None) -> ReplicaRollout | None:
    """New tokens per prompt and, for each, log p(token) under the model's unscaled distribution
    (log-softmax of the full-vocabulary logits, no temperature or top-p) — the behaviour log-probs PPO's
    ratio needs. Complete on the last pipeline stage, None elsewhere (the engine, ``slots`` > 0: on every
    rank of the replica). With ``params.keep_groups`` (tail batching, partial rollout) only the kept rows
    are answered; the others are None or ``Carried`` (``groups``). ``faults``: the worker's fault hook, whose
    point ``generate`` lies in the decode loop."""
    if params.slots:
        return generate_continuous(sm, prompts, params, params.slots, faults)
    run = FixedDecode(sm, prompts, params).run(faults)
    return ReplicaRollout(run.answers(), run.stats(), run.route_rows()) if sm.groups.last_stage else None


def reference_generate(model: torch.nn.Module, prompt: list[int], params: SamplingParams) -> list[int]:
    """Greedy decoding of one prompt without a cache or padding (the single-process reference)."""
    seq = list(prompt)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(params.max_new_tokens):
            tok = int(model(torch.tensor([seq]))[0, -1].argmax())
            out.append(tok)
            seq.append(tok)
            if tok in params.stops:
                break
    return out
