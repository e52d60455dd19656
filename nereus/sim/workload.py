"""A batch that grows with the GPU count (weak scaling), for simulations that compare both assumptions.

Published RL runs mostly fix the global batch (verl's and OpenRLHF's scripts set ``data.train_batch_size``
/ ``--rollout_batch_size`` once), so adding GPUs shrinks each GPU's share; an operator who instead keeps
each GPU's share raises the batch with the cluster. ``GrowingBatchJob`` is a job whose prompts per step
are ``prompts_per_gpu`` times the GPUs it is given: every ``with_gpus`` (the controller's and the
baselines' forecast for a GPU count, the simulator's step on the GPUs available then) sets the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from nereus.spec.job import JobSpec


@dataclass(frozen=True)
class GrowingBatchJob(JobSpec):
    prompts_per_gpu: float = 0.0

    @staticmethod
    def of(job: JobSpec, prompts_per_gpu: float) -> GrowingBatchJob:
        if prompts_per_gpu <= 0:
            raise ValueError(f"prompts_per_gpu must be positive, not {prompts_per_gpu}")
        values = {f.name: getattr(job, f.name) for f in fields(JobSpec)}
        return GrowingBatchJob(**values, prompts_per_gpu=prompts_per_gpu).with_gpus(job.cluster.num_gpus)

    def prompts_for(self, gpus: int) -> int:
        """``prompts_per_gpu`` × the GPUs a plan can use (whole nodes), rounded to whole mini-batches."""
        gpn = self.cluster.gpus_per_node
        usable = gpus if gpus < gpn else gpus // gpn * gpn
        unit = self.algorithm.mini_batches
        return max(unit, round(self.prompts_per_gpu * max(usable, 1) / unit) * unit)

    def with_gpus(self, total: int) -> GrowingBatchJob:
        job = replace(self, cluster=self.cluster.with_gpus(total))
        return replace(job, workload=replace(job.workload, prompts_per_step=self.prompts_for(total)))


def batch_at(job: JobSpec, gpus: int) -> JobSpec:
    """``job`` with the batch it runs at on ``gpus`` available GPUs and its own cluster: unchanged for a
    fixed batch, ``prompts_per_gpu`` × GPUs for a ``GrowingBatchJob``."""
    if not isinstance(job, GrowingBatchJob):
        return job
    return replace(job, workload=replace(job.workload, prompts_per_step=job.prompts_for(gpus)))
