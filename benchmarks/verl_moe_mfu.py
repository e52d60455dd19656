"""verl's Megatron training of MoE models: the cost model's MFU against verl's published MFU.

    python benchmarks/verl_moe_mfu.py [--json]

verl's docs/perf/dpsk.md publishes the MFU of its Qwen3-30B-A3B Megatron recipe on 8, 16 and 32 96 GB GPUs
(0.40, 0.37, 0.31) and of its DeepSeek-V3 benchmark on 96 (0.19). verl's MFU is its flops counter's FLOPs of
the update (verl/utils/flops_counter.py: 6 FLOPs per active weight and token, the router and the embedding
and LM head included, plus the attention's 6·s²·head_dim·heads per layer, causal halved for MLA) over the
update policy's seconds, the GPUs and H20's 148 TFLOP/s. The cost model's MFU is the same FLOPs over its
training stage without the host loads of offloaded parameters, which verl's timer leaves out.

The three Qwen3-30B-A3B rows fit ``published_frameworks.VERL_MEGATRON_MOE_TRAINING_EFFICIENCY`` (the GEMM
efficiency at which the pooled MFU matches, GPU-seconds weighted); DeepSeek-V3 is held out. Lengths as the
validation's rules give them (``sim.published_runs``: no mean published for the Qwen3 rows), the attention
term at the mean length.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from e2e_validation import read_rows  # noqa: E402

from nereus.cost.hardware import Hardware  # noqa: E402
from nereus.cost.plan_cost import estimate_plan  # noqa: E402
from nereus.sim.published_frameworks import VERL_MEGATRON_MOE_TRAINING_EFFICIENCY  # noqa: E402
from nereus.sim.published_runs import job_of, plan_of  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
H20_PEAK = 148e12  # verl's flops_counter table for "H20" (and hardware.csv)
# Qwen3-30B-A3B-Base's config.json (Hugging Face): the columns of the e2e schema
QWEN3_30B = {"model": "Qwen3-30B-A3B-Base", "arch": "moe", "params_b": "30.5", "active_params_b": "3.3",
             "n_layers": "48", "hidden": "2048", "n_heads": "32", "n_kv_heads": "4", "head_dim": "128",
             "vocab": "151936", "n_experts": "128", "experts_per_token": "8", "moe_ffn_hidden": "768",
             "shared_experts": "0"}
# examples/grpo_trainer/run_qwen3moe-30b_megatron_96gb.sh at the table's commit: colocated GRPO, rollout TP 4,
# TP1 PP1 EP8, 512 prompts x 16, caps 2,048 + 8,192, dynamic batching, offload=True with the optimizer on the
# host (OFFLOAD_FRACTION 1); the table's three sizes, 8 GPUs a node.
QWEN3_MFU = {8: 0.40, 16: 0.37, 32: 0.31}
DSV3_MFU = 0.19
# DeepSeek-V3's config.json: what verl's counter reads that the schema has no column for (MLA).
DSV3_MLA = {"q_lora": 1536, "kv_lora": 512, "nope": 128, "rope": 64, "v": 128, "first_dense": 3,
            "dense_ffn": 18432, "shared": 1}


def qwen3_row(gpus: int) -> dict:
    return {**QWEN3_30B, "run_id": f"qwen3_30b_{gpus}", "framework": "verl", "algorithm": "grpo",
            "critic": "no", "reference": "no", "gpu": "H20-96G", "gpus_total": str(gpus), "gpus_per_node": "8",
            "placement": "colocated", "gen_gpus": str(gpus), "train_gpus": str(gpus), "rollout_engine": "vllm",
            "rollout_tp": "4", "train_backend": "megatron", "train_tp": "1", "train_pp": "1", "train_ep": "8",
            "offload": "param+optimizer", "dynamic_bsz": "yes", "prompts_per_step": "512",
            "samples_per_prompt": "16", "max_prompt_len": "2048", "max_response_len": "8192", "sync_mode": "sync"}


def qwen3_flops(row: dict, tokens: float, seq: float) -> float:
    """verl's ``_estimate_qwen2_moe_flops`` (its counter for qwen3_moe)."""
    h, layers, heads, kv, hd = (int(row[k]) for k in ("hidden", "n_layers", "n_heads", "n_kv_heads", "head_dim"))
    experts, top_k, width, vocab = (int(row[k]) for k in ("n_experts", "experts_per_token", "moe_ffn_hidden", "vocab"))
    per_layer = h * top_k * width * 3 + h * experts + h * (2 * heads * hd + 2 * kv * hd)
    dense = per_layer * layers + vocab * h * 2
    return 6 * dense * tokens + 6 * tokens * seq * hd * heads * layers


def dsv3_flops(row: dict, tokens: float, seq: float) -> float:
    """verl's ``_estimate_deepseek_v3_flops``."""
    m = DSV3_MLA
    h, layers, heads, vocab = (int(row[k]) for k in ("hidden", "n_layers", "n_heads", "vocab"))
    experts, top_k, width = (int(row[k]) for k in ("n_experts", "experts_per_token", "moe_ffn_hidden"))
    q_dim = m["nope"] + m["rope"]
    attn = (h * m["q_lora"] + heads * q_dim * m["q_lora"] + h * (m["kv_lora"] + m["rope"])
            + heads * (q_dim - m["rope"] + m["v"]) * m["kv_lora"] + heads * m["v"] * h)
    moe = h * experts + h * width * (top_k + m["shared"]) * 3 + attn
    dense = h * m["dense_ffn"] * 3 + attn
    params = moe * (layers - m["first_dense"]) + dense * m["first_dense"] + vocab * h * 2
    return 6 * params * tokens + 3 * tokens * seq * layers * (q_dim + m["v"]) * heads


def priced_mfu(row: dict, flops_of, efficiency: float | None = None) -> tuple[float, float, float]:
    """(MFU, FLOPs, seconds) of the row's update: ``efficiency`` replaces the framework's (None: as built)."""
    job = job_of(row, {})
    if efficiency is not None:
        job = replace(job, options=replace(job.options, training_efficiency=efficiency))
    cost = estimate_plan(Hardware(job.cluster), job, plan_of(row, job)).costs["actor/training"]
    seconds = cost.time() - cost.terms.get("overhead", 0.0)  # without loading offloaded parameters
    seq = job.workload.prompt_length + job.workload.response.mean
    flops = flops_of(row, job.sequences_per_step() * seq, seq)
    return flops / (seconds * job.cluster.num_gpus * H20_PEAK), flops, seconds


def pooled(efficiency: float | None) -> float:
    """The Qwen3 rows' MFU over their GPU-seconds together."""
    priced = [priced_mfu(qwen3_row(g), qwen3_flops, efficiency) for g in QWEN3_MFU]
    return sum(p[1] for p in priced) / sum(p[1] / p[0] for p in priced)


def fitted_efficiency() -> float:
    """The GEMM efficiency at which the pooled MFU matches the published pooled MFU (bisection)."""
    target = len(QWEN3_MFU) / sum(1 / v for v in QWEN3_MFU.values())
    low, high = 0.05, 1.0
    for _ in range(40):
        mid = (low + high) / 2
        low, high = (mid, high) if pooled(mid) < target else (low, mid)
    return (low + high) / 2


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print only the JSON summary line")
    args = ap.parse_args(argv)
    fit = fitted_efficiency()
    dsv3 = next(r for r in read_rows(ROOT / "nereus" / "cost" / "e2e_runs.csv") if r["run_id"] == "verl_dsv3_1")
    lines, out = [], {"fitted_efficiency": round(fit, 3), "used": VERL_MEGATRON_MOE_TRAINING_EFFICIENCY}
    for gpus, published in QWEN3_MFU.items():
        row = qwen3_row(gpus)
        prior, used = priced_mfu(row, qwen3_flops, 0.0)[0], priced_mfu(row, qwen3_flops)[0]
        lines.append(f"Qwen3-30B-A3B, {gpus:>2} H20 (fit)     MFU published {published:.2f}, priced {used:.3f} "
                     f"({100 * (used / published - 1):+.0f}%), at the prior {prior:.3f}")
    prior, used = priced_mfu(dsv3, dsv3_flops, 0.0)[0], priced_mfu(dsv3, dsv3_flops)[0]
    lines.append(f"DeepSeek-V3, 96 H20 (held out)    MFU published {DSV3_MFU:.2f}, priced {used:.3f} "
                 f"({100 * (used / DSV3_MFU - 1):+.0f}%), at the prior {prior:.3f}")
    out.update(dsv3_mfu=round(used, 3), dsv3_mfu_prior=round(prior, 3), dsv3_published=DSV3_MFU,
               qwen3_pooled=round(pooled(None), 3))
    if not args.json:
        print("\n".join(lines))
        print(f"fitted efficiency {fit:.3f} (used: {VERL_MEGATRON_MOE_TRAINING_EFFICIENCY})")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
