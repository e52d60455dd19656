"""The cost model's predictions for published training runs at their published TP/PP
(``nereus.cost.published`` holds the measurements and rebuilds the jobs). The fields a paper leaves
out (micro-batch size, interleaving) are chosen as the planner would, hence this layer."""

from __future__ import annotations

from nereus.cost.hardware import Hardware
from nereus.cost.plan_cost import estimate_plan
from nereus.cost.published import gpt_training_job, hardware_flops, model_flops, moe_pretraining_job, row_job
from nereus.cost.stages import stage_cost
from nereus.planner.layouts import plan_from_layout
from nereus.spec.job import JobSpec
from nereus.spec.layout import Layout


def predicted_step_time(job: JobSpec, layout: str) -> float:
    """Step time of ``job`` under the given TP/PP(/DP), micro-batching chosen as the planner would."""
    hw = Hardware(job.cluster)
    est = estimate_plan(hw, job, plan_from_layout(hw, job, layout))
    if not est.feasible:
        raise ValueError(f"{layout} does not fit: {est.violations[0]}")
    return est.step_time_s


def row_tflops(row: dict) -> float:
    """Predicted per-GPU TFLOP/s (Eq. 3 FLOPs) of one Table 1 row at its published TP/PP."""
    t = predicted_step_time(row_job(row), f"tp={row['tensor_parallel']},pp={row['pipeline_parallel']}")
    flops = hardware_flops(int(row["layers"]), int(row["hidden_size"]), int(row["global_batch"]))
    return flops / t / int(row["gpus"]) / 1e12


def held_out_prediction(case: dict) -> tuple[str, float, float]:
    """(metric, predicted, published) for one held-out case."""
    job = gpt_training_job(case["layers"], case["hidden"], case["heads"], case["batch"], case["gpus"],
                           **case["options"])
    t = predicted_step_time(job, case["layout"])
    peak = job.cluster.gpu.peak_flops
    if "mfu" in case:
        mfu = model_flops(case["layers"], case["hidden"], case["batch"]) / t / case["gpus"] / peak
        return "MFU", mfu, case["mfu"]
    tflops = hardware_flops(case["layers"], case["hidden"], case["batch"]) / t / case["gpus"] / 1e12
    return "TFLOP/s", tflops, case["tflops"]


def moe_pretraining_tokens(case: dict, gpus_per_node: int | None = None) -> float:
    """Predicted tokens/s per GPU of one ``MOE_PRETRAINING`` case at its published layout (micro-batch 1,
    the distributed optimizer, no recompute), its GPUs in nodes of ``gpus_per_node`` (default: its NVLink
    domain)."""
    job = moe_pretraining_job(case, gpus_per_node)
    layout = Layout(tp=case["tp"], pp=case["pp"], dp=case["gpus"] // (case["tp"] * case["pp"]), ep=case["ep"],
                    micro_batch_size=1, recompute="none", sequence_parallel=case["tp"] > 1, zero1=True)
    cost = stage_cost(Hardware(job.cluster), job, job.model_stages()[0], layout)
    if cost is None:
        raise ValueError(f"{case['name']}: the layout cannot split the batch")
    return case["batch"] * case["seq"] / cost.time() / case["gpus"]
