"""Traces: how a run's workload and cluster change over its steps (YAML or JSON).

Schema (every key validated; errors name the key path)::

    name: r1-zero-growth
    source: "DeepSeek-AI 2025, DeepSeek-R1, Fig. 1b ..."   # required: where the numbers come from
    steps: 1000
    response_length:
      sigma: 0.7                  # log-normal spread of one step's lengths (long tail)
      points:                     # mean interpolates linearly between points; max is a context limit
        - {step: 0, mean: 1500, max: 8192}      #   and holds until the next point (raised in stages)
        - {step: 1000, mean: 12000, max: 32768}
    gpus:                         # optional availability, each entry holds until the next
      - {step: 0, gpus: 64}
      - {step: 500, gpus: 1024}
    failures:                     # optional: GPUs lost at a step (they stay lost)
      - {step: 450, gpus: 8}
    failure_rate:                 # optional: random losses, drawn per step from the simulation's seed
      per_1000_steps: 4           #   expected failures per 1,000 steps
      gpus: 8                     #   GPUs lost per failure (a node)
    acceptance:                   # optional: per-token acceptance rate α of speculative drafts, by kind
      source: "..."               #   required with it: where the rates come from
      suffix:                     #   a kind of DRAFT_KINDS; α interpolates linearly between points
        - {step: 0, alpha: 0.62}  #   and holds after the last one
        - {step: 500, alpha: 0.7}
    policy_lag: 0                 # optional: run.policy_lag of a simulation (0 or 1; a job's run section wins)
    length_correlation:           # optional: prompt-level correlation of response lengths
      siblings: 0.5               #   correlation of log lengths of responses to the same prompt (GRPO group)
      source: "..."               #   required with it
"""

from __future__ import annotations

import random
from bisect import bisect_right
from dataclasses import dataclass, replace
from pathlib import Path

from nereus.spec.errors import SpecError
from nereus.spec.fields import MAX_GPUS, MAX_STEPS, MAX_TOKENS, Fields
from nereus.spec.files import load_json, load_yaml, read_text_file
from nereus.spec.levers import DRAFT_KINDS, check_policy_lag
from nereus.spec.response import ResponseLength


@dataclass(frozen=True)
class LengthPoint:
    step: int
    mean: float
    max: int


@dataclass(frozen=True)
class Trace:
    name: str
    source: str
    steps: int
    sigma: float
    points: tuple[LengthPoint, ...]
    gpus: tuple[tuple[int, int], ...] = ()  # (step, available GPUs)
    failures: tuple[tuple[int, int], ...] = ()  # (step, GPUs lost)
    failure_rate: tuple[float, int] = (0.0, 0)  # (expected failures per 1,000 steps, GPUs each)
    acceptance: tuple[tuple[str, tuple[tuple[int, float], ...]], ...] = ()  # (kind, ((step, alpha), ...))
    acceptance_source: str = ""
    sibling_correlation: float = 0.0  # correlation of log lengths within a prompt's group of responses
    correlation_source: str = ""
    policy_lag: int = 0  # run.policy_lag for a simulation of this trace (spec.levers.POLICY_LAGS)

    def acceptance_at(self, kind: str, step: int) -> float | None:
        """The trace's acceptance rate of ``kind`` drafts at ``step`` (linear between points, held before
        the first and after the last); None when the trace gives none for that kind."""
        points = dict(self.acceptance).get(kind)
        if not points:
            return None
        steps = [s for s, _ in points]
        i = bisect_right(steps, step) - 1
        if i < 0:
            return points[0][1]
        if i + 1 >= len(points):
            return points[i][1]
        (s0, a0), (s1, a1) = points[i], points[i + 1]
        return a0 + (a1 - a0) * (step - s0) / (s1 - s0)

    def with_sampled_failures(self, seed: int) -> Trace:
        """The trace with its random failures drawn (seeded), added to the explicit ones."""
        rate, gpus = self.failure_rate
        if rate <= 0:
            return self
        rng = random.Random(f"{seed}:failures:{self.name}")
        drawn = tuple((s, gpus) for s in range(1, self.steps) if rng.random() < rate / 1000)
        merged = tuple(sorted(self.failures + drawn))
        return replace(self, failures=merged, failure_rate=(0.0, 0))

    def response_at(self, step: int) -> ResponseLength:
        pts = self.points
        i = bisect_right([p.step for p in pts], step) - 1
        if i < 0:
            p = pts[0]
            return ResponseLength(min(p.mean, p.max), p.max, "lognormal", self.sigma)
        p = pts[i]
        if i + 1 < len(pts):
            q = pts[i + 1]
            mean = p.mean + (q.mean - p.mean) * (step - p.step) / (q.step - p.step)
        else:
            mean = p.mean
        return ResponseLength(min(mean, p.max), p.max, "lognormal", self.sigma)

    def gpus_at(self, step: int, default: int) -> int:
        """Available GPUs at ``step``: the schedule's entry, less every failure so far."""
        avail = default
        for s, n in self.gpus:
            if s <= step:
                avail = n
        lost = sum(n for s, n in self.failures if s <= step)
        return max(0, avail - lost)


def trace_from_dict(data: object, where: str = "trace") -> Trace:
    root = Fields(data, where)
    steps = root.get("steps", int, minimum=1, maximum=MAX_STEPS)
    rl = root.sub("response_length", required=True)
    sigma = rl.get("sigma", float, 0.6, minimum=0, maximum=3)
    raw = rl.get("points", list)
    rl.finish()
    if not raw:
        raise SpecError(rl.key_path("points"), "give at least one {step, mean, max} point")
    points = []
    for i, item in enumerate(raw):
        f = Fields(item, f"{rl.key_path('points')}[{i}]")
        p = LengthPoint(f.get("step", int, minimum=0, maximum=MAX_STEPS),
                        f.get("mean", float, minimum=1, maximum=MAX_TOKENS),
                        f.get("max", int, minimum=1, maximum=MAX_TOKENS))
        f.finish()
        if points and p.step <= points[-1].step:
            raise SpecError(f.key_path("step"), f"steps must increase (previous point is at {points[-1].step})")
        points.append(p)
    trace = Trace(
        name=root.get("name", str, "trace"),
        source=root.get("source", str),
        steps=steps,
        sigma=sigma,
        points=tuple(points),
        gpus=_step_list(root, "gpus"),
        failures=_step_list(root, "failures"),
        failure_rate=_failure_rate(root),
        policy_lag=check_policy_lag(root.get("policy_lag", int, 0), root.key_path("policy_lag")),
    )
    acceptance, acceptance_source = _acceptance(root)
    siblings, correlation_source = _length_correlation(root)
    root.finish()
    return replace(trace, acceptance=acceptance, acceptance_source=acceptance_source,
                   sibling_correlation=siblings, correlation_source=correlation_source)


def _acceptance(root: Fields) -> tuple[tuple[tuple[str, tuple[tuple[int, float], ...]], ...], str]:
    """The optional ``acceptance`` section: a source and, per draft kind, increasing (step, alpha) points."""
    if not root.has("acceptance"):
        root.get("acceptance", dict, None)
        return (), ""
    f = root.sub("acceptance")
    source = f.get("source", str)
    kinds = [k for k in f.data if k != "source"]
    for kind in kinds:
        if kind not in DRAFT_KINDS:
            raise SpecError(f.key_path(str(kind)), f"unknown draft kind; use one of {list(DRAFT_KINDS)}")
    if not kinds:
        raise SpecError(f.path, f"give acceptance points for at least one draft kind of {list(DRAFT_KINDS)}")
    out = []
    for kind in kinds:
        raw = f.get(kind, list)
        if not raw:
            raise SpecError(f.key_path(kind), "give at least one {step, alpha} point")
        points: list[tuple[int, float]] = []
        for i, item in enumerate(raw):
            p = Fields(item, f"{f.key_path(kind)}[{i}]")
            point = (p.get("step", int, minimum=0, maximum=MAX_STEPS), p.get("alpha", float, minimum=0, maximum=0.999))
            p.finish()
            if points and point[0] <= points[-1][0]:
                raise SpecError(p.key_path("step"), f"steps must increase (previous point is at {points[-1][0]})")
            points.append(point)
        out.append((kind, tuple(points)))
    f.finish()
    return tuple(out), source


def _length_correlation(root: Fields) -> tuple[float, str]:
    """The optional ``length_correlation`` section: the sibling correlation of log lengths and its source."""
    if not root.has("length_correlation"):
        root.get("length_correlation", dict, None)
        return 0.0, ""
    f = root.sub("length_correlation")
    value = (f.get("siblings", float, minimum=0, maximum=1), f.get("source", str))
    f.finish()
    return value


def _failure_rate(root: Fields) -> tuple[float, int]:
    if not root.has("failure_rate"):
        root.get("failure_rate", dict, None)
        return (0.0, 0)
    f = root.sub("failure_rate")
    rate = (f.get("per_1000_steps", float, minimum=0, maximum=1000), f.get("gpus", int, minimum=1, maximum=MAX_GPUS))
    f.finish()
    return rate


def _step_list(root: Fields, key: str) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    for i, item in enumerate(root.get(key, list, [])):
        f = Fields(item, f"{root.key_path(key)}[{i}]")
        entry = (f.get("step", int, minimum=0, maximum=MAX_STEPS),
                 f.get("gpus", int, minimum=0 if key == "failures" else 1, maximum=MAX_GPUS))
        f.finish()
        if key == "gpus" and out and entry[0] <= out[-1][0]:
            raise SpecError(f.key_path("step"), f"steps must increase (previous entry is at {out[-1][0]})")
        out.append(entry)
    return tuple(out)


def load_trace(path: str | Path) -> Trace:
    path = Path(path)
    text = read_text_file(path, "trace")
    data = load_json(text, str(path), "trace") if path.suffix == ".json" else load_yaml(text, str(path))
    return trace_from_dict(data, str(path))
