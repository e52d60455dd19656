"""The fixed batch decoded from static buffers: one captured CUDA graph per decode step on a GPU, the very
same code run eagerly elsewhere (``run.rollout.native_decode``; docs/generation.md, "Static decode").

Why: the per-step loop (``fixed_decode``) rebuilds masks and positions on the host and launches every
layer's kernels from Python, so on a GPU a small model's decode step is bound by the host, not the device.
Here everything a step reads lives in buffers allocated once, for a batch bucket (a power of two, as vLLM's
CUDA-graph capture sizes) and one cache length:

- token ids, and each row's cache offset (= its next position: prompts are prefilled without padding,
  each at the front of its cache row) as [rows] tensors;
- the KV caches (``StaticKVCache``), written at the per-row offset tensor by index (no host sync, unlike
  ``KVCache.update``'s per-row path, which slices up to the furthest written position) and read over the
  whole static length under a mask computed on the device (position ≤ offset);
- the step's logits, into which the captured graph writes.

A step is then ``graph.replay()`` (Python launches one graph, not hundreds of kernels), then sampling the
first ``n`` rows eagerly with the fixed batch's stream and rule (``sampling.sample``), so tokens and
log-probs are those of the per-step loop: greedy tokens equal, log-probs to rounding (another
summation order: no left padding, keys over the static length). The prompts are prefilled packed, end to
end in one row (``decoder.varlen_attention``), each sequence's keys and values scattered into its cache
row, and the LM head runs on each prompt's last position only.

Scope: one pipeline stage and TP 1 (a graph would have to hold the stage hand-offs and collectives), no
speculation, tail batching or continuous batching; the engine runs the per-step loop otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from nereus.runtime.comm.faults import FaultHook
from nereus.runtime.engines.answers import DecodeStats, ReplicaRollout
from nereus.runtime.engines.sampling import SamplingParams, row_limit, sample, stream_seed
from nereus.runtime.model.decoder import CausalLM, KVCache, logprobs_from_logits, packed_positions
from nereus.runtime.parallel.sharded import ShardedModel

# cache lengths are rounded up to a multiple of this (shapes a GPU's allocator reuses across calls)
LENGTH_QUANTUM = 64


def batch_bucket(rows: int) -> int:
    """The smallest power of two holding ``rows`` (vLLM captures its CUDA graphs at such batch sizes)."""
    if rows < 1:
        raise ValueError(f"a decode batch needs at least one row, got {rows}")
    return 1 << (rows - 1).bit_length()


def length_bucket(tokens: int) -> int:
    return -(-tokens // LENGTH_QUANTUM) * LENGTH_QUANTUM


def decode_path(mode: str, sm: ShardedModel, params: SamplingParams) -> str:
    """Which decode the native engine runs for one fixed-batch call: ``graphed`` (static buffers, a captured
    CUDA graph), ``static`` (the same buffers, eager) or ``loop`` (``fixed_decode``). ``mode``:
    ``run.rollout.native_decode`` (auto: graphed on a CUDA device, the loop elsewhere; the loop where router
    replay records routes)."""
    if mode == "loop" or not static_supported(sm, params) or params.record_routes:  # the loop records routes
        return "loop"
    # an MoE layer's routing sizes its expert batches on the host: no graph, the static buffers eager
    cuda = sm.groups.device.type == "cuda" and sm.cfg.arch.moe is None
    if mode == "auto":
        return "graphed" if cuda else "loop"
    return "graphed" if mode == "graphed" and cuda else "static"


def static_supported(sm: ShardedModel, params: SamplingParams) -> bool:
    """One stage, TP 1, and a plain fixed batch (no slots, speculation or group stop rule)."""
    dims = sm.groups.dims
    return (dims.pp == 1 and dims.tp == 1 and not params.slots and params.speculation is None
            and not params.keep_groups and not sm.cfg.value_head)


class StaticKVCache(KVCache):
    """A layer's keys and values [rows, kv_heads, length, head_dim], written at a per-row offset tensor
    without a host sync; attention reads the whole length (the caller masks positions past the offset)."""

    def __init__(self, rows: int, kv_heads: int, length: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__(rows, kv_heads, length, head_dim, dtype, device)
        self.row_index = torch.arange(rows, device=device)

    def update(self, k: torch.Tensor, v: torch.Tensor,
               start: int | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One new position per row ([rows, kv_heads, 1, head_dim]) at ``start`` [rows]."""
        self.k[self.row_index, :, start] = k[:, :, 0]  # advanced indices first: [rows, kv_heads, head_dim]
        self.v[self.row_index, :, start] = v[:, :, 0]
        return self.k, self.v


@dataclass
class PackedWrite:
    """A cache stand-in for the packed prefill: scatters the packed keys and values [1, kv_heads, T, d]
    into the static cache (token t to row ``rows[t]``, position ``cols[t]``) and hands them back unchanged
    for the varlen attention over the packed row."""

    cache: StaticKVCache
    rows: torch.Tensor
    cols: torch.Tensor

    def update(self, k: torch.Tensor, v: torch.Tensor,
               start: int | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.cache.k[self.rows, :, self.cols] = k[0].transpose(0, 1)  # [T, kv_heads, head_dim]
        self.cache.v[self.rows, :, self.cols] = v[0].transpose(0, 1)
        return k, v


class StaticDecode:
    """Static buffers of one decode batch bucket and cache length on ``model``'s device, and the step
    over them: captured as a CUDA graph (``capture``, on a CUDA device) or run eagerly."""

    def __init__(self, model: CausalLM, rows: int, length: int, dtype: torch.dtype, capture: bool) -> None:
        self.model, self.length = model, length
        self.rows = batch_bucket(rows)
        dev = self.device = model.inv_freq.device
        head_dim = model.cfg.arch.head_dim
        self.caches = {int(i): StaticKVCache(self.rows, layer.self_attn.kv_heads, length, head_dim, dtype, dev)
                       for i, layer in model.model.layers.items()}
        self.ids = torch.zeros(self.rows, dtype=torch.long, device=dev)
        self.offset = torch.zeros(self.rows, dtype=torch.long, device=dev)
        self.cols = torch.arange(length, device=dev)
        self.logits = torch.zeros(self.rows, model.cfg.arch.vocab, dtype=torch.float32, device=dev)
        self.graph: torch.cuda.CUDAGraph | None = None
        if capture and dev.type == "cuda":
            self._capture()

    @torch.no_grad()
    def _forward(self) -> None:
        """Feed ``ids`` at ``offset``, logits into ``logits``, advance ``offset``: no host value is read."""
        mask = (self.cols[None] <= self.offset[:, None])[:, None, None]  # [rows, 1, 1, length]
        out = self.model(self.ids[:, None], self.offset[:, None], mask, self.caches, self.offset)
        self.logits.copy_(out[:, -1])
        self.offset.add_(1).clamp_(max=self.length - 1)  # a finished or padding row never reads past it

    def _capture(self) -> None:
        """Warm up on a side stream (as torch.cuda.graphs asks), then capture one step; the warm-up's
        writes land at positions the prefill and the first steps overwrite before anything reads them."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._forward()
        self.offset.zero_()

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed each of the first ``len(tokens)`` rows its token; the logits of every row [rows, V] (a
        view of the static buffer, valid until the next step)."""
        self.ids[: tokens.shape[0]].copy_(tokens)
        if self.graph is not None:
            self.graph.replay()
        else:
            self._forward()
        return self.logits

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]]) -> torch.Tensor:
        """The prompts packed end to end in one forward, each one's keys and values into its cache row
        (from position 0); the logits at each prompt's last position [n, V]."""
        if any(not p for p in prompts):
            raise ValueError(f"prompt {[len(p) for p in prompts].index(0)} is empty")
        lens = tuple(len(p) for p in prompts)
        m, dev = self.model, self.device
        ids = torch.tensor([[t for p in prompts for t in p]], device=dev)
        cols = packed_positions(lens, dev)
        rows = torch.repeat_interleave(torch.arange(len(lens), device=dev), torch.tensor(lens, device=dev))
        writes = {i: PackedWrite(c, rows, cols[0]) for i, c in self.caches.items()}
        h = m.model.embed_tokens(ids)
        ctx = m.context(cols, h.dtype, caches=writes, seq_lens=lens)
        for layer in m.model.layers.values():
            h = layer(h, ctx)
        last = torch.cumsum(torch.tensor(lens, device=dev), 0) - 1
        self.offset[: len(lens)] = torch.tensor(lens, device=dev)
        return m.project(m.head_input(m.model.norm(h[:, last])))[0]

    def kv_bytes(self) -> int:
        return sum(c.nbytes() for c in self.caches.values())


@dataclass
class Rows:
    """What the replica's rows generated so far, and which are finished (stop token or length limit)."""

    limits: list[int]
    stops: frozenset[int]
    tokens: list[list[int]] = field(default_factory=list)
    logps: list[list[float]] = field(default_factory=list)
    finished: list[bool] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.tokens = [[] for _ in self.limits]
        self.logps = [[] for _ in self.limits]
        self.finished = [n <= 0 for n in self.limits]

    def record(self, new: torch.Tensor, logps: torch.Tensor) -> None:
        """Each live row's new token and its log-prob (one transfer to the host)."""
        both = torch.stack([new.double(), logps.double()]).cpu().tolist()
        for j, (tok, lp) in enumerate(zip(*both, strict=True)):
            if self.finished[j]:
                continue
            self.tokens[j].append(int(tok))
            self.logps[j].append(lp)
            self.finished[j] = int(tok) in self.stops or len(self.tokens[j]) >= self.limits[j]

    @property
    def done(self) -> bool:
        return all(self.finished)


@torch.no_grad()
def static_generate(sm: ShardedModel, prompts: list[list[int]], params: SamplingParams, capture: bool,
                    faults: FaultHook | None = None) -> ReplicaRollout:
    """``fixed_batch.generate_with_logprobs``'s answer from static buffers (``static_supported`` must hold):
    this replica's rows of ``prompts``, sampled from the same stream with the same rule. ``capture``: one
    CUDA graph per step on a CUDA device."""
    ids = list(range(len(prompts)))[sm.replica_rows(len(prompts))]
    mine = [list(prompts[i]) for i in ids]
    rows = Rows([row_limit(params, i) for i in ids], params.stops)
    room = length_bucket(max(map(len, mine)) + params.max_new_tokens)
    decode = StaticDecode(sm.model, len(mine), room, sm.dtype, capture)
    gen = torch.Generator(device=sm.groups.device).manual_seed(stream_seed(params.seed, sm.groups.coords.dp_rank))
    logits, iterations = decode.prefill(mine), 0
    while True:
        new = sample(logits, params, gen)
        rows.record(new, logprobs_from_logits(logits, new))
        if rows.done:
            break
        if faults is not None:
            faults.at("generate")
        logits = decode.step(new)[: len(mine)]
        iterations += 1
    sm.record_memory("generate", kv_cache=decode.kv_bytes())
    return ReplicaRollout(list(zip(rows.tokens, rows.logps, strict=True)), DecodeStats(iterations))
