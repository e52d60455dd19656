"""Human-readable and JSON explanations of a searched plan."""

from __future__ import annotations

from nereus.cost.decode import DecodePhases
from nereus.cost.plan_cost import PlanEstimate
from nereus.planner.search import Candidate, SearchResult
from nereus.spec.job import JobSpec
from nereus.spec.layout import STAGES


def fmt_bytes(n: float) -> str:
    """Decimal units, as datasheets quote device memory (80 GB)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def gpu_ranges(gpus: tuple[int, ...]) -> str:
    """``0-7,16-23`` for a GPU list."""
    out, start, prev = [], None, None
    for g in sorted(gpus):
        if start is None:
            start = prev = g
        elif g == prev + 1:
            prev = g
        else:
            out.append(f"{start}-{prev}" if prev > start else str(start))
            start = prev = g
    if start is not None:
        out.append(f"{start}-{prev}" if prev > start else str(start))
    return ",".join(out)


def _phases(times: dict[str, float]) -> str:
    return ", ".join(f"{k.replace('_', ' ')} {v:.2f} s" for k, v in times.items())


def why_lost(best: Candidate, other: Candidate) -> str:
    """The phase that costs the runner-up most against the winner."""
    def phase(c: Candidate, s: str) -> float:
        return max(g.phase_times[s] for g in c.groups)

    deltas = {s: phase(other, s) - phase(best, s) for s in STAGES}
    deltas["weight sync"] = other.sync_s - best.sync_s
    worst = max(deltas, key=lambda k: deltas[k])
    return f"{worst} +{deltas[worst]:.2f} s"


def estimate_text(job: JobSpec, est: PlanEstimate, placements: dict[str, tuple[int, ...]]) -> list[str]:
    lines = [f"predicted step time {est.step_time_s:.2f} s  ({_phases(est.phase_times)})", "",
             f"{'model-stage':<22}{'layout':<42}{'GPUs':<12}{'time':>10}{'peak/device':>14}"]
    for name in placements:
        cost = est.costs[name]
        lay = cost.layout
        text = lay.short() + ("" if name.endswith("generation") else f" recompute={lay.recompute}")
        lines.append(f"{name:<22}{text:<42}{gpu_ranges(placements[name]):<12}"
                     f"{est.stage_times[name]:>9.3f}s{fmt_bytes(cost.peak_bytes):>14}")
        if cost.decode is not None:
            lines.append(decode_text(cost.decode))
    peak = max(est.device_peak_bytes)
    lines += ["", f"per-device peak memory (all stages resident + the largest transient): max {fmt_bytes(peak)}, "
                  f"min {fmt_bytes(min(est.device_peak_bytes))}; capacity {fmt_bytes(est.capacity_bytes)}"]
    for v in est.violations[:5]:
        lines.append(f"  over capacity: {v}")
    return lines


def decode_text(d: DecodePhases) -> str:
    """One replica's generation under the decode model (before calibration): the regime of a step at
    the bulk batch, and how the time splits between the bulk phase, the draining tail and prefill."""
    return (f"{'':<4}decode per replica: {d.regime}-bound at batch {d.batch} ({1e3 * d.bulk_step_s:.1f} ms/step); "
            f"bulk {d.bulk_s:.2f} s, tail {d.tail_s:.2f} s (down to 1 sequence at {1e3 * d.tail_step_s:.1f} "
            f"ms/step), prefill {d.prefill_s:.2f} s; {d.sequences} sequences")


def explain_text(job: JobSpec, result: SearchResult) -> str:
    c = job.cluster
    est, plan = result.estimate, result.plan
    lines = [f"Plan for '{job.name}' ({job.algorithm.name}) on {c.num_gpus} x {c.gpu.name} "
             f"({c.nodes} node(s) x {c.gpus_per_node}); strategy: {plan.strategy or '?'}"]
    lines += estimate_text(job, est, {str(p.model_stage): p.gpus for p in plan.placements})
    if result.runners_up and result.best is not None:
        lines += ["", "runners-up (best plan of each other colocation strategy):"]
        for r in result.runners_up:
            gap = (r.step_time_s / est.step_time_s - 1) * 100
            lines.append(f"  {r.strategy:<44} {r.step_time_s:8.2f} s  (+{gap:.1f}%; {why_lost(result.best, r)})")
    lines += ["", f"searched {result.evaluated_layouts} layouts in {result.search_time_s * 1000:.0f} ms"]
    return "\n".join(lines)


def result_json(job: JobSpec, result: SearchResult) -> dict:
    out = {"plan": result.plan.to_dict(), "strategy": result.plan.strategy or None,
           **result.estimate.to_dict(),
           "runners_up": [{"strategy": r.strategy, "step_time_s": r.step_time_s,
                           "why": why_lost(result.best, r) if result.best else ""} for r in result.runners_up],
           "search_time_s": result.search_time_s, "evaluated_layouts": result.evaluated_layouts,
           "cluster": job.cluster.to_dict()}
    return out
