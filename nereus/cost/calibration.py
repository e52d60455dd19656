"""Calibration: per-term correction factors fitted to measured stage times of plans that ran.

Every model-stage time is a sum of analytical terms t_k (``nereus.cost.stages``); the calibrated time is
Σ_k c_k·t_k with one factor per (stage kind, term), e.g. ``training.compute`` or ``generation.memory``.
The factors solve a non-negative least-squares problem on relative errors, with a ridge pull towards 1
(the prior) so that a term the measurements never exercised keeps its analytical value:

    minimise  Σ_rows ((Σ_k c_k t_rk − y_r) / y_r)²  +  λ Σ_k (c_k − 1)²   subject to  c ≥ 0

solved exactly with the Lawson–Hanson active-set algorithm on the ridge-augmented system
(Lawson & Hanson 1974, "Solving Least Squares Problems", ch. 23, algorithm NNLS).

Per-term factors are identifiable only from measurements of different layouts: one layout's terms scale
together (compute, memory and overhead of one pass are proportional across its steps), so the columns are
nearly collinear and the fit would split the error among them arbitrarily. While a stage kind has been
measured under fewer than ``min_layouts`` distinct layouts, its terms share one factor (a scale of that
stage kind's prediction); with more, each term gets its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from nereus.cost.generation import ROLLOUT
from nereus.cost.hardware import Hardware
from nereus.cost.plan_cost import PlanEstimate, estimate_plan
from nereus.spec.errors import SpecError
from nereus.spec.job import JobSpec
from nereus.spec.layout import Plan
from nereus.spec.levers import GenerationLevers


@dataclass
class Calibrator:
    hw: Hardware
    ridge: float = 1e-4
    max_rows: int = 512  # recent measurements kept; older ones age out as the job changes
    min_layouts: int = 2  # distinct layouts of a stage kind before its terms get factors of their own
    # factors known beforehand, taken instead of fitted for every term the rows exercise (a simulated run's
    # hidden truth, which prices what the fit's errors cost: benchmarks/calibration_headroom.py); a term
    # missing from them keeps its prior 1
    known: dict[str, float] = field(default_factory=dict)
    _rows: list[tuple[dict[str, float], float, tuple]] = field(default_factory=list)
    factors: dict[str, float] = field(default_factory=dict)

    def observe(self, job: JobSpec, plan: Plan, measured_s: dict[str, float]) -> None:
        """Record measured seconds per model-stage (``"actor/training"``; ``"weight_sync"`` optional)."""
        est = estimate_plan(self.hw, job, plan)
        for name, seconds in measured_s.items():
            if not (isinstance(seconds, (int, float)) and 0 < seconds < float("inf")):
                raise SpecError(f"measured.{name}", f"must be a positive number of seconds, got {seconds!r}")
            if name == "weight_sync":
                raw = est.phase_times["weight_sync"]
                if raw > 0:
                    self._rows.append(({"sync": raw}, seconds, ("sync",)))
                continue
            if name not in est.costs:
                raise SpecError(f"measured.{name}", f"not a model-stage of this plan ({sorted(est.costs)})")
            cost = est.costs[name]
            stage = cost.model_stage.stage
            if not np.isfinite(cost.time()):
                continue  # a layout the model deems infeasible tells nothing about the terms
            lay = cost.layout
            signature = (stage, lay.tp, lay.pp, lay.dp, lay.micro_batch_size, lay.interleave, lay.recompute)
            self._rows.append(({f"{stage}.{k}": v for k, v in cost.terms.items() if v > 0}, seconds, signature))
        del self._rows[: max(0, len(self._rows) - self.max_rows)]

    def fit(self) -> dict[str, float]:
        if not self._rows:
            return {}
        keys = sorted({k for terms, _, _ in self._rows for k in terms})
        if self.known:
            self.factors = {k: self.known.get(k, 1.0) for k in keys}
            return self.factors
        layouts: dict[str, set] = {}
        for _, _, sig in self._rows:
            layouts.setdefault(sig[0], set()).add(sig)
        # a stage kind seen under too few layouts: one shared column (see the module docstring)
        group = {k: k if len(layouts.get(k.split(".")[0], ())) >= self.min_layouts else k.split(".")[0] + ".*"
                 for k in keys}
        cols = sorted(set(group.values()))
        col = {c: i for i, c in enumerate(cols)}
        a = np.zeros((len(self._rows), len(cols)))
        y = np.ones(len(self._rows))
        for r, (terms, seconds, _) in enumerate(self._rows):
            for k, v in terms.items():
                a[r, col[group[k]]] += v / seconds  # relative error rows
        lam = np.sqrt(self.ridge * len(self._rows))  # the ridge pulls towards the prior factor 1
        c = nnls(np.vstack([a, lam * np.eye(len(cols))]), np.concatenate([y, lam * np.ones(len(cols))]))
        self.factors = {k: float(c[col[group[k]]]) for k in keys}
        return self.factors

    def predict(self, job: JobSpec, plan: Plan) -> PlanEstimate:
        return estimate_plan(self.hw, job, plan, self.factors)

    def relative_errors(self) -> list[float]:
        """Fitted relative error of every recorded row (for reports)."""
        return [sum(v * self.factors.get(k, 1.0) for k, v in terms.items()) / seconds - 1
                for terms, seconds, _ in self._rows]


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int | None = None) -> np.ndarray:
    """argmin ||a x − b|| subject to x ≥ 0 (Lawson & Hanson 1974, ch. 23)."""
    n = a.shape[1]
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    w = a.T @ (b - a @ x)
    for _ in range(max_iter or 3 * n + 10):
        if passive.all() or (w[~passive] <= 1e-12).all():
            break
        candidates = np.where(~passive, w, -np.inf)
        passive[int(np.argmax(candidates))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            # Step back towards x until the first passive coordinate hits zero, then drop it.
            mask = passive & (z <= 0)
            alpha = np.min(x[mask] / (x[mask] - z[mask]))
            x = x + alpha * (z - x)
            passive &= x > 1e-12
            x[~passive] = 0.0
        w = a.T @ (b - a @ x)
    return x


def plain_equivalent(measured_s: dict[str, float], levers: GenerationLevers | None) -> dict[str, float]:
    """``measured_s`` with the rollout's seconds of a step run under ``levers`` turned into the seconds the
    plain plan the model prices would have taken: times the levers' predicted plain / lever generation
    seconds (``predicted``'s ``base_s`` / ``generation_s``, from the lever rule's choice). Fitted as
    measured, a lever-on step would fold the lever's gain into the generation factors, and a plan priced
    with the lever on those factors would count the gain twice. Unchanged without levers or without that
    prediction (a choice priced as whole steps, ``step_s``)."""
    p = levers.predicted if levers is not None else {}
    base, fast = p.get("base_s", 0.0), p.get("generation_s", 0.0)
    stage = str(ROLLOUT)
    if stage not in measured_s or base <= 0 or fast <= 0:
        return measured_s
    return {**measured_s, stage: measured_s[stage] * base / fast}
