"""What one published run's prediction is made of (``benchmarks/e2e_validation.py --explain RUN_ID``).

A user checking the cost model against a run of their own needs to see which of the row's cells it read,
which empty ones a stated rule filled (``sim.published_runs``), the plan it priced, each stage's device
seconds and their largest terms, and how every published column's prediction is put together
(``published_predict.predicted_parts``: the same formulas the validation's numbers come from, so the text
cannot drift from them).
"""

from __future__ import annotations

from nereus.cost.hardware import Hardware
from nereus.cost.plan_cost import estimate_plan
from nereus.sim.published_cells import canonical, setting
from nereus.sim.published_frameworks import framework_of, named_framework
from nereus.sim.published_predict import StepTimes, driver_seconds, predicted_parts, priced
from nereus.sim.published_runs import (
    UNSTATED_PROMPT_FRACTION,
    UNSTATED_RESPONSE_TOKENS,
    PublishedRun,
    number,
    prompt_cap,
    text,
    weight_sync_only,
)
from nereus.spec.layout import Layout

# Optional yes/no columns, which a row's notes may state instead (``published_cells.setting``)
OPTIONAL_SETTINGS = ("enforce_eager", "partial_rollout", "checkpoint_engine")
# Cells a stated rule fills when a row leaves them empty (sim.published_runs' module docstring, and the
# framework defaults of sim.published_frameworks): an explanation names the ones this row left empty.
RULED_CELLS = ("framework", "algorithm", "critic", "reference", "arch", "params_b", "n_kv_heads", "head_dim",
               "shared_experts", "placement", "max_prompt_len", "mean_prompt_len", "mean_response_len",
               "samples_per_prompt", "gpus_per_node", "gen_gpus", "train_gpus", "rollout_engine", "rollout_tp",
               "rollout_ep", "train_backend", "train_tp", "train_pp", "train_cp", "train_ep", "offload",
               "dynamic_bsz", "gpu_memory_utilization", "sync_mode", "staleness", *OPTIONAL_SETTINGS)
# Cells that shape the batch, the rollout and the trainer's work, which a row timing the weight sync alone
# does not read
BATCH_CELLS = ("algorithm", "critic", "reference", "max_prompt_len", "mean_prompt_len", "mean_response_len",
               "samples_per_prompt", "dynamic_bsz", "staleness", "enforce_eager", "partial_rollout")
TERMS_SHOWN = 4  # a stage's largest cost terms printed beside its seconds


def layout_text(layout: Layout, stage: str) -> str:
    """A layout as people write one: ``TP4 PP1 DP8 EP8 FSDP recompute full, micro-batch 8``; a rollout's
    degrees only (its engine has no optimizer, recomputation or micro-batches)."""
    parts = [f"TP{layout.tp}", f"PP{layout.pp}", f"DP{layout.dp}"]
    parts += [f"EP{layout.ep}"] if layout.ep > 1 else []
    if stage == "generation":
        return " ".join(parts)
    parts += ["FSDP"] if layout.fsdp else (["ZeRO-1"] if layout.zero1 and stage == "training" else [])
    parts += [f"recompute {layout.recompute}"] if layout.recompute != "none" else []
    return " ".join(parts) + f", micro-batch {layout.micro_batch_size}"


def length_text(row: dict, run: PublishedRun) -> str:
    """Prompt and response lengths as the job reads them, and the rule where the row gives no mean."""
    wl = run.job.workload
    if weight_sync_only(run.published):
        return "none read: the row times the weight sync alone, which moves the model whatever the batch"
    framework = framework_of(row)
    prompt_rule = "" if number(row, "mean_prompt_len") is not None else \
        f" (mean_prompt_len empty: {UNSTATED_PROMPT_FRACTION:.3g} of the cap)"
    if number(row, "max_prompt_len") is None:
        prompt_rule = (f" of cap {prompt_cap(row):,} (max_prompt_len empty: the mean over "
                       f"{UNSTATED_PROMPT_FRACTION:.3g})")
    if framework.prompt_at_cap:
        prompt_rule = f" (its cap: {framework.name} pads every prompt to it)"
    response_rule = "" if number(row, "mean_response_len") is not None else \
        f" (mean_response_len empty: {UNSTATED_RESPONSE_TOKENS} tokens, at most half the cap)"
    return (f"{wl.prompts_per_step} prompts x {run.job.algorithm.samples_per_prompt} samples; prompt mean "
            f"{wl.prompt_length:,}{prompt_rule}; response mean {wl.response.mean:,.0f} of cap {wl.response.max:,}, "
            f"{wl.response.distribution} sigma {wl.response.sigma:g}{response_rule}")


def relevant(cell: str, run: PublishedRun) -> bool:
    """The cell bears on the run: expert parallelism on an MoE model, the staleness on a streaming one, the
    checkpoint engine on a rollout of its own GPUs, the batch's cells on a row that times more than the
    weight sync."""
    if cell in ("rollout_ep", "train_ep", "shared_experts"):
        return run.job.models["actor"].moe is not None
    if cell in BATCH_CELLS and weight_sync_only(run.published):
        return False
    if cell in ("staleness", "partial_rollout"):
        return run.sync_mode in ("fully_async", "partial_rollout")
    return cell != "checkpoint_engine" or run.plan.strategy == "disaggregated"


def left_empty(read: dict, cell: str) -> bool:
    """The row gives the cell no value: empty, and for an optional setting not stated in its notes either."""
    return not text(read, cell) and (cell not in OPTIONAL_SETTINGS or not setting(read, cell, ""))


def framework_text(row: dict) -> str:
    """The framework as the row names it, and whose defaults price a framework the rules do not list."""
    written = text(row, "framework")
    if not written:
        return "verl (framework empty: verl's defaults)"
    return written if named_framework(written) else f"{written} (not listed: verl's defaults)"


def header(row: dict, run: PublishedRun) -> list[str]:
    c = run.job.cluster
    source = text(row, "source").rstrip("/").rsplit("/", 1)[-1] or "no source given"
    read = canonical(row)  # cells written "N/A" or an offload written "yes" are read as empty
    empty = [k for k in RULED_CELLS if left_empty(read, k) and relevant(k, run)]
    algorithm = text(row, "algorithm") or run.job.algorithm.name
    return [f"{run.run_id} ({source}): {framework_text(row)} {algorithm}, {run.sync_mode}, "
            f"{run.plan.strategy}, {c.num_gpus} x {c.gpu.name} in {c.nodes} node(s) of {c.gpus_per_node}",
            f"lengths: {length_text(row, run)}",
            "empty cells a stated rule filled: " + (", ".join(empty) if empty else "none")]


def plan_lines(run: PublishedRun) -> list[str]:
    o = run.job.options
    share = f" at {o.gpu_memory_utilization:g} of each GPU's memory" if o.gpu_memory_utilization else ""
    lines = [f"plan: weight sync {run.plan.weight_sync}, offload {o.offload}, rollout engine {o.rollout_engine}{share}"]
    for pl in run.plan.placements:
        shown = layout_text(pl.layout, pl.model_stage.stage)
        lines.append(f"  {str(pl.model_stage):<22} {shown} on {len(pl.gpus)} GPUs")
    return lines


def stage_lines(run: PublishedRun, device: StepTimes, source: str) -> list[str]:
    if weight_sync_only(run.published):
        return []
    costs = estimate_plan(Hardware(run.job.cluster), run.job, run.plan).costs
    lines = [f"device seconds ({'cost model' if source == 'cost' else 'simulator truth'}; terms: the cost model's):"]
    for name in (str(pl.model_stage) for pl in run.plan.placements):
        seconds = device.stages[name]
        terms = sorted(((v, k) for k, v in costs[name].terms.items() if v > 0), reverse=True)[:TERMS_SHOWN]
        shown = ", ".join(f"{k} {v:.2f}" for v, k in terms)
        drain = f"; drain after the last queued sequence starts {device.tail_s:.2f}" \
            if name.endswith("/generation") and device.tail_s > 0 else ""
        lines.append(f"  {name:<22} {seconds:9.2f}  ({shown}{drain})")
    lines.append(f"driver pass a stage call: {driver_seconds(run):.2f} s ({run.job.sequences_per_step():,} sequences "
                 f"x {run.padded_tokens:,} padded slots)")
    return lines


def column_lines(run: PublishedRun, device: StepTimes) -> list[str]:
    lines = [f"{'column':<18} {'published':>10} {'predicted':>10} {'error':>7}  how"]
    for column, part in predicted_parts(run, device).items():
        published = run.published[column]
        error = f"{100 * (part.value / published - 1):+.0f}%" if published > 0 else "-"
        lines.append(f"{column:<18} {published:10.2f} {part.value:10.2f} {error:>7}  {part.how}")
    return lines


def explain(row: dict, run: PublishedRun, source: str) -> str:
    """The explanation of one modelled row; ``RowSkipped`` where its plan cannot be priced."""
    priced_run, device = priced(run, source)
    return "\n".join(header(row, priced_run) + plan_lines(priced_run) + stage_lines(priced_run, device, source)
                     + column_lines(priced_run, device))
