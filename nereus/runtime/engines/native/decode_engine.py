"""Continuous-batching generation: per-sequence KV caches, a fixed number of slots refilled from a queue
as sequences end, per-sequence stop and per-sequence sampling streams.

Why per-sequence everything: a sequence's tokens and log-probs must not depend on which slot it ran in,
which sequences ran beside it, or whether it moved to another worker mid-generation (``kv_migrate``). So

- each sequence owns its caches (one ``KVCache`` of batch 1 per layer of this rank's pipeline stage,
  holding this rank's KV-head shard), sized to its own prompt plus ``max_new_tokens``;
- each sequence is its own micro-batch of one row: one forward over all busy slots runs them one after
  another through the pipeline (``parallel.pp.forward_only``, so under PP stage s works on slot i+1 while
  stage s+1 works on slot i), and no matrix product ever mixes two sequences' rows — results are
  bit-identical to generating the sequence alone;
- each sequence samples from its own ``torch.Generator`` seeded from ``(seed, sequence id)``
  (``stream_seed``), so its draws do not depend on its neighbours; its state travels with it.

Continuous batching itself is Orca's iteration-level scheduling (Yu et al., OSDI 2022,
https://www.usenix.org/conference/osdi22/presentation/yu): after every decode iteration finished sequences
leave their slots and queued ones take them. Every rank of a DP replica runs the same engine in lockstep:
TP ranks sample identically (same full-vocabulary logits, same generator state) and the last pipeline
stage broadcasts each iteration's tokens and log-probs over the pipeline group, so every rank of the
replica holds the same sequence records; only the caches differ (each rank's layers and KV heads).

A sequence whose caches were dropped (``drop``) is refilled from its tokens: by default its prompt in one
forward, then its generated tokens one per iteration (``refill="replay"``: the same computations as the
first time, hence bit-identical caches); ``refill="prefill"`` does prompt and generated tokens in one
forward (faster, equal up to rounding).

With ``speculation`` set (``spec.levers.Speculation``: ``SamplingParams.speculation`` at the start,
switched by the engine loop between iterations) and at most its ``live_at_most`` sequences live,
a decoding sequence feeds its last token and up to ``k`` n-gram drafts as one chunk and emits the tokens
the rejection rule keeps (``speculative``): greedy tokens equal plain decoding's, sampled ones have the
same distribution. ``draft_tokens``/``accepted_tokens`` count what it proposed and kept.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from nereus.runtime.comm.faults import FaultHook
from nereus.runtime.engines.answers import Answer, Carried, DecodeStats, GroupOrder, ReplicaRollout
from nereus.runtime.engines.native.speculative import propose, verify
from nereus.runtime.engines.sampling import SamplingParams, sample, stream_seed
from nereus.runtime.model.decoder import KVCache, logprobs_from_logits
from nereus.runtime.parallel.pp import forward_only
from nereus.runtime.parallel.sharded import ShardedModel
from nereus.runtime.parallel.tp import gather_vocab
from nereus.spec.levers import Speculation

REFILLS = ("replay", "prefill")
# responses to the same prompt searched for drafts: a GRPO group's size (verl's rollout.n is 5-16 in its
# examples); more costs a Python scan each per iteration for little more acceptance
SIBLING_SOURCES = 16


@dataclass
class Sequence:
    """One request and where it stands. ``cached``: positions whose keys and values are in ``caches``
    (None while queued or dropped); ``tokens``/``logprobs``: generated so far (log p under the unscaled
    model distribution, as ``generate_with_logprobs``)."""

    seq_id: int
    prompt: list[int]
    max_len: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    gen: torch.Generator | None = None
    caches: dict[int, KVCache] | None = None
    cached: int = 0
    refill: str = "replay"
    done: bool = False

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.tokens)

    def all_tokens(self) -> list[int]:
        return self.prompt + self.tokens

    def next_chunk(self) -> tuple[int, int]:
        """Positions [start, end) to feed next: the prompt (and, refilling with ``prefill``, the generated
        tokens) when nothing is cached, else one token."""
        if self.cached == 0:
            return 0, (self.length if self.refill == "prefill" else len(self.prompt))
        return self.cached, self.cached + 1

    def kv_bytes(self) -> int:
        return sum(c.nbytes() for c in (self.caches or {}).values())


@dataclass(frozen=True)
class SeqInfo:
    """What a migration plan needs to know of a sequence (``elastic.kvplan``)."""

    seq_id: int
    prompt_len: int
    generated: int
    cached: int
    max_len: int
    rng_bytes: int


class DecodeEngine:
    """The continuous-batching engine of one DP replica on ``sm`` (every rank of the replica builds one
    with the same arguments and makes the same calls). ``slots``: sequences decoded together."""

    def __init__(self, sm: ShardedModel, params: SamplingParams, slots: int) -> None:
        if sm.cfg.value_head:
            raise ValueError("generation needs a model with an LM head")
        if slots < 1:
            raise ValueError(f"slots must be at least 1, got {slots}")
        self.sm, self.params, self.slots = sm, params, slots
        self.queue: deque[Sequence] = deque()
        self.active: list[Sequence] = []
        self.finished: dict[int, Sequence] = {}
        self.iterations = 0
        self.peak_kv_bytes = 0
        self.speculation: Speculation | None = params.speculation  # switched between iterations
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.speculative_iterations = 0
        self.verifications = 0  # sequences' draft chains verified

    # ----- requests -----------------------------------------------------------------------------------
    def submit(self, seq_id: int, prompt: list[int], max_new: int | None = None) -> None:
        """Queue a request; ``max_new``: its own length limit (default ``params.max_new_tokens``; 0: it is
        finished at once, generating nothing)."""
        if not prompt:
            raise ValueError(f"prompt of sequence {seq_id} is empty")
        if seq_id in self.sequences():
            raise ValueError(f"sequence {seq_id} is already in this engine")
        limit = self.params.max_new_tokens if max_new is None else max_new
        seq = Sequence(seq_id, list(prompt), len(prompt) + limit)
        seq.gen = self._generator(seq_id)
        if limit <= 0:
            seq.done = True
            self.finished[seq_id] = seq
            return
        self.queue.append(seq)

    def _generator(self, seq_id: int) -> torch.Generator:
        return torch.Generator(device=self.sm.groups.device).manual_seed(stream_seed(self.params.seed, seq_id))

    @property
    def rng_bytes(self) -> int:
        """Bytes of a sequence's stream state (the same for every sequence of this engine's device)."""
        return self._generator(0).get_state().numel()

    def sequences(self) -> dict[int, Sequence]:
        """Every sequence this engine holds, unfinished and finished."""
        out = {s.seq_id: s for s in (*self.active, *self.queue)}
        out.update(self.finished)
        return out

    def unfinished(self) -> list[Sequence]:
        return [*self.active, *self.queue]

    def info(self, seq_ids: Iterable[int]) -> list[SeqInfo]:
        held = self.sequences()
        rng = self._generator(0).get_state().numel()
        return [SeqInfo(i, len(held[i].prompt), len(held[i].tokens), held[i].cached, held[i].max_len, rng)
                for i in seq_ids]

    @property
    def idle(self) -> bool:
        return not self.active and not self.queue

    # ----- moving sequences in and out (``kv_migrate``) ---------------------------------------------
    def take(self, seq_ids: Iterable[int]) -> list[Sequence]:
        """Remove unfinished sequences (after a migration committed, or to drop them elsewhere)."""
        wanted = set(seq_ids)
        out = [s for s in self.unfinished() if s.seq_id in wanted]
        if len(out) != len(wanted):
            raise KeyError(f"sequences {sorted(wanted - {s.seq_id for s in out})} are not unfinished here")
        self.active = [s for s in self.active if s.seq_id not in wanted]
        self.queue = deque(s for s in self.queue if s.seq_id not in wanted)
        return out

    def install(self, seqs: Iterable[Sequence]) -> None:
        """Adopt sequences that already ran elsewhere (their caches, if any, in this rank's shard); they
        take the next free slots, before the queued ones that never started."""
        for seq in reversed(list(seqs)):
            if seq.seq_id in self.sequences():
                raise ValueError(f"sequence {seq.seq_id} is already in this engine")
            self.queue.appendleft(seq)

    def drop(self, seq_ids: Iterable[int], refill: str = "replay") -> None:
        """Free the caches of unfinished sequences; they are refilled from their tokens when next run."""
        if refill not in REFILLS:
            raise ValueError(f"refill must be one of {REFILLS}, got {refill!r}")
        wanted = set(seq_ids)
        for s in self.unfinished():
            if s.seq_id in wanted:
                s.caches, s.cached, s.refill = None, 0, refill

    # ----- running ----------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> list[Sequence]:
        """One iteration: refill free slots from the queue, feed every busy slot its next chunk (with its
        drafts when speculating), sample the sequences that caught up. Returns those that finished in it."""
        while len(self.active) < self.slots and self.queue:
            self.active.append(self.queue.popleft())
        if not self.active:
            return []
        chunks = [s.next_chunk() for s in self.active]
        drafts = self._drafts(chunks)
        for s in self.active:
            if s.caches is None:
                s.caches = self._new_caches(s.max_len)
        self.peak_kv_bytes = max(self.peak_kv_bytes, sum(s.kv_bytes() for s in self.active))
        outs = self._forward(chunks, drafts)
        sampling = [i for i, (s, (_, end)) in enumerate(zip(self.active, chunks, strict=True)) if end == s.length]
        emitted = self._sample(outs, sampling, drafts)
        for s, (_, end) in zip(self.active, chunks, strict=True):
            s.cached = end
        done = []
        for i, (toks, lps) in zip(sampling, emitted, strict=True):
            s = self.active[i]
            s.cached += len(toks) - 1  # the accepted drafts' keys and values are in the caches already
            self.accepted_tokens += len(toks) - 1
            for tok, lp in zip(toks, lps, strict=True):
                s.tokens.append(tok)
                s.logprobs.append(lp)
                if tok in self.params.stops or s.length >= s.max_len:
                    s.done, s.caches = True, None
                    done.append(s)
                    break
        self.active = [s for s in self.active if not s.done]
        self.finished.update((s.seq_id, s) for s in done)
        self.iterations += 1
        return done

    def _drafts(self, chunks: list[tuple[int, int]]) -> list[list[int]]:
        """Each busy slot's n-gram drafts: none unless speculating, the slot is decoding (one token to
        feed) and at most ``live_at_most`` sequences are live; at most what its length limit leaves room for."""
        spec = self.speculation
        if spec is None or len(self.active) + len(self.queue) > spec.live_at_most:
            return [[] for _ in self.active]
        by_prompt: dict[tuple[int, ...], list[Sequence]] = {}
        for s in self.sequences().values():
            by_prompt.setdefault(tuple(s.prompt), []).append(s)
        out = []
        for s, (a, b) in zip(self.active, chunks, strict=True):
            if s.caches is None or b != s.length or b - a != 1:
                out.append([])
                continue
            siblings = [o.all_tokens() for o in reversed(by_prompt[tuple(s.prompt)]) if o is not s and o.tokens]
            siblings = siblings[:SIBLING_SOURCES]
            out.append(propose(s.all_tokens(), siblings, spec, s.max_len - s.length - 1))
        if any(out):
            self.speculative_iterations += 1
            self.verifications += sum(1 for d in out if d)
            self.draft_tokens += sum(map(len, out))
        return out

    def run(self) -> dict[int, Sequence]:
        """Step until nothing is left; every finished sequence by id."""
        while not self.idle:
            self.step()
        self.sm.record_memory("generate", kv_cache=self.peak_kv_bytes)
        return self.finished

    def _new_caches(self, max_len: int) -> dict[int, KVCache]:
        sm = self.sm
        return {int(i): KVCache(1, layer.self_attn.kv_heads, max_len, sm.cfg.arch.head_dim, sm.dtype,
                                sm.groups.device) for i, layer in sm.model.model.layers.items()}

    def _forward(self, chunks: list[tuple[int, int]], drafts: list[list[int]]) -> list[torch.Tensor]:
        """Each busy slot's chunk (and drafts) as its own micro-batch through the pipeline; last-stage outputs."""
        sm, dev = self.sm, self.sm.groups.device
        inputs = [torch.tensor([s.all_tokens()[a:b] + d], device=dev)
                  for s, (a, b), d in zip(self.active, chunks, drafts, strict=True)]

        def run(x: torch.Tensor, i: int) -> torch.Tensor:
            a = chunks[i][0]
            b = a + x.shape[1]
            positions = torch.arange(a, b, device=dev)[None]
            # query position q attends to keys 0..q (causal, aligned to the end of the cached prefix)
            mask = torch.ones(b - a, b, dtype=torch.bool, device=dev).tril(diagonal=a)[None, None]
            return sm.model(x, positions, mask, self.active[i].caches, a)

        shape = lambda i: (1, inputs[i].shape[1], sm.cfg.arch.hidden)  # noqa: E731
        return forward_only(run, sm.comm, inputs, shape, sm.dtype)

    def _sample(self, outs: list[torch.Tensor], sampling: list[int],
                drafts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
        """Tokens and log-probs each sampling slot emits (one, or up to its drafts + 1), on every rank."""
        g = self.sm.groups
        width = 1 + max((len(drafts[i]) for i in sampling), default=0)
        tokens = torch.zeros(len(sampling), width, dtype=torch.long, device=g.device)
        logps = torch.zeros(len(sampling), width, dtype=torch.float64, device=g.device)
        counts = torch.zeros(len(sampling), dtype=torch.long, device=g.device)
        if outs:  # last stage: every TP rank samples the same tokens from the same logits and stream
            for j, i in enumerate(sampling):
                seq, d = self.active[i], drafts[i]
                if d:
                    toks, lps = verify(gather_vocab(outs[i][0, -len(d) - 1:], g.tp_group), d, self.params, seq.gen)
                else:
                    logits = gather_vocab(outs[i][:, -1], g.tp_group)
                    tok = sample(logits, self.params, seq.gen)
                    toks, lps = [int(tok[0])], [float(logprobs_from_logits(logits, tok.to(logits.device))[0])]
                counts[j] = len(toks)
                tokens[j, : len(toks)] = torch.tensor(toks)
                logps[j, : len(toks)] = torch.tensor(lps, dtype=torch.float64)
        if g.layout.pp > 1 and sampling:
            src = g.pp_peer(g.layout.pp - 1)
            for t in (tokens, logps, counts):
                dist.broadcast(t, src=src, group=g.pp_group)
        return [(tokens[j, :n].tolist(), logps[j, :n].tolist()) for j, n in enumerate(counts.tolist())]


def replica_engine(sm: ShardedModel, prompts: list[list[int]], params: SamplingParams, slots: int) -> DecodeEngine:
    """A fresh engine of ``slots`` slots with this replica's rows of ``prompts`` queued (sequence ids = their
    indices in ``prompts``, so each samples from the same stream whichever replica runs it). A resumed row
    (``params.resumed``) re-prefills its prompt and carried tokens and generates only what its limit leaves."""
    engine = DecodeEngine(sm, params, slots)
    for i in range(len(prompts))[sm.replica_rows(len(prompts))]:
        carried = params.resumed[i] if params.resumed else 0
        limit = 0 if i in params.resumed_done else params.max_new_tokens - carried
        engine.submit(i, prompts[i], limit)
    return engine


def generate_continuous(sm: ShardedModel, prompts: list[list[int]], params: SamplingParams,
                        slots: int, faults: FaultHook | None = None) -> ReplicaRollout:
    """``generate_with_logprobs``'s answer from the continuous-batching engine: this replica's rows of
    ``prompts`` (sequence ids = their indices in ``prompts``), on every rank of the replica. With
    ``params.keep_groups``: only the rows of the first groups to finish (``first_groups``); the others
    None (tail batching), or ``Carried`` with ``params.carry_partial`` (partial rollout)."""
    engine = replica_engine(sm, prompts, params, slots)
    ids = sorted(engine.sequences())
    if faults is not None and faults.armed_at("generate") and not engine.idle:
        engine.step()  # prefill and the first tokens: the fault lands in the middle of decoding
        faults.at("generate")
    if not params.keep_groups:
        done = engine.run()
        return ReplicaRollout([(done[i].tokens, done[i].logprobs) for i in ids], engine_stats(engine))
    kept, aborted = first_groups(engine, params.keep_groups, params.group_size, params.must_groups)
    held = {**engine.finished, **aborted}
    out: list[Answer] = []
    for i in ids:
        s = held[i]
        if i in kept:
            out.append((s.tokens, s.logprobs))
        else:
            out.append(Carried(s.tokens, s.logprobs, s.done) if params.carry_partial else None)
    return ReplicaRollout(out, engine_stats(engine))


def engine_stats(engine: DecodeEngine) -> DecodeStats:
    return DecodeStats(engine.iterations, engine.speculative_iterations, engine.verifications, engine.draft_tokens,
                       engine.accepted_tokens)


def first_groups(engine: DecodeEngine, keep: int, group_size: int,
                 must: int = 0) -> tuple[set[int], dict[int, Sequence]]:
    """Tail batching's stop rule on the engine (``answers.GroupOrder``): step ``engine`` until ``keep`` whole
    groups (sequence ids ``g·group_size .. (g+1)·group_size − 1``) have finished, the replica's ``must``
    lowest-numbered groups among them, then abort every unfinished sequence (caches freed). Returns the
    ids of the kept groups' sequences and the aborted sequences by id."""
    order = GroupOrder(engine.sequences(), group_size, keep, must)
    while True:
        order.update(engine.finished.keys())
        if order.satisfied or engine.idle:
            break
        engine.step()
    aborted = {s.seq_id: s for s in engine.take([s.seq_id for s in engine.unfinished()])}
    engine.sm.record_memory("generate", kv_cache=engine.peak_kv_bytes)
    return order.kept_rows(), aborted
