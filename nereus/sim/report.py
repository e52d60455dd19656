"""Render runs (simulated or real): a Markdown table, PNG plots and a Perfetto/Chrome trace timeline, with
the summary's figures under plain labels and the tail levers (tail batching's rounds, speculative decoding)
explained in words. A real run's record (``nereus run``) is read with the ``metrics.jsonl`` beside it, for
its learning curves and held-out accuracy."""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

from nereus.sim.explain import ROUND_KEYS, duration, generation_table, markdown_table, notes, rounds_of
from nereus.spec.errors import SpecError, brief, cut
from nereus.spec.fields import MAX_GPUS, MAX_SEQUENCES, MAX_STEPS, MAX_TOKENS, Fields, read_json_file
from nereus.spec.files import MAX_RECORD_BYTES, read_text_file
from nereus.spec.generation import DECISION_KINDS, GenerationEntry

PHASES = ("generation", "inference", "training", "weight_sync")
# What the report reads of a run record (``control.record.RunRecord.to_dict``), checked up front so that a
# hand-edited or foreign file is refused by key instead of failing half-way through the plots.
SUMMARY_KEYS = ("mean_step_s", "run_s", "transition_share", "tokens_per_s", "controller_overhead_share")
STEP_KEYS = ("step_time_s", "transition_s", "response_mean", "response_max")
# A step or phase over 10^12 s (30,000 years) is not a run; bounding it keeps the plots' axis arithmetic finite.
MAX_SECONDS = 1e12
MAX_FIGURE = 1e18  # a backend's figure (tokens, bytes, seconds): past an exabyte it is not a measurement
MAX_SKIP_NOTES = 5  # warnings about skipped metrics lines or fields, then a count


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
        tail = s.sub("tail")  # a simulated step's tail-batching round (``sim.backend``), when it was one
        for key in ROUND_KEYS if s.has("tail") else ():
            tail.get(key, float, minimum=0, maximum=MAX_SEQUENCES)
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
    _check_decision(e.sub("decision", required=True))
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


# the fields of the decision kinds (``spec.generation``) besides look, moves and declined: type and range
DECISION_FIELDS: dict[str, tuple[type, float, float]] = {
    "reason": (str, 0, 0), "gain_s": (float, -MAX_SECONDS, MAX_SECONDS), "cost_s": (float, -MAX_SECONDS, MAX_SECONDS),
    "bytes": (int, 0, MAX_FIGURE), "groups": (int, 0, MAX_SEQUENCES), "sequences": (int, 0, MAX_SEQUENCES)}


def _check_decision(d: Fields, kinds: tuple[str, ...] = tuple(DECISION_KINDS)) -> None:
    """A decision (``GenerationDecision.to_json``): every field of every kind its type and in range, null
    refused where a value belongs; a declined move (``continue``) checked as a move itself."""
    d.get("kind", str, choices=kinds)
    for key, (kind, low, high) in DECISION_FIELDS.items():
        if d.has(key) and d.data[key] is None:
            raise SpecError(d.key_path(key), f"is null; expected {'text' if kind is str else 'a number'}")
        d.get(key, kind, None, **({} if kind is str else {"minimum": low, "maximum": high}))
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
    if d.data.get("declined") is not None:
        _check_decision(d.sub("declined"), ("move_sequences",))


# ----- a real run: what its folder holds beside the record --------------------------------------------------

def load_metrics(record_path: str | Path) -> list[dict[str, float]]:
    """The per-step metrics a real run wrote beside its record (``metrics.jsonl``, one line a step, its
    ``step`` counted from 1), the last line of a step kept; numbers only. [] when there is no such file;
    a line that is not a metrics record, or a field that is neither a number nor text, is skipped with a
    warning naming the file, line and field (the record itself was checked and refuses)."""
    path = Path(record_path).parent / "metrics.jsonl"
    if not path.is_file():
        return []
    try:
        text = read_text_file(path, "metrics", MAX_RECORD_BYTES)
    except SpecError as err:
        print(f"nereus: warning: {err}; the learning curves are left out", file=sys.stderr)
        return []
    rows: dict[int, dict[str, float]] = {}
    skipped: list[str] = []
    for n, line in enumerate(text.splitlines(), 1):
        row = _metrics_row(line, f"{path}:{n}", skipped)
        if row is not None:
            rows[int(row["step"])] = row
    for note in skipped[:MAX_SKIP_NOTES]:
        print(f"nereus: warning: {note}", file=sys.stderr)
    if len(skipped) > MAX_SKIP_NOTES:
        print(f"nereus: warning: {path}: {len(skipped) - MAX_SKIP_NOTES} more skipped", file=sys.stderr)
    return [rows[k] for k in sorted(rows)]


def _metrics_row(line: str, where: str, skipped: list[str]) -> dict[str, float] | None:
    """The numbers of one ``metrics.jsonl`` line, or None; what is skipped is noted in ``skipped`` by file,
    line and field (text values, such as ``nereus/plan``, are kept out silently: they are no curve)."""
    try:
        d = json.loads(line)
    except (ValueError, RecursionError):
        skipped.append(f"{where}: not JSON; line skipped")
        return None
    step = d.get("step") if isinstance(d, dict) else None
    if not isinstance(d, dict) or not (type(step) is int and 0 <= step <= MAX_STEPS):
        what = "step: " + (f"expected a step number 0..{MAX_STEPS}, got {brief(step)}" if isinstance(d, dict)
                           else f"expected a JSON object, got {type(d).__name__}")
        skipped.append(f"{where}: {what}; line skipped")
        return None
    row = {}
    for key, value in d.items():
        if type(value) in (int, float) and math.isfinite(value) and abs(value) <= MAX_FIGURE:
            row[key] = float(value)
        elif not isinstance(value, str):
            skipped.append(f"{where}: {cut(key, 100)}: expected a finite number, got {brief(value)}; "
                           "field skipped")
    return row


def start_accuracy(record_path: str | Path) -> tuple[float, bool] | None:
    """(held-out accuracy before the first step, whether a warm-start trained the actor first) from the
    latest checkpoint's ``state.json`` beside a real run's record; None when there is none to read."""
    folder = Path(record_path).parent
    try:
        step = int(read_text_file(folder / "latest", "checkpoint pointer", 64).strip())
        state = read_json_file(folder / f"step_{step}" / "state.json", "checkpoint state", 2**24)
    except (SpecError, ValueError, OSError):
        return None
    acc, steps = (state.get("warmstart_accuracy"), state.get("warmstart/actor_steps", 0)) \
        if isinstance(state, dict) else (None, 0)
    if type(acc) not in (int, float) or not 0 <= acc <= 1:
        return None
    return float(acc), type(steps) in (int, float) and steps > 0


def accuracy_line(run: dict) -> str | None:
    """A real run's held-out accuracy, from after the warm-start (where one ran) or the start, else its
    first evaluation, to its last; None without evaluations."""
    learning = run.get("learning", {})
    evals = [(int(m["step"]), m["val/accuracy"]) for m in learning.get("metrics", []) if "val/accuracy" in m]
    if not evals:
        return None
    last_step, last = evals[-1]
    start = learning.get("start")
    if start is not None:
        first, where = start[0], ("after the warm-start" if start[1] else "at the start")
    elif len(evals) > 1:
        first, where = evals[0][1], f"at step {evals[0][0]}"
    else:
        return f"held-out accuracy ({run['policy']}): {100 * last:.1f}% at step {last_step}"
    return (f"held-out accuracy ({run['policy']}): {100 * first:.1f}% {where} -> {100 * last:.1f}% at step "
            f"{last_step} ({100 * (last - first):+.1f} points)")


def keep_rate_line(run: dict) -> str | None:
    """A real run's dynamic sampling (``run.filter_groups``): its keep-rate (kept / generated groups) from the
    first step to the last and its mean, and the generation batches a step drew; None without it."""
    rows = [m for m in run.get("learning", {}).get("metrics", []) if "train/filter_groups_keep_rate" in m]
    if not rows:
        return None
    rates = [m["train/filter_groups_keep_rate"] for m in rows]
    batches = [m.get("train/num_gen_batches", 1.0) for m in rows]
    return (f"dynamic sampling ({run['policy']}): keep-rate {100 * rates[0]:.1f}% at step {int(rows[0]['step'])} -> "
            f"{100 * rates[-1]:.1f}% at step {int(rows[-1]['step'])} (mean {100 * sum(rates) / len(rates):.1f}%), "
            f"{sum(batches) / len(batches):.1f} generation batches a step (at most {max(batches):.0f})")


# ----- plots --------------------------------------------------------------------------------------------------

def _pyplot():  # noqa: ANN202 - matplotlib.pyplot, imported on first use (it is slow to import)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:  # noqa: ANN001 - a matplotlib Figure
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def plot_runs(runs: list[dict], out_dir: Path) -> list[Path]:
    """step_latency.png (transitions and tail batching's long rounds marked) and workload.png (GPUs and
    response length)."""
    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for r in runs:
        line, = ax.plot([s["step"] for s in r["steps"]], [s["step_time_s"] for s in r["steps"]], lw=1,
                        label=r["policy"])
        long = {s for s, x in rounds_of(r).items() if x["long_round"]}
        for marks, marker in (([s for s in r["steps"] if s["transition_s"] > 0], "v"),
                              ([s for s in r["steps"] if s["step"] in long], "D")):
            ax.scatter([s["step"] for s in marks], [s["step_time_s"] for s in marks], marker=marker, s=30,
                       color=line.get_color(), zorder=3)
    ax.set(xlabel="step", ylabel="step latency (s)",
           title="Step latency over the run (▼ transition, ◆ tail batching's long round)")
    ax.legend()
    ax.grid(alpha=0.3)
    latency = _save(fig, out_dir / "step_latency.png")

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
    return [latency, _save(fig, out_dir / "workload.png")]


# A real run's learning curves from its metrics.jsonl: (file stem, title, y label, ((metric, legend), ...)).
LEARNING_PLOTS = (
    ("reward", "Reward per step", "reward", (("critic/score/mean", "mean score (all rewards)"),
                                             ("reward/rule/mean", "rule reward"),
                                             ("reward_model/score/mean", "reward model"))),
    ("accuracy", "Accuracy", "accuracy", (("val/accuracy", "held-out"),
                                          ("reward/rule/mean", "training batch (rule reward)"))),
    ("kl", "KL divergence", "nats per token", (("actor/ppo_kl", "to the policy that sampled (PPO updates)"),
                                               ("actor/reward_kl_penalty", "to the reference (in the reward)"),
                                               ("actor/kl_loss", "to the reference (as a loss)"))),
    ("response_length", "Response length", "tokens", (("response_length/mean", "mean"),
                                                      ("response_length/max", "longest"))),
    # run.filter_groups (DAPO's dynamic sampling): the share of generated groups kept, per step
    ("keep_rate", "Dynamic sampling: groups kept per group generated", "keep-rate",
     (("train/filter_groups_keep_rate", "keep-rate"),)),
)


def plot_learning(runs: list[dict], out_dir: Path) -> list[Path]:
    """reward.png, accuracy.png, kl.png, response_length.png and keep_rate.png (dynamic sampling) per step,
    for the runs whose folder has metrics (real runs); a plot with no series is not written."""
    written = []
    for stem, title, ylabel, series in LEARNING_PLOTS:
        lines = [(r, key, label) for r in runs for key, label in series
                 if any(key in m for m in r.get("learning", {}).get("metrics", []))]
        if not lines:
            continue
        fig, ax = _pyplot().subplots(figsize=(10, 4.5))
        for r, key, label in lines:
            rows = [m for m in r["learning"]["metrics"] if key in m]
            name = label if len(runs) == 1 else f"{r['policy']}: {label}"
            ax.plot([m["step"] for m in rows], [m[key] for m in rows], lw=1,
                    marker="o" if len(rows) <= 40 else None, ms=3, label=name)
            start = r["learning"].get("start")
            if key == "val/accuracy" and start is not None:
                ax.scatter([0], [start[0]], marker="s", zorder=3,
                           label="after the warm-start" if start[1] else "at the start")
        ax.set(xlabel="step", ylabel=ylabel, title=title)
        ax.legend()
        ax.grid(alpha=0.3)
        written.append(_save(fig, out_dir / f"{stem}.png"))
    return written


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
    runs = []
    for p in paths:
        run = load_run(p)
        run["learning"] = {"metrics": load_metrics(p), "start": start_accuracy(p)}
        runs.append(run)
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


def report_text(runs: list[dict], pngs: list[Path]) -> str:
    """report.md: the runs' table, held-out accuracy, the plots, the tail levers in words and the decisions."""
    lines = ["# Runs", "", markdown_table(runs), ""]
    accuracy = [line for r in runs if (line := accuracy_line(r))]
    accuracy += [line for r in runs if (line := keep_rate_line(r))]
    wall = [f"{r['policy']}: {duration(r['summary']['wall_s'])} wall-clock for the steps" for r in runs
            if r.get("trace") == "runtime" and isinstance(r["summary"].get("wall_s"), (int, float))]
    lines += [*(f"- {x}" for x in accuracy + wall), *([""] if accuracy or wall else [])]
    lines += [f"![{p.stem}]({p.name})" for p in pngs] + [""]
    for r in runs:
        lines += notes(r)
    inside = generation_table(runs)
    return "\n".join(lines + ([inside] if inside else [])).rstrip() + "\n"


def _write_outputs(runs: list[dict], out: Path) -> dict[str, Path]:
    table = out / "report.md"
    pngs = plot_runs(runs, out) + plot_learning(runs, out)
    table.write_text(report_text(runs, pngs))
    trace = out / "timeline.json"
    trace.write_text(json.dumps(timeline(runs)))
    return {"markdown": table, "timeline": trace, **{p.stem: p for p in pngs}}
