"""The fixed batch's decode loop: one DP replica's rows decoded together, one forward per iteration over
the whole left-padded batch, with the tail levers that change the work rather than its placement:

- **per-row length limits**: a row resumed by partial rollout (``SamplingParams.resumed``) generates only
  what its limit leaves; a row in ``resumed_done`` generates nothing;
- **tail batching and partial rollout's stop rule** (``params.keep_groups``): the loop stops once enough
  whole groups have finished (``answers.GroupOrder``); the others are deferred (None) or carried
  (``Carried``, with ``params.carry_partial``);
- **speculative decoding with n-gram drafts** (``params.speculation``, switched by the live batch: only
  while at most ``live_at_most`` rows are live). Each row feeds its pending token and ``k`` drafts as one
  chunk of one batched forward; the rejection rule (Leviathan et al. 2023,
  https://arxiv.org/abs/2211.17192; ``speculative.verify_rows``) keeps each row's accepted drafts and
  one more token, so rows advance by different numbers of tokens: each row then writes its keys and
  values at its own cache offset (``KVCache.update`` with per-row offsets), and a rejected draft's
  position is overwritten by the row's next chunk, never attended. Under greedy decoding the tokens
  equal plain decoding's; sampled ones have its distribution.

Without levers the loop makes exactly the computations of plain decoding, in the same order.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

from nereus.runtime.comm.faults import FaultHook
from nereus.runtime.engines.answers import Answer, Carried, DecodeStats, GroupOrder
from nereus.runtime.engines.native.speculative import as_text, propose_text, verify_rows
from nereus.runtime.engines.sampling import SamplingParams, row_limit, sample, stream_seed
from nereus.runtime.model.decoder import KVCache, logprobs_from_logits
from nereus.runtime.model.moe import RoutingRecord
from nereus.runtime.model.routes import RouteLog, sparse_layer_ids
from nereus.runtime.parallel.pp import forward_only
from nereus.runtime.parallel.sharded import ShardedModel
from nereus.runtime.parallel.tp import gather_vocab
from nereus.spec.levers import Speculation

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


class PipelineForward:
    """One forward of the whole pipeline over new tokens, writing the KV caches; the last stage's
    full-vocabulary logits at the last ``last`` positions, [B, last, V] (None on other stages)."""

    def __init__(self, sm: ShardedModel, batch: int, length: int) -> None:
        self.sm = sm
        dev = sm.groups.device
        self.caches = {int(i): KVCache(batch, layer.self_attn.kv_heads, length, sm.cfg.arch.head_dim, sm.dtype, dev)
                       for i, layer in sm.model.model.layers.items()}

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, start: int,
                 last: int = 1, routing: RoutingRecord | None = None) -> torch.Tensor | None:
        sm, dev = self.sm, self.sm.groups.device

        def run(x: torch.Tensor, _i: int) -> torch.Tensor:
            return sm.model(x, positions.to(dev), mask.to(dev), self.caches, start, routing=routing)

        outs = forward_only(run, sm.comm, [tokens.to(dev)], lambda _i: (*tokens.shape, sm.cfg.arch.hidden),
                            sm.dtype)
        return gather_vocab(outs[0][:, -last:], sm.groups.tp_group) if outs else None

    def kv_bytes(self) -> int:
        return sum(c.nbytes() for c in self.caches.values())


class DraftSource(Protocol):
    def __call__(self, prompts: list[list[int]], rows: list[list[int]], finished: list[bool],
                 k: int) -> list[list[int]]:
        """Exactly ``k`` draft tokens per row to follow its prompt and generated ``rows``."""


class NgramDrafts:
    """Each row's n-gram proposal (``speculative.propose_text``) from its own text and its siblings' (rows
    with the same prompt), padded by repeating its last token: any draft keeps the rule exact, and a run
    of one token is the likeliest continuation the proposal could not see. A finished row's drafts are
    never read. Each row's text is kept as a string of code points, extended by what it generated since
    the last call (rows only grow)."""

    def __init__(self, spec: Speculation | None, pad: int) -> None:
        self.spec, self.pad = spec, pad
        self.texts: list[str] = []
        self.siblings: list[list[int]] = []

    def __call__(self, prompts: list[list[int]], rows: list[list[int]], finished: list[bool],
                 k: int) -> list[list[int]]:
        if not self.texts:
            self.texts = [as_text(p) for p in prompts]
            by_prompt: dict[tuple[int, ...], list[int]] = {}
            for j, p in enumerate(prompts):
                by_prompt.setdefault(tuple(p), []).append(j)
            self.siblings = [[o for o in by_prompt[tuple(p)] if o != j][:SIBLING_SOURCES]
                             for j, p in enumerate(prompts)]
        for j, (p, r) in enumerate(zip(prompts, rows, strict=True)):
            grown = len(p) + len(r) - len(self.texts[j])
            if grown:
                self.texts[j] += as_text(r[len(r) - grown:])
        out = []
        for j, text in enumerate(self.texts):
            if finished[j]:
                out.append([self.pad] * k)
                continue
            d = propose_text(text, [self.texts[o] for o in self.siblings[j]], self.spec, k)
            out.append(d + [d[-1] if d else ord(text[-1])] * (k - len(d)))
        return out


class FixedDecode:
    """This replica's rows of ``prompts`` (global row ids = their indices) decoded as one batch; every rank
    of the replica builds one with the same arguments and makes the same calls.

    Row ``b``'s keys and values fill cache positions ``0 .. lengths[b]`` (``keys`` marks those holding its
    prompt or tokens, not its left padding); its pending token (sampled, not fed yet) goes in at
    ``lengths[b]``. Rows advance alike until speculation lets them accept different numbers of drafts;
    from then on each writes at its own offset."""

    def __init__(self, sm: ShardedModel, prompts: list[list[int]], params: SamplingParams,
                 drafter: DraftSource | None = None) -> None:
        if sm.cfg.value_head:
            raise ValueError("generation needs a model with an LM head")
        self.sm, self.params = sm, params
        self.ids = list(range(len(prompts)))[sm.replica_rows(len(prompts))]
        self.prompts = [list(prompts[i]) for i in self.ids]
        tokens, valid = left_pad(self.prompts, params.pad_token_id)
        b, p = tokens.shape
        self.limit = torch.tensor([row_limit(params, i) for i in self.ids])
        room = p + params.max_new_tokens + (params.speculation.draft_tokens if params.speculation else 0)
        self.step = PipelineForward(sm, b, room)
        self.keys = torch.zeros(b, room, dtype=torch.bool)  # positions holding a row's prompt or its tokens
        self.keys[:, :p] = valid
        self.lengths = torch.full((b,), p)
        positions = (valid.long().cumsum(1) - 1).clamp(min=0)
        self.last_pos = positions[:, -1]
        # one stream per DP replica, hashed from (step seed, replica): seed + replica would make replica 1 of
        # one step reuse replica 0's stream of the step whose seed is one higher
        seed = stream_seed(params.seed, sm.groups.coords.dp_rank)
        self.gen = torch.Generator(device=sm.groups.device).manual_seed(seed)
        self.stops = torch.tensor(sorted(params.stops), dtype=torch.long)
        self.finished = self.limit <= 0
        self.rows: list[list[int]] = [[] for _ in self.ids]
        self.row_logps: list[list[float]] = [[] for _ in self.ids]
        self.order = (GroupOrder(self.ids, params.group_size, params.keep_groups, params.must_groups)
                      if params.keep_groups else None)
        self.drafter = drafter or NgramDrafts(params.speculation, params.pad_token_id)
        self.iterations = 0  # decode forwards (the prefill not counted)
        self.draft_tokens = self.accepted_tokens = self.speculative_iterations = self.verifications = 0
        self.prefill = (tokens, positions, valid)
        # router replay: each sparse layer's experts for every position fed (one stage holds every layer)
        layers = sparse_layer_ids(sm.cfg.arch)
        record = params.record_routes and layers and sm.groups.dims.pp == 1
        self.routes = RouteLog(b, layers, sm.cfg.arch.moe.top_k) if record else None
        self.fed: tuple[RoutingRecord, tuple[int, int]] | None = None  # the last decode forward's routing

    # ----- the loop -------------------------------------------------------------------------------------
    @torch.no_grad()
    def run(self, faults: FaultHook | None = None) -> FixedDecode:
        """Prefill, then decode until every row finished; ``faults``' point ``generate`` is met at each decode
        iteration (the prompts prefilled, tokens being sampled)."""
        tokens, positions, valid = self.prefill
        record = RoutingRecord() if self.routes is not None else None
        logits = self.step(tokens, positions, prefill_mask(valid), 0, routing=record)
        if self.routes is not None:
            self.routes.keep(record, tuple(tokens.shape), valid)
        pending = self._emit(logits)
        while not self._done():
            if faults is not None:
                faults.at("generate")
            k = self._draft_width()
            if k:
                pending = self._speculate(pending, k)
                continue
            logits = self._forward(pending[:, None])
            self._advance((~self.finished).long())
            self.iterations += 1
            pending = self._emit(logits)
        self.sm.record_memory("generate", kv_cache=self.step.kv_bytes())
        return self

    def _done(self) -> bool:
        if self.order is not None:
            self.order.update({i for i, f in zip(self.ids, self.finished.tolist(), strict=True) if f})
            if self.order.satisfied:
                return True
        return bool(self.finished.all())

    def _forward(self, chunk: torch.Tensor) -> torch.Tensor | None:
        """Feed each row's ``chunk`` [B, w] at its own cache offset (one offset while every row has the
        same); query ``j`` of a row attends to the row's tokens and the chunk's first ``j + 1``. Returns
        the last stage's logits at the chunk's ``w`` positions."""
        w = chunk.shape[1]
        end = int(self.lengths.max()) + w
        at = torch.arange(end)[None, None, :]
        first = self.lengths[:, None, None]
        upto = first + torch.arange(w)[None, :, None]  # [B, w, 1]: the last position each query sees
        mask = (self.keys[:, None, :end] & (at < first)) | ((at >= first) & (at <= upto))
        positions = self.last_pos[:, None] + 1 + torch.arange(w)
        same = bool((self.lengths == self.lengths[0]).all())
        record = RoutingRecord() if self.routes is not None else None
        self.fed = None if record is None else (record, tuple(chunk.shape))
        return self.step(chunk, positions, mask[:, None], int(self.lengths[0]) if same else self.lengths, last=w,
                         routing=record)

    def _advance(self, fed: torch.Tensor) -> None:
        """Row ``b``'s next ``fed[b]`` positions hold its tokens now (the pending one and accepted drafts);
        a finished row's cache stays as it is (what it is fed is never read)."""
        cols = torch.arange(self.keys.shape[1])[None]
        if self.routes is not None and self.fed is not None:  # the chunk positions each row advanced by
            record, shape = self.fed
            self.routes.keep(record, shape, torch.arange(shape[1])[None] < fed[:, None])
        self.keys |= (cols >= self.lengths[:, None]) & (cols < (self.lengths + fed)[:, None])
        self.lengths = self.lengths + fed
        self.last_pos = self.last_pos + fed

    def _emit(self, logits: torch.Tensor | None) -> torch.Tensor:
        """Sample one token per row from the last position's logits (the last stage samples, the other
        pipeline stages receive them) and record it with its log-prob."""
        g = self.sm.groups
        last = logits[:, -1] if logits is not None else None
        new = (sample(last, self.params, self.gen).to(g.device) if last is not None
               else torch.empty(len(self.ids), dtype=torch.long, device=g.device))
        if g.layout.pp > 1:
            dist.broadcast(new, src=g.pp_peer(g.layout.pp - 1), group=g.pp_group)
        new = new.cpu()
        logps = logprobs_from_logits(last, new.to(last.device)).cpu()[:, None] if last is not None else None
        return self._record(new[:, None], torch.ones(len(self.ids), dtype=torch.long), logps)

    def _record(self, chunk: torch.Tensor, counts: torch.Tensor, logps: torch.Tensor | None) -> torch.Tensor:
        """Append each live row's first ``counts[b]`` tokens of ``chunk`` [B, w] (up to its first stop or
        its length limit) and their log-probs; rows that end are marked finished. Returns each row's
        pending token: its last one (pad for a row finished before)."""
        toks, lps = chunk.tolist(), logps.tolist() if logps is not None else None
        stops, limits, was = self.params.stops, self.limit.tolist(), self.finished.tolist()
        pending = torch.full((len(self.ids),), self.params.pad_token_id, dtype=torch.long)
        for j, (row, n) in enumerate(zip(toks, counts.tolist(), strict=True)):
            if was[j]:
                continue
            for c, t in enumerate(row[:n]):
                self.rows[j].append(t)
                if lps is not None:
                    self.row_logps[j].append(lps[j][c])
                if t in stops or len(self.rows[j]) >= limits[j]:
                    self.finished[j] = True
                    break
            pending[j] = self.rows[j][-1]
        return pending

    # ----- speculation ----------------------------------------------------------------------------------
    def _draft_width(self) -> int:
        """Drafts per row this iteration: ``draft_tokens`` while speculating with at most
        ``live_at_most`` rows live, else 0."""
        spec = self.params.speculation
        if spec is None or int((~self.finished).sum()) > spec.live_at_most:
            return 0
        return spec.draft_tokens

    def _speculate(self, pending: torch.Tensor, k: int) -> torch.Tensor:
        """One verification chunk: each row's pending token and ``k`` drafts in one forward; each live
        row keeps what the rejection rule emits for it and advances by that many positions."""
        drafts = self.drafter(self.prompts, self.rows, self.finished.tolist(), k)
        logits = self._forward(torch.cat([pending[:, None], torch.tensor(drafts, dtype=torch.long)], dim=1))
        tokens, counts, logps = self._verify(logits, drafts)
        live = ~self.finished
        before = torch.tensor([len(r) for r in self.rows])
        pending = self._record(tokens, counts, logps)
        self._advance(torch.tensor([len(r) for r in self.rows]) - before)  # up to a row's stop or limit
        self.iterations += 1
        self.speculative_iterations += 1
        self.verifications += int(live.sum())
        self.draft_tokens += k * int(live.sum())
        self.accepted_tokens += int((counts - 1)[live].sum())
        return pending

    def _verify(self, logits: torch.Tensor | None,
                drafts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Each row's tokens [B, k + 1] and how many of them it emits [B] (on every rank), and their
        log-probs (last stage): the rejection rule, row by row (``speculative.verify_rows``)."""
        g, b, k = self.sm.groups, len(drafts), len(drafts[0])
        tokens = torch.zeros(b, k + 1, dtype=torch.long, device=g.device)
        counts = torch.ones(b, dtype=torch.long, device=g.device)
        logps = None
        if logits is not None:
            out, n, lps = verify_rows(logits, torch.tensor(drafts, device=logits.device), self.params, self.gen)
            tokens, counts, logps = out.to(g.device), n.to(g.device), lps.float().cpu()
        if g.layout.pp > 1:
            for t in (tokens, counts):
                dist.broadcast(t, src=g.pp_peer(g.layout.pp - 1), group=g.pp_group)
        return tokens.cpu(), counts.cpu(), logps

    # ----- answers --------------------------------------------------------------------------------------
    def stats(self) -> DecodeStats:
        return DecodeStats(self.iterations, self.speculative_iterations, self.verifications, self.draft_tokens,
                           self.accepted_tokens)

    def route_rows(self) -> list[torch.Tensor] | None:
        """Each row's routes [positions fed, sparse layers, k] (``model.routes``), None when not recorded."""
        return None if self.routes is None else self.routes.rows()

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
