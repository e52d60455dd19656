"""Achieved-efficiency priors and the time of basic operations on one cluster (compute, HBM, links).

The same priors apply to every model and layout (they are properties of the hardware and libraries, not
of a job); calibration (``nereus.cost.calibration``) corrects them per term from measured step times.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from nereus.spec.cluster import GB, ClusterSpec

GIB = 1024**3
# Host-to-device copy rate from pinned memory, one direction of a PCIe x16 link: 5.0 (32 GT/s a lane,
# 128b/130b: 63 GB/s) on Hopper and Blackwell boards, 4.0 (31.5 GB/s) on A100/A800 (PCI-SIG base
# specifications; NVIDIA A100 and H100 datasheets, "PCIe Gen4" / "PCIe Gen5").
PCIE_BYTES_PER_S = 63e9
PCIE_GEN4_GPUS = ("A100", "A800")
# A GPU node's host memory bandwidth, two sockets, by the board's host generation (the peak: host copies and
# CPU-Adam stream their arrays, as a STREAM-like kernel does). PCIe 4.0 boards: 2 x 8 channels of DDR4-3200,
# 25.6 GB/s each (NVIDIA DGX A100 datasheet: 2 x AMD EPYC 7742, 8 DDR4-3200 channels a socket); PCIe 5.0
# boards: 2 x 8 channels of DDR5-4800, 38.4 GB/s each (NVIDIA DGX H100 datasheet: 2 x Intel Xeon Platinum
# 8480C, 8 DDR5-4800 channels a socket).
HOST_MEMORY_DDR4_BYTES_PER_S = 2 * 8 * 25.6e9
HOST_MEMORY_DDR5_BYTES_PER_S = 2 * 8 * 38.4e9


@dataclass(frozen=True)
class Priors:
    # Dense bf16 GEMMs of transformer shapes reach 70–80% of datasheet peak with cuBLAS on A100/H100
    # (NVIDIA "Matrix Multiplication Background" user guide; Narayanan et al. 2021 report 52% of peak for
    # the whole model at scale, GEMMs included with everything else).
    gemm_efficiency: float = 0.75
    # Streaming kernels (norms, activations, dropout, softmax, residual adds, decode weight/KV reads)
    # achieve ~80% of HBM peak (STREAM-like triad measurements on A100/H100).
    hbm_efficiency: float = 0.8
    # NCCL bus bandwidth reaches ~75-85% of the link rate for large messages (nccl-tests on DGX A100/H100).
    intra_link_efficiency: float = 0.8
    inter_link_efficiency: float = 0.8
    # Latency per ring step of a collective (alpha of the alpha-beta model), seconds.
    intra_latency_s: float = 1e-6
    inter_latency_s: float = 5e-6
    # Fixed cost of a plan-to-plan transition besides the bytes it moves (driver round trips, regrouping
    # process groups, rebuilding engines), once per transition and per model-stage moved. No published
    # figure covers a whole transition; 0 until measured: ``TransitionCalibrator`` fits both to the job's
    # measured transitions (CPU profiles set them under ``priors:``).
    transition_fixed_s: float = 0.0
    transition_per_stage_s: float = 0.0
    # Start of a rollout engine that is a program of its own (vLLM), once per move that starts engines
    # of a generation stage (``cost.transition.engines_rebuilt``). A vLLM user's log of a small
    # model, compile cache already warm: "init engine (profile, create kv cache, warmup model) took 34.11
    # seconds" (vllm-project/vllm issue 20264); larger models and TP 8 take minutes (issue 19824). CPU
    # profiles measure theirs; ``TransitionCalibrator`` refits it from the job's measured rebuilds.
    engine_start_s: float = 34.0
    # Fixed cost of one decode iteration of an inference engine: scheduling, sampling, launch (vLLM-like).
    decode_step_overhead_s: float = 1e-3
    # Fixed cost of one micro-batch pass of one pipeline stage (Python dispatch, kernel launches): hidden by
    # asynchronous launches on GPUs (0 by default), a few ms on CPU workers, where small micro-batches
    # cost more than their FLOPs (``nereus profile`` jobs set it under ``priors:``).
    micro_batch_overhead_s: float = 0.0
    # CPU cores the workers share (the CPU runtime's local workers); 0: every device is its own (GPUs).
    host_cores: float = 0.0
    # Device memory no model can use: CUDA context, NCCL buffers, allocator fragmentation.
    reserved_bytes: float = 2 * GIB  # capped at 10% of a small device (see Hardware.usable_bytes)
    # Fraction of free device memory an inference engine gives to its KV cache (vLLM's default 0.9).
    kv_memory_fraction: float = 0.9


@dataclass(frozen=True)
class Hardware:
    """A cluster plus priors; every method returns seconds.

    Without explicit ``priors`` the defaults apply, overridden by the cluster spec's ``priors:`` (for
    instance a measured ``nereus profile``, whose figures are achieved rates: efficiencies 1.0).
    """

    cluster: ClusterSpec
    priors: Priors = field(default=None)  # type: ignore[assignment]  # None -> Priors() + cluster's overrides

    def __post_init__(self) -> None:
        if self.priors is None:
            object.__setattr__(self, "priors", replace(Priors(), **dict(self.cluster.priors)))

    @property
    def capacity_bytes(self) -> float:
        return self.cluster.gpu.memory_bytes

    def usable_bytes(self) -> float:
        capacity = self.cluster.gpu.memory_bytes
        return capacity - min(self.priors.reserved_bytes, 0.1 * capacity)

    def compute_time(self, flops: float) -> float:
        return flops / (self.cluster.gpu.peak_flops * self.priors.gemm_efficiency)

    def hbm_time(self, nbytes: float) -> float:
        return nbytes / (self.cluster.gpu.hbm_bytes_per_s * self.priors.hbm_efficiency)

    def group_bandwidth(self, size: int, stride: int) -> float:
        """Bus bandwidth (bytes/s) of a group of ``size`` ranks ``stride`` GPUs apart.

        Inside one node the group uses NVLink. Across nodes NCCL runs one ring per NIC, so a node's
        members of the group together drive ``members_per_node`` NICs: bus bandwidth is that many
        times one NIC's rate, capped by NVLink (NCCL's ring/tree algorithms; nccl-tests' busbw).
        """
        p = self.priors
        intra = self.cluster.gpu.intra_node_bytes_per_s * p.intra_link_efficiency
        if size * stride <= self.cluster.gpus_per_node:
            return intra
        inter = self.cluster.gpu.inter_node_bytes_per_s * p.inter_link_efficiency * self._members_per_node(stride)
        return min(intra, inter)

    def _members_per_node(self, stride: int) -> int:
        """Members of a group ``stride`` GPUs apart that one node holds, when the group spans nodes."""
        gpn = self.cluster.gpus_per_node
        return max(1, gpn // stride) if stride < gpn else 1

    def nodes_spanned(self, size: int, stride: int) -> int:
        """Nodes a group of ``size`` ranks ``stride`` GPUs apart lies on."""
        if size * stride <= self.cluster.gpus_per_node:
            return 1
        return -(-size // self._members_per_node(stride))

    def ring_latency(self, steps: int, crossings: int) -> float:
        """Latency of a ring collective of ``steps`` steps of which ``crossings`` cross a node boundary:
        those pay the network's latency, the others NVLink's (NCCL's own latency model, NVIDIA/nccl
        src/graph/tuning.cc: ``(nsteps-nInterSteps)*intraLat + nInterSteps*interLat``)."""
        p = self.priors
        return (steps - crossings) * p.intra_latency_s + crossings * p.inter_latency_s

    def all_reduce_time(self, nbytes: float, size: int, stride: int = 1) -> float:
        """Ring all-reduce: 2(n−1)/n · bytes over the bus bandwidth, plus 2(n−1) latency steps
        (Thakur, Rabenseifner & Gropp 2005, "Optimization of Collective Communication Operations in MPICH"),
        2(k−1) of them between the k nodes the ring spans (NCCL's ``nInterSteps`` of an all-reduce)."""
        if size <= 1:
            return 0.0
        crossings = 2 * (self.nodes_spanned(size, stride) - 1)
        return (2 * (size - 1) / size * nbytes / self.group_bandwidth(size, stride)
                + self.ring_latency(2 * (size - 1), crossings))

    def all_gather_time(self, nbytes: float, size: int, stride: int = 1) -> float:
        """Ring all-gather (or reduce-scatter) of a ``nbytes`` total: (n−1)/n · bytes, n−1 latency steps,
        k−1 of them between the k nodes the ring spans."""
        if size <= 1:
            return 0.0
        crossings = self.nodes_spanned(size, stride) - 1
        return ((size - 1) / size * nbytes / self.group_bandwidth(size, stride)
                + self.ring_latency(size - 1, crossings))

    def p2p_time(self, nbytes: float, cross_node: bool) -> float:
        gpu, p = self.cluster.gpu, self.priors
        if cross_node:
            return nbytes / (gpu.inter_node_bytes_per_s * p.inter_link_efficiency) + p.inter_latency_s
        return nbytes / (gpu.intra_node_bytes_per_s * p.intra_link_efficiency) + p.intra_latency_s

    def with_priors(self, **changes: float) -> Hardware:
        return replace(self, priors=replace(self.priors, **changes))


def device_memory_bytes(hw: Hardware) -> float:
    """The GPU's memory as its driver reports it, of which an engine takes a share. A datasheet's memory
    figure ("80GB" for an H100, ``hardware.csv``'s ``hbm_gb``) counts binary gigabytes: HBM stacks come in
    GiB, and ``torch.cuda.mem_get_info`` reports 79.1-79.6 GiB on an H100 80GB. The rest of the memory model
    reads the figure as decimal gigabytes, 7% less, a margin it keeps."""
    return hw.cluster.gpu.memory_bytes * GIB / GB


def kv_cache_budget(hw: Hardware, weights: float, others: float, utilization: float = 0.0) -> float:
    """Bytes of KV cache on one rank of a rollout replica holding ``weights`` beside ``others`` (memory of
    colocated models it cannot use). Without an engine setting, the ``kv_memory_fraction`` prior of what is
    free. With one, as vLLM sizes it (``gpu_memory_utilization``: vllm/v1/worker/gpu_worker.py,
    ``determine_available_memory``): that share of the device's memory less everything else the engine
    holds, its weights and its profiled activations and non-torch memory (``reserved_bytes``); never more
    than is free beside the others."""
    free = (hw.usable_bytes() - weights - others) * hw.priors.kv_memory_fraction
    if not utilization:
        return free
    return min(free, utilization * device_memory_bytes(hw) - weights - hw.priors.reserved_bytes)


def _pcie_gen4(hw: Hardware) -> bool:
    return any(hw.cluster.gpu.name.startswith(name) for name in PCIE_GEN4_GPUS)


def pcie_bytes_per_s(hw: Hardware) -> float:
    """One GPU's PCIe link to its host, one direction."""
    return PCIE_BYTES_PER_S / 2 if _pcie_gen4(hw) else PCIE_BYTES_PER_S


def host_memory_bytes_per_s(hw: Hardware) -> float:
    """One node's host memory bandwidth (all its sockets), by the host generation its PCIe link implies."""
    return HOST_MEMORY_DDR4_BYTES_PER_S if _pcie_gen4(hw) else HOST_MEMORY_DDR5_BYTES_PER_S
