"""Tokens per second of the runtime under every layout with TP·PP·DP ≤ WORLD on this machine: training
(forward + backward + Adam), inference (log-probs of given tokens) and generation (KV-cached decode).

    python benchmarks/runtime_layouts.py [--world 4] [--steps 3] [--layers 4 --hidden 256 ...]

Ranks are forked processes with gloo (NCCL on CUDA machines), one thread each; on a machine with fewer
cores than ranks they share cores, so figures compare layouts on this machine, not hardware peaks.
Median over ``--steps`` timed repetitions after one warm-up.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch
import torch.distributed as dist

from nereus.runtime.cluster.launch import run_world
from nereus.runtime.comm.groups import ParallelGroups
from nereus.runtime.engines.native.fixed_batch import SamplingParams, generate
from nereus.runtime.model.decoder import ModelConfig, build_model
from nereus.runtime.model.hf import slice_boxes
from nereus.runtime.parallel.batch import TrainBatch
from nereus.runtime.parallel.sharded import ShardedModel, shard_boxes
from nereus.spec.layout import Layout
from nereus.spec.model import ModelArch


def _loss(out: torch.Tensor, mb: TrainBatch) -> torch.Tensor:
    return -out.mean()


def _timed(fn, steps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _measure(cfg: ModelConfig, lay: Layout, state: dict, a: argparse.Namespace) -> tuple[float, ...] | None:
    groups = ParallelGroups(lay)
    sm = ShardedModel(cfg, groups, slice_boxes(state, shard_boxes(cfg, groups))) if groups.member else None
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.arch.vocab, (a.batch, a.seq), generator=g)
    prompts = torch.randint(0, cfg.arch.vocab, (a.batch, a.prompt), generator=g).tolist()
    params = SamplingParams(max_new_tokens=a.new_tokens)
    noop = lambda: None  # noqa: E731  (ranks outside the layout still join the barriers)
    train = _timed((lambda: sm.train_step(TrainBatch(tokens), _loss)) if sm else noop, a.steps)
    infer = _timed((lambda: sm.logprobs(tokens)) if sm else noop, a.steps)
    gen = _timed((lambda: generate(sm, prompts, params)) if sm else noop, a.steps)
    dist.barrier()
    groups.destroy()
    n = a.batch * a.seq
    return n / train, n / infer, a.batch * a.new_tokens / gen


def _body(rank: int, world: int, a: argparse.Namespace) -> None:
    arch = ModelArch(a.layers, a.hidden, a.ffn, a.heads, a.kv_heads, a.vocab)
    cfg = ModelConfig(arch)
    state = build_model(cfg, seed=0).state_dict()
    if rank == 0:
        print(f"model: {arch.layers} layers, hidden {arch.hidden}, {arch.params() / 1e6:.1f}M params; batch "
              f"{a.batch} x {a.seq} tokens (train/inference), {a.batch} x ({a.prompt} + {a.new_tokens}) generation; "
              f"{world} ranks, backend {dist.get_backend()}")
        print(f"{'layout':<22}{'train tok/s':>14}{'inference tok/s':>18}{'generation tok/s':>19}")
    for t, p, d in itertools.product((1, 2, 4), (1, 2, 4), (1, 2, 4)):
        if t * p * d > world or a.batch % (d * a.mbs) or a.heads % t or (a.kv_heads % t and t % a.kv_heads):
            continue
        lay = Layout(tp=t, pp=p, dp=d, micro_batch_size=a.mbs, recompute="none", sequence_parallel=False)
        figures = _measure(cfg, lay, state, a)
        if rank == 0:
            print(f"{lay.short():<22}{figures[0]:>14.0f}{figures[1]:>18.0f}{figures[2]:>19.1f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in [("world", 4), ("steps", 3), ("layers", 4), ("hidden", 256), ("ffn", 688), ("heads", 8),
                          ("kv_heads", 2), ("vocab", 2048), ("batch", 8), ("seq", 128), ("mbs", 2), ("prompt", 32),
                          ("new_tokens", 16)]:
        ap.add_argument(f"--{name.replace('_', '-')}", dest=name, type=int, default=default)
    a = ap.parse_args()
    run_world(_body, a.world, a, timeout_s=600)


if __name__ == "__main__":
    main()
