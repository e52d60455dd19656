"""verl's trainer-to-rollout weight sync when the rollout has GPUs of its own (one-step-off and fully-async
recipes), with and without its checkpoint engine (``async_training.checkpoint_engine.enable``), priced from
what the code does per tensor and per byte. ``SYNC_TIMES`` is the registry of every mechanism a plan may
name (``Plan.weight_sync``): Nereus's own direct copy is the default outside it.

Both run over one NCCL group of every trainer and rollout rank (verl/experimental/fully_async_policy,
``param_sync.ParameterSynchronizer``); the timed sync is the whole worker call. Host loops are priced in
``cost.sync_host_costs`` (the trainer's export of full checkpoint tensors, the engine's ``load_weights``);
bytes on the links. A broadcast leaves a node through one NIC (``Hardware.p2p_time``): NCCL runs a
broadcast as a ring whose data enters every node once, and broadcasts over many nodes measure at one NIC's
rate or below (github.com/NVIDIA/nccl/issues/590: 9-15 GB/s over 16 nodes of 8 NICs; verl's checkpoint_engine README:
8.25 GB/s over 4 nodes of 400 Gb/s ConnectX-7). Each broadcast call also pays NCCL's fixed ring latency
plus one hop (NVIDIA/nccl src/graph/tuning.cc: ``baseLat`` 8.4 µs, ``hwLat`` 3.4 µs NVLink, 14 µs network,
Simple protocol).

- ``tensor-broadcast`` (no checkpoint engine; ``base_detach_sync._sync_vllm_weights`` and the Megatron
  worker's ``sync_rollout_weights``): tensor by tensor, the trainer exports the full tensor, its rank 0
  broadcasts it, and every rollout rank calls the engine's ``load_weights`` with that one tensor, so each
  tensor pays a whole call (its parameter-dict walk grows with the model's layers). The trainer's and the
  engine's host loops run side by side, the slower one sets the pace; the bytes do not hide under them:
  the exporter's object collectives copy their result to the host, which waits for the default stream,
  and Ray's NCCL stream is the default stream itself or a blocking stream it waits for, so the loop and
  the link take turns (ray.util.collective ``StreamPool._init_once``, ``NCCLGroup._sync_streams``).
- ``checkpoint-engine`` (``checkpoint_engine.CheckpointEngine``, after MoonshotAI/checkpoint-engine), in
  order: every trainer rank runs the same export and keeps every n-th tensor, copied to host memory
  (device to host over PCIe); packs its share into pinned buckets of ``device_buffer_size_M`` (4,096 MB
  by default; a host memory copy); then per round each trainer rank copies its next bucket to its GPU
  (rank-parallel, over PCIe) and the ranks broadcast their buckets in turn, the rollout ranks loading each
  bucket with one ``load_weights`` call after its broadcast (``overlap_broadcast_and_consume`` is off by
  default). The bytes cross the links once, the engine's calls are per bucket, its per-tensor work stays.

Both broadcast every byte to every rank of the group, so no run of either is faster than the whole model
entering one receiver at its links' peak (``broadcast_floor``, ``SYNC_FLOORS``): a published sync below it
timed something else, and the validation does not compare it. verl's fully-async ablation prints 0.02 s for
Qwen2.5-7B with the checkpoint engine, while each rollout GPU must receive the 15 GB over NVLink (450 GB/s
one way: 34 ms) and each of the four trainer GPUs copies its 3.8 GB share to host memory and back over
PCIe 5.0 (2 x 60 ms).
"""

from __future__ import annotations

import math

from nereus.cost.hardware import Hardware, host_memory_bytes_per_s, pcie_bytes_per_s
from nereus.cost.memory import BF16, trainer_weight_bytes
from nereus.cost.offload import offloads_params, param_round_trip_time
from nereus.cost.sync_host_costs import (
    NCCL_CALL_S,
    engine_load_time,
    export_time,
)
from nereus.cost.weight_sync import (
    checkpoint_tensors,
    gather_broadcast_time,
    zero3_gather_time,
)
from nereus.spec.job import JobSpec
from nereus.spec.layout import Placement

# verl's default checkpoint-engine bucket (fully_async_ppo_trainer.yaml, ``device_buffer_size_M: 4096``).
BUCKET_BYTES = 4096 * 2**20
# NCCL's extra latency per broadcast call beyond ``NCCL_CALL_S``: one ring hop (tuning.cc ``hwLat``,
# Simple protocol; a broadcast over channels that repeat the same ring adds one hop).
NCCL_HOP_NVLINK_S = 3.4e-6
NCCL_HOP_NET_S = 14e-6


def host_copy_bytes_per_s(hw: Hardware, train: Placement) -> float:
    """One trainer rank's share of its node's host memory bandwidth (``cost.hardware``) while all of the
    node's ranks copy: a copy reads and writes each byte, so each copies at half the bandwidth over its
    node's trainer ranks."""
    per_node: dict[int, int] = {}
    for g in train.gpus:
        per_node[hw.cluster.node_of(g)] = per_node.get(hw.cluster.node_of(g), 0) + 1
    return host_memory_bytes_per_s(hw) / 2 / max(per_node.values())


def _crosses_nodes(hw: Hardware, train: Placement, gen: Placement) -> bool:
    nodes = {hw.cluster.node_of(g) for g in (*train.gpus, *gen.gpus)}
    return len(nodes) > 1


def broadcast_time(hw: Hardware, job: JobSpec, train: Placement, gen: Placement, calls: int) -> float:
    """The whole model broadcast over the sync group in ``calls`` NCCL calls: bytes through one NIC (or
    NVLink inside a node), each call NCCL's fixed latency and one hop."""
    cross = _crosses_nodes(hw, train, gen)
    hop = NCCL_HOP_NET_S if cross else NCCL_HOP_NVLINK_S
    return hw.p2p_time(job.models["actor"].params() * BF16, cross) + calls * (NCCL_CALL_S + hop)


def tensor_broadcast_time(hw: Hardware, job: JobSpec, train: Placement, gen: Placement) -> float:
    """verl without the checkpoint engine: export, broadcast and load tensor by tensor, a load call each."""
    tensors = checkpoint_tensors(job)
    loops = max(export_time(hw, job, train.layout), engine_load_time(job, calls=tensors))
    return loops + broadcast_time(hw, job, train, gen, calls=tensors)


def checkpoint_engine_time(hw: Hardware, job: JobSpec, train: Placement, gen: Placement) -> float:
    """verl's checkpoint engine: export, host copies of each rank's share, bucket rounds over PCIe, the
    buckets broadcast in turn and loaded a bucket a call."""
    weights = job.models["actor"].params() * BF16
    senders = len(train.gpus)
    share = weights / senders
    rounds = math.ceil(share / BUCKET_BYTES)
    host = share / pcie_bytes_per_s(hw) + share / host_copy_bytes_per_s(hw, train)  # to host, then packed
    to_device = rounds * min(share, BUCKET_BYTES) / pcie_bytes_per_s(hw)
    buckets = senders * rounds
    return (export_time(hw, job, train.layout) + host + to_device
            + broadcast_time(hw, job, train, gen, calls=buckets) + engine_load_time(job, calls=buckets))


# verl's colocated refit bucket (rollout.update_weights_bucket_megabytes, 2048 by default:
# verl/workers/config/rollout.py).
COLOCATED_BUCKET_BYTES = 2048 * 2**20


def hybrid_reshard_time(hw: Hardware, job: JobSpec, train: Placement, gen: Placement) -> float:
    """verl's hybrid engine, the rollout on the trainer's GPUs (``hybrid-reshard``): the trainer exports every
    checkpoint tensor (``export_time``: its host loop and the gathers that assemble full tensors), each rank
    copies them into a CUDA-IPC bucket that its co-located engine rank clones and loads with one
    ``load_weights`` call a bucket, the loader copying the rank's TP shard in place (verl/workers/rollout/
    vllm_rollout: ``vLLMAsyncRollout.update_weights`` and ``update_weights_from_ipc``; before its buckets, one
    call over a generator of the same tensors, fsdp_vllm.py's ``update_params``). The trainer waits for each
    bucket's load before it fills the next, so export, loads and copies add up. The host loops are what a
    Mixture-of-Experts checkpoint's tens of thousands of tensors pay, as on separate GPUs. A trainer whose
    weights live on the host loads them for the export and puts them back after (verl's ``rollout_mode``),
    as its framework moves them (``cost.offload``)."""
    weights = job.models["actor"].params() * BF16
    buckets = max(1, math.ceil(weights / COLOCATED_BUCKET_BYTES))
    copies = hw.hbm_time(2 * weights) + hw.hbm_time(2 * weights / gen.layout.tp)  # bucket fill and clone; shard
    held = 0.0
    if offloads_params(job.options.offload):
        own = trainer_weight_bytes(job.models["actor"], train.layout, job.options.weight_bytes)
        held = param_round_trip_time(hw, own, offloads_params(job.options.pageable_offload))
    return export_time(hw, job, train.layout) + engine_load_time(job, calls=buckets) + copies + held


# NeMo RL's refit bucket (nemo_rl/utils/packed_tensor.py, v0.6.0: ``NRL_REFIT_BUFFER_MEMORY_RATIO`` 0.02 of the
# GPU's memory, at most 5 GiB; two buffers on their own streams).
PACKED_BUCKET_FRACTION = 0.02
PACKED_BUCKET_MAX_BYTES = 5 * 2**30


def packed_broadcast_time(hw: Hardware, job: JobSpec, train: Placement, gen: Placement) -> float:
    """NeMo RL's refit of a rollout on GPUs of its own (``packed_broadcast_producer`` / ``_consumer``): the
    trainer's export packs tensors into GPU buckets, each bucket is one NCCL broadcast, and each rollout
    rank unpacks it and loads it with one ``load_weights`` call. Two buffers on their own streams overlap
    the three, so the slowest sets the pace, plus one bucket's broadcast and load to fill the pipeline. The
    export is priced as verl's exporter of the same backend (``export_time``: an assumption, NeMo RL's
    Megatron bridge walks the same parameters)."""
    weights = job.models["actor"].params() * BF16
    bucket = min(PACKED_BUCKET_FRACTION * hw.cluster.gpu.memory_bytes, PACKED_BUCKET_MAX_BYTES)
    buckets = max(1, math.ceil(weights / bucket))
    link = broadcast_time(hw, job, train, gen, calls=buckets)
    load = engine_load_time(job, calls=buckets)
    return max(export_time(hw, job, train.layout), link, load) + (link + load) / buckets


def broadcast_floor(hw: Hardware, job: JobSpec, train: Placement, gen: Placement) -> float:
    """The least time a broadcast of the whole model over the sync group can take: every byte enters every
    receiver, at best through all of its links at once (NVLink and its NIC) at their datasheet peaks, with
    nothing else to do. A bound, not an estimate: no placement or protocol is assumed."""
    gpu = hw.cluster.gpu
    return job.models["actor"].params() * BF16 / (gpu.intra_node_bytes_per_s + gpu.inter_node_bytes_per_s)


SYNC_TIMES = {"hybrid-reshard": hybrid_reshard_time, "gather-broadcast": gather_broadcast_time,
              "tensor-broadcast": tensor_broadcast_time, "checkpoint-engine": checkpoint_engine_time,
              "packed-broadcast": packed_broadcast_time, "zero3-gather": zero3_gather_time}
# The mechanisms whose every run takes at least a floor (seconds), by the bytes they move into each receiver.
SYNC_FLOORS = {"tensor-broadcast": broadcast_floor, "checkpoint-engine": broadcast_floor,
               "packed-broadcast": broadcast_floor}
