"""Per-device memory accounting of the runtime, and the cost model's prediction for the same layout.

How we measure (the same on CPU and GPU, no allocator statistics needed):
- parameters, gradients, optimizer state, KV cache: bytes of the tensors the rank holds (exact);
- activations of a training step: bytes of tensors autograd saves for backward, counted once per
  storage while alive (``saved_tensors_hooks``; a saved tensor dies when its micro-batch's backward
  frees the graph), peak over the whole pipeline schedule, so micro-batches in flight add up. Weights
  saved by linear layers are not activations and are excluded. This is Korthikanti et al.'s definition.
Transient buffers (gradients flowing backward, matmul workspaces, allocator fragmentation) are not counted,
as the cost model does not count them either.

The prediction is ``nereus.cost.stages.training_cost`` / ``generation_cost`` for a job with the same
model, layout, batch and sequence length. The cost model assumes bf16 weights and 16-bit activations;
the runtime computes in ``dtype_bytes`` (fp32 on CPU), so those two terms are rescaled by dtype_bytes/2.
Gradients (``grad_bytes``=4) and Adam (fp32 master + two moments, 12 bytes/parameter) already match.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Protocol

import torch

from nereus.cost.hardware import Hardware
from nereus.cost.stages import generation_cost, training_cost
from nereus.spec import job_from_dict
from nereus.spec.job import JobSpec
from nereus.spec.layout import Layout, ModelStage
from nereus.spec.model import ModelArch


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of distinct storages among ``tensors``."""
    seen: dict[int, int] = {}
    for t in tensors:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


@dataclass(frozen=True)
class MemoryReport:
    """Bytes one rank holds during an operation, by kind."""

    op: str
    parameters: int
    gradients: int = 0
    optimizer: int = 0
    activations: int = 0
    kv_cache: int = 0

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.activations + self.kv_cache

    def to_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


class SavedWeights(Protocol):
    """Weights that a saved tensor may be a view of and that can be rebuilt in backward instead of kept
    (``parallel.zero3.Zero3``): ``pack`` gives a reference for such a tensor (None for any other)."""

    def pack(self, t: torch.Tensor) -> object | None: ...

    def unpack(self, ref: object) -> torch.Tensor: ...


class _Saved:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class ActivationMeter:
    """Peak bytes of tensors saved for backward while ``track`` is active (see the module docstring)."""

    def __init__(self, weights: SavedWeights | None = None) -> None:
        self.weights = weights  # gathered ZeRO-3 weights are saved as references, neither kept nor counted
        self.peak = 0
        self._current = 0
        self._live: dict[int, list[int]] = {}  # storage pointer -> [bytes, references]
        self._exclude: set[int] = set()

    @contextmanager
    def track(self, exclude: Iterable[torch.Tensor] = ()) -> Iterator[ActivationMeter]:
        self.peak = self._current = 0
        self._live.clear()
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield self

    def _pack(self, t: torch.Tensor) -> object:
        ref = self.weights.pack(t) if self.weights is not None else None
        if ref is not None:
            return ref
        if isinstance(t, torch.nn.Parameter) or t.untyped_storage().data_ptr() in self._exclude:
            return t
        key = t.untyped_storage().data_ptr()
        entry = self._live.setdefault(key, [t.untyped_storage().nbytes(), 0])
        if entry[1] == 0:
            self._current += entry[0]
            self.peak = max(self.peak, self._current)
        entry[1] += 1
        holder = _Saved(t)
        weakref.finalize(holder, self._release, key)
        return holder

    def _release(self, key: int) -> None:
        entry = self._live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self._current -= entry[0]
            del self._live[key]

    def _unpack(self, packed: object) -> torch.Tensor:
        if isinstance(packed, _Saved):
            return packed.tensor
        return packed if isinstance(packed, torch.Tensor) else self.weights.unpack(packed)


def _job(arch: ModelArch, value_head: bool, layout: Layout, training: dict, **workload) -> tuple[str, JobSpec]:
    role = "critic" if value_head else "actor"
    models = {m: arch.to_dict() for m in ("actor", "critic")}
    opts = {"recompute": layout.recompute, "sequence_parallel": layout.sequence_parallel, "zero1": layout.zero1,
            "attention": "flash", "grad_bytes": 4}
    return role, job_from_dict({
        "name": "runtime-memory", "models": models, **training, "workload": workload,
        "cluster": {"gpu": {"name": "cpu-local", "peak_tflops": 1, "hbm_tb_per_s": 1, "memory_gb": 1000,
                            "intra_node_gb_per_s": 1, "inter_node_gb_per_s": 1},
                    "nodes": 1, "gpus_per_node": max(layout.world, 1)},
        "options": opts,
    })


def predict_training(arch: ModelArch, layout: Layout, batch: int, seq: int, value_head: bool = False,
                     dtype_bytes: int = 4) -> dict[str, float]:
    """The cost model's per-device memory of one training step of ``batch`` sequences of ``seq`` tokens
    (fullest device), by kind, rescaled to ``dtype_bytes`` weights and activations."""
    role, job = _job(arch, value_head, layout, {"algorithm": {"name": "train", "models": ["critic" if value_head
                                                                                         else "actor"]}},
                     global_batch=batch, sequence_length=seq)
    cost = training_cost(Hardware(job.cluster), job, ModelStage(role, "training"), layout)
    if cost is None:
        raise ValueError(f"the cost model cannot split a batch of {batch} under {layout.short()}")
    m = dict(cost.memory)
    scale = dtype_bytes / 2
    return {"parameters": m["weights"] * scale, "gradients": m["gradients"], "optimizer": m["optimizer"],
            "activations": m["activations"] * scale + m["logits"]}


def predict_generation(arch: ModelArch, layout: Layout, batch: int, prompt: int, new_tokens: int,
                       dtype_bytes: int = 4) -> dict[str, float]:
    """The cost model's per-device weights and KV cache for generating ``new_tokens`` after ``prompt``
    tokens for ``batch`` sequences (every response at full length), rescaled to ``dtype_bytes``."""
    role, job = _job(arch, False, layout, {"algorithm": {"name": "ppo", "samples_per_prompt": 1}},
                     prompts_per_step=batch, prompt_length=prompt,
                     response_length={"mean": new_tokens, "max": new_tokens})
    cost = generation_cost(Hardware(job.cluster), job, ModelStage("actor", "generation"), layout)
    scale = dtype_bytes / 2
    return {"parameters": cost.memory["weights"] * scale, "kv_cache": cost.memory["kv_cache"] * scale}
