"""A Llama/Qwen2/Qwen3-style decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention) in plain PyTorch.

The math here knows nothing of parallelism. Module and parameter names follow HuggingFace checkpoints
(``model.layers.3.self_attn.q_proj.weight``), so a model's ``state_dict`` keys are the tensor names of
``nereus.spec.sharding``. A model may hold only part of the decoder (a pipeline stage): layers live in a
``ModuleDict`` keyed by their global index, and the embedding, the final norm and the heads are present
only where a stage keeps them. ``nereus.runtime.parallel`` applies TP/PP/DP to it from outside.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn

from nereus.runtime.model.moe import MoEBlock, RoutingRecord
from nereus.spec.model import ModelArch


@dataclass(frozen=True)
class ModelConfig:
    """Architecture plus the numerics a checkpoint fixes (RoPE base and scaling, norm epsilon)."""

    arch: ModelArch
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    rope_scaling: dict = field(default_factory=dict, hash=False)  # HF rope_parameters beyond the base
    value_head: bool = False  # critic/reward: a hidden→1 ``score`` head replaces the LM head
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None  # a tuple when config.json lists several (written back so)

    def with_value_head(self, value_head: bool = True) -> ModelConfig:
        return replace(self, value_head=value_head)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies of rotary embeddings (Su et al. 2021); ``llama3`` scaling as in Llama 3.1."""
    d = cfg.arch.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).to(torch.float32) / d))
    kind = cfg.rope_scaling.get("rope_type", "default")
    if kind == "default":
        return inv
    if kind != "llama3":
        raise ValueError(f"rope_type {kind!r} is not supported (default or llama3)")
    s = cfg.rope_scaling
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen <= old / low) & (wavelen >= old / high)
    return torch.where(is_mid, mid, scaled)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """cos/sin of shape [B, 1, T, head_dim] for integer ``positions`` [B, T]."""
    freqs = positions[..., None].to(torch.float32) * inv_freq.to(positions.device)
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


def _up(x: torch.Tensor) -> torch.Tensor:
    """16-bit tensors in fp32 for reductions; fp32/fp64 unchanged."""
    return x.float() if x.element_size() < 4 else x


class _RMSNormFn(torch.autograd.Function):
    """y = w · x / rms(x) in fp32 (as HF), keeping only x and 1/rms for backward (x/rms is recomputed)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        h = _up(x)
        rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return weight * (h * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, weight, rstd = ctx.saved_tensors
        xhat = _up(x) * rstd
        g = _up(grad)
        dw = (g * xhat).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        dxhat = g * _up(weight)
        dx = rstd * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdim=True))
        return dx.to(x.dtype), dw, None


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFn.apply(x, self.weight, self.eps)


class KVCache:
    """Preallocated keys and values of one layer: [B, kv_heads, max_len, head_dim] each."""

    def __init__(self, batch: int, kv_heads: int, max_len: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.k = torch.zeros(batch, kv_heads, max_len, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)

    def update(self, k: torch.Tensor, v: torch.Tensor,
               start: int | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write new keys and values [B, kv_heads, T, head_dim] at positions ``start`` .. ``start + T``: one
        offset for the batch, or one per row ([B] long: rows that decoded different numbers of tokens,
        speculative decoding's per-row acceptance). Returns every position up to the furthest written."""
        t = k.shape[2]
        if isinstance(start, int):
            end = start + t
            self.k[:, :, start:end] = k
            self.v[:, :, start:end] = v
            return self.k[:, :, :end], self.v[:, :, :end]
        at = start.to(k.device)[:, None] + torch.arange(t, device=k.device)  # [B, T]
        rows = torch.arange(k.shape[0], device=k.device)[:, None].expand_as(at)
        self.k[rows, :, at] = k.transpose(1, 2)  # advanced indices first: [B, T, kv_heads, head_dim]
        self.v[rows, :, at] = v.transpose(1, 2)
        end = int(at.max()) + 1
        return self.k[:, :, :end], self.v[:, :, :end]

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


@dataclass
class Context:
    """Per-call inputs every layer reads: rotary tables, an optional boolean attention mask
    [B, 1, T, S] (True = attend; None = causal over the whole sequence), KV caches and their offset, and
    for packed sequences (a batch of one row holding several sequences end to end) their lengths."""

    cos: torch.Tensor
    sin: torch.Tensor
    mask: torch.Tensor | None = None
    caches: dict[int, KVCache] | None = None
    start: int | torch.Tensor = 0  # the caches' write offset: one for the batch, or one per row
    seq_lens: tuple[int, ...] | None = None  # packed: each sequence's length along T (they sum to T)
    routing: RoutingRecord | None = None  # MoE: router record/replay and load-balancing statistics


def packed_positions(seq_lens: tuple[int, ...], device: torch.device | str = "cpu") -> torch.Tensor:
    """Positions [1, T] of sequences packed end to end: each restarts at 0, as if it ran alone."""
    lens = torch.tensor(seq_lens, dtype=torch.long, device=device)
    starts = torch.cumsum(lens, 0) - lens
    total = int(lens.sum())
    return (torch.arange(total, device=device) - torch.repeat_interleave(starts, lens, output_size=total))[None]


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: tuple[int, ...],
                     gqa: bool) -> torch.Tensor:
    """Causal attention confined to each packed sequence ([1, heads, T, head_dim] split along T by
    ``seq_lens``): the block-diagonal causal mask, computed block by block so that the work and memory
    are Σ len² rather than T² (what flash-attention's varlen kernels do with cumulative lengths)."""
    parts = zip(q.split(seq_lens, 2), k.split(seq_lens, 2), v.split(seq_lens, 2), strict=True)
    return torch.cat([F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=gqa) for a, b, c in parts],
                     dim=2)


class CallSlot(nn.Module):
    """A slot around one part of the forward pass that just calls it; activation recomputation swaps in a
    module that checkpoints the part instead (``parallel.recompute``). Holds no tensors."""

    def forward(self, fn: Callable[..., torch.Tensor], *args: object) -> torch.Tensor:
        return fn(*args)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        a = cfg.arch
        self.heads, self.kv_heads, self.head_dim = a.heads, a.kv_heads, a.head_dim  # TP sets local counts
        self.q_proj = nn.Linear(a.hidden, a.heads * a.head_dim, bias=a.qkv_bias)
        self.k_proj = nn.Linear(a.hidden, a.kv_heads * a.head_dim, bias=a.qkv_bias)
        self.v_proj = nn.Linear(a.hidden, a.kv_heads * a.head_dim, bias=a.qkv_bias)
        self.o_proj = nn.Linear(a.heads * a.head_dim, a.hidden, bias=False)
        # Qwen3: RMSNorm of each query and key head before RoPE, one weight shared by the heads
        self.q_norm = RMSNorm(a.head_dim, cfg.rms_eps) if a.qk_norm else None
        self.k_norm = RMSNorm(a.head_dim, cfg.rms_eps) if a.qk_norm else None
        # the column-parallel projections' shared input: TP replaces it (``parallel.tp``), else a no-op
        self.tp_input: nn.Module = nn.Identity()
        self.core_call: nn.Module = CallSlot()  # selective recomputation checkpoints the core (``parallel.recompute``)

    def forward(self, x: torch.Tensor, ctx: Context, layer: int) -> torch.Tensor:
        x = self.tp_input(x)
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, ctx.cos, ctx.sin), apply_rope(k, ctx.cos, ctx.sin)
        if ctx.caches is not None:
            k, v = ctx.caches[layer].update(k, v, ctx.start)
        out = self.core_call(attention_core, q, k, v, ctx)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: Context) -> torch.Tensor:
    """softmax(q·kᵀ/√d)·v of RoPE'd queries and keys [B, heads, T, head_dim] (the part Megatron-LM's selective
    recomputation re-runs, Korthikanti et al. 2022, Sec. 5): causal, masked by ``ctx.mask``, or within each
    packed sequence."""
    gqa = q.shape[1] != k.shape[1]  # SDPA reads each KV head for its query group, no copies
    if ctx.seq_lens is not None:
        return varlen_attention(q, k, v, ctx.seq_lens, gqa)
    if ctx.mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=ctx.mask, enable_gqa=gqa)


class _SwiGLU(torch.autograd.Function):
    """silu(gate) · up, keeping only gate and up for backward (silu is recomputed, as Megatron-LM's fused
    SwiGLU does): three ffn-wide tensors per layer instead of four."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = ctx.saved_tensors
        sig = torch.sigmoid(gate)
        silu = gate * sig
        return grad * up * sig * (1 + gate * (1 - sig)), grad * silu


class MLP(nn.Module):
    """SwiGLU of width ``ffn_hidden`` (the dense ``arch.ffn_hidden`` unless given: an MoE expert's)."""

    def __init__(self, cfg: ModelConfig, ffn_hidden: int | None = None) -> None:
        super().__init__()
        a = cfg.arch
        width = a.ffn_hidden if ffn_hidden is None else ffn_hidden
        self.gate_proj = nn.Linear(a.hidden, width, bias=False)
        self.up_proj = nn.Linear(a.hidden, width, bias=False)
        self.down_proj = nn.Linear(width, a.hidden, bias=False)
        self.tp_input: nn.Module = nn.Identity()  # as in ``Attention``

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.tp_input(x)
        return self.down_proj(_SwiGLU.apply(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.index = index
        self.input_layernorm = RMSNorm(cfg.arch.hidden, cfg.rms_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.arch.hidden, cfg.rms_eps)
        moe = cfg.arch.moe
        self.mlp: nn.Module = (MoEBlock(moe, cfg.arch.hidden, index, lambda width: MLP(cfg, width))
                               if moe is not None and moe.sparse(index) else MLP(cfg))
        self.layer_call: nn.Module = CallSlot()  # full recomputation checkpoints the layer (``parallel.recompute``)

    def forward(self, x: torch.Tensor, ctx: Context) -> torch.Tensor:
        return self.layer_call(self.block, x, ctx)

    def block(self, x: torch.Tensor, ctx: Context) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx, self.index)
        if isinstance(self.mlp, MoEBlock):
            return x + self.mlp(self.post_attention_layernorm(x), ctx.routing)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """``model.*`` of a checkpoint: embedding, layers, final norm (each possibly absent on a stage)."""

    def __init__(self, cfg: ModelConfig, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        a = cfg.arch
        self.embed_tokens = nn.Embedding(a.vocab, a.hidden) if first else None
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, i) for i in layers})
        self.norm = RMSNorm(a.hidden, cfg.rms_eps) if last else None


class CausalLM(nn.Module):
    """The whole decoder, or one pipeline stage of it (``layers``, ``first``, ``last``).

    ``forward`` takes token ids on the first stage and hidden states elsewhere; it returns hidden states,
    or on the last stage the LM-head logits [B, T, V] (vocabulary shard under TP) or values [B, T].
    """

    def __init__(self, cfg: ModelConfig, layers: range | None = None, first: bool = True,
                 last: bool = True) -> None:
        super().__init__()
        a = cfg.arch
        self.cfg = cfg
        self.first, self.last = first, last
        self.model = Decoder(cfg, range(a.layers) if layers is None else layers, first, last)
        self.lm_head: nn.Linear | None = None
        self.score: nn.Linear | None = None
        if last and cfg.value_head:
            self.score = nn.Linear(a.hidden, 1, bias=False)
        elif last and not a.tied_embeddings:
            self.lm_head = nn.Linear(a.hidden, a.vocab, bias=False)
        self.tied_head: nn.Parameter | None = None  # tied weight copy on a last stage without embedding
        self.head_input: nn.Module = nn.Identity()  # the LM head's input: TP replaces it, as in ``Attention``
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def head_weight(self) -> torch.Tensor:
        if self.lm_head is not None:
            return self.lm_head.weight
        if self.tied_head is not None:
            return self.tied_head
        return self.model.embed_tokens.weight

    def context(self, positions: torch.Tensor, dtype: torch.dtype, mask: torch.Tensor | None = None,
                caches: dict[int, KVCache] | None = None, start: int | torch.Tensor = 0,
                seq_lens: tuple[int, ...] | None = None, routing: RoutingRecord | None = None) -> Context:
        cos, sin = rope_cos_sin(self.inv_freq, positions, dtype)
        return Context(cos, sin, mask, caches, start, seq_lens, routing)

    def forward(self, inputs: torch.Tensor, positions: torch.Tensor | None = None,
                mask: torch.Tensor | None = None, caches: dict[int, KVCache] | None = None,
                start: int | torch.Tensor = 0, seq_lens: tuple[int, ...] | None = None,
                routing: RoutingRecord | None = None) -> torch.Tensor:
        """``seq_lens``: ``inputs`` is one row of sequences packed end to end ([1, Σ seq_lens]); positions
        restart and attention stays within each (``varlen_attention``), so every sequence's outputs are
        those it has alone. ``routing``: an MoE model's router record or replay (``moe.RoutingRecord``)."""
        h = self.model.embed_tokens(inputs) if self.first else inputs
        if seq_lens is not None and (h.shape[0] != 1 or sum(seq_lens) != h.shape[1] or caches is not None):
            raise ValueError(f"packed sequences of lengths summing to {sum(seq_lens)} need one row of that many "
                             f"tokens and no KV cache; got {tuple(h.shape[:2])}")
        if positions is None and seq_lens is not None:
            positions = packed_positions(seq_lens, h.device)
        elif positions is None:
            positions = torch.arange(start, start + h.shape[1], device=h.device).expand(h.shape[0], -1)
        ctx = self.context(positions, h.dtype, mask, caches, start, seq_lens, routing)
        for layer in self.model.layers.values():
            h = layer(h, ctx)
        if not self.last:
            return h
        h = self.model.norm(h)
        if self.score is not None:
            return self.score(h).squeeze(-1)
        return self.project(self.head_input(h))

    def project(self, h: torch.Tensor) -> torch.Tensor:
        """LM-head logits in fp32 (TP swaps in a vocabulary-parallel projection)."""
        return F.linear(h, self.head_weight()).float()


def build_model(cfg: ModelConfig, seed: int | None = None, dtype: torch.dtype = torch.float32) -> CausalLM:
    """The whole model, randomly initialised (normal(0, 0.02) like HF Llama) when ``seed`` is given."""
    gen = torch.Generator().manual_seed(seed if seed is not None else 0)
    model = CausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # near 1, not exactly, so tests see a misplaced norm
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return model.to(dtype)


def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log p(tokens) under full-vocabulary ``logits`` [..., V]."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens[..., None]).squeeze(-1)
