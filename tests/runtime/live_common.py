"""Shared by the live-transition tests: four small models (one per PPO role), a job for the transition
graph, runtime keys under given layouts, and the global state of every key gathered from all ranks."""

from __future__ import annotations

import json
from dataclasses import asdict

import torch
import torch.distributed as dist

from nereus.elastic.graph import build_graph
from nereus.elastic.plan import TransitionPlan
from nereus.runtime.comm.groups import ParallelGroups
from nereus.runtime.model.decoder import ModelConfig, build_model
from nereus.runtime.model.hf import slice_boxes
from nereus.runtime.parallel.batch import TrainBatch
from nereus.runtime.parallel.sharded import ShardedModel, shard_boxes
from nereus.runtime.transitions.holdings import holdings_of
from nereus.runtime.transitions.live import KeySpec, plan_of
from nereus.spec import Layout, job_from_dict
from nereus.spec.model import ModelArch

WORLD = 4
# Actor: tied embeddings and q/k/v biases (Qwen2-style: the last stage's tied_head copy, bias order);
# critic and reward: value heads; reference: one KV head replicated over TP. Four layers: PP up to 4.
ACTOR = ModelConfig(ModelArch(layers=4, hidden=32, ffn_hidden=56, heads=4, kv_heads=2, vocab=50,
                              tied_embeddings=True, qkv_bias=True), rope_theta=1e4, eos_token_id=3)
CRITIC = ModelConfig(ModelArch(layers=4, hidden=32, ffn_hidden=40, heads=4, kv_heads=2, vocab=50)).with_value_head()
REFERENCE = ModelConfig(ModelArch(layers=4, hidden=32, ffn_hidden=48, heads=4, kv_heads=1, vocab=50))
REWARD = ModelConfig(ModelArch(layers=4, hidden=24, ffn_hidden=40, heads=4, kv_heads=2, vocab=50)).with_value_head()
CFGS = {"actor": ACTOR, "critic": CRITIC, "reference": REFERENCE, "reward": REWARD}
STAGE = {"actor": "training", "critic": "training", "reference": "inference", "reward": "inference"}
BATCH, SEQ = 8, 8


def lay(tp: int = 1, pp: int = 1, dp: int = 1, mbs: int = 1) -> Layout:
    return Layout(tp=tp, pp=pp, dp=dp, micro_batch_size=mbs, recompute="none", sequence_parallel=False)


def job(cfgs: dict[str, ModelConfig] = CFGS, chunk_mib: float | None = None):
    models = {}
    for role in ("actor", "critic", "reference", "reward"):
        arch = json.loads(json.dumps(asdict(cfgs.get(role, CFGS[role]).arch)))  # tuples as lists, as YAML has them
        models[role] = arch
    return job_from_dict({
        "name": "live", "models": models, "algorithm": {"name": "ppo"},
        "workload": {"prompts_per_step": 8, "prompt_length": 8, "response_length": {"mean": 8, "max": 16}},
        "cluster": {"gpu": {"name": "cpu-local", "peak_tflops": 0.05, "hbm_tb_per_s": 0.01, "memory_gb": 8,
                            "intra_node_gb_per_s": 1, "inter_node_gb_per_s": 1},
                    "nodes": 1, "gpus_per_node": WORLD},
        "options": {"weight_bytes": 4, "recompute": "none", "sequence_parallel": False},
    })


def spec(model: str, layout: Layout, ranks, key: str | None = None, stage: str | None = None) -> KeySpec:
    stage = stage or STAGE[model]
    return KeySpec(key or f"{model}/{stage}", model, stage, CFGS[model], layout, tuple(ranks))


def graph_between(old: list[KeySpec], new: list[KeySpec], **kw) -> TransitionPlan:
    return build_graph(job(**kw), plan_of(old, WORLD), plan_of(new, WORLD))


def initial_state(model: str, cfg: ModelConfig | None = None) -> dict[str, torch.Tensor]:
    """``model``'s initial weights (of ``cfg`` when given instead of the role's config)."""
    return {k: v.detach().clone() for k, v in build_model(cfg or CFGS[model], seed=7).state_dict().items()}


def groups_for(s: KeySpec) -> ParallelGroups:
    from nereus.runtime.parallel.sharded import tied_head

    return ParallelGroups(s.layout, list(s.ranks), tied_embeddings=tied_head(s.cfg))


def load(s: KeySpec, groups: ParallelGroups, state: dict[str, torch.Tensor]) -> ShardedModel | None:
    if not groups.member:
        return None
    return ShardedModel(s.cfg, groups, slice_boxes(state, shard_boxes(s.cfg, groups)))


def make_batch(cfg: ModelConfig, seed: int) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.arch.vocab, (BATCH, SEQ), generator=g)
    adv = torch.randn(BATCH, SEQ, generator=g)
    return TrainBatch(tokens, advantages=adv, returns=torch.randn(BATCH, SEQ, generator=g))


def loss_fn(out: torch.Tensor, mb: TrainBatch) -> torch.Tensor:
    if out.shape[-1] == mb.tokens.shape[-1]:  # values
        return ((out - mb.returns) ** 2).mean()
    return -(out * mb.advantages[:, 1:]).mean() + 0.1 * (out**2).mean()


def train_step(sm: ShardedModel | None, cfg: ModelConfig, seed: int, lr: float = 1e-2) -> list[float]:
    """One step on every rank of the layout; the micro-batch losses gathered to every rank."""
    mine = sm.train_step(make_batch(cfg, seed), loss_fn, lr) if sm is not None else []
    mine = mine if sm is not None and sm.is_output_rank else []
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (sm.groups.coords.dp_rank if sm is not None else -1, mine))
    return [x for _, losses in sorted(p for p in parts if p[1]) for x in losses]


def global_state(model: str, sm: ShardedModel | None,
                 cfg: ModelConfig | None = None) -> dict[tuple[str, str, int], torch.Tensor]:
    """(state, tensor, component) → whole tensor, assembled on every rank from every rank's buffers;
    elements no rank holds stay NaN (callers check coverage)."""
    mine = []
    if sm is not None:
        for (_, state, name, boxes), buf in holdings_of(model, sm).buffers.items():
            for box in boxes:
                mine += [(state, name, i, box, v.clone()) for i, v in enumerate(buf.view(box))]
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    shapes = {k: tuple(v.shape) for k, v in initial_state(model, cfg).items()}
    full: dict[tuple[str, str, int], torch.Tensor] = {}
    for rank_parts in parts:
        for state, name, i, box, v in rank_parts:
            t = full.setdefault((state, name, i), torch.full(shapes[name], float("nan"), dtype=v.dtype))
            t[tuple(slice(lo, hi) for lo, hi in box)] = v
    return full


def assert_same_state(got: dict, want: dict, where: str) -> None:
    assert set(got) == set(want), f"{where}: states {sorted(set(got) ^ set(want))} differ"
    for key, t in want.items():
        assert not torch.isnan(got[key]).any(), f"{where}: {key} not covered"
        assert torch.equal(got[key], t), f"{where}: {key} changed"
