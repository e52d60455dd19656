"""The driver's training operations: keys placed on the workers and released, the optimizer step, and a
key's weights and optimizer state read and written (checkpoints) and reported (memory, shapes)."""

from __future__ import annotations

from pathlib import Path

import torch

from nereus.runtime.cluster.calls import TrainStep
from nereus.runtime.cluster.runtime_roles.core import RuntimeCore
from nereus.runtime.model.decoder import ModelConfig
from nereus.runtime.model.memory import MemoryReport
from nereus.runtime.parallel.batch import TrainBatch
from nereus.runtime.parallel.sharded import LossFn, TrainStats
from nereus.runtime.transitions.live import KeySpec
from nereus.spec.layout import Layout


class TrainingOps(RuntimeCore):
    """Places and releases keys (every key, trained or not: ``load`` records it in ``specs``), runs
    ``TrainStep`` through ``submit`` (which marks the model changed since the newest snapshot), and reads
    and writes each worker's state of a key, on the workers of its layout."""

    def load(self, key: str, cfg: ModelConfig, layout: Layout, ranks: list[int] | None = None,
             checkpoint: str | Path | None = None, state: dict | None = None, dtype: str = "float32",
             schedule: str = "1f1b", model: str | None = None, stage: str | None = None) -> None:
        """Place ``cfg``'s model under ``layout`` on workers ``ranks`` (default the first ``layout.world``),
        each reading its boxes from an HF ``checkpoint`` directory or cutting them from whole ``state``.
        ``model``/``stage`` name what the key holds in a plan (default: from a key "model/stage")."""
        ranks = list(range(layout.world)) if ranks is None else list(ranks)
        self._check_nodes(key, layout, ranks)
        ckpt = str(checkpoint) if checkpoint else None
        self._all([w.load.remote(key, cfg, layout, ranks, ckpt, state, dtype, schedule) for w in self.workers],
                  f"load {key}")
        head, _, tail = key.partition("/")
        self.specs[key] = KeySpec(key, model or head, stage or tail or "inference", cfg, layout, tuple(ranks), dtype)

    def release(self, key: str) -> None:
        self._all([w.release.remote(key) for w in self.workers], f"release {key}")
        self.specs.pop(key, None)

    def train_step(self, key: str, batch: TrainBatch, loss_fn: LossFn, lr: float = 1e-3,
                   max_grad_norm: float | None = None, weight_decay: float = 0.0) -> TrainStats:
        """One optimizer step; ``max_grad_norm`` clips the global gradient norm first, ``weight_decay`` is
        AdamW's decoupled decay (``ShardedModel.step``). Returns each replica's losses, loss statistics and
        gradient norm."""
        return TrainStats(tuple(self._on(key, TrainStep(batch, loss_fn, lr, max_grad_norm, weight_decay))))

    def memory(self, key: str) -> list[MemoryReport | None]:
        """The last operation's memory report of every worker of ``key``'s layout, in layout rank order."""
        return self._all([self.workers[r].memory.remote(key) for r in self.specs[key].ranks], "memory")

    def shard_shapes(self, key: str) -> list[dict[str, tuple[int, ...]] | None]:
        return self._all([self.workers[r].shard_shapes.remote(key) for r in self.specs[key].ranks], "shard_shapes")

    # ----- state (checkpoints, tests) ----------------------------------------------------------------
    def read_weights(self, key: str) -> dict[str, torch.Tensor]:
        """``key``'s whole weights by checkpoint name, assembled from its shards."""
        from nereus.runtime.parallel.shard_state import assemble

        return assemble(self._get([self.workers[r].read_shards.remote(key) for r in self.specs[key].ranks]))

    def read_optimizer(self, key: str) -> dict[int, dict[str, torch.Tensor]]:
        """worker rank → its Adam state of ``key`` (``shard_state.read_optimizer``); ranks without one yet
        (no step taken) are left out."""
        states = self._get([self.workers[r].read_optimizer.remote(key) for r in self.specs[key].ranks])
        return {r: st for r, st in zip(self.specs[key].ranks, states, strict=True) if st is not None}

    def write_optimizer(self, key: str, states: dict[int, dict[str, torch.Tensor]], lr: float) -> None:
        """Install what ``read_optimizer`` returned, under the same layout on the same workers; raises
        ``ValueError`` naming what does not match."""
        ranks = self.specs[key].ranks
        if set(states) != set(ranks):
            raise ValueError(f"optimizer state of workers {sorted(states)} for {key!r}, whose layout runs on "
                             f"{sorted(ranks)}: resume under the layout the checkpoint was written with")
        self._get([self.workers[r].write_optimizer.remote(key, states[r], lr) for r in ranks])
