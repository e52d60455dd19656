"""Ray actors, one per device, joined into one torch.distributed world; models load onto them under a
layout, several layouts coexisting (each under its own key, with its own process groups).

``Runtime`` starts a local Ray instance by default (loopback only, no dashboard) or joins the cluster at
``address``. Workers use gloo on CPU and NCCL with one GPU each when CUDA is present. Every call that
creates groups goes to all workers, because torch.distributed creates each group collectively.
"""

from __future__ import annotations

import os
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

import ray
import torch

from nereus.runtime.model import ModelConfig
from nereus.spec.layout import Layout


@ray.remote
class Worker:
    """One device: holds the shards of every loaded model-stage, keyed by name."""

    def __init__(self, rank: int, world: int) -> None:
        torch.set_num_threads(1)
        self.rank, self.world = rank, world
        self.models: dict[str, object] = {}
        self.groups: dict[str, object] = {}

    def address(self) -> tuple[str, int]:
        from nereus.runtime.launch import free_port

        return ray.util.get_node_ip_address(), free_port()

    def init_dist(self, master: str, port: int, timeout_s: float) -> str:
        import torch.distributed as dist

        from nereus.runtime.groups import default_backend, local_device

        os.environ.update(MASTER_ADDR=master, MASTER_PORT=str(port), LOCAL_RANK="0")
        backend = default_backend()
        if backend == "nccl":
            torch.cuda.set_device(local_device())
        dist.init_process_group(backend, rank=self.rank, world_size=self.world,
                                timeout=timedelta(seconds=timeout_s))
        return backend

    def load(self, key: str, cfg: ModelConfig, layout: Layout, ranks: list[int], checkpoint: str | None,
             state: dict | None, dtype: str, schedule: str) -> bool:
        from nereus.runtime.engine import ShardedModel, shard_boxes, tied_head
        from nereus.runtime.groups import ParallelGroups
        from nereus.runtime.hf import load_boxes, slice_boxes

        groups = ParallelGroups(layout, ranks, tied_embeddings=tied_head(cfg))
        self.groups[key] = groups
        if not groups.member:
            return False
        boxes = shard_boxes(cfg, groups)
        tensors = load_boxes(checkpoint, boxes) if checkpoint else slice_boxes(state, boxes)
        self.models[key] = ShardedModel(cfg, groups, tensors, getattr(torch, dtype), schedule)
        return True

    def call(self, key: str, op: str, *args: object, **kwargs: object) -> object:
        """Run ``op`` on this worker's shard of ``key``; None on workers outside the layout."""
        from nereus.runtime.generate import generate, generate_with_logprobs

        sm = self.models.get(key)
        if sm is None:
            return None
        if op == "generate":
            out = generate(sm, *args, **kwargs)
        elif op == "generate_with_logprobs":
            out = generate_with_logprobs(sm, *args, **kwargs)
        elif op == "memory":
            return asdict(sm.last_report) if sm.last_report else None
        elif op == "boxes":
            return {name: tuple(p.shape) for name, p in sm.shards().items()}
        else:
            out = getattr(sm, op)(*args, **kwargs)
        if not sm.is_output_rank:
            return None
        return sm.groups.coords.dp, out

    def apply(self, key: str, fn: object, *args: object) -> object:
        """``fn(shard, *args)`` on this worker's shard of ``key`` (None outside the layout); callers use it
        for operations the runtime does not name, such as reading or writing shards and optimizer state."""
        sm = self.models.get(key)
        return None if sm is None else fn(sm, *args)

    def release(self, key: str) -> None:
        self.models.pop(key, None)
        groups = self.groups.pop(key, None)
        if groups is not None:
            groups.destroy()


class Runtime:
    """``world`` workers (Ray actors) in one process group; ``load`` places a model under a layout."""

    def __init__(self, world: int, address: str | None = None, temp_dir: str | Path | None = None,
                 timeout_s: float = 600.0) -> None:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        gpu = torch.cuda.is_available()
        if not ray.is_initialized():
            if address:
                ray.init(address=address)
            else:
                root = Path(temp_dir or Path.cwd() / ".tmp" / "ray").absolute()
                ray.init(num_cpus=max(world, os.cpu_count() or 1), include_dashboard=False,
                         _temp_dir=str(root), _node_ip_address="127.0.0.1", log_to_driver=False)
        opts = {"num_gpus": 1} if gpu else {"num_cpus": 1}
        self.workers = [Worker.options(**opts).remote(r, world) for r in range(world)]
        master, port = ray.get(self.workers[0].address.remote())
        self.backend = ray.get([w.init_dist.remote(master, port, timeout_s) for w in self.workers])[0]
        self.layouts: dict[str, tuple[Layout, list[int]]] = {}

    def load(self, key: str, cfg: ModelConfig, layout: Layout, ranks: list[int] | None = None,
             checkpoint: str | Path | None = None, state: dict | None = None, dtype: str = "float32",
             schedule: str = "1f1b") -> None:
        """Place ``cfg``'s model under ``layout`` on workers ``ranks`` (default the first ``layout.world``),
        each reading its boxes from an HF ``checkpoint`` directory or cutting them from whole ``state``."""
        ranks = list(range(layout.world)) if ranks is None else list(ranks)
        ckpt = str(checkpoint) if checkpoint else None
        ray.get([w.load.remote(key, cfg, layout, ranks, ckpt, state, dtype, schedule) for w in self.workers])
        self.layouts[key] = (layout, ranks)

    def _run(self, key: str, op: str, *args: object, **kwargs: object) -> list:
        _, ranks = self.layouts[key]
        results = ray.get([self.workers[r].call.remote(key, op, *args, **kwargs) for r in ranks])
        return [out for _, out in sorted(r for r in results if r is not None)]

    def logprobs(self, key: str, tokens: torch.Tensor) -> torch.Tensor:
        return torch.cat(self._run(key, "logprobs", tokens))

    def values(self, key: str, tokens: torch.Tensor) -> torch.Tensor:
        return torch.cat(self._run(key, "values", tokens))

    def train_step(self, key: str, batch: dict, loss_fn: object, lr: float = 1e-3) -> list[float]:
        return [x for part in self._run(key, "train_step", batch, loss_fn, lr) for x in part]

    def generate(self, key: str, prompts: list[list[int]], params: object) -> list[list[int]]:
        return [row for part in self._run(key, "generate", prompts, params) for row in part]

    def generate_with_logprobs(self, key: str, prompts: list[list[int]],
                               params: object) -> list[tuple[list[int], list[float]]]:
        """New tokens and their sampling-time log-probs per prompt (``generate.generate_with_logprobs``)."""
        return [row for part in self._run(key, "generate_with_logprobs", prompts, params) for row in part]

    def apply(self, key: str, fn: object, *args: object) -> list:
        """``fn(shard, *args)`` on every worker of ``key``'s layout (all together, as collectives need);
        results in layout rank order. ``fn`` must be importable or picklable by value."""
        _, ranks = self.layouts[key]
        return ray.get([self.workers[r].apply.remote(key, fn, *args) for r in ranks])

    def memory(self, key: str) -> list[dict | None]:
        """The last operation's memory report of every worker of ``key``'s layout, in layout rank order."""
        _, ranks = self.layouts[key]
        return ray.get([self.workers[r].call.remote(key, "memory") for r in ranks])

    def shard_shapes(self, key: str) -> list[dict]:
        _, ranks = self.layouts[key]
        return ray.get([self.workers[r].call.remote(key, "boxes") for r in ranks])

    def release(self, key: str) -> None:
        ray.get([w.release.remote(key) for w in self.workers])
        self.layouts.pop(key, None)

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)
        self.workers = []
