"""Tiny jobs and plans for the transition-graph tests, and brute-force references built with numpy masks
(independent of the box algebra the graph and ``verify`` use)."""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from nereus.elastic.emu import build_emus
from nereus.elastic.plan import Copy, Keep, Send
from nereus.spec import Layout, ModelStage, Placement, Plan, job_from_dict

TINY = {"layers": 4, "hidden": 32, "ffn_hidden": 48, "heads": 4, "kv_heads": 2, "vocab": 37}
STAGES = ("actor/generation", "actor/inference", "reference/inference", "critic/inference", "reward/inference",
          "actor/training", "critic/training")


def tiny_job(arch: dict | None = None, nodes: int = 2, gpus_per_node: int = 4, memory_gb: float | None = None,
             grad_bytes: int = 4):
    arch = dict(arch or TINY)
    gpu: object = "H100"
    if memory_gb is not None:
        gpu = {"name": "tiny", "peak_tflops": 1000, "hbm_tb_per_s": 3, "memory_gb": memory_gb,
               "intra_node_gb_per_s": 450, "inter_node_gb_per_s": 50}
    return job_from_dict({
        "name": "tiny",
        "models": {m: dict(arch) for m in ("actor", "critic", "reference", "reward")},
        "algorithm": {"name": "ppo"},
        "workload": {"prompts_per_step": 64, "prompt_length": 8, "response_length": {"mean": 8, "max": 16}},
        "cluster": {"gpu": gpu, "nodes": nodes, "gpus_per_node": gpus_per_node},
        "options": {"grad_bytes": grad_bytes},
    })


def plan(entries: list[tuple[str, dict, list[int]]], num_gpus: int) -> Plan:
    return Plan(tuple(Placement(ModelStage.parse(ms), Layout(**lay), tuple(g)) for ms, lay, g in entries), num_gpus)


def tensor_shapes(job) -> dict[tuple[str, str], tuple[int, ...]]:
    from nereus.spec.sharding import model_tensors

    return {(m, t.name): t.shape for m, arch in job.models.items()
            for t in model_tensors(arch, job.has_value_head(m))}


def holdings(job, p: Plan) -> dict[tuple[int, str, str, str], list]:
    """(device, model, state, tensor) → list of box sets held (distinct)."""
    out: dict[tuple, list] = defaultdict(list)
    for emu in build_emus(job, p):
        for t in emu.tensors:
            for s in t.shards:
                key = (s.device, emu.model_stage.model, t.state, t.name)
                if s.boxes not in out[key]:
                    out[key].append(s.boxes)
    return out


def mask(shape: tuple[int, ...], boxsets) -> np.ndarray:
    m = np.zeros(shape, dtype=np.int32)
    for bs in boxsets:
        for box in bs:
            m[tuple(slice(a, b) for a, b in box)] += 1
    return m


def brute_force_lower_bound(job, old: Plan, new: Plan) -> int:
    """Bytes of every new data buffer that its device does not hold in the old plan (element by element)."""
    shapes = tensor_shapes(job)
    bpe = {"weights": 2, "optimizer": 12}
    before, after = holdings(job, old), holdings(job, new)
    total = 0
    for (d, m, st, name), sets in after.items():
        if st not in bpe:
            continue
        have = mask(shapes[(m, name)], before.get((d, m, st, name), [])) > 0
        for bs in sets:
            need = mask(shapes[(m, name)], [bs]) > 0
            total += int(np.count_nonzero(need & ~have)) * bpe[st]
    return total


def brute_force_coverage(job, new: Plan, graph) -> list[str]:
    """Every element of every new data buffer written exactly once (kept, copied or received)."""
    shapes = tensor_shapes(job)
    counts: dict[tuple, np.ndarray] = {}
    after = holdings(job, new)

    def add(device, part, group_id, piece, dest):
        for name in graph.groups[group_id].names:
            key = (device, part.model, part.state, name, dest)
            if key not in counts:
                counts[key] = np.zeros(shapes[(part.model, name)], dtype=np.int32)
            counts[key] += mask(shapes[(part.model, name)], [piece])

    for step in graph.steps:
        for part in getattr(step, "parts", ()):
            for p in part.pieces:
                if isinstance(step, Keep):
                    add(step.device, part, p.group, p.boxes, p.boxes)
                elif isinstance(step, Copy):
                    add(step.device, part, p.group, p.piece, p.dest)
                elif isinstance(step, Send):
                    add(step.dst, part, p.group, p.piece, p.dest)
    problems = []
    for (d, m, st, name), sets in after.items():
        if st == "grads":
            continue
        for bs in sets:
            want = mask(shapes[(m, name)], [bs])
            got = counts.get((d, m, st, name, bs))
            if got is None or not np.array_equal(got, want):
                problems.append(f"GPU {d} {m} {st} {name} {bs}")
    return problems
