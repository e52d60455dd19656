"""Transition graphs of the 8B PPO example: predicted time against the bandwidth bound and the baselines,
and the time to build and schedule the graph at 1,024 GPUs.

For each transition it prints the scheduled (predicted) time, the bandwidth bound, their ratio, and how
many times slower each baseline is (checkpoint through storage and reload, gather to one rank then
scatter, per-tensor broadcast from one source replica; ``nereus.elastic.baselines``). Targets:
predicted within 1.2x of the bound, checkpoint-and-reload >= 10x slower at 2 GB/s per node, and graph
build + schedule <= 2 s for the four-model job at 1,024 GPUs. No assertions: this prints what it measures.

    python benchmarks/transition_plan.py [--storage-gb-per-s 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from nereus.cost.hardware import Hardware
from nereus.elastic.transition import no_cyclic_gc, plan_transition
from nereus.planner.search import materialize, search
from nereus.spec import JobSpec, Layout, ModelStage, Placement, Plan, load_job

ROOT = Path(__file__).resolve().parent.parent


def one(stage: str, gpus: range | list[int], num_gpus: int, **layout) -> Plan:
    return Plan((Placement(ModelStage.parse(stage), Layout(**layout), tuple(gpus)),), num_gpus)


def actor_sync_plans(job: JobSpec) -> tuple[Plan, Plan, Plan, Plan, str]:
    """The planner's actor training and generation layouts at 64 GPUs, as weight moves both ways."""
    plan = search(Hardware(job.cluster), job).plan
    train, gen = plan.placement("actor/training"), plan.placement("actor/generation")
    n = plan.num_gpus
    # training → generation: the training state stays, the generation layout's weights are built from it
    t2g = (Plan((train,), n), Plan((train, gen), n))
    # generation → training: the training layout's weights rebuilt from the generation copy (an inference
    # stage with the training layout's shards stands for them: weights only, the optimizer stays put)
    as_train = Placement(ModelStage("actor", "inference"), train.layout, train.gpus)
    g2t = (Plan((gen,), n), Plan((gen, as_train), n))
    label = f"train {train.layout.short()} / gen {gen.layout.short()}"
    return (*t2g, *g2t, label)


def cases(base: JobSpec) -> list[tuple[str, JobSpec, Plan, Plan]]:
    j64, j128, j512, j1024 = (base.with_gpus(n) for n in (64, 128, 512, 1024))
    out = [
        ("TP 2→4 (actor training, 64 GPUs)", j64, one("actor/training", range(64), 64, tp=2, pp=4, dp=8),
         one("actor/training", range(64), 64, tp=4, pp=4, dp=4)),
        ("PP 4→2 (actor training, 64 GPUs)", j64, one("actor/training", range(64), 64, tp=2, pp=4, dp=8),
         one("actor/training", range(64), 64, tp=2, pp=2, dp=16)),
        ("DP 64→128 (actor training, TP1·PP1)", j128, one("actor/training", range(64), 128, dp=64),
         one("actor/training", range(128), 128, dp=128)),
        ("512→1,024 GPUs (4-model PPO plans)", j1024, search(Hardware(j512.cluster), j512).plan,
         search(Hardware(j1024.cluster), j1024).plan),
    ]
    t2g_old, t2g_new, g2t_old, g2t_new, label = actor_sync_plans(j64)
    out.append((f"actor train→gen, 64 GPUs ({label})", j64, t2g_old, t2g_new))
    out.append(("actor gen→train, 64 GPUs (weights)", j64, g2t_old, g2t_new))
    return out


def report_cases(base: JobSpec, storage: float) -> None:
    print(f"{'transition':<62} {'predicted':>10} {'bound':>9} {'ratio':>6} {'GB sent':>9} "
          f"{'ckpt x':>8} {'gather x':>9} {'bcast x':>8}")
    for name, job, old, new in cases(base):
        r = plan_transition(job, old, new, storage_bytes_per_s=storage * 1e9).report
        b = r.baselines_s
        ratio = r.predicted_s / r.bandwidth_bound_s if r.bandwidth_bound_s else float("nan")
        print(f"{name:<62} {r.predicted_s:>9.3f}s {r.bandwidth_bound_s:>8.3f}s {ratio:>6.2f} "
              f"{r.bytes_sent / 1e9:>9.1f} {b['checkpoint'] / r.predicted_s:>8.1f} "
              f"{b['gather_scatter'] / r.predicted_s:>9.1f} {b['broadcast'] / r.predicted_s:>8.1f}"
              + (f"  detours {r.detour_bytes / 1e9:.1f} GB" if r.detours else ""), flush=True)


def timing(base: JobSpec, repeats: int) -> None:
    j512, j1024 = base.with_gpus(512), base.with_gpus(1024)
    hw = Hardware(j1024.cluster)
    best = search(hw, j1024)
    runner_up = materialize(j1024, best.runners_up[0])
    pairs = {"512→1,024 GPUs": (search(Hardware(j512.cluster), j512).plan, best.plan),
             f"1,024 GPUs: best → runner-up ({best.runners_up[0].strategy})": (best.plan, runner_up)}
    print(f"\nbuild + schedule, 8B four-model PPO at 1,024 GPUs ({repeats} runs; wall and CPU seconds):")
    for name, (old, new) in pairs.items():
        wall, cpu = [], []
        for _ in range(repeats):
            w, c = time.perf_counter(), time.process_time()
            with no_cyclic_gc():
                r = plan_transition(j1024, old, new, hw).report
            wall.append(time.perf_counter() - w)
            cpu.append(time.process_time() - c)
        print(f"  {name:<60} median {statistics.median(wall):.2f} s wall, {statistics.median(cpu):.2f} s CPU "
              f"(build {r.build_s:.2f} + schedule {r.schedule_s:.2f}; {sum(r.ops.values())} ops, "
              f"{r.ops.get('send', 0)} sends)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", default=str(ROOT / "examples" / "ppo_8b_h100.yaml"))
    parser.add_argument("--storage-gb-per-s", type=float, default=2.0, help="checkpoint baseline, per node")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    base = load_job(args.job)
    print(f"job {base.name} on {base.cluster.gpu.name}; baselines as times slower than the transition "
          f"(checkpoint at {args.storage_gb_per_s:g} GB/s per node)\n")
    report_cases(base, args.storage_gb_per_s)
    timing(base, args.repeats)


if __name__ == "__main__":
    main()
