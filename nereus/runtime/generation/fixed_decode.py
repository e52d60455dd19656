"""The fixed batch's decode loop: one DP replica's rows decoded together, one forward per iteration over
the whole left-padded batch, with the tail levers that change the work rather than its placement:

- **per-row length limits**: a row resumed by partial rollout (``SamplingParams.resumed``) generates only
  what its limit leaves; a row in ``resumed_done`` generates nothing;
- **tail batching and partial rollout's stop rule** (``params.keep_groups``): the loop stops once enough
  whole groups have finished (``groups.GroupOrder``); the others are deferred (None) or carried
  (``Carried``, with ``params.carry_partial``);
- **speculative decoding with n-gram drafts** (``params.speculation``, switched by the live batch: only
  while at most ``max_live`` rows are live). Each live row feeds its pending token and ``k`` drafts as one
  chunk; each row's drafts are checked by the rejection rule (``speculative.verify``), and every row then
  advances by the same ``m + 1`` tokens, ``m`` the fewest drafts any live row accepted (a row that ends
  within its accepted drafts does not count). Cutting a row's accepted run short keeps the rule exact: a
  token is emitted only where the rule emits it, and where the cut falls depends on the row's past and
  on the other rows, never on the token itself (Leviathan et al. 2023, https://arxiv.org/abs/2211.17192,
  Theorem 1 holds position by position). Under greedy decoding the tokens equal plain decoding's; sampled
  ones have its distribution. One shared advance keeps the batch's KV caches aligned (one write offset
  for every row), which is what makes the chunk one batched forward.

Without levers the loop makes exactly the computations of plain decoding, in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from nereus.runtime.generation.groups import Answer, Carried, GroupOrder
from nereus.runtime.generation.sampling import SamplingParams, sample, stream_seed
from nereus.runtime.generation.speculative import propose, verify
from nereus.runtime.model.decoder import KVCache, logprobs_from_logits
from nereus.runtime.model.sharded import ShardedModel
from nereus.runtime.parallel.pp import forward_only
from nereus.runtime.parallel.tp import gather_vocab
from nereus.spec.rollout import Speculation

# responses to the same prompt searched for drafts (as the continuous-batching engine's SIBLING_SOURCES)
SIBLING_SOURCES = 16


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


def prefill_mask(valid: torch.Tensor) -> torch.Tensor:
    """[B, 1, P, P]: causal and not padding; a padding query attends to itself (its output is unused)."""
    p = valid.shape[1]
    causal = torch.ones(p, p, dtype=torch.bool).tril()
    return (causal & valid[:, None, None, :]) | torch.eye(p, dtype=torch.bool)


class Stepper:
    """One forward of the whole pipeline over new tokens, writing the KV caches; the last stage's
    full-vocabulary logits at the last ``last`` positions, [B, last, V] (None on other stages)."""

    def __init__(self, sm: ShardedModel, batch: int, length: int) -> None:
        self.sm = sm
        dev = sm.groups.device
        self.caches = {int(i): KVCache(batch, layer.self_attn.kv_heads, length, sm.cfg.arch.head_dim, sm.dtype, dev)
                       for i, layer in sm.model.model.layers.items()}

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, start: int,
                 last: int = 1) -> torch.Tensor | None:
        sm, dev = self.sm, self.sm.groups.device

        def run(x: torch.Tensor, _i: int) -> torch.Tensor:
            return sm.model(x, positions.to(dev), mask.to(dev), self.caches, start)

        outs = forward_only(run, sm.comm, [tokens.to(dev)], lambda _i: (*tokens.shape, sm.cfg.arch.hidden),
                            sm.dtype)
        return gather_vocab(outs[0][:, -last:], sm.groups.tp_group) if outs else None

    def kv_bytes(self) -> int:
        return sum(c.nbytes() for c in self.caches.values())


def row_limit(params: SamplingParams, row: int) -> int:
    """New tokens global row ``row`` may generate: the limit less what a previous step generated for it."""
    if row in params.resumed_done:
        return 0
    return params.max_new_tokens - (params.resumed[row] if params.resumed else 0)


class Drafter(Protocol):
    def __call__(self, prompts: list[list[int]], rows: list[list[int]], finished: list[bool],
                 k: int) -> list[list[int]]:
        """Exactly ``k`` draft tokens per row to follow its prompt and generated ``rows``."""


@dataclass(frozen=True)
class NgramDrafts:
    """Each row's n-gram proposal (``speculative.propose``) from its own text and its siblings' (rows with
    the same prompt), padded by repeating its last token: any draft keeps the rule exact, and a run of
    one token is the likeliest continuation the proposal could not see. A finished row's drafts are
    never read."""

    spec: Speculation | None
    pad: int

    def __call__(self, prompts: list[list[int]], rows: list[list[int]], finished: list[bool],
                 k: int) -> list[list[int]]:
        texts = [p + r for p, r in zip(prompts, rows, strict=True)]
        by_prompt: dict[tuple[int, ...], list[int]] = {}
        for j, p in enumerate(prompts):
            by_prompt.setdefault(tuple(p), []).append(j)
        out = []
        for j, text in enumerate(texts):
            if finished[j]:
                out.append([self.pad] * k)
                continue
            siblings = [texts[o] for o in by_prompt[tuple(prompts[j])] if o != j][:SIBLING_SOURCES]
            d = propose(text, siblings, self.spec, k)
            out.append(d + [(d or text)[-1]] * (k - len(d)))
        return out


class FixedDecode:
    """This replica's rows of ``prompts`` (global row ids = their indices) decoded as one batch; every rank
    of the replica builds one with the same arguments and makes the same calls."""

    def __init__(self, sm: ShardedModel, prompts: list[list[int]], params: SamplingParams,
                 drafter: Drafter | None = None) -> None:
        if sm.cfg.value_head:
            raise ValueError("generation needs a model with an LM head")
        self.sm, self.params = sm, params
        self.ids = list(range(len(prompts)))[sm.replica_rows(len(prompts))]
        self.prompts = [list(prompts[i]) for i in self.ids]
        tokens, valid = left_pad(self.prompts, params.pad_token_id)
        b, p = tokens.shape
        self.limit = torch.tensor([row_limit(params, i) for i in self.ids])
        self.step = Stepper(sm, b, p + params.max_new_tokens)
        self.keys = torch.zeros(b, p + params.max_new_tokens, dtype=torch.bool)
        self.keys[:, :p] = valid
        self.cached = p  # cache positions written and valid: the next fed token lands here
        positions = (valid.long().cumsum(1) - 1).clamp(min=0)
        self.last_pos = positions[:, -1]
        # one stream per DP replica, hashed from (step seed, replica): seed + replica would make replica 1 of
        # one step reuse replica 0's stream of the step whose seed is one higher
        self.gen = torch.Generator(device=sm.groups.device).manual_seed(stream_seed(params.seed, sm.groups.coords.dp))
        self.stops = torch.tensor(sorted(params.stops), dtype=torch.long)
        self.finished = self.limit <= 0
        self.emitted = 0  # tokens each live row has generated (the pending one included)
        self.rows: list[list[int]] = [[] for _ in self.ids]
        self.row_logps: list[list[float]] = [[] for _ in self.ids]
        self.order = (GroupOrder(self.ids, params.group_size, params.keep_groups, params.must_groups)
                      if params.keep_groups else None)
        self.drafter = drafter or NgramDrafts(params.speculation, params.pad_token_id)
        self.iterations = 0  # decode forwards (the prefill not counted)
        self.draft_tokens = self.accepted_tokens = self.speculative_iterations = 0
        self.prefill = (tokens, positions, valid)

    # ----- the loop -------------------------------------------------------------------------------------
    @torch.no_grad()
    def run(self) -> FixedDecode:
        tokens, positions, valid = self.prefill
        logits = self.step(tokens, positions, prefill_mask(valid), 0)
        pending = self._emit_sampled(logits)
        while not self._done():
            k = self._draft_width()
            if k:
                pending = self._speculate(pending, k)
                continue
            self.keys[:, self.cached] = True
            self.last_pos = self.last_pos + 1
            logits = self.step(pending[:, None], self.last_pos[:, None], self.keys[:, None, None, : self.cached + 1],
                               self.cached)
            self.cached += 1
            self.iterations += 1
            pending = self._emit_sampled(logits)
        self.sm.record_memory("generate", kv_cache=self.step.kv_bytes())
        return self

    def _done(self) -> bool:
        if self.order is not None:
            self.order.update({i for i, f in zip(self.ids, self.finished.tolist(), strict=True) if f})
            if self.order.satisfied:
                return True
        return bool(self.finished.all())

    def _emit_sampled(self, logits: torch.Tensor | None) -> torch.Tensor:
        """Sample one token per row from the last position's logits, on every rank; record it."""
        g = self.sm.groups
        last = logits[:, -1] if logits is not None else None
        new = (sample(last, self.params, self.gen).to(g.device) if last is not None
               else torch.empty(len(self.ids), dtype=torch.long, device=g.device))
        if g.layout.pp > 1:
            dist.broadcast(new, src=g.pp_peer(g.layout.pp - 1), group=g.pp_group)
        new = new.cpu()
        logps = logprobs_from_logits(last, new.to(last.device)).cpu()[:, None] if last is not None else None
        return self._record(new[:, None], logps)

    def _record(self, chunk: torch.Tensor, logps: torch.Tensor | None) -> torch.Tensor:
        """Append each live row's tokens of ``chunk`` [B, w] (up to its first stop) and their log-probs;
        rows that end get marked finished. Returns the chunk's last column, padded for finished rows."""
        toks, lps = chunk.tolist(), logps.tolist() if logps is not None else None
        stops, limits = set(self.params.stops), self.limit.tolist()
        was = self.finished.tolist()
        for j, row in enumerate(toks):
            if was[j]:
                continue
            for c, t in enumerate(row):
                self.rows[j].append(t)
                if lps is not None:
                    self.row_logps[j].append(lps[j][c])
                if t in stops or self.emitted + c + 1 >= limits[j]:
                    self.finished[j] = True
                    break
        self.emitted += chunk.shape[1]
        last = chunk[:, -1].clone()
        last[torch.tensor(was)] = self.params.pad_token_id
        return last

    # ----- speculation ----------------------------------------------------------------------------------
    def _draft_width(self) -> int:
        """Drafts per live row this iteration: 0 unless speculating with at most ``max_live`` rows live;
        at most what the tightest live row's limit leaves room for."""
        spec = self.params.speculation
        live = ~self.finished
        if spec is None or int(live.sum()) > spec.max_live:
            return 0
        room = int(self.limit[live].min()) - self.emitted - 1
        return max(0, min(spec.num_speculative_tokens, room))

    def _speculate(self, pending: torch.Tensor, k: int) -> torch.Tensor:
        """One verification chunk: the pending tokens and ``k`` drafts per row in one forward, every row
        advanced by the same accepted count plus one."""
        drafts = self.drafter(self.prompts, self.rows, self.finished.tolist(), k)
        chunk = torch.cat([pending[:, None], torch.tensor(drafts, dtype=torch.long)], dim=1)
        c, b = self.cached, len(self.ids)
        history = self.keys[:, None, None, :c].expand(b, 1, k + 1, c)
        block = torch.ones(k + 1, k + 1, dtype=torch.bool).tril().expand(b, 1, k + 1, k + 1)
        positions = self.last_pos[:, None] + 1 + torch.arange(k + 1)
        logits = self.step(chunk, positions, torch.cat([history, block], dim=-1), c, last=k + 1)
        emitted, logps = self._verify(logits, drafts)
        m = emitted.shape[1] - 1
        self.keys[:, c: c + m + 1] = True  # the pending token and the accepted drafts; the rejected ones'
        # keys and values stay in the caches past ``cached``, where no mask reaches, until overwritten
        self.cached, self.last_pos = c + m + 1, self.last_pos + m + 1
        live = int((~self.finished).sum())
        self.iterations += 1
        self.speculative_iterations += 1
        self.draft_tokens += k * live
        self.accepted_tokens += m * live
        return self._record(emitted, logps)

    def _verify(self, logits: torch.Tensor | None, drafts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The tokens every row emits [B, m + 1] (on every rank) and their log-probs (last stage): each live
        row's rejection-rule output cut at the fewest drafts a live row accepted that did not end in them."""
        g, pad = self.sm.groups, self.params.pad_token_id
        width = torch.zeros(1, dtype=torch.long)
        outs: list[tuple[list[int], list[float]]] = []
        if logits is not None:
            stops, k = self.params.stops, len(drafts[0])
            for j, d in enumerate(drafts):
                outs.append(([], []) if self.finished[j] else verify(logits[j], d, self.params, self.gen))
            bounds = [len(t) - 1 for j, (t, _) in enumerate(outs) if not self.finished[j] and not stops & set(t)]
            width[0] = min(bounds, default=k) + 1
        if g.layout.pp > 1:
            dist.broadcast(width, src=g.pp_peer(g.layout.pp - 1), group=g.pp_group)
        w = int(width[0])
        tokens = torch.full((len(drafts), w), pad, dtype=torch.long)
        logps = torch.zeros(len(drafts), w) if logits is not None else None
        for j, (t, lp) in enumerate(outs):
            tokens[j, : min(w, len(t))] = torch.tensor(t[:w], dtype=torch.long)
            logps[j, : min(w, len(lp))] = torch.tensor(lp[:w])
        if g.layout.pp > 1:
            tokens = tokens.to(g.device)
            dist.broadcast(tokens, src=g.pp_peer(g.layout.pp - 1), group=g.pp_group)
        return tokens.cpu(), logps

    # ----- answers --------------------------------------------------------------------------------------
    def answers(self) -> list[Answer]:
        """Each row's (tokens, log-probs) — kept rows only with ``keep_groups``: the others None, or
        ``Carried`` with ``carry_partial``."""
        kept = self.order.kept_rows() if self.order is not None else None
        out: list[Answer] = []
        for j, i in enumerate(self.ids):
            row = (self.rows[j], self.row_logps[j])
            if kept is None or i in kept:
                out.append(row)
            else:
                out.append(Carried(*row, bool(self.finished[j])) if self.params.carry_partial else None)
        return out
