"""Runs in plain words: durations in units that fit, the summary's figures under labels, tail batching's
rounds and speculative decoding explained, and the decisions inside the step with identical consecutive ones
grouped. ``nereus simulate`` prints these; ``sim.report`` writes them into report.md."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING

from nereus.spec.generation import (
    CarryOver,
    ChangeTailLayout,
    DeferSequences,
    GenerationEntry,
    MoveSequences,
    SetSpeculation,
)

if TYPE_CHECKING:
    pass

# A tail-batching round, under the runtime's metric names (``run.rounds``: ``tail/<key>``).
ROUND_KEYS = ("long_round", "launched_groups", "kept_groups", "deferred_groups")


# ----- plain words: durations, percentages and the summary's figures ----------------------------------------

def duration(seconds: float) -> str:
    """Seconds in units that fit: "8.3 ms", "12.4 s", "104 s", "2 min 20 s", "14 h 6 min", "3 d 2 h"."""
    if not math.isfinite(seconds) or seconds == 0:
        return f"{seconds:g} s"
    sign, s = ("-" if seconds < 0 else ""), abs(seconds)
    if s < 1:
        return f"{sign}{s * 1e3:.3g} ms"
    if s < 99.95:
        return f"{sign}{s:.3g} s"
    if s < 119.5:
        return f"{sign}{s:.0f} s"
    minutes, sec = divmod(round(s), 60)
    if minutes < 60:
        return f"{sign}{minutes} min {sec} s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{sign}{hours} h {minutes} min"
    days, hours = divmod(hours, 24)
    return f"{sign}{days} d {hours} h"


def percent(share: float) -> str:
    return f"{100 * share:.3g}%"


# ``RunRecord.summary``'s keys: (label, unit). Units: "s" a duration, "%" a share, "/s" a rate, "n" a count,
# "x" a plain number, "" text.
SUMMARY_LABELS: Mapping[str, tuple[str, str]] = MappingProxyType({
    "policy": ("policy", ""), "steps": ("steps", "n"), "mean_step_s": ("mean step time", "s"),
    "run_s": ("run time (steps, transitions, lost time)", "s"), "transitions": ("transitions", "n"),
    "transition_s": ("time in transitions", "s"), "transition_share": ("share of the run in transitions", "%"),
    "tokens_per_s": ("throughput (tokens/s)", "/s"), "tokens_per_gpu_s": ("throughput per GPU (tokens/s)", "/s"),
    "failures": ("failures", "n"), "lost_s": ("time lost to failures", "s"),
    "controller_overhead_s_per_step": ("controller time per step", "s"),
    "controller_overhead_share": ("controller share of the run", "%"),
    "policy_lag_mean": ("mean policy lag (steps)", "x"), "policy_lag_max": ("largest policy lag (steps)", "n"),
    "on_policy_share": ("trained tokens on-policy", "%"),
    "balanced_step_s": ("mean step with the work spread evenly over the GPUs", "s"),
    "balanced_tokens_per_s": ("throughput with the work spread evenly (tokens/s)", "/s"),
    "balanced_generation_s": ("  of that step, generation", "s"),
    "balanced_rest_s": ("  of that step, inference, training and syncs", "s"),
})
WALL_LABELS = ("wall-clock time of the steps", "wall-clock time to simulate")  # real, simulated


def _figure(value: object, unit: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if unit == "s":
        return duration(value)
    if unit == "%":
        return percent(value)
    if unit in ("/s", "n"):
        return f"{value:,.0f}"
    return f"{value:.3g}"


def summary_lines(summary: Mapping, simulated: bool = True) -> list[str]:
    """``RunRecord.summary``, a figure a line under its label and in its unit (an unknown key keeps its name)."""
    rows = []
    for key, value in summary.items():
        label, unit = SUMMARY_LABELS.get(key, (key.replace("_", " "), "x"))
        if key == "wall_s":
            label, unit = WALL_LABELS[simulated], "s"
        rows.append((label, _figure(value, unit)))
    width = max((len(label) for label, _ in rows), default=0)
    return [f"{label:<{width}}  {text}" for label, text in rows]


def markdown_table(runs: list[dict]) -> str:
    rows = ["| policy | steps | mean step | run time | transitions | share in transitions | tokens/s "
            "| controller share |", "|" + "---|" * 8]
    for r in runs:
        s = r["summary"]
        rows.append(f"| {r['policy']} | {s['steps']} | {duration(s['mean_step_s'])} | {duration(s['run_s'])} | "
                    f"{s['transitions']} | {percent(s['transition_share'])} | {s['tokens_per_s']:,.0f} | "
                    f"{percent(s['controller_overhead_share'])} |")
    return "\n".join(rows)


def _cell(value: float | int | None, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def _span(values: list[int]) -> str:
    lo, hi = min(values), max(values)
    return str(lo) if lo == hi else f"{lo}–{hi}"


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


# ----- tail batching's rounds and speculative decoding, in words --------------------------------------------

def rounds_of(run: dict) -> dict[int, dict[str, float]]:
    """Tail batching's rounds by step: a simulated step's ``tail``, a real run's ``tail/*`` metrics."""
    out = {s["step"]: s["tail"] for s in run["steps"] if isinstance(s.get("tail"), dict)}
    for m in run.get("learning", {}).get("metrics", []):
        if all(f"tail/{k}" in m for k in ROUND_KEYS):
            out[int(m["step"]) - 1] = {k: m[f"tail/{k}"] for k in ROUND_KEYS}  # metrics count steps from 1
    return out


TAIL_WORDS = ("Tail batching launches more prompts than a step trains, trains the groups of responses that "
              "finish first and stops the rest; their prompts wait (deferred). Once a step's worth waits, a "
              "long round regenerates them from scratch. Their responses are the long ones, so a long round "
              "takes about twice a short one: those are the periodic slow steps.")
SPEC_WORDS = ("Speculative decoding drafts several next tokens cheaply and has the model check them all in one "
              "pass, keeping those it would have produced itself, so the responses are the ones plain decoding "
              "gives. It pays when few sequences are still running (the long tail), where a pass costs about "
              "the same for one token as for several; the controller switches it on below a number of running "
              "sequences per replica.")
DRAFT_WORDS = MappingProxyType({
    "suffix": "drafts copied from earlier responses to the same prompt (suffix decoding)",
    "ngram": "drafts looked up in the prompt and the response so far (n-gram)",
    "draft_model": "drafts from a small model of the same family", "draft_head": "drafts from a head on the "
    "model's hidden states (EAGLE/MTP)"})
MAX_LISTED = 12  # long rounds listed by step per run; the rest are counted


def tail_lines(run: dict) -> list[str]:
    """Tail batching's rounds of one run in words, each long round by its step; [] when it ran none."""
    rounds = rounds_of(run)
    if not rounds:
        return []
    times = {s["step"]: s["step_time_s"] for s in run["steps"]}
    long = sorted(s for s, r in rounds.items() if r["long_round"])
    short = sorted(s for s, r in rounds.items() if not r["long_round"])
    text = f"{run['policy']}: {len(short)} short rounds"
    if short:
        text += (f" (each launched {_span([int(rounds[s]['launched_groups']) for s in short])} prompts, trained "
                 f"the first {_span([int(rounds[s]['kept_groups']) for s in short])} to finish and deferred the rest)")
    text += f" and {len(long)} long rounds"
    mean_long, mean_short = _mean([times.get(s, 0.0) for s in long]), _mean([times.get(s, 0.0) for s in short])
    if mean_long is not None and mean_short is not None:
        text += f"; a long round took {duration(mean_long)} on average, a short one {duration(mean_short)}"
    lines = [text + "."]
    lines += [f"step {s}: long round (regenerates {rounds[s]['launched_groups']:.0f} deferred prompts), "
              f"{duration(times.get(s, 0.0))}" for s in long[:MAX_LISTED]]
    if len(long) > MAX_LISTED:
        more = long[MAX_LISTED:]
        lines.append(f"... and {len(more)} more long round{'s' * (len(more) > 1)}, at steps {_span(more)}")
    return lines


def speculation_line(run: dict) -> str | None:
    """Speculative decoding in one run in words: when it was on, with what drafts, and generation's time
    with it against plain decoding of the same responses (over the steps tail batching did not stop
    early, where the simulator's plain time is that of the whole generation); None when it never ran."""
    on = [e for e in _entries(run) if isinstance(e.decision, SetSpeculation) and e.outcome.applied
          and e.decision.speculation is not None]
    if not on:
        return None
    specs = [e.decision.speculation for e in on]
    kinds = sorted({s.draft for s in specs})
    text = (f"{run['policy']}: on in {len({e.step for e in on})} of {len(run['steps'])} steps, "
            f"{'; '.join(DRAFT_WORDS.get(k, k) for k in kinds)}, {_span([s.draft_tokens for s in specs])} "
            f"tokens drafted at a time, switched on once a replica has at most "
            f"{_span([s.live_at_most for s in specs])} sequences running")
    gen = {s["step"]: s["phases"].get("generation", 0.0) for s in run["steps"]}
    short = {s for s, r in rounds_of(run).items() if not r["long_round"]}
    pairs = [(gen[e.step], gen[e.step] + e.outcome.gain_s) for e in on
             if e.outcome.gain_s is not None and e.step in gen and e.step not in short and gen[e.step] > 0]
    if pairs:
        spec, plain = _mean([a for a, _ in pairs]), _mean([b for _, b in pairs])
        text += (f". Generation took {duration(spec)} a step with it, against {duration(plain)} for plain "
                 f"decoding of the same responses ({plain / spec:.2g}x faster")
        text += f", over the {len(pairs)} steps not stopped early)" if short else ")"
    return text + "."


def _entries(run: dict) -> list[GenerationEntry]:
    return [GenerationEntry.from_json(raw) for raw in run.get("generation_decisions", [])]


# ----- decisions inside the step: identical ones in a row grouped -------------------------------------------

@dataclass
class DecisionGroup:
    """Consecutive acting decisions of one run that are the same decision with the same outcome (all but the
    predicted seconds alike: ``identity``): one row."""

    policy: str
    kind: str
    outcome: str
    identity: str
    what: str
    entries: list[GenerationEntry] = field(default_factory=list)
    gains: list[float] = field(default_factory=list)  # measured gains, each at most its step's time
    capped: int = 0  # measured gains larger than their step, shown as the step's time

    def label(self) -> str:
        return self.kind if len(self.entries) == 1 else f"{self.kind} ×{len(self.entries)}"

    def figures(self) -> tuple[float | None, ...]:
        """Means over the group: predicted gain and cost, measured cost and gain."""
        d, o = [e.decision for e in self.entries], [e.outcome for e in self.entries]
        return (_mean([x.gain_s for x in d]), _mean([x.cost_s for x in d]),
                _mean([x.cost_s for x in o if x.cost_s is not None]), _mean(self.gains))


def _what(e: GenerationEntry) -> str:
    """What a decision did, in words."""
    d, f = e.decision, e.outcome.figures
    if isinstance(d, SetSpeculation):
        s = d.speculation
        if s is None:
            return "off"
        return f"{s.draft} drafts, k={s.draft_tokens}, on at ≤ {s.live_at_most} running per replica"
    if isinstance(d, MoveSequences):
        return (f"replica {d.donor} → {d.receiver}: {len(d.moves)} sequences ({d.kv} with KV, {d.refills} "
                f"re-prefilled, {d.queued} not started), {_cell(d.bytes, ',')} bytes")
    if isinstance(d, ChangeTailLayout):
        return (f"tail on TP{d.phase.tail_tp} × {d.phase.tail_replicas}: {_cell(f.get('unfinished'), '.0f')} "
                f"unfinished, {_cell(f.get('kv_sent'), '.0f')} with KV, {_cell(f.get('recomputed'), '.0f')} "
                f"recomputed, {_cell(f.get('bytes_sent'), ',.0f')} bytes")
    if isinstance(d, DeferSequences):
        return f"defer {d.groups} unfinished groups to a long round"
    if isinstance(d, CarryOver):
        return f"carry {d.sequences} unfinished responses to the next step"
    return d.kind


def decision_groups(run: dict) -> tuple[list[DecisionGroup], int]:
    """The run's acting decisions inside the step, identical consecutive ones grouped, and how many were
    declined. A measured gain is capped at the time of the step it belongs to (``DecisionGroup.capped``)."""
    times = {s["step"]: s["step_time_s"] for s in run["steps"]}
    groups: list[DecisionGroup] = []
    declined = 0
    for e in _entries(run):
        if not e.decision.acts:
            declined += 1
            continue
        o = e.outcome
        outcome = "applied" if o.applied else ("aborted" if o.reason.startswith("aborted") else "not applied")
        same = {k: v for k, v in e.decision.to_json().items() if k not in ("gain_s", "cost_s")}
        key = (run["policy"], e.decision.kind, outcome, json.dumps(same, sort_keys=True))
        if not groups or (groups[-1].policy, groups[-1].kind, groups[-1].outcome, groups[-1].identity) != key:
            groups.append(DecisionGroup(*key, _what(e)))
        g = groups[-1]
        g.entries.append(e)
        if o.gain_s is not None:
            limit = times.get(e.step, math.inf)
            g.capped += o.gain_s > limit
            g.gains.append(min(o.gain_s, limit))
    return groups, declined


CAP_WORDS = ("measured gains larger than their own step are shown as the step's time: the gain is counted "
             "against plain decoding of the whole generation, which takes more than twice the step once "
             "speculation makes generation over twice as fast (and, in a round tail batching stopped early, "
             "past the point where it stopped)")
MAX_TABLED = 100  # rows of the generation table per run; the rest are counted


def generation_table(runs: list[dict]) -> str:
    """Decisions inside the step (``generation_decisions`` of a run record, either backend): a row per group of
    identical consecutive acting decisions (steps, what it did, mean predicted gain and cost, mean measured
    cost and gain), then how many were declined; "" when no run has any."""
    rows, declined, left, count, capped = [], 0, 0, 0, 0
    for r in runs:
        groups, no = decision_groups(r)
        declined += no
        count += sum(len(g.entries) for g in groups)
        capped += sum(g.capped for g in groups)
        left += max(0, len(groups) - MAX_TABLED)
        for g in groups[:MAX_TABLED]:
            pg, pc, mc, mg = g.figures()
            rows.append(f"| {g.policy} | {_span([e.step for e in g.entries])} | "
                        f"{_span([e.iteration for e in g.entries])} | {g.label()} | {g.outcome} | {g.what} | "
                        f"{_cell(pg, '.3f')} | {_cell(pc, '.3f')} | {_cell(mc, '.3f')} | {_cell(mg, '+.3f')} |")
    if not rows and not declined:
        return ""
    head = ("| policy | step | iteration | decision | outcome | what it did | predicted gain (s) | predicted cost (s) "
            "| measured cost (s) | measured gain (s) |")
    more = f" ({left} more rows not tabled)" if left else ""
    note = f" {capped} {CAP_WORDS}." if capped else ""
    return "\n".join(["## Decisions inside the step", "", head, "|" + "---|" * 10, *rows, "",
                      f"{count} acting in {len(rows) + left} rows of identical consecutive decisions (figures are "
                      f"means over a row){more}, {declined} declined (predicted gain under margin × cost).{note} "
                      "Every decision, with its reason, is in the run record's generation_decisions."])


def decision_lines(run: dict, limit: int = 30) -> list[str]:
    """The grouped decisions inside the step as text lines (``nereus simulate``)."""
    groups, declined = decision_groups(run)
    lines = []
    for g in groups[:limit]:
        pg, _, _, mg = g.figures()
        lines.append(f"steps {_span([e.step for e in g.entries]):<10} {g.label()} ({g.outcome}): {g.what}; "
                     f"predicted gain {duration(pg or 0.0)}, measured {'—' if mg is None else duration(mg)} "
                     "a step (mean)")
    if len(groups) > limit:
        lines.append(f"... and {len(groups) - limit} more rows (`nereus report` tables them)")
    capped = sum(g.capped for g in groups)
    if capped:
        lines.append(f"{capped} {CAP_WORDS}")
    if declined:
        lines.append(f"{declined} declined (predicted gain under margin × cost)")
    return lines


def notes(run: dict, markdown: bool = True) -> list[str]:
    """Tail batching and speculative decoding of one run, in words, each under its heading."""
    out = []
    rounds, spec = tail_lines(run), speculation_line(run)
    bullet = "- " if markdown else "  "
    for title, words, lines in (("Tail batching", TAIL_WORDS, rounds),
                                ("Speculative decoding", SPEC_WORDS, [spec] if spec else [])):
        if lines:
            out += [f"## {title}", "", words, ""] if markdown else [words]
            out += [bullet + line for line in lines] + [""]
    return out
