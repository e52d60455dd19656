"""The ``Worker``'s training role: a key's shard placed under a layout and dropped again, the optimizer
step, and the shard's state read and written (checkpoints) and reported (memory, shapes)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from nereus.runtime.cluster.calls import ReplicaOutput
from nereus.runtime.cluster.worker_roles.core import WorkerCore
from nereus.runtime.model.decoder import ModelConfig
from nereus.runtime.parallel.batch import TrainBatch
from nereus.runtime.parallel.sharded import LossFn, ReplicaStats, ShardedModel
from nereus.spec.layout import Layout

if TYPE_CHECKING:
    from nereus.runtime.model.memory import MemoryReport
    from nereus.runtime.parallel.shard_state import Shards


class TrainingRole(WorkerCore):
    """Places a key's shard (``load``: its groups into ``groups``, its shard into ``models``; every key,
    trained or not, is loaded here) and drops it (``release``, which also closes the key's rollout engine:
    the generation role's ``close_engines``); the optimizer step, with the fault
    point ``train_step`` from ``faults``; the shard's weights and Adam state read and written."""

    def load(self, key: str, cfg: ModelConfig, layout: Layout, ranks: list[int], checkpoint: str | None,
             state: dict | None, dtype: str, schedule: str) -> bool:
        from nereus.runtime.comm.groups import ParallelGroups
        from nereus.runtime.model.dtypes import torch_dtype
        from nereus.runtime.model.hf import load_boxes, slice_boxes
        from nereus.runtime.parallel.sharded import ShardedModel, shard_boxes, tied_head

        groups = ParallelGroups(layout, ranks, tied_embeddings=tied_head(cfg))
        self.groups[key] = groups
        if not groups.member:
            return False
        boxes = shard_boxes(cfg, groups)
        tensors = load_boxes(checkpoint, boxes) if checkpoint else slice_boxes(state, boxes)
        self.models[key] = ShardedModel(cfg, groups, tensors, torch_dtype(dtype), schedule)
        return True

    def release(self, key: str) -> None:
        self.models.pop(key, None)
        self.close_engines([key])
        groups = self.groups.pop(key, None)
        if groups is not None:
            groups.destroy()

    def train_step(self, key: str, batch: TrainBatch, loss_fn: LossFn, lr: float, max_grad_norm: float | None,
                   weight_decay: float = 0.0) -> ReplicaOutput[ReplicaStats] | None:
        """One optimizer step; the fault point ``backward`` lies inside the backward pass, ``train_step``
        between the backward pass and Adam."""

        def run(sm: ShardedModel) -> ReplicaOutput[ReplicaStats] | None:
            metrics: list[object] = []
            armed = self._backward_fault(sm)
            try:
                losses = sm.backward(batch, loss_fn, metrics)
            finally:
                if armed is not None:
                    armed.remove()
            self.faults.at("train_step")
            norm = sm.step(lr, max_grad_norm, weight_decay)
            return self._output(sm, ReplicaStats(tuple(losses), tuple(metrics), norm))

        return self._on(key, run)

    def _backward_fault(self, sm: ShardedModel) -> torch.utils.hooks.RemovableHandle | None:
        """Where a fault waits at ``backward``: a gradient hook on the shard's last parameter, which autograd
        reaches first, so the fault lands while the backward pass runs (before any gradient all-reduce)."""
        if not self.faults.armed_at("backward"):
            return None
        last = list(sm.model.parameters())[-1]
        return last.register_hook(lambda grad: self.faults.at("backward"))

    def memory(self, key: str) -> MemoryReport | None:
        sm = self.models.get(key)
        return sm.last_report if sm is not None else None

    def shard_shapes(self, key: str) -> dict[str, tuple[int, ...]] | None:
        sm = self.models.get(key)
        return None if sm is None else {name: tuple(p.shape) for name, p in sm.shards().items()}

    def read_shards(self, key: str) -> Shards | None:
        """name → (global box, tensor) of DP replica 0's shard (``shard_state.read_shards``)."""
        from nereus.runtime.parallel.shard_state import read_shards

        return self._on(key, read_shards)

    def read_optimizer(self, key: str) -> dict[str, torch.Tensor] | None:
        from nereus.runtime.parallel.shard_state import read_optimizer

        return self._on(key, read_optimizer)

    def write_optimizer(self, key: str, state: dict[str, torch.Tensor], lr: float) -> bool:
        from nereus.runtime.parallel.shard_state import write_optimizer

        self._on(key, write_optimizer, state, lr)
        return key in self.models
