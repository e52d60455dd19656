"""Published training measurements the cost model is checked against, and helpers to rebuild them.

``narayanan2021_table1.csv`` (package data; its header cites the paper) holds Table 1 of Narayanan et al.
2021. The held-out cases below were not used to set any prior. The predictions at a published layout
(``nereus.planner.published``) complete that layout as the planner would, so they live a layer up.
"""

from __future__ import annotations

import csv
from importlib import resources

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
