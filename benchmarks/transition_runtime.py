"""Live transitions on the runtime versus checkpoint-restart and gather-scatter, all measured in one run.

For a Llama-like model of >= 100M parameters (``--small``: a tiny one for smoke tests) on 4 forked gloo
ranks, each transition below moves the whole model state (fp32 weights and, for the trained actor, ZeRO-1
Adam state: master, exp_avg, exp_avg_sq) from the old layout to the new one three ways, on the same state:

* ``exec``: the live executor (``nereus.runtime.transitions.live.transition_keys``) following the transition graph;
* ``dcp``: torch.distributed.checkpoint save of the old shards and resharded load through local disk
  (``nereus.runtime.transitions.reshard.checkpoint_reshard``; files go to ``.tmp/`` and are deleted afterwards);
* ``g/s``: every tensor gathered on rank 0, then the new pieces scattered (``reshard.gather_scatter``).

Each is timed as the max over ranks of its elapsed time (barrier before, all_reduce MAX after), repeated
``--repeats`` times from the same old state (the executor never modifies old buffers, so every repeat
starts fresh), and the median is reported. A first world measures this machine: point-to-point bandwidth
rank 0 -> 1, all-pairs egress and memcpy rate; the transition graphs are then planned in the parent with
those numbers as the cluster's links and memory bandwidth, so ``pred`` (the graph's predicted time) and
``graph bound`` (its bandwidth bound) are in this machine's terms. ``bound`` is measured: per rank
max(bytes sent, bytes received) of the executor over the p2p bandwidth, maximised over ranks. Baseline
outputs are checked bit-equal to the executor's once per transition. Goals (reported, not asserted):
exec >= 5x faster than dcp, exec within 2x of the bound.

    .venv/bin/python benchmarks/transition_runtime.py [--small] [--repeats N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import asdict

import torch
import torch.distributed as dist

from nereus.cost.hardware import Hardware
from nereus.elastic.transition import plan_transition
from nereus.runtime.cluster.launch import run_world
from nereus.runtime.comm.groups import ParallelGroups
from nereus.runtime.comm.transfer import TransferComm
from nereus.runtime.model.decoder import ModelConfig
from nereus.runtime.model.hf import slice_boxes
from nereus.runtime.parallel.sharded import ShardedModel, shard_boxes, tied_head
from nereus.runtime.transitions.holdings import WEIGHTS, holdings_of
from nereus.runtime.transitions.live import KeySpec, new_needs, plan_of, transition_keys
from nereus.runtime.transitions.reshard import all_pairs_bandwidth, checkpoint_reshard, gather_scatter, p2p_bandwidth
from nereus.spec import Layout, job_from_dict
from nereus.spec.model import ModelArch
from nereus.spec.sharding import model_tensors

WORLD = 4
FULL = ModelArch(layers=12, hidden=768, ffn_hidden=2048, heads=12, kv_heads=12, vocab=32000)
SMALL = ModelArch(layers=4, hidden=64, ffn_hidden=128, heads=4, kv_heads=4, vocab=256)
COMPS = ("#master", "#exp_avg", "#exp_avg_sq")  # the optimizer buffer's components as pseudo-tensors
# reshard's DCP baseline needs ShardedTensor (arbitrary boxes); its deprecation notice would flood stderr
warnings.filterwarnings("ignore", message="Please use DTensor", category=FutureWarning)


def lay(tp: int = 1, pp: int = 1, dp: int = 1) -> Layout:
    return Layout(tp=tp, pp=pp, dp=dp, micro_batch_size=1, recompute="none", sequence_parallel=False)


# (label, model, stage, old layout, old ranks, new layout, new ranks)
TRANSITIONS = [
    ("actor tp2·dp2 -> tp4", "actor", "training", lay(tp=2, dp=2), (0, 1, 2, 3), lay(tp=4), (0, 1, 2, 3)),
    ("actor tp2·dp2 -> pp2·dp2", "actor", "training", lay(tp=2, dp=2), (0, 1, 2, 3), lay(pp=2, dp=2),
     (0, 1, 2, 3)),
    ("actor dp4 -> tp2·pp2", "actor", "training", lay(dp=4), (0, 1, 2, 3), lay(tp=2, pp=2), (0, 1, 2, 3)),
    ("actor tp4 -> dp2 (shrink)", "actor", "training", lay(tp=4), (0, 1, 2, 3), lay(dp=2), (0, 1)),
    ("ref tp1@0 -> tp2·dp2 (grow)", "reference", "inference", lay(), (0,), lay(tp=2, dp=2), (0, 1, 2, 3)),
]


def specs_of(cfg: ModelConfig, t) -> tuple[KeySpec, KeySpec]:
    _, model, stage, old_l, old_r, new_l, new_r = t
    return (KeySpec(f"{model}/{stage}", model, stage, cfg, old_l, old_r),
            KeySpec(f"{model}/{stage}", model, stage, cfg, new_l, new_r))


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def timed(fn):
    """(fn's result, elapsed seconds as the slowest rank saw them)."""
    dist.barrier()
    t0 = time.perf_counter()
    out = fn()
    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return out, float(dt.item())


# ----- world 1: this machine's links and memory ------------------------------------------------------
def _probe(rank: int, world: int, nbytes: int, out: str) -> None:
    p2p = p2p_bandwidth(nbytes, repeats=3)
    pairs = torch.tensor([all_pairs_bandwidth(nbytes // (world - 1), repeats=3)], dtype=torch.float64)
    dist.all_reduce(pairs, op=dist.ReduceOp.MIN)  # the slowest rank's egress bounds an all-to-all
    if rank == 0:
        # memcpy rate of one rank alone (one thread, as every rank runs): the executor's pack/unpack speed
        src, dst = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        src.fill_(1)
        best = math.inf
        for _ in range(3):
            t0 = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - t0)
        with open(out, "w") as f:
            json.dump({"p2p_bytes_per_s": p2p, "all_pairs_bytes_per_s": float(pairs.item()),
                       "memcpy_bytes_per_s": nbytes / best, "probe_bytes": nbytes}, f)
    dist.barrier()


# ----- the parent: job, graphs, global state ---------------------------------------------------------
def job_for(arch: ModelArch, links: dict):
    models = {role: asdict(arch) for role in ("actor", "critic", "reference", "reward")}
    gb = links["p2p_bytes_per_s"] / 1e9
    return job_from_dict({
        "name": "transition-runtime", "models": models, "algorithm": {"name": "ppo"},
        "workload": {"prompts_per_step": 8, "prompt_length": 8, "response_length": {"mean": 8, "max": 16}},
        "cluster": {"gpu": {"name": "cpu-local", "peak_tflops": 0.05, "memory_gb": 16,
                            "hbm_tb_per_s": links["memcpy_bytes_per_s"] / 1e12,
                            "intra_node_gb_per_s": gb, "inter_node_gb_per_s": gb},
                    "nodes": 1, "gpus_per_node": WORLD},
        "options": {"weight_bytes": 4, "recompute": "none", "sequence_parallel": False},
    })


def global_state(arch: ModelArch) -> dict[str, torch.Tensor]:
    """Whole tensors, generated once before forking (the ranks share them): each weight name and each of
    its three optimizer components, seeded per tensor, so every replica slices the same values."""
    out = {}
    for i, spec in enumerate(model_tensors(arch)):
        for j, suffix in enumerate(("",) + COMPS):
            g = torch.Generator().manual_seed(1000 * i + j)
            t = torch.randn(spec.shape, generator=g)
            out[spec.name + suffix] = t.abs_() if suffix == "#exp_avg_sq" else t  # a second moment is >= 0
    return out


# ----- world 2: the transitions ----------------------------------------------------------------------
def groups_of(s: KeySpec) -> ParallelGroups:
    return ParallelGroups(s.layout, list(s.ranks), tied_embeddings=tied_head(s.cfg))


def load(s: KeySpec, g: ParallelGroups, state: dict[str, torch.Tensor]) -> ShardedModel | None:
    """This rank's old shards and, when trained, its ZeRO-1 Adam state filled from the global tensors
    (random moments rather than Adam's zeros, so the moved bytes are not trivial)."""
    if not g.member:
        return None
    sm = ShardedModel(s.cfg, g, slice_boxes(state, shard_boxes(s.cfg, g)))
    if s.training:
        sm.make_optimizer().ensure_state()
        for (_, st, name, boxes), buf in holdings_of(s.model, sm).buffers.items():
            for box in boxes if st != WEIGHTS else ():
                where = tuple(slice(lo, hi) for lo, hi in box)
                for view, suffix in zip(buf.view(box), COMPS, strict=True):
                    view.copy_(state[name + suffix][where])
    return sm


def pieces(model: str, sm: ShardedModel | None) -> dict[tuple[str, tuple], torch.Tensor]:
    """(baseline tensor name, box) -> view, for every buffer of ``sm``: the baselines' view of the state."""
    out = {}
    for (_, st, name, boxes), buf in (holdings_of(model, sm).buffers.items() if sm is not None else ()):
        names = [name] if st == WEIGHTS else [name + c for c in COMPS]
        for box in boxes:
            for n, view in zip(names, buf.view(box), strict=True):
                out[(n, box)] = view
    return out


def baseline_args(old: KeySpec, new: KeySpec, sm, new_groups, state):
    """Shards, new boxes, shapes and dtypes of the same state for ``reshard``'s baselines."""
    shards: dict[str, list] = {}
    for (n, box), view in pieces(old.model, sm).items():
        shards.setdefault(n, []).append((box, view))
    new_boxes: dict[str, list] = {}
    for (_, st, name, boxes) in new_needs([new], {new.key: new_groups}):
        for n in [name] if st == WEIGHTS else [name + c for c in COMPS]:
            new_boxes.setdefault(n, []).extend(boxes)
    names = [t.name for t in model_tensors(old.cfg.arch)]
    names += [n + c for n in names for c in COMPS] if old.training else []
    return shards, new_boxes, {n: tuple(state[n].shape) for n in names}, dict.fromkeys(names, torch.float32)


def same(result, expected: dict) -> bool:
    """Every rank's baseline pieces equal the executor's (collective: all ranks agree on the answer)."""
    got = {(n, box): t for n, ps in result.items() for box, t in ps}
    ok = got.keys() == expected.keys() and all(torch.equal(got[k], v) for k, v in expected.items())
    flag = torch.tensor([int(ok)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def run_executor(graph, old, new, sm, new_groups, comm, repeats: int):
    """Median time, per-rank Measured dicts of the last repeat, per-phase medians and the new pieces."""
    held = {old.key: sm} if sm is not None else {}
    times, phases = [], []
    for _ in range(repeats):
        models = None  # drop the previous repeat's new buffers before allocating again
        (models, meas), dt = timed(lambda: transition_keys(graph, held, [old], [new], {new.key: new_groups}, comm))
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, meas.to_dict())
        times.append(dt)
        phases.append({p: max(m["seconds"].get(p, 0.0) for m in every) for p in every[0]["seconds"]})
    median_phases = {p: statistics.median(ph[p] for ph in phases) for p in phases[0]}
    return statistics.median(times), times, every, median_phases, pieces(new.model, models.get(new.key))


def run_baseline(name: str, fn, expected: dict, repeats: int):
    times, equal = [], None
    for _ in range(repeats):
        result, dt = timed(fn)
        times.append(dt)
        if equal is None:  # one cross-check per transition is enough
            equal = same(result, expected)
        result = None
    return {f"{name}_s": statistics.median(times), f"{name}_runs": times, f"{name}_equal": equal}


def one_transition(i: int, t, cfg, graph, comm, state, repeats: int, tmp: str) -> dict:
    rank = dist.get_rank()
    old, new = specs_of(cfg, t)
    old_g, new_g = groups_of(old), groups_of(new)  # every rank creates every group, in the same order
    sm = load(old, old_g, state)
    exec_s, runs, every, phases, expected = run_executor(graph, old, new, sm, new_g, comm, repeats)
    rec = {"label": t[0], "exec_s": exec_s, "exec_runs": runs, "exec_phases_s": phases, "measured": every}
    if rank == 0:
        log(f"  {t[0]}: exec {exec_s:.3f}s (" + ", ".join(f"{k} {v:.3f}s" for k, v in phases.items()) + ")")
    args = baseline_args(old, new, sm, new_g, state)
    path = os.path.join(tmp, f"t{i}")

    def dcp():
        try:
            return checkpoint_reshard(*args, path=path)
        finally:
            dist.barrier()  # every rank has read before rank 0 deletes the checkpoint
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)

    rec.update(run_baseline("dcp", dcp, expected, repeats))
    if rank == 0:
        log(f"  {t[0]}: dcp {rec['dcp_s']:.3f}s")
    rec.update(run_baseline("gs", lambda: gather_scatter(*args, root=0), expected, repeats))
    if rank == 0:
        log(f"  {t[0]}: gather-scatter {rec['gs_s']:.3f}s")
    return rec


def _transitions(rank: int, world: int, arch, graphs, state, repeats: int, tmp: str, out: str) -> None:
    cfg = ModelConfig(arch)
    comm = TransferComm(timeout_s=600)
    records = []
    for i, (t, graph) in enumerate(zip(TRANSITIONS, graphs, strict=True)):
        if rank == 0:
            log(f"transition {i + 1}/{len(TRANSITIONS)}: {t[0]}")
        records.append(one_transition(i, t, cfg, graph, comm, state, repeats, tmp))
    if rank == 0:
        with open(out, "w") as f:
            json.dump(records, f)
    dist.barrier()


# ----- report ------------------------------------------------------------------------------------------
def summarise(rec: dict, report, links: dict, state_bytes: int) -> dict:
    """One row: the measured times, the graph's figures and the ratios the goals are stated in."""
    per_rank = [max(m["bytes_sent"], m["bytes_received"]) for m in rec["measured"]]  # kept: the JSON has all
    bound = max(per_rank) / links["p2p_bytes_per_s"]
    # the same bytes at the contended all-pairs rate: what 4 ranks sharing 2 cores' loopback can do at once
    bound_ap = max(per_rank) / links["all_pairs_bytes_per_s"]
    # every transfer at once through one shared loopback: on a host whose cores one busy pair already
    # saturates (p2p is measured with exactly one pair moving), the ranks' links are not independent
    shared = sum(m["bytes_sent"] for m in rec["measured"]) / links["p2p_bytes_per_s"]
    return {**rec, "shared_link_bound_s": shared,
            "exec_over_shared_bound": rec["exec_s"] / shared if shared else None,
            "state_bytes": state_bytes, "predicted_s": report.predicted_s,
            "graph_bandwidth_bound_s": report.bandwidth_bound_s, "graph_peak_bytes": report.peak_bytes,
            "max_rank_bytes_moved": max(per_rank), "bandwidth_bound_s": bound,
            "all_pairs_bound_s": bound_ap, "exec_over_all_pairs_bound": rec["exec_s"] / bound_ap if bound_ap else None,
            "dcp_over_exec": rec["dcp_s"] / rec["exec_s"], "gs_over_exec": rec["gs_s"] / rec["exec_s"],
            "exec_over_bound": rec["exec_s"] / bound if bound else None,
            "exec_over_predicted": rec["exec_s"] / report.predicted_s if report.predicted_s else None}


def print_table(rows: list[dict], links: dict) -> None:
    print(f"links: p2p {links['p2p_bytes_per_s'] / 1e9:.2f} GB/s, all-pairs egress "
          f"{links['all_pairs_bytes_per_s'] / 1e9:.2f} GB/s/rank, memcpy {links['memcpy_bytes_per_s'] / 1e9:.2f} GB/s")
    head = (f"{'transition':<30}{'state':>9}{'exec':>8}{'pred':>8}{'bound':>8}{'g.bnd':>8}{'dcp':>8}{'g/s':>8}"
            f"{'dcp/ex':>8}{'gs/ex':>8}{'ex/bnd':>8}{'ex/pred':>8}{'ex/apb':>8}{'ex/shb':>8}{'equal':>7}")
    print(head)
    print("-" * len(head))
    for r in rows:
        eq = "yes" if r["dcp_equal"] and r["gs_equal"] else "NO"
        print(f"{r['label']:<30}{r['state_bytes'] / 1e6:>7.0f}MB{r['exec_s']:>7.2f}s{r['predicted_s']:>7.2f}s"
              f"{r['bandwidth_bound_s']:>7.2f}s{r['graph_bandwidth_bound_s']:>7.2f}s{r['dcp_s']:>7.2f}s"
              f"{r['gs_s']:>7.2f}s{r['dcp_over_exec']:>7.1f}x{r['gs_over_exec']:>7.1f}x"
              f"{r['exec_over_bound']:>7.2f}x{r['exec_over_predicted']:>7.2f}x{r['exec_over_all_pairs_bound']:>7.2f}x"
              f"{r['exec_over_shared_bound']:>7.2f}x{eq:>7}")
    print("bound: max over ranks of max(bytes sent, received) / p2p rate; g.bnd: the graph's own bound; "
          "ex/apb: exec over that bound at the all-pairs rate; ex/shb: exec over all bytes sent / p2p rate "
          "(one shared loopback)")
    for r in rows:
        phases = ", ".join(f"{k} {v:.3f}s" for k, v in r["exec_phases_s"].items())
        print(f"  {r['label']}: exec phases (max over ranks) {phases}")


def summary_line(rows: list[dict]) -> str:
    dcp = [r["dcp_over_exec"] for r in rows]
    bnd = [r["exec_over_bound"] for r in rows]
    geo = math.exp(statistics.fmean(math.log(x) for x in dcp))
    return (f"summary: exec vs DCP {min(dcp):.1f}x..{max(dcp):.1f}x faster (geomean {geo:.1f}x; goal >= 5x met in "
            f"{sum(x >= 5 for x in dcp)}/{len(rows)}); exec/bound {min(bnd):.2f}..{max(bnd):.2f} (goal <= 2 met in "
            f"{sum(x <= 2 for x in bnd)}/{len(rows)}; against the shared-loopback bound "
            f"{sum(r['exec_over_shared_bound'] <= 2 for r in rows)}/{len(rows)}); gather-scatter/exec geomean "
            f"{math.exp(statistics.fmean(math.log(r['gs_over_exec']) for r in rows)):.1f}x; "
            f"baselines bit-equal to exec: {all(r['dcp_equal'] and r['gs_equal'] for r in rows)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="tiny model: a quick smoke run")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs of each method per transition (median)")
    ap.add_argument("--json", help="write every figure to this path")
    a = ap.parse_args()
    arch = SMALL if a.small else FULL
    os.makedirs(".tmp", exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="transition_runtime_", dir=".tmp")
    t_start, load0 = time.perf_counter(), os.getloadavg()
    try:
        log(f"model {arch.params() / 1e6:.1f}M params; probing links")
        run_world(_probe, WORLD, (4 if a.small else 64) << 20, os.path.join(tmp, "links.json"), timeout_s=600)
        with open(os.path.join(tmp, "links.json")) as f:
            links = json.load(f)
        job = job_for(arch, links)
        cfg = ModelConfig(arch)
        transitions = [plan_transition(job, plan_of([o], WORLD), plan_of([n], WORLD), Hardware(job.cluster))
                       for o, n in (specs_of(cfg, t) for t in TRANSITIONS)]
        log("generating the global state")
        state = global_state(arch)
        out = os.path.join(tmp, "records.json")
        run_world(_transitions, WORLD, arch, [x.graph for x in transitions], state, a.repeats, tmp, out,
                  timeout_s=3600)
        with open(out) as f:
            records = json.load(f)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rows = [summarise(rec, x.report, links, arch.params() * (16 if t[2] == "training" else 4))
            for rec, x, t in zip(records, transitions, TRANSITIONS, strict=True)]
    print(f"model: {arch.params() / 1e6:.1f}M params, fp32, {WORLD} gloo ranks; medians of {a.repeats} runs")
    print_table(rows, links)
    print(summary_line(rows))
    total = time.perf_counter() - t_start
    # the machine may be shared: 4 ranks on few cores turn other load straight into transfer time
    load = (load0, os.getloadavg())
    print(f"benchmark wall time {total:.1f}s; load average (1/5/15 min) at start {load[0]}, at end {load[1]}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"params": arch.params(), "world": WORLD, "repeats": a.repeats, "links": links,
                       "wall_s": total, "load_average": load, "transitions": rows}, f, indent=1)


if __name__ == "__main__":
    main()
