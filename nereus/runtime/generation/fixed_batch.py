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
import torch.distributed as dist

from nereus.runtime.generation.decode_engine import generate_continuous
from nereus.runtime.generation.sampling import SamplingParams, sample, stream_seed
from nereus.runtime.model.decoder import KVCache, logprobs_from_logits
from nereus.runtime.model.sharded import ShardedModel
from nereus.runtime.parallel.pp import forward_only
from nereus.runtime.parallel.tp import gather_vocab

__all__ = ["SamplingParams", "generate", "generate_with_logprobs", "left_pad", "reference_generate", "sample"]


def left_pad(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [B, P] and validity mask [B, P] of prompts padded on the left to the longest."""
    width = max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), width), pad, dtype=torch.long)
    valid = torch.zeros(len(prompts), width, dtype=torch.bool)
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty")
        tokens[i, width - len(p):] = torch.tensor(p)
        valid[i, width - len(p):] = True
    return tokens, valid


def _prefill_mask(valid: torch.Tensor) -> torch.Tensor:
    """[B, 1, P, P]: causal and not padding; a padding query attends to itself (its output is unused)."""
    p = valid.shape[1]
    causal = torch.ones(p, p, dtype=torch.bool).tril()
    return (causal & valid[:, None, None, :]) | torch.eye(p, dtype=torch.bool)


class _Stepper:
    """One forward of the whole pipeline over new tokens, writing the KV caches; last-stage logits."""

    def __init__(self, sm: ShardedModel, batch: int, length: int) -> None:
        self.sm = sm
        dev = sm.groups.device
        self.caches = {int(i): KVCache(batch, layer.self_attn.kv_heads, length, sm.cfg.arch.head_dim, sm.dtype, dev)
                       for i, layer in sm.model.model.layers.items()}

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                 start: int) -> torch.Tensor | None:
        sm, dev = self.sm, self.sm.groups.device

        def run(x: torch.Tensor, _i: int) -> torch.Tensor:
            return sm.model(x, positions.to(dev), mask.to(dev), self.caches, start)

        outs = forward_only(run, sm.comm, [tokens.to(dev)], lambda _i: (*tokens.shape, sm.cfg.arch.hidden),
                            sm.dtype)
        return gather_vocab(outs[0][:, -1], sm.groups.tp_group) if outs else None

    def kv_bytes(self) -> int:
        return sum(c.nbytes() for c in self.caches.values())


@torch.no_grad()
def generate(sm: ShardedModel, prompts: list[list[int]], params: SamplingParams) -> list[list[int]] | None:
    """New tokens per prompt of this rank's replica (EOS included when reached), on every rank."""
    if params.slots:
        return [toks for toks, _ in generate_continuous(sm, prompts, params, params.slots)]
    tokens, _ = _generate(sm, prompts, params)
    return _trim(tokens, params.stops)


@torch.no_grad()
def generate_with_logprobs(sm: ShardedModel, prompts: list[list[int]],
                           params: SamplingParams) -> list[tuple[list[int], list[float]]] | None:
    """New tokens per prompt and, for each, log p(token) under the model's unscaled distribution
    (log-softmax of the full-vocabulary logits, no temperature or top-p) — the behaviour log-probs PPO's
    ratio needs. Complete on the last pipeline stage, None elsewhere (the engine, ``slots`` > 0: on every
    rank of the replica)."""
    if params.slots:
        return generate_continuous(sm, prompts, params, params.slots)
    tokens, logps = _generate(sm, prompts, params)
    if logps is None:
        return None
    rows = _trim(tokens, params.stops)
    return [(row, logps[i, : len(row)].tolist()) for i, row in enumerate(rows)]


def _generate(sm: ShardedModel, prompts: list[list[int]],
              params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor | None]:
    if sm.cfg.value_head:
        raise ValueError("generation needs a model with an LM head")
    mine = prompts[sm.replica_rows(len(prompts))]
    tokens, valid = left_pad(mine, params.pad_token_id)
    b, p = tokens.shape
    length = p + params.max_new_tokens
    step = _Stepper(sm, b, length)
    keys = torch.zeros(b, length, dtype=torch.bool)
    keys[:, :p] = valid
    positions = (valid.long().cumsum(1) - 1).clamp(min=0)
    # one stream per DP replica, hashed from (step seed, replica): seed + replica would make replica 1 of one
    # step reuse replica 0's stream of the step whose seed is one higher
    gen = torch.Generator(device=sm.groups.device).manual_seed(stream_seed(params.seed, sm.groups.coords.dp))
    logits = step(tokens, positions, _prefill_mask(valid), 0)
    last_pos = positions[:, -1]
    finished = torch.zeros(b, dtype=torch.bool)
    stops = torch.tensor(sorted(params.stops), dtype=torch.long)
    out: list[torch.Tensor] = []
    logps: list[torch.Tensor] = []
    for t in range(params.max_new_tokens):
        new = _next_tokens(sm, logits, params, gen, b)
        new = torch.where(finished, torch.full_like(new, params.pad_token_id), new)
        out.append(new)
        if logits is not None:
            logps.append(logprobs_from_logits(logits, new.to(logits.device)).cpu())
        if stops.numel():
            finished |= torch.isin(new, stops)
        if bool(finished.all()) or t == params.max_new_tokens - 1:
            break
        keys[:, p + t] = True
        last_pos = last_pos + 1
        logits = step(new[:, None], last_pos[:, None], keys[:, None, None, : p + t + 1], p + t)
    sm.record_memory("generate", kv_cache=step.kv_bytes())
    return torch.stack(out, dim=1), torch.stack(logps, dim=1) if logps else None


def _next_tokens(sm: ShardedModel, logits: torch.Tensor | None, params: SamplingParams,
                 gen: torch.Generator, batch: int) -> torch.Tensor:
    g = sm.groups
    dev = g.device
    new = sample(logits, params, gen).to(dev) if logits is not None else torch.empty(batch, dtype=torch.long,
                                                                                      device=dev)
    if g.layout.pp > 1:
        dist.broadcast(new, src=g.pp_peer(g.layout.pp - 1), group=g.pp_group)
    return new.cpu()


def _trim(generated: torch.Tensor, stops: frozenset[int]) -> list[list[int]]:
    """Each row up to and including its first stop token."""
    out = []
    for row in generated.tolist():
        end = next((i for i, t in enumerate(row) if t in stops), None)
        out.append(row if end is None else row[: end + 1])
    return out


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
