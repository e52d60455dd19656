"""verl's trainer-to-rollout weight sync when the rollout has GPUs of its own (one-step-off and fully-async
recipes), with and without its checkpoint engine (``async_training.checkpoint_engine.enable``), priced from
the links the bytes cross. ``SYNC_TIMES`` is the registry of every mechanism a plan may name
(``Plan.weight_sync``): Nereus's own direct copy is the default outside it.

- ``tensor-broadcast`` (no checkpoint engine): one NCCL group spans the trainer's and the rollouter's
  ranks; parameter by parameter the trainer assembles the full tensor, its rank 0 broadcasts it to every
  rank and each rollout rank hands it to the engine's ``load_weights`` (volcengine/verl,
  verl/experimental/fully_async_policy/base_detach_sync.py, ``_sync_vllm_weights``). The whole model
  leaves through the sender's link (a pipelined broadcast, Thakur et al. 2005), each tensor pays the
  broadcast's hops of latency, and each pays one collective call and one engine load call on the host:
  the per-tensor reload cost Nereus measured for vLLM's in-place load (``ENGINE_RELOAD_PER_TENSOR_S``).
  A Mixture-of-Experts checkpoint holds three tensors per expert per layer, so its sync is dominated by
  those calls.
- ``checkpoint-engine``: every trainer rank keeps a share of the weights in pinned host buckets of
  ``device_buffer_size_M`` (4,096 MB by default); per round each rank copies its next bucket to its GPU
  (in parallel over the ranks, over PCIe), then the ranks broadcast their buckets in turn and the rollout
  ranks load each bucket in one call (verl/experimental/fully_async_policy/checkpoint_engine.py,
  ``update_checkpoint``, after MoonshotAI/checkpoint-engine). The bytes cross the sender's link once, the
  host copies add ``W / (ranks · PCIe)``, and the calls are per bucket, not per tensor: the engine's
  reload set-up is paid once (``ENGINE_RELOAD_FIXED_S``).
"""

from __future__ import annotations

import math

from nereus.cost.hardware import Hardware
from nereus.cost.memory import BF16
from nereus.cost.weight_sync import (
    ENGINE_RELOAD_FIXED_S,
    ENGINE_RELOAD_PER_TENSOR_S,
    gather_broadcast_time,
    hybrid_reshard_time,
)
from nereus.spec.job import JobSpec
from nereus.spec.layout import Placement

# verl's default checkpoint-engine bucket (fully_async_ppo_trainer.yaml, ``device_buffer_size_M: 4096``).
BUCKET_BYTES = 4096 * 2**20
# Host-to-device copy rate from pinned memory, one direction of a PCIe x16 link: 5.0 (32 GT/s a lane,
# 128b/130b: 63 GB/s) on Hopper and Blackwell boards, 4.0 (31.5 GB/s) on A100/A800 (PCI-SIG base
# specifications; NVIDIA A100 and H100 datasheets, "PCIe Gen4" / "PCIe Gen5").
PCIE_BYTES_PER_S = 63e9
PCIE_GEN4_GPUS = ("A100", "A800")


def pcie_bytes_per_s(hw: Hardware) -> float:
    gen4 = any(hw.cluster.gpu.name.startswith(name) for name in PCIE_GEN4_GPUS)
    return PCIE_BYTES_PER_S / 2 if gen4 else PCIE_BYTES_PER_S


def checkpoint_tensors_with_experts(job: JobSpec) -> int:
    """The actor's checkpoint tensors as a Hugging Face checkpoint names them: per layer attention (q, k,
    v, o; +3 QKV biases, +2 q/k norms) and two norms, then a dense MLP's three or, in a sparse layer, three
    per routed expert, the router, and a shared expert's three and its gate; the embedding, the final norm
    and an untied LM head."""
    a = job.models["actor"]
    attention = 6 + (3 if a.qkv_bias else 0) + (2 if a.qk_norm else 0)
    total = 2 + (0 if a.tied_embeddings else 1)
    for layer in range(a.layers):
        if a.moe is not None and a.moe.sparse(layer):
            shared = 4 if a.moe.shared_expert_ffn_hidden else 0
            total += attention + 3 * a.moe.experts + 1 + shared
        else:
            total += attention + 3
    return total


def _crosses_nodes(hw: Hardware, train: Placement, gen: Placement) -> bool:
    nodes = {hw.cluster.node_of(g) for g in (*train.gpus, *gen.gpus)}
    return len(nodes) > 1


def _broadcast_hops(hw: Hardware, train: Placement, gen: Placement) -> float:
    """Latency of one pipelined broadcast over the sync group: one hop per further rank."""
    ranks = len(train.gpus) + len(gen.gpus)
    lat = hw.priors.inter_latency_s if _crosses_nodes(hw, train, gen) else hw.priors.intra_latency_s
    return (ranks - 1) * lat


def tensor_broadcast_time(hw: Hardware, job: JobSpec, train: Placement, gen: Placement) -> float:
    """verl without the checkpoint engine: gather, broadcast and load tensor by tensor."""
    weights = job.models["actor"].params() * BF16
    tensors = checkpoint_tensors_with_experts(job)
    shards = train.layout.tp * train.layout.pp * (train.layout.dp if train.layout.fsdp else 1)
    gather = hw.all_gather_time(weights, shards)
    move = hw.p2p_time(weights, _crosses_nodes(hw, train, gen))
    return gather + move + tensors * (_broadcast_hops(hw, train, gen) + ENGINE_RELOAD_PER_TENSOR_S)


def checkpoint_engine_time(hw: Hardware, job: JobSpec, train: Placement, gen: Placement) -> float:
    """verl's checkpoint engine: host buckets copied to the GPUs rank-parallel, broadcast bucket by bucket,
    loaded a bucket a call."""
    weights = job.models["actor"].params() * BF16
    senders = len(train.gpus)
    buckets = max(senders, math.ceil(weights / BUCKET_BYTES))
    host_copy = weights / (senders * pcie_bytes_per_s(hw))
    move = hw.p2p_time(weights, _crosses_nodes(hw, train, gen))
    return host_copy + move + buckets * _broadcast_hops(hw, train, gen) + ENGINE_RELOAD_FIXED_S


SYNC_TIMES = {"hybrid-reshard": hybrid_reshard_time, "gather-broadcast": gather_broadcast_time,
              "tensor-broadcast": tensor_broadcast_time, "checkpoint-engine": checkpoint_engine_time}
