"""Render runs (simulated or real): a Markdown table, PNG plots and a Perfetto/Chrome trace timeline."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from nereus.spec.errors import SpecError
from nereus.spec.fields import MAX_GPUS, MAX_STEPS, MAX_TOKENS, Fields, read_json_file
from nereus.spec.files import MAX_RECORD_BYTES

PHASES = ("generation", "inference", "training", "weight_sync")
# What the report reads of a run record (``control.record.RunRecord.to_dict``), checked up front so that a
# hand-edited or foreign file is refused by key instead of failing half-way through the plots.
SUMMARY_KEYS = ("mean_step_s", "run_s", "transition_share", "tokens_per_s", "controller_overhead_share")
STEP_KEYS = ("step_time_s", "transition_s", "response_mean", "response_max")
# A step or phase over 10^12 s (30,000 years) is not a run; bounding it keeps the plots' axis arithmetic finite.
MAX_SECONDS = 1e12


def load_run(path: str | Path) -> dict:
    """A run record (``nereus simulate --out``, or a run's ``run_record.json``), every key the report
    reads checked; errors name the file and the key."""
    data = read_json_file(path, "run", MAX_RECORD_BYTES)
    if not isinstance(data, dict) or not {"policy", "steps", "summary"} <= set(data):
        raise SpecError(str(path), "not a run record (policy, steps and summary are missing): give a file "
                                   "written by `nereus simulate --out` or a run's run_record.json")
    try:
        _check_record(data)
    except SpecError as err:
        raise SpecError(f"{path}: {err.path}", err.message) from None
    return data


def _check_record(data: dict) -> None:
    root = Fields(data, "")
    root.get("policy", str)
    summary = root.sub("summary")
    summary.get("steps", int, minimum=0)
    summary.get("transitions", int, minimum=0)
    for key in SUMMARY_KEYS:
        summary.get(key, float, minimum=0)
    steps = root.get("steps", list)
    if len(steps) > MAX_STEPS:
        raise SpecError("steps", f"{len(steps):,} steps is more than a run has (at most {MAX_STEPS:,})")
    for i, item in enumerate(steps):
        s = Fields(item, f"steps[{i}]")
        s.get("step", int, minimum=0, maximum=MAX_STEPS)
        s.get("gpus", int, minimum=0, maximum=MAX_GPUS)
        s.get("lost_s", float, 0.0, minimum=0, maximum=MAX_SECONDS)
        s.get("strategy", str, None)
        for key in STEP_KEYS:
            s.get(key, float, minimum=0, maximum=MAX_TOKENS if key.startswith("response") else MAX_SECONDS)
        phases = s.sub("phases", required=True)
        for name in phases.data:
            phases.get(name, float, minimum=0, maximum=MAX_SECONDS)
    for i, item in enumerate(root.get("decisions", list, [])):
        _check_decision(Fields(item, f"decisions[{i}]"))


def _check_decision(d: Fields) -> None:
    """A decision the report reads: its action, and for mid-step decisions (``run.midstep.Decision``) every
    field ``midstep_table`` prints, each its type and in range (a hand-edited record fails by key, not
    half-way through writing the report)."""
    action = d.get("action", str)
    if action != "midstep":
        return
    for key in ("step", "iteration", "donor", "receiver"):
        d.get(key, int, None, minimum=0, maximum=MAX_STEPS if key == "step" else MAX_TOKENS)
    for key in ("admitted", "committed"):
        d.get(key, bool, False)
    d.get_list("moved", int, [])
    for key in ("kv", "refill", "queued", "bytes"):
        d.get(key, int, 0, minimum=0)
    for key in ("predicted_gain_s", "predicted_cost_s", "move_s"):
        d.get(key, float, None, minimum=0, maximum=MAX_SECONDS)
    d.get("measured_gain_s", float, None, minimum=-MAX_SECONDS, maximum=MAX_SECONDS)


def markdown_table(runs: list[dict]) -> str:
    head = ("| policy | steps | mean step (s) | run time (h) | transitions | transition share | tokens/s "
            "| controller overhead |")
    rows = [head, "|" + "---|" * 8]
    for r in runs:
        s = r["summary"]
        rows.append(f"| {r['policy']} | {s['steps']} | {s['mean_step_s']:.2f} | {s['run_s'] / 3600:.2f} | "
                    f"{s['transitions']} | {100 * s['transition_share']:.3f}% | {s['tokens_per_s']:,.0f} | "
                    f"{100 * s['controller_overhead_share']:.3f}% |")
    return "\n".join(rows)


def _cell(d: dict, key: str, fmt: str) -> str:
    return "—" if d.get(key) is None else format(d[key], fmt)


def midstep_table(runs: list[dict]) -> str:
    """Mid-step decisions of real runs (``run.midstep``: ``action: midstep`` in a record's decisions): a row
    per admitted move (where, what moved how, predicted gain and cost, measured move time and gain), then
    how many were refused; "" when a run has none."""
    rows, refused = [], 0
    for r in runs:
        for d in r.get("decisions", []):
            if not isinstance(d, dict) or d.get("action") != "midstep":
                continue
            if not d.get("admitted"):
                refused += 1
                continue
            outcome = "moved" if d.get("committed") else "aborted"
            rows.append(f"| {r['policy']} | {d.get('step')} | {d.get('iteration')} | {outcome} | "
                        f"{d.get('donor')} → {d.get('receiver')} | {len(d.get('moved', []))} | {d.get('kv', 0)} | "
                        f"{d.get('refill', 0)} | {d.get('queued', 0)} | {_cell(d, 'bytes', ',')} | "
                        f"{_cell(d, 'predicted_gain_s', '.3f')} | {_cell(d, 'predicted_cost_s', '.3f')} | "
                        f"{_cell(d, 'move_s', '.3f')} | {_cell(d, 'measured_gain_s', '+.3f')} |")
    if not rows and not refused:
        return ""
    head = ("| policy | step | iteration | outcome | replicas | sequences | KV | re-prefill | not started | bytes "
            "| predicted gain (s) | predicted cost (s) | measured move (s) | measured gain (s) |")
    return "\n".join(["## Mid-step decisions", "", head, "|" + "---|" * 14, *rows, "",
                      f"{len(rows)} admitted, {refused} refused (predicted gain under margin × cost); every "
                      "decision, with its reason, is in the run's decisions.jsonl."])


def plot_runs(runs: list[dict], out_dir: Path) -> list[Path]:
    """step_latency.png (transitions marked) and workload.png (GPUs and response length)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for r in runs:
        steps = [s["step"] for s in r["steps"]]
        line, = ax.plot(steps, [s["step_time_s"] for s in r["steps"]], lw=1, label=r["policy"])
        moves = [s for s in r["steps"] if s["transition_s"] > 0]
        ax.scatter([s["step"] for s in moves], [s["step_time_s"] for s in moves], marker="v", s=40,
                   color=line.get_color(), zorder=3)
    ax.set_xlabel("step")
    ax.set_ylabel("step latency (s)")
    ax.set_title("Step latency over the run (▼ = transition)")
    ax.legend()
    ax.grid(alpha=0.3)
    latency = out_dir / "step_latency.png"
    fig.tight_layout()
    fig.savefig(latency, dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(10, 4.5))
    first = runs[0]["steps"]
    steps = [s["step"] for s in first]
    ax.plot(steps, [s["gpus"] for s in first], color="tab:blue", label="GPUs used")
    ax.set_xlabel("step")
    ax.set_ylabel("GPUs", color="tab:blue")
    ax2 = ax.twinx()
    ax2.plot(steps, [s["response_mean"] for s in first], color="tab:orange", lw=1, label="mean response")
    ax2.plot(steps, [s["response_max"] for s in first], color="tab:red", lw=0.6, alpha=0.6, label="longest")
    ax2.set_ylabel("response length (tokens)", color="tab:orange")
    ax2.legend(loc="upper left")
    ax.set_title(f"Workload and GPUs ({runs[0]['policy']})")
    workload = out_dir / "workload.png"
    fig.tight_layout()
    fig.savefig(workload, dpi=110)
    plt.close(fig)
    return [latency, workload]


def timeline(runs: list[dict]) -> dict:
    """Chrome/Perfetto trace: one process per run, a track for step phases and one for transitions."""
    events = []
    for pid, r in enumerate(runs, start=1):
        events.append({"ph": "M", "pid": pid, "name": "process_name", "args": {"name": r["policy"]}})
        events.append({"ph": "M", "pid": pid, "tid": 1, "name": "thread_name", "args": {"name": "step phases"}})
        events.append({"ph": "M", "pid": pid, "tid": 2, "name": "thread_name", "args": {"name": "transitions"}})
        t = 0.0
        for s in r["steps"]:
            for phase in PHASES:
                dur = s["phases"].get(phase, 0.0)
                if dur > 0:
                    events.append({"ph": "X", "pid": pid, "tid": 1, "ts": t * 1e6, "dur": dur * 1e6,
                                   "name": phase, "args": {"step": s["step"], "gpus": s["gpus"]}})
                    t += dur
            if s["transition_s"] > 0:
                events.append({"ph": "X", "pid": pid, "tid": 2, "ts": t * 1e6, "dur": s["transition_s"] * 1e6,
                               "name": "transition", "args": {"after_step": s["step"], "strategy": s["strategy"]}})
                t += s["transition_s"]
            t += s.get("lost_s", 0.0)
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_report(paths: list[str], out_dir: str | Path) -> dict[str, Path]:
    """Write the report of the runs ``paths`` into ``out_dir``: everything is written into a temporary
    folder beside it first, then moved in, so a failure leaves no half-written report (and an existing
    folder keeps its other files). Returns each output's final path."""
    runs = [load_run(p) for p in paths]
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        written = _write_outputs(runs, staging)
        if not out.exists():
            staging.chmod(0o755)  # mkdtemp makes it private; a report is for reading
            staging.rename(out)
        else:
            for path in written.values():
                os.replace(path, out / path.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return {name: out / path.name for name, path in written.items()}


def _write_outputs(runs: list[dict], out: Path) -> dict[str, Path]:
    table = out / "report.md"
    pngs = plot_runs(runs, out)
    lines = ["# Runs", "", markdown_table(runs), ""] + [f"![{p.stem}]({p.name})" for p in pngs]
    midstep = midstep_table(runs)
    if midstep:
        lines += ["", midstep]
    table.write_text("\n".join(lines) + "\n")
    trace = out / "timeline.json"
    trace.write_text(json.dumps(timeline(runs)))
    return {"markdown": table, "timeline": trace, **{p.stem: p for p in pngs}}
