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
from nereus.spec.generation import DECISION_KINDS, ChangeTailLayout, GenerationEntry, MoveSequences

PHASES = ("generation", "inference", "training", "weight_sync")
# What the report reads of a run record (``control.record.RunRecord.to_dict``), checked up front so that a
# hand-edited or foreign file is refused by key instead of failing half-way through the plots.
SUMMARY_KEYS = ("mean_step_s", "run_s", "transition_share", "tokens_per_s", "controller_overhead_share")
STEP_KEYS = ("step_time_s", "transition_s", "response_mean", "response_max")
# A step or phase over 10^12 s (30,000 years) is not a run; bounding it keeps the plots' axis arithmetic finite.
MAX_SECONDS = 1e12
MAX_FIGURE = 1e18  # a backend's figure (tokens, bytes, seconds): past an exabyte it is not a measurement


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
    for i, item in enumerate(root.get("generation_decisions", list, [])):
        _check_generation_entry(Fields(item, f"generation_decisions[{i}]"))
    for i, item in enumerate(root.get("decisions", list, [])):
        Fields(item, f"decisions[{i}]").get("action", str)


def _check_generation_entry(e: Fields) -> None:
    """A decision inside a step (``spec.generation.GenerationEntry``): every field ``generation_table``
    prints, each its type and in range, then the typed value itself (a hand-edited record fails by key,
    not half-way through writing the report)."""
    for key in ("step", "iteration", "live"):
        e.get(key, int, minimum=0, maximum=MAX_STEPS if key == "step" else MAX_TOKENS)
    e.get("model_stage", str)
    e.get("overhead_s", float, 0.0, minimum=0, maximum=MAX_SECONDS)
    d = e.sub("decision", required=True)
    d.get("kind", str, choices=DECISION_KINDS)
    for key in ("gain_s", "cost_s"):
        d.get(key, float, 0.0, minimum=-MAX_SECONDS, maximum=MAX_SECONDS)
    d.get("bytes", int, 0, minimum=0)
    look = d.sub("look")
    for key in ("iterations", "live_at_most"):
        look.get(key, int, 0, minimum=0, maximum=MAX_TOKENS)
    for j, move in enumerate(d.get("moves", list, [])):
        m = Fields(move, f"{d.path}.moves[{j}]")
        record = m.get_list("seq", (int, float))
        if not 5 <= len(record) <= 7 or any(v < 0 for v in record):
            raise SpecError(m.key_path("seq"), "expected a sequence record [id, replica, prompt, generated, "
                            "cached, rng_bytes, forecast] of non-negative numbers")
        m.get("dst", int, minimum=0, maximum=MAX_GPUS)
        m.get("refill", bool)
    o = e.sub("outcome", required=True)
    o.get("applied", bool)
    o.get("reason", str, "")
    for key in ("cost_s", "gain_s"):
        o.get(key, float, None, minimum=-MAX_SECONDS, maximum=MAX_SECONDS)
    figures = o.sub("figures")
    for name in figures.data:
        figures.get(name, float, minimum=-MAX_FIGURE, maximum=MAX_FIGURE)
    try:
        GenerationEntry.from_json(e.data)
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise SpecError(e.path, f"not a decision inside a step ({type(err).__name__}: {err})"[:300]) from None


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


def _cell(value: float | int | None, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


MAX_TABLED = 100  # rows of the generation table per run; the rest are counted


def _generation_row(policy: str, e: GenerationEntry) -> str:
    """One acting decision inside a step: where, what it moved how, predicted and measured numbers."""
    d, o = e.decision, e.outcome
    outcome = "applied" if o.applied else ("aborted" if o.reason.startswith("aborted") else "not applied")
    if isinstance(d, MoveSequences):
        what = (f"{d.donor} → {d.receiver} | {len(d.moves)} | {d.kv} | {d.refills} | {d.queued} | "
                f"{_cell(d.bytes, ',')}")
    elif isinstance(d, ChangeTailLayout):
        f = o.figures
        what = (f"TP{d.phase.tail_tp} × {d.phase.tail_replicas} | {_cell(f.get('unfinished'), '.0f')} | "
                f"{_cell(f.get('kv_sent'), '.0f')} | {_cell(f.get('recomputed'), '.0f')} | — | "
                f"{_cell(f.get('bytes_sent'), ',.0f')}")
    else:
        what = "— | — | — | — | — | —"
    return (f"| {policy} | {e.step} | {e.iteration} | {d.kind} | {outcome} | {what} | {_cell(d.gain_s, '.3f')} | "
            f"{_cell(d.cost_s, '.3f')} | {_cell(o.cost_s, '.3f')} | {_cell(o.gain_s, '+.3f')} |")


def generation_table(runs: list[dict]) -> str:
    """Decisions inside the step (``generation_decisions`` of a run record, either backend): a row per
    acting decision (where, what it moved how, predicted gain and cost, measured cost and gain), then how
    many were declined; "" when no run has any."""
    rows, declined, left = [], 0, 0
    for r in runs:
        tabled = 0
        for raw in r.get("generation_decisions", []):
            e = GenerationEntry.from_json(raw)
            if not e.decision.acts:
                declined += 1
            elif tabled < MAX_TABLED:
                rows.append(_generation_row(r["policy"], e))
                tabled += 1
            else:
                left += 1
    if not rows and not declined:
        return ""
    head = ("| policy | step | iteration | decision | outcome | replicas / tail | sequences | KV | re-prefill "
            "| not started | bytes | predicted gain (s) | predicted cost (s) | measured cost (s) | measured gain (s) |")
    more = f" ({left} more not tabled)" if left else ""
    return "\n".join(["## Decisions inside the step", "", head, "|" + "---|" * 15, *rows, "",
                      f"{len(rows) + left} acting{more}, {declined} declined (predicted gain under margin × cost); "
                      "every decision, with its reason, is in the run record's generation_decisions."])


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
    inside = generation_table(runs)
    if inside:
        lines += ["", inside]
    table.write_text("\n".join(lines) + "\n")
    trace = out / "timeline.json"
    trace.write_text(json.dumps(timeline(runs)))
    return {"markdown": table, "timeline": trace, **{p.stem: p for p in pngs}}
