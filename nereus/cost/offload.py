"""Training state kept in host memory (``Options.offload``: the e2e schema's ``offload`` column, verl's
``param_offload`` / ``optimizer_offload``, DeepSpeed's ``offload_optimizer``), priced from the links and the
host's memory.

- ``optimizer``: the fp32 master weights and Adam moments live on the host, and the update runs there
  (ZeRO-Offload, Ren et al. 2021, USENIX ATC, Sec. 4: gradients to the CPU, CPU-Adam, bf16 weights back; verl's
  Megatron ``optimizer_cpu_offload`` the same). Per update each rank sends its gradient shard down and takes
  its weight shard back over PCIe (2 bytes a parameter each way), and the host's Adam streams every
  parameter's fp32 weight, gradient and two moments in and the weight and moments out (28 bytes a parameter,
  memory-bound: DeepSpeed's CPU-Adam is vectorised), for all the ranks of a node through one host's memory.
- ``optimizer-swap``: the optimizer state lives on the host between steps but the update runs on the GPU:
  it is loaded before the update and put back after, once a step (verl's FSDP workers,
  ``load_fsdp_optimizer`` / ``offload_fsdp_optimizer`` around ``update_actor``; docs/cost-model.md).
- ``param``: the model's weights (and gradients) leave the GPU between its stages (verl's
  ``offload_fsdp_model_to_cpu`` / ``offload_megatron_model_to_cpu`` around the rollout): they are held only
  while the stage runs, and each stage loads them over PCIe and a training stage puts them back.

Neither is resident on the GPU beside the rollout's KV cache, which is what lets a colocated run of a model
whose training state exceeds a GPU generate at all.

How the state moves is a second choice (``Options.pageable_offload``, the same four kinds): between pinned
host buffers at the link's rate, or out into newly allocated pageable memory, which one host thread faults in
as it copies, at that thread's rate (``NEW_PAGE_COPY_S_PER_BYTE``), and back from pageable memory through the
driver's staging copy (``PAGEABLE_COPY_S_PER_BYTE``). Frameworks that do the second each time:

- NeMo RL's Megatron worker, the optimizer (nemo_rl/models/policy/workers/megatron_policy_worker.py, v0.6.0,
  ``move_optimizer``: ``state[k] = v.to("cpu")`` before the refit, ``v.to("cuda")`` before training); its
  model's buffers go through Megatron-Core's own pinned copy (``_ParamAndGradBuffer.offload_to_cpu``);
- verl's Megatron workers, a trained model's weights (verl/utils/megatron_utils.py,
  ``offload_megatron_model_to_cpu``: ``buffer.param_data.data.cpu().pin_memory()`` at every offload of a
  DDP-wrapped module, the actor's and the critic's; the reference, not DDP-wrapped, moves with
  ``to("cpu", non_blocking=True)``, which PyTorch lands in pinned memory) and verl's FSDP2 workers
  (verl/utils/fsdp_utils.py, ``offload_fsdp2_model_to_cpu``: ``model.cpu()``).
"""

from __future__ import annotations

from nereus.cost.hardware import Hardware, host_memory_bytes_per_s, pcie_bytes_per_s

OFFLOADS = ("none", "param", "optimizer", "param+optimizer", "optimizer-swap", "param+optimizer-swap")
PAGEABLE_KINDS = ("none", "param", "optimizer", "param+optimizer")  # ``Options.pageable_offload``
# One host thread copying into never-touched pageable memory (the pages faulted in as it writes) and between
# pageable buffers already touched, per byte: ``python benchmarks/host_call_costs.py`` on an AMD EPYC core
# (torch 2.13, one thread, 256 MiB copies, fastest of 7): 2.1 GB/s and 11-13 GB/s. A GPU's copy to or
# from pageable memory goes through the driver's pinned staging buffers and one host copy, so it runs at
# the slower of that copy and the link.
NEW_PAGE_COPY_S_PER_BYTE = 0.47e-9
PAGEABLE_COPY_S_PER_BYTE = 0.085e-9
CPU_ADAM_BYTES_PER_PARAM = 28  # read fp32 weight, gradient, two moments; write weight and moments
PCIE_BYTES_PER_PARAM = 2 + 2  # bf16 gradient down, bf16 weight back


def offloads_optimizer(offload: str) -> bool:
    return "optimizer" in offload


def updates_on_host(offload: str) -> bool:
    """The optimizer steps on the host (ZeRO-Offload's CPU-Adam), not swapped in for a GPU update."""
    return offloads_optimizer(offload) and not offload.endswith("-swap")


def _out_to_new_pages_s(hw: Hardware, nbytes: float) -> float:
    """``nbytes`` from the GPU into newly allocated pageable host memory: the host thread's copy that faults
    the pages in, or the link where that is slower."""
    return nbytes * max(NEW_PAGE_COPY_S_PER_BYTE, 1 / pcie_bytes_per_s(hw))


def optimizer_swap_time(hw: Hardware, nbytes: float, pageable: bool) -> float:
    """The optimizer state's ``nbytes`` out to the host and back, once a step: over the link between pinned
    buffers, or out into new pageable pages and back from them (``pageable``)."""
    if not pageable:
        return 2 * param_load_time(hw, nbytes)
    return _out_to_new_pages_s(hw, nbytes) + nbytes * max(PAGEABLE_COPY_S_PER_BYTE, 1 / pcie_bytes_per_s(hw))


def param_put_back_time(hw: Hardware, nbytes: float, pageable: bool) -> float:
    """A stage's weights back to the host after it: over the link into pinned memory, or (``pageable``) into
    new pageable pages, then copied into a pinned buffer for the next load (verl's ``.cpu().pin_memory()``)."""
    if not pageable:
        return param_load_time(hw, nbytes)
    return _out_to_new_pages_s(hw, nbytes) + nbytes * PAGEABLE_COPY_S_PER_BYTE


def param_round_trip_time(hw: Hardware, nbytes: float, pageable: bool) -> float:
    """A stage's weights loaded for it and put back after (``param_put_back_time``)."""
    return param_load_time(hw, nbytes) + param_put_back_time(hw, nbytes, pageable)


def offloads_params(offload: str) -> bool:
    return "param" in offload


def host_update_time(hw: Hardware, params_per_rank: float, ranks: int) -> float:
    """One optimizer update on the host: each rank's PCIe transfers (ranks in parallel, a link each), then
    CPU-Adam over the parameters of a node's ranks through its host memory."""
    per_node = min(ranks, hw.cluster.gpus_per_node)
    transfer = params_per_rank * PCIE_BYTES_PER_PARAM / pcie_bytes_per_s(hw)
    return transfer + per_node * params_per_rank * CPU_ADAM_BYTES_PER_PARAM / host_memory_bytes_per_s(hw)


def param_load_time(hw: Hardware, nbytes: float) -> float:
    """A stage's weights (or gradients) over PCIe, each rank on its own link."""
    return nbytes / pcie_bytes_per_s(hw)
