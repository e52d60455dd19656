"""Published training measurements the cost model is checked against, and helpers to rebuild them.

``narayanan2021_table1.csv`` (package data; its header cites the paper) holds Table 1 of Narayanan et al.
2021. The held-out cases below were not used to set any prior. The predictions at a published layout
(``nereus.planner.published``) complete that layout as the planner would, so they live a layer up.
"""

from __future__ import annotations

import csv
from importlib import resources

from nereus.spec.cluster import gpu_presets, nvlink_node
from nereus.spec.job import JobSpec, job_from_dict

SEQ, VOCAB = 2048, 51200

# Held-out measurements (GPT, s = 2048, V = 51,200, A100-80GB).
HELD_OUT = [
    {"name": "530B, full recompute", "layers": 105, "hidden": 20480, "heads": 128, "gpus": 2240,
     "layout": "tp=8,pp=35,dp=8", "batch": 1920, "options": {}, "mfu": 0.421,
     "source": "Korthikanti et al. 2022 (arXiv 2205.05198), abstract; batch as MT-NLG (Smith et al. 2022, 2.4)"},
    {"name": "530B, selective recompute + sequence parallel", "layers": 105, "hidden": 20480, "heads": 128,
     "gpus": 2240, "layout": "tp=8,pp=35,dp=8", "batch": 1920,
     "options": {"recompute": "selective", "sequence_parallel": True}, "mfu": 0.542,
     "source": "Korthikanti et al. 2022 (arXiv 2205.05198), abstract"},
    {"name": "GPT-3 175B", "layers": 96, "hidden": 12288, "heads": 96, "gpus": 1024, "layout": "tp=8,pp=16",
     "batch": 1536, "options": {}, "tflops": 138.0,
     "source": "NVIDIA/Megatron-LM README, 'GPT-3 Example' (~32 s/iteration, 138 TFLOP/s per GPU)"},
]


# Held-out Mixture-of-Experts pre-training in BF16: Megatron-Bridge's performance summary, 25.11 NeMo container,
# DGX-GB200 (https://github.com/NVIDIA-NeMo/Megatron-Bridge/blob/067f987df03b8355b03192d88d70f1709fedf51a/docs/
# performance-summary-archive.md, "25.11 NeMo Container", "System: DGX-GB200"; the recipes: scripts/performance/
# configs/{qwen,deepseek}/*_workload_base_configs.py, https://github.com/NVIDIA-NeMo/Megatron-Bridge/tree/
# 7fca53411a86fe14f974fbc0b725e54821d98a0d). Sequences of 4,096 tokens, micro-batch 1, routing force-balanced and
# token-dropless (its notes); tokens/s per GPU as published. Architectures as their Hugging Face configs;
# DeepSeek-V3's MLA is priced as multi-head attention of hidden / heads wide heads (``sim.published_runs``), which
# understates its attention FLOPs. Both recipes' uneven pipeline split (94 and 61 layers) is priced at its fullest
# stage, without the interleaving (VP 3 and 4) the model needs even chunks for; DeepSeek-V3 recomputes only its MLA
# up-projection, priced as no recompute. The 256 GPUs are 64 trays of 4 in NVL72 racks, whose NVLink joins 72: four
# domains of 64 (``spec.cluster.nvlink_node``), the reach of the recipes' NVLink-domain all-to-all ("hybridep").
QWEN3_235B = {"layers": 94, "hidden": 4096, "heads": 64, "kv_heads": 4, "head_dim": 128, "vocab": 151936,
              "ffn_hidden": 1536, "moe": {"experts": 128, "top_k": 8, "expert_ffn_hidden": 1536}}
DEEPSEEK_V3 = {"layers": 61, "hidden": 7168, "heads": 128, "kv_heads": 128, "vocab": 129280, "ffn_hidden": 18432,
               "moe": {"experts": 256, "top_k": 8, "expert_ffn_hidden": 2048, "shared_expert_ffn_hidden": 2048,
                       "dense_layers": [0, 1, 2]}}
MOE_PRETRAINING = [
    {"name": "Qwen3-235B-A22B, 256 GB200, BF16", "arch": QWEN3_235B, "gpus": 256, "gpus_per_host": 4,
     "batch": 8192, "seq": 4096, "tp": 1, "pp": 8, "ep": 32, "tokens_per_s_per_gpu": 4916},
    {"name": "DeepSeek-V3 (w/o MTP), 256 GB200, BF16", "arch": DEEPSEEK_V3, "gpus": 256, "gpus_per_host": 4,
     "batch": 4096, "seq": 4096, "tp": 1, "pp": 4, "ep": 64, "tokens_per_s_per_gpu": 3139},
]


def moe_pretraining_job(case: dict, gpus_per_node: int | None = None) -> JobSpec:
    """A Megatron pre-training job of one ``MOE_PRETRAINING`` case on GB200s, nodes of ``gpus_per_node``
    (default: the NVLink domain its hosts sit in, ``spec.cluster.nvlink_node``)."""
    per_node = gpus_per_node or nvlink_node(gpu_presets()["GB200"].nvlink_domain, case["gpus"], case["gpus_per_host"])
    return job_from_dict({
        "name": case["name"], "models": {"moe": case["arch"]}, "algorithm": {"name": "train"},
        "workload": {"global_batch": case["batch"], "sequence_length": case["seq"]},
        "cluster": {"gpu": "GB200", "nodes": case["gpus"] // per_node, "gpus_per_node": per_node},
    })


def gpt_training_job(layers: int, hidden: int, heads: int, global_batch: int, gpus: int, **options) -> JobSpec:
    """A Megatron-LM GPT training job as in Narayanan et al. 2021: GeLU 4h MLP, tied embeddings,
    V = 51,200, s = 2048, full recomputation, no sequence parallelism or distributed optimizer, and
    attention kernels that materialise the s×s scores. ``options`` override any of these."""
    opts = {"recompute": "full", "sequence_parallel": False, "zero1": False, "attention": "standard", **options}
    return job_from_dict({
        "name": f"gpt-{layers}x{hidden}",
        "models": {"gpt": {"layers": layers, "hidden": hidden, "ffn_hidden": 4 * hidden, "heads": heads,
                           "vocab": VOCAB, "tied_embeddings": True, "mlp": "gelu"}},
        "algorithm": {"name": "train"},
        "workload": {"global_batch": global_batch, "sequence_length": SEQ},
        "cluster": {"gpu": "A100-SXM-80GB", "nodes": max(1, gpus // 8), "gpus_per_node": min(8, gpus)},
        "options": opts,
    })


def hardware_flops(layers: int, hidden: int, batch: int) -> float:
    """FLOPs per iteration with full recomputation (Narayanan et al. 2021, Eq. 3)."""
    return 96 * batch * SEQ * layers * hidden**2 * (1 + SEQ / (6 * hidden) + VOCAB / (16 * layers * hidden))


def model_flops(layers: int, hidden: int, batch: int) -> float:
    """FLOPs per iteration without recomputation, the MFU numerator (Korthikanti et al. 2022, Sec. 6.3)."""
    return 72 * batch * SEQ * layers * hidden**2 * (1 + SEQ / (6 * hidden) + VOCAB / (12 * layers * hidden))


def narayanan_rows() -> list[dict]:
    text = resources.files("nereus.cost").joinpath("narayanan2021_table1.csv").read_text()
    return list(csv.DictReader(line for line in text.splitlines() if not line.startswith("#")))


def row_job(row: dict) -> JobSpec:
    return gpt_training_job(int(row["layers"]), int(row["hidden_size"]), int(row["attention_heads"]),
                            int(row["global_batch"]), int(row["gpus"]))
