"""The piece-level plan of a mid-step switch to a tail layout, as the cost model prices it
(``cost.generation.with_tail``): every sequence still generating at the trigger moves from its bulk
replica to its tail replica — KV pieces per (layers, KV heads) of each destination rank, or the record only
where it re-prefills — then the commit, then the sources free their caches (``elastic.kvplan``)."""

from __future__ import annotations

import numpy as np

from nereus.cost.batching import Factors
from nereus.cost.generation import BulkRun, GenModel, generated_at, kv_choice, nodes_of, tail_assignment, trigger_time
from nereus.elastic.kvplan import GenPlacement, KVShape, MigrationPlan, SeqMove, plan_migration
from nereus.spec.generation import TailPhase
from nereus.spec.layout import Layout


def tail_migration_plan(model: GenModel, bulk: BulkRun, phase: TailPhase, f: Factors | None = None) -> MigrationPlan:
    """``phase``'s move on this step's bulk run (see the module docstring)."""
    f = f or Factors()
    lay, arch = model.placement.layout, model.arch
    t_star = trigger_time(bulk, phase.trigger_live)
    ids = np.flatnonzero(bulk.finish_s > t_star)
    prompt = model.job.workload.prompt_length
    generated = generated_at(bulk, ids, t_star).astype(int)
    ctx = prompt + generated
    dest = tail_assignment(model, bulk, ids, phase)
    gpus = list(model.placement.gpus)
    tail_gpus = gpus[:phase.tail_gpus]
    cross = bool(nodes_of(model, gpus) - nodes_of(model, tail_gpus))
    refill = kv_choice(model, ctx.astype(float), phase, cross, f)
    src = GenPlacement(Layout(tp=lay.tp, pp=lay.pp, dp=lay.dp), tuple(gpus))
    dst = GenPlacement(Layout(tp=phase.tail_tp, dp=phase.tail_replicas), tuple(tail_gpus))
    moves = [SeqMove(int(i), prompt, int(g), int(c), 0, int(bulk.replica[i]), int(d), bool(r))
             for i, g, c, d, r in zip(ids, generated, ctx, dest, refill, strict=True)]
    shape = KVShape(arch.layers, arch.kv_heads, arch.head_dim, int(model.job.options.weight_bytes))
    return plan_migration("actor", shape, src, dst, moves)
