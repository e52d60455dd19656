"""Typed, validated data: job spec, cluster, layouts and plans. No torch here."""

from nereus.spec.cluster import ClusterSpec, GpuSpec, gpu_presets
from nereus.spec.errors import InfeasibleError, SpecError
from nereus.spec.job import Algorithm, JobSpec, Options, ResponseLength, Workload, job_from_dict, load_job
from nereus.spec.layout import STAGES, Layout, ModelStage, Placement, Plan
from nereus.spec.model import PRESETS, ModelArch

__all__ = [
    "Algorithm", "ClusterSpec", "GpuSpec", "InfeasibleError", "JobSpec", "Layout", "ModelArch", "ModelStage",
    "Options", "PRESETS", "Placement", "Plan", "ResponseLength", "STAGES", "SpecError", "Workload",
    "gpu_presets", "job_from_dict", "load_job",
]
