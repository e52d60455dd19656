"""One simulated step as a timeline per GPU group: bulk decoding, speculation, the mid-step move, the tail,
inference overlapped on the GPUs the tail freed, then inference, training and weight sync — as Chrome/Perfetto trace
JSON (the event format of ``sim.report.timeline`` and ``elastic.timeline``: one process, a track per GPU
group) and as a PNG (matplotlib).

    python -m nereus.sim.step_timeline traces/long_tail_dapo.yaml --job examples/ppo_8b_h100.yaml \\
        --policy nereus --step 30 --out docs/img/intrastep_step   # writes .json and .png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from nereus.control.pools import runs_one_step_off
from nereus.sim.run import simulate_with_backend
from nereus.spec import load_job
from nereus.spec.layout import Plan
from nereus.spec.trace import load_trace

COLORS = {"bulk": "#4c72b0", "speculation": "#64b5cd", "migration": "#c44e52", "tail": "#dd8452",
          "inference (overlapped)": "#55a868", "idle": "#dddddd", "inference": "#8fd19e", "training": "#8172b3",
          "weight_sync": "#937860", "driver": "#aaaaaa"}


def step_rows(last: dict) -> list[tuple[str, str, float, float]]:
    """(GPU group, kind, start s, end s) of the backend's last step (``SimBackend.last_generation``)."""
    model, out, phase = last["model"], last["outcome"], last["phase"]
    noise = last["noise"] * last.get("stretch", 1.0)  # the slowest GPU's pace (sim.reality)
    lay, gpus = model.placement.layout, list(model.placement.gpus)
    label = {r: f"GPUs {min(model.replica_gpus(r))}-{max(model.replica_gpus(r))}" for r in range(lay.dp)}
    rows: list[tuple[str, str, float, float]] = []
    seg = {(g, k): (a * noise, b * noise) for g, k, a, b in out.segments}
    end = out.generation_s * noise
    for r in range(lay.dp):
        a, b = seg[(f"replica {r}", "bulk")]
        rows.append((label[r], "bulk", a, b))
        if (f"replica {r}", "speculation") in seg:  # draft-and-verify once the replica's batch is small
            a, b = seg[(f"replica {r}", "speculation")]
            rows.append((label[r], "speculation", a, b))
        if not out.moved:
            rows.append((label[r], "idle", b, end))
            continue
        m0, m1 = seg[("all", "migration")]
        rows.append((label[r], "idle", b, m0))
        rows.append((label[r], "migration", m0, m1))
        first = gpus.index(model.replica_gpus(r)[0])
        if first < phase.tail_gpus:
            t0, t1 = seg[(f"tail {first // phase.tail_tp}", "tail")]
            rows += [(label[r], "tail", t0, t1), (label[r], "idle", t1, end)]
        elif out.overlap_share > 0:
            busy = min(end, m1 + last["early_s"] / out.overlap_share)
            rows += [(label[r], "inference (overlapped)", m1, busy), (label[r], "idle", busy, end)]
        else:
            rows.append((label[r], "idle", m1, end))
    driver = last.get("driver_s", 0.0)  # the batch's pass through the driver (sim.reality)
    rows += [(label[r], "driver", end, end + driver) for r in range(lay.dp)]
    rows += _later_stages(model.plan, last["phases"], list(label.values()), end + driver)
    return [row for row in rows if row[3] > row[2]]


def _later_stages(plan: Plan, phases: dict[str, float], tracks: list[str],
                  end: float) -> list[tuple[str, str, float, float]]:
    """Inference, training and weight sync after the generation on its GPUs; on a plan that runs
    one-step-off, inference and training of the step before on the training pool's GPUs from the step's
    start (``sim.backend``: the step is the slower pool plus the weight sync)."""
    rows: list[tuple[str, str, float, float]] = []
    pool = None
    if runs_one_step_off(plan):
        rollout = set(plan.placement("actor/generation").gpus)
        others = sorted({g for p in plan.placements for g in p.gpus} - rollout)
        pool = f"GPUs {others[0]}-{others[-1]} (training pool)"
    t = 0.0 if pool else end
    for kind in ("inference", "training"):
        dur = phases.get(kind, 0.0)
        rows += [(pool, kind, t, t + dur)] if pool else [(g, kind, t, t + dur) for g in tracks]
        t += dur
    if pool:  # the training pool waits for the rollout's samples (verl's wait_prev_gen)
        rows.append((pool, "idle", t, end))
    t = max(t, end)
    sync = phases.get("weight_sync", 0.0)
    return rows + [(g, "weight_sync", t, t + sync) for g in (tracks + [pool] if pool else tracks)]


def chrome_trace(rows: list[tuple[str, str, float, float]], title: str) -> dict:
    groups = list(dict.fromkeys(g for g, *_ in rows))
    events = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": title}}]
    events += [{"ph": "M", "pid": 1, "tid": i, "name": "thread_name", "args": {"name": g}}
               for i, g in enumerate(groups)]
    events += [{"ph": "X", "pid": 1, "tid": groups.index(g), "ts": a * 1e6, "dur": (b - a) * 1e6, "name": kind}
               for g, kind, a, b in rows if kind != "idle"]
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def plot(rows: list[tuple[str, str, float, float]], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys(g for g, *_ in rows))
    fig, ax = plt.subplots(figsize=(10, 0.28 * len(groups) + 1.6))
    from matplotlib.patches import Patch

    for g, kind, a, b in rows:
        ax.barh(groups.index(g), b - a, left=a, color=COLORS[kind], height=0.8)
    kinds = [k for k in COLORS if any(kind == k for _, kind, _, _ in rows)]
    ax.legend([Patch(color=COLORS[k]) for k in kinds], kinds, ncol=4, fontsize=8, loc="upper center",
              bbox_to_anchor=(0.5, -0.14))
    ax.set_yticks(range(len(groups)), groups, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("seconds into the step")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description="timeline of one simulated step (intra-step adaptation)")
    ap.add_argument("trace")
    ap.add_argument("--job", required=True)
    ap.add_argument("--policy", default="nereus")
    ap.add_argument("--step", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True, help="path without suffix: writes OUT.json and OUT.png")
    args = ap.parse_args()
    job, trace = load_job(args.job), load_trace(args.trace)
    record, backend = simulate_with_backend(job, trace, args.policy, args.seed, args.step + 1)
    rows = step_rows(backend.last_generation)
    s = record.steps[-1]
    title = f"{args.policy}, {trace.name}, step {args.step}: {s['step_time_s']:.1f} s"
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(chrome_trace(rows, title)))
    plot(rows, title, out.with_suffix(".png"))
    print(f"{title}; wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
