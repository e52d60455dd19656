"""What the controller pays to move between plans: the transition graph's scheduled makespan
(nereus.elastic), screened first by the quick bandwidth estimate (nereus.cost.transition), and cached
per pair of plans — a transition's cost depends on the models and the two plans, not on the workload.
Both are bandwidth-bound times; the fixed part of a move (``cost.transition.TransitionFit``) is added
on top, fitted to the transitions this job measured (``observe``)."""

from __future__ import annotations

import math

from nereus.cost.hardware import Hardware
from nereus.cost.transition import (
    TransitionCalibrator,
    TransitionFit,
    engines_rebuilt,
    estimate_transition,
    moved_stages,
)
from nereus.spec.errors import InfeasibleError
from nereus.spec.job import JobSpec
from nereus.spec.layout import Plan


class TransitionCoster:
    def __init__(self, use_graph: bool = True, prior: TransitionFit | None = None) -> None:
        self.use_graph = use_graph
        self._exact: dict[tuple[Plan, Plan], float] = {}
        self.graph_calls = 0
        self.calibrator = TransitionCalibrator(prior or TransitionFit())

    @property
    def fit(self) -> TransitionFit:
        return self.calibrator.fit

    def observe(self, job: JobSpec, old: Plan, new: Plan, bandwidth_s: float, measured_s: float) -> TransitionFit:
        """A transition ran: ``bandwidth_s`` its scheduled bandwidth-bound time, ``measured_s`` its wall time."""
        return self.calibrator.observe(bandwidth_s, moved_stages(old, new), measured_s, engines_rebuilt(job, old, new))

    def quick(self, hw: Hardware, job: JobSpec, old: Plan, new: Plan) -> float:
        """Per-device receive volume over the link, plus the fixed part: cheap enough for every candidate."""
        return self.fit.seconds(estimate_transition(hw, job, old, new).seconds, moved_stages(old, new),
                                engines_rebuilt(job, old, new))

    def __call__(self, hw: Hardware, job: JobSpec, old: Plan, new: Plan) -> float:
        """The scheduled makespan of the transition graph plus the fixed part; infinite when the move
        cannot fit in memory even with chunking and host detours."""
        if not self.use_graph:
            return self.quick(hw, job, old, new)
        return self.fit.seconds(self.scheduled(hw, job, old, new), moved_stages(old, new),
                                engines_rebuilt(job, old, new))

    def scheduled(self, hw: Hardware, job: JobSpec, old: Plan, new: Plan) -> float:
        """The transition graph's makespan (bytes only), cached per pair of plans."""
        key = (old, new)
        if key not in self._exact:
            from nereus.elastic.transition import plan_transition

            self.graph_calls += 1
            gpus = max(old.num_gpus, new.num_gpus)
            if gpus > job.cluster.num_gpus:  # a move off GPUs the job has just lost
                job = job.with_gpus(gpus)
                hw = Hardware(job.cluster, hw.priors)
            try:
                self._exact[key] = plan_transition(job, old, new, hw).report.predicted_s
            except InfeasibleError:
                self._exact[key] = math.inf
        return self._exact[key]
