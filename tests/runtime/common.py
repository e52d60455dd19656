"""Tiny models, batches, losses and the single-process reference shared by the runtime tests."""

from __future__ import annotations

import itertools
from dataclasses import replace
from functools import lru_cache

import torch

from nereus.runtime.model.decoder import ModelConfig, build_model
from nereus.runtime.model.moe import RoutingRecord
from nereus.runtime.parallel.batch import TrainBatch
from nereus.spec.layout import Layout
from nereus.spec.model import ModelArch
from nereus.spec.moe import MoESpec

# 12 heads of 8 and one KV head: TP 2, 3 and 4 all split whole heads and replicate the KV head; the
# FFN width (200) and vocabulary (101) split unevenly over 3 and 4 ranks; 4 layers split 2/1/1 over PP 3.
MQA = ModelConfig(ModelArch(layers=4, hidden=96, ffn_hidden=200, heads=12, kv_heads=1, vocab=101),
                  rope_theta=10000.0, eos_token_id=7)
# Grouped-query attention (4 heads, 2 KV heads), tied embeddings and q/k/v biases (Qwen2-style).
GQA = ModelConfig(ModelArch(layers=3, hidden=64, ffn_hidden=120, heads=4, kv_heads=2, vocab=90,
                            tied_embeddings=True, qkv_bias=True), rope_theta=1e6, eos_token_id=5)
GQA_VALUE = GQA.with_value_head()
# Qwen3-style: per-head q/k norms and head_dim given (4 heads of 24 over hidden 64); TP 4 replicates its 2
# KV heads, so the k-norm gradient sums shares of ranks holding the same KV head.
QWEN3 = ModelConfig(ModelArch(layers=2, hidden=64, ffn_hidden=120, heads=4, kv_heads=2, vocab=90, head_dim=24,
                              qk_norm=True), rope_theta=1e6, eos_token_id=5)
# Mixture of Experts: 4 experts of width 24, 2 per token, layer 1 dense, Qwen3's q/k norms and Qwen2-MoE's shared
# expert (``runtime.model.moe``); TP 2 splits each expert like the dense MLP
MOE = ModelConfig(ModelArch(layers=3, hidden=32, ffn_hidden=48, heads=4, kv_heads=2, vocab=50, qk_norm=True,
                            moe=MoESpec(4, 2, 24, True, shared_expert_ffn_hidden=20, dense_layers=(1,),
                                        aux_loss_coef=0.01)),
                  rope_theta=1e4, eos_token_id=5)
# the same without the load-balancing loss, which depends on how tokens are grouped into micro-batches: for checks
# that the objective does not (packing)
MOE_NO_AUX = replace(MOE, arch=replace(MOE.arch, moe=replace(MOE.arch.moe, aux_loss_coef=0.0)))

BATCH, SEQ, LR = 12, 10, 1e-2  # 12 sequences split over DP 1, 2, 3 and 4
# Adam divides by sqrt(v) + eps: at near-zero gradients eps=1e-8 turns a 1e-9 fp32 difference of reduction
# order into a 1e-3 difference of the update; eps=1e-5 keeps the comparison about the math.
ADAM_EPS = 1e-5


def all_layouts(max_world: int = 4) -> list[Layout]:
    """Every (tp, pp, dp) with tp·pp·dp ≤ max_world, micro-batch size 1, ZeRO-1 on."""
    return [Layout(tp=t, pp=p, dp=d, micro_batch_size=1, recompute="none", sequence_parallel=False)
            for t, p, d in itertools.product(range(1, max_world + 1), repeat=3) if t * p * d <= max_world]


def batch(cfg: ModelConfig, seed: int = 0) -> TrainBatch:
    """Random tokens with advantages and returns per position [B, T] (``policy_loss`` reads them)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.arch.vocab, (BATCH, SEQ), generator=g)
    adv = torch.randn(BATCH, SEQ, generator=g)
    return TrainBatch(tokens, advantages=adv, returns=torch.randn(BATCH, SEQ, generator=g))


def policy_loss(out: torch.Tensor, mb: TrainBatch) -> torch.Tensor:
    """A policy-gradient-shaped loss on next-token log-probs (or a value regression for value heads)."""
    if out.shape[-1] == mb.tokens.shape[-1]:
        return ((out - mb.returns) ** 2).mean()
    return -(out * mb.advantages[:, 1:]).mean() + 0.1 * (out**2).mean()


@lru_cache(maxsize=8)
def reference(cfg: ModelConfig, mbs: int = 1) -> dict[str, dict[str, torch.Tensor]]:
    """Single-process results: state, logits, log-probs/values, gradients and weights after one Adam step."""
    torch.manual_seed(0)
    model = build_model(cfg, seed=1)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    b = batch(cfg)
    out: dict[str, dict[str, torch.Tensor]] = {"state": state}
    with torch.no_grad():
        y = model(b.tokens)
    if cfg.value_head:
        out["fwd"] = {"values": y}
    else:
        logp = torch.log_softmax(y, -1)[:, :-1].gather(-1, b.tokens[:, 1:, None]).squeeze(-1)
        out["fwd"] = {"logits": y, "logprobs": logp}
    n = BATCH // mbs
    for i in range(0, BATCH, mbs):
        mb = b.select(slice(i, i + mbs))
        record = RoutingRecord(aux=True)
        y = model(mb.tokens, routing=record)
        if not cfg.value_head:
            y = torch.log_softmax(y, -1)[:, :-1].gather(-1, mb.tokens[:, 1:, None]).squeeze(-1)
        aux = record.layer_aux_losses().mean() * cfg.arch.moe.aux_loss_coef if cfg.arch.moe else 0.0
        ((policy_loss(y, mb) + aux) / n).backward()  # an MoE model's load-balancing loss as the runtime trains it
    out["grad"] = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
    # what torch.nn.utils.clip_grad_norm_ measures (a tied embedding is one parameter, counted once)
    out["grad_norm"] = torch.stack([g.double().pow(2).sum() for g in out["grad"].values()]).sum().sqrt()
    torch.optim.Adam(model.parameters(), lr=LR, eps=ADAM_EPS, foreach=False).step()
    out["stepped"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return out
