"""What the host loops of a trainer-to-rollout weight sync cost: the trainer exporting its sharded weights
as full checkpoint-named tensors, and the rollout engine loading named tensors into its fused parameters.
Both run in Python one tensor at a time, so for a Mixture-of-Experts checkpoint (three tensors per expert
per layer: 18,771 for Qwen3-30B-A3B) they, not the bytes, set the sync time.

Counts come from the frameworks' source; the unit costs are host Python work, measured with
``benchmarks/host_call_costs.py`` (fastest batch of 100 back-to-back calls, torch 2.x on an AMD EPYC core;
rerun it to see a machine's own figures):

- the engine's ``load_weights`` (vLLM, vllm/model_executor/models/qwen2.py and qwen3_moe.py, the same
  pattern in SGLang's models) rebuilds ``dict(self.named_parameters())`` at every call, walking every module
  of the model, and an MoE model also rebuilds its expert-name table (three entries per expert,
  ``FusedMoE.make_expert_params_mapping``); then per tensor it scans that table by substring until the
  tensor's entry (half of it on average) and runs the weight loader's few eager ops (select the expert and
  shard slice, narrow to its tensor-parallel part, copy). A sync that calls it once per tensor pays the
  walk per tensor (sgl-project/sglang issue 30848 measures the same loop at ~60 s a pass of
  Qwen3-30B-A3B);
- a Megatron trainer (ISEEKYAN/mbridge ``Bridge.export_weights``, verl's default with
  ``megatron.use_mbridge``; verl/utils/megatron_utils.py ``per_tensor_generator`` without) exchanges, for every
  parameter of its model chunk, the name and the tensor spec over the pipeline group with three
  ``torch.distributed`` object collectives (pickled, gathered, unpickled), broadcasts the tensor over the
  pipeline group, all-gathers an expert's weights over the expert-parallel group and splits each into
  checkpoint tensors; an FSDP trainer (verl's ``get_per_tensor_param``) gathers each DTensor
  (``full_tensor``). The bytes of those gathers are priced on the links (``Hardware.all_gather_time``).
"""

from __future__ import annotations

from nereus.cost.hardware import Hardware
from nereus.cost.memory import BF16
from nereus.cost.weight_sync import checkpoint_tensors
from nereus.spec.job import JobSpec
from nereus.spec.layout import Layout

# benchmarks/host_call_costs.py, per unit (see the module docstring):
MODULE_WALK_S = 0.93e-6  # one module visited by dict(model.named_parameters())
MAPPING_ENTRY_S = 0.18e-6  # one entry of an expert-name table built per call
# One substring test while scanning that table; sgl-project/sglang PR 19299 measures the same scan at
# 36.9 µs a tensor over ~990 entries (37 ns each) on its own host.
NAME_COMPARE_S = 0.04e-6
OBJECT_COLLECTIVE_S = 0.26e-3  # one all_gather_object (pickle, size and payload exchange, unpickle)
DTENSOR_GATHER_S = 38e-6  # the host part of one DTensor.full_tensor()
EAGER_OP_S = 1.25e-6  # one eager torch op's dispatch
# An engine decoder layer's modules: the layer; attention with its qkv and output projections, rotary
# embedding, attention kernel and q/k norms; the MLP block with gate_up/down and activation, or router and
# fused experts; two norms (vLLM's Qwen2DecoderLayer / Qwen3MoeDecoderLayer).
ENGINE_MODULES_PER_LAYER = 13
ENGINE_MODULES_OUTSIDE_LAYERS = 5  # model, embedding, final norm, LM head, logits processor
# The weight loader's eager ops per tensor: the expert or shard slice, the tensor-parallel narrow of the
# source and of the destination, the copy (vLLM FusedMoE.weight_loader, MergedColumnParallelLinear's).
LOADER_OPS_PER_TENSOR = 4
# Megatron-to-checkpoint conversion per tensor: the split of a fused weight (qkv, fc1) and its rename
# (verl's default_tp_concat_fn and McoreToHFWeightConverter.convert_param).
CONVERT_OPS_PER_TENSOR = 2
# The per-parameter object collectives of both Megatron exporters: the name's all_gather_object and
# broadcast_object_list (``broadcast_str_from_megatron_pp``), the spec's all_gather_object
# (``broadcast_from_megatron_pp``; mbridge/core/util.py and verl's megatron_utils alike).
OBJECT_COLLECTIVES_PER_PARAMETER = 3
# One NCCL collective call's fixed latency, ring, Simple protocol (NVIDIA/nccl src/graph/tuning.cc,
# ``baseLat``): paid by every tensor broadcast and gather a loop issues.
NCCL_CALL_S = 8.4e-6


def expert_tensors(job: JobSpec) -> int:
    """Checkpoint tensors that are routed experts' (gate, up, down of each expert of each sparse layer)."""
    a = job.models["actor"]
    return 0 if a.moe is None else 3 * a.moe.experts * a.sparse_layers()


def engine_call_time(job: JobSpec) -> float:
    """Fixed cost of one ``load_weights`` call: the parameter-dict walk and, for MoE, the expert table."""
    a = job.models["actor"]
    modules = ENGINE_MODULES_PER_LAYER * a.layers + ENGINE_MODULES_OUTSIDE_LAYERS
    table = 0 if a.moe is None else 3 * a.moe.experts * MAPPING_ENTRY_S
    return modules * MODULE_WALK_S + table


def engine_load_time(job: JobSpec, calls: int) -> float:
    """Every checkpoint tensor handed to the engine in ``calls`` calls of its ``load_weights``: the calls'
    fixed costs, the expert-table scans, the loader's ops."""
    a = job.models["actor"]
    scan = 0.0 if a.moe is None else expert_tensors(job) * 1.5 * a.moe.experts * NAME_COMPARE_S
    return calls * engine_call_time(job) + scan + checkpoint_tensors(job) * LOADER_OPS_PER_TENSOR * EAGER_OP_S


def megatron_parameters(job: JobSpec, layout: Layout) -> int:
    """Parameters verl's Megatron exporter walks, over all pipeline stages: per layer the fused qkv weight
    and its norm, the output projection (+ qkv bias, + q/k norms); a dense MLP's fc1, its norm and fc2, or
    a sparse layer's pre-MLP norm, router and each local expert's fc1 and fc2 (grouped GEMM weights, one
    per expert; experts / ep of them) and a shared expert's three; the embedding, final norm, output layer."""
    a = job.models["actor"]
    attention = 3 + (1 if a.qkv_bias else 0) + (2 if a.qk_norm else 0)
    sparse = a.sparse_layers()
    sparse_mlp = 0 if a.moe is None else 2 + 2 * (a.moe.experts // max(1, layout.ep)) + (
        3 if a.moe.shared_expert_ffn_hidden else 0)
    outside = 2 + (0 if a.tied_embeddings else 1)
    return outside + a.layers * attention + (a.layers - sparse) * 3 + sparse * sparse_mlp


def export_gather_time(hw: Hardware, job: JobSpec, layout: Layout) -> float:
    """The bytes the trainer's ranks gather to assemble full tensors: dense weights over tensor and
    pipeline parallelism (and data parallelism under FSDP), experts also over expert parallelism."""
    a = job.models["actor"]
    weights = a.params() * BF16
    experts = 0 if a.moe is None else a.sparse_layers() * a.moe.experts * a.moe.expert_params(a.hidden) * BF16
    shards = layout.tp * layout.pp * (layout.dp if layout.fsdp else 1)
    expert_shards = shards * (1 if layout.fsdp else layout.ep)
    return hw.all_gather_time(weights - experts, shards) + hw.all_gather_time(experts, expert_shards)


def export_time(hw: Hardware, job: JobSpec, layout: Layout) -> float:
    """The trainer's export of every checkpoint tensor: host loop plus gathered bytes. FSDP gathers each
    tensor as a DTensor; Megatron runs its per-parameter object collectives, one expert gather per local
    expert weight, and converts each checkpoint tensor."""
    tensors = checkpoint_tensors(job)
    if layout.fsdp:
        host = tensors * (DTENSOR_GATHER_S + NCCL_CALL_S)
    else:
        params = megatron_parameters(job, layout)
        host = (params * (OBJECT_COLLECTIVES_PER_PARAMETER * OBJECT_COLLECTIVE_S + NCCL_CALL_S)
                + tensors * CONVERT_OPS_PER_TENSOR * EAGER_OP_S)
        a = job.models["actor"]
        if a.moe is not None and layout.ep > 1:  # one gather per local expert's fc1 and fc2
            host += 2 * a.sparse_layers() * (a.moe.experts // layout.ep) * NCCL_CALL_S
    return host + export_gather_time(hw, job, layout)
