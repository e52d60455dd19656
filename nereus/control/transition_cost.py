"""What the controller pays to move between plans: the transition graph's scheduled makespan
(nereus.elastic), screened first by the quick bandwidth estimate (nereus.cost.transition), and cached
per pair of plans — a transition's cost depends on the models and the two plans, not on the workload."""

from __future__ import annotations

import math

from nereus.cost.hardware import Hardware
from nereus.cost.transition import estimate_transition
from nereus.spec.errors import InfeasibleError
from nereus.spec.job import JobSpec
from nereus.spec.layout import Plan


class TransitionCoster:
    def __init__(self, use_graph: bool = True) -> None:
        self.use_graph = use_graph
        self._exact: dict[tuple[Plan, Plan], float] = {}
        self.graph_calls = 0

    def quick(self, hw: Hardware, job: JobSpec, old: Plan, new: Plan) -> float:
        """Per-device receive volume over the link: cheap enough for every candidate."""
        return estimate_transition(hw, job, old, new).seconds

    def __call__(self, hw: Hardware, job: JobSpec, old: Plan, new: Plan) -> float:
        """The scheduled makespan of the transition graph; infinite when the move cannot fit in memory
        even with chunking and host detours."""
        if not self.use_graph:
            return self.quick(hw, job, old, new)
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
