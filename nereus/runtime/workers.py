"""Ray actors, one per device, joined into one torch.distributed world; models load onto them under a
layout, several layouts coexisting (each under its own key, with its own process groups).

``Runtime`` starts a local Ray instance by default (loopback only, no dashboard) or joins the cluster at
``address``. Workers use gloo on CPU and NCCL with one GPU each when CUDA is present. Every call that
creates groups goes to all workers, because torch.distributed creates each group collectively.
"""

from __future__ import annotations

import os
import signal
import threading
import uuid
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

import ray
import torch

from nereus.runtime.failover import FailoverMixin
from nereus.runtime.live import KeySpec
from nereus.runtime.model import ModelConfig
from nereus.runtime.raylocal import start_local_ray
from nereus.spec.layout import Layout


class WorldAborted(RuntimeError):
    """The driver aborted this worker's world (a peer was lost); the call in flight was abandoned."""


# Calls run one at a time, in order ("default" group); ``abort`` and ``pid`` answer from their own thread
# even while a call is blocked in a collective with a lost peer.
@ray.remote(concurrency_groups={"control": 1})
class Worker:
    """One device: holds the shards of every loaded model-stage, keyed by name."""

    def __init__(self, rank: int, world: int) -> None:
        torch.set_num_threads(1)
        self.rank, self.world = rank, world
        self.models: dict[str, object] = {}
        self.groups: dict[str, object] = {}
        self._abort = threading.Event()
        self._stuck: list[threading.Thread] = []  # calls abandoned by ``abort``, still blocked
        self._die_in: str | None = None

    # ----- failure handling -----------------------------------------------------------------------
    @ray.method(concurrency_group="control")
    def pid(self) -> int:
        return os.getpid()

    @ray.method(concurrency_group="control")
    def abort(self) -> bool:
        """Give up the call in flight (blocked on a lost peer): it returns ``WorldAborted`` at once and
        the world is re-formed by ``reinit``."""
        self._abort.set()
        return True

    @ray.method(concurrency_group="control")
    def die_in(self, op: str) -> bool:
        """Fault injection for tests and benchmarks: SIGKILL this process in the middle of the next ``op``
        call (``train_step``: after its backward pass, before the optimizer step; ``transition``: after
        the prepare vote, while the transfers run)."""
        self._die_in = op
        return True

    def _guarded(self, fn, *args: object) -> object:
        """``fn(*args)`` on a helper thread, so that ``abort`` can release this worker from a collective
        that will never complete; a gloo collective cannot be interrupted, so the thread is abandoned (it
        fails once ``reinit`` destroys its world) and never touches state the recovery rebuilds."""
        if self._abort.is_set():
            raise WorldAborted("this worker's world was aborted; re-form it (Runtime.recover)")
        out: dict = {}
        done = threading.Event()

        def run() -> None:
            try:
                out["value"] = fn(*args)
            except BaseException as exc:  # noqa: BLE001 - re-raised on the calling thread
                out["error"] = exc
            finally:
                done.set()

        t = threading.Thread(target=run, daemon=True)
        t.start()
        while not done.wait(0.05):
            if self._abort.is_set():
                self._stuck.append(t)
                raise WorldAborted("a peer was lost; the call in flight was abandoned")
        if "error" in out:
            raise out["error"]
        return out["value"]

    def address(self) -> tuple[str, int]:
        from nereus.runtime.launch import free_port

        return ray.util.get_node_ip_address(), free_port()

    def init_dist(self, master: str, port: int, timeout_s: float) -> str:
        import torch.distributed as dist

        from nereus.runtime.groups import default_backend, local_device

        backend = default_backend()
        if backend == "nccl":
            torch.cuda.set_device(local_device())
        if master.startswith("file://"):  # one host: a file rendezvous, so no TCP store listens on any interface
            init = master
        else:
            os.environ.update(MASTER_ADDR=master, MASTER_PORT=str(port))
            init = "env://"
        os.environ["LOCAL_RANK"] = "0"
        dist.init_process_group(backend, init_method=init, rank=self.rank, world_size=self.world,
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

    def reinit(self, master: str, port: int, world: int, timeout_s: float, rank: int | None = None) -> bool:
        """Leave the current world (every group with it) and join one of ``world`` workers as ``rank``
        (default: the same), keeping this worker's shards in memory; ``regroup`` then rebuilds them on the
        new world's groups. Calls abandoned by ``abort`` fail once their world is gone."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        for t in self._stuck:
            t.join(timeout=2.0)  # it fails once its world is destroyed; never wait long on it
        self._stuck = [t for t in self._stuck if t.is_alive()]
        self._abort.clear()
        self.world, self.groups, self.pending = world, {}, {}
        self.rank = self.rank if rank is None else rank
        self.init_dist(master, port, timeout_s)
        return self.init_comm(min(timeout_s, 120.0))

    def state_image(self, key_model: dict[str, str], optimizer_for: list[str], weights_dp0_only: bool) -> dict:
        """A copy of this worker's state of the keys in ``key_model`` (``recovery.state_image``); as a
        return value it lives in Ray's object store, owned by the driver: a host-memory snapshot that
        outlives this process."""
        from nereus.runtime.recovery import state_image

        return state_image(self.models, key_model, set(optimizer_for), weights_dp0_only)

    def state_images(self, models: list[str], keys: dict[str, dict[str, str]], optimizer_for: list[str]):
        """``state_image`` of each of ``models`` (its keys in ``keys``), one return value each (a snapshot:
        data-parallel replica 0's weights, every rank's optimizer state)."""
        images = tuple(self.state_image(keys[m], optimizer_for, True) for m in models)
        return images if len(images) > 1 else images[0]

    def restore(self, specs: list, images: dict[str, list]) -> bool:
        """Replace every key by ``specs`` (groups from ``prepare_groups`` in the re-formed world), each
        buffer filled from ``images`` (model → object refs of state images, in preference order)."""
        from nereus.runtime.recovery import restore_state

        pending, self.pending = self.pending, {}
        fetched = {m: ray.get(refs) for m, refs in images.items()}
        models = restore_state(specs, pending, fetched, self.comm)
        self.models, self.groups = models, dict(pending)
        return True

    def regroup(self, specs: list) -> bool:
        """Every key's groups in the new world (collective, same order everywhere), and its shard rebuilt
        around the same tensors: parameters adopted, Adam's segments and moments handed over."""
        from nereus.runtime.engine import tied_head
        from nereus.runtime.groups import ParallelGroups
        from nereus.runtime.live import rebuild

        for s in specs:
            g = ParallelGroups(s.layout, list(s.ranks), tied_embeddings=tied_head(s.cfg))
            self.groups[s.key] = g
            if s.key in self.models:
                self.models[s.key] = rebuild(self.models[s.key], g)
        return True

    def init_comm(self, timeout_s: float) -> bool:
        from nereus.runtime.executor import TransferComm

        self.comm = TransferComm(timeout_s)
        return True

    def prepare_groups(self, specs: list) -> bool:
        """The process groups of every key of a coming transition, created ahead (collective: every
        worker, same order); a key whose layout and workers do not change keeps its groups."""
        from nereus.runtime.engine import tied_head
        from nereus.runtime.groups import ParallelGroups

        self.pending = {}
        for s in specs:
            cur = self.groups.get(s.key)
            if cur is not None and (cur.layout, tuple(cur.ranks)) == (s.layout, tuple(s.ranks)):
                self.pending[s.key] = cur
            else:
                self.pending[s.key] = ParallelGroups(s.layout, list(s.ranks), tied_embeddings=tied_head(s.cfg))
        return True

    def transition(self, graph: object, old_specs: list, new_specs: list, fault: str | None = None,
                   sources: list | None = None) -> dict:
        """Replace the keys of ``old_specs`` by ``new_specs``, state moved as ``graph`` plans (groups from
        ``prepare_groups``) from the keys of ``sources`` (default ``old_specs``; a weight sync reads the
        training key only). On failure every worker keeps its old shards and reports the error."""
        return self._guarded(self._transition, graph, old_specs, new_specs, fault, sources)

    def _transition(self, graph: object, old_specs: list, new_specs: list, fault: str | None,
                    sources: list | None) -> dict:
        import time

        from nereus.runtime.live import transition_keys

        t0 = time.perf_counter()
        sources = old_specs if sources is None else sources
        if self._die_in == "transition":
            fault = "die"
        old = {s.key: self.models[s.key] for s in sources if s.key in self.models}
        pending, self.pending = self.pending, {}
        try:
            models, measured = transition_keys(graph, old, sources, new_specs, pending, self.comm, fault)
        except Exception as exc:  # noqa: BLE001 - reported to the driver; the old layout stays
            for key, g in pending.items():
                if g is not self.groups.get(key):
                    g.destroy()
            self.comm.renew()
            return {"ok": False, "error": str(exc), "wall_s": time.perf_counter() - t0}
        keep = {id(g) for g in pending.values()}
        for s in old_specs:
            self.models.pop(s.key, None)
            g = self.groups.pop(s.key, None)
            if g is not None and id(g) not in keep:
                g.destroy()
        self.models.update(models)
        self.groups.update(pending)
        return {"ok": True, "error": "", "wall_s": time.perf_counter() - t0, "measured": measured.to_dict()}

    def call(self, key: str, op: str, *args: object, **kwargs: object) -> object:
        """Run ``op`` on this worker's shard of ``key``; None on workers outside the layout."""
        return self._guarded(self._call, key, op, args, kwargs)

    def _call(self, key: str, op: str, args: tuple, kwargs: dict) -> object:
        from nereus.runtime.generate import generate, generate_with_logprobs

        sm = self.models.get(key)
        if sm is None:
            return None
        if op == "train_step" and self._die_in == "train_step":  # fault injection (``die_in``)
            sm.backward(*args[:2])
            os.kill(os.getpid(), signal.SIGKILL)
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
        return None if sm is None else self._guarded(fn, sm, *args)

    def release(self, key: str) -> None:
        self.models.pop(key, None)
        groups = self.groups.pop(key, None)
        if groups is not None:
            groups.destroy()


def _world_job(job: object, world: int) -> object:
    """The job on the runtime's ``world`` devices; a count that is not whole nodes (survivors of a lost
    worker) counts as one node of that many."""
    from dataclasses import replace

    if world <= job.cluster.gpus_per_node or world % job.cluster.gpus_per_node == 0:
        return job.with_gpus(world)
    return replace(job, cluster=replace(job.cluster, nodes=1, gpus_per_node=world))


class Runtime(FailoverMixin):
    """``world`` workers (Ray actors) in one process group; ``load`` places a model under a layout. A lost
    worker raises ``WorkerLostError``; ``recover`` continues on the survivors (``failover``)."""

    def __init__(self, world: int, address: str | None = None, temp_dir: str | Path | None = None,
                 timeout_s: float = 600.0, max_workers: int | None = None) -> None:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        gpu = torch.cuda.is_available()
        self._store_dir = None if address else Path(temp_dir or Path.cwd() / ".tmp" / "ray").absolute() / "rendezvous"
        if not ray.is_initialized():
            if address:
                ray.init(address=address)
            else:
                root = Path(temp_dir or Path.cwd() / ".tmp" / "ray").absolute()
                start_local_ray(max(world, max_workers or 0, os.cpu_count() or 1), root)
        self.timeout_s = timeout_s
        self.worker_options = {"num_gpus": 1} if gpu else {"num_cpus": 1}
        self.workers = [Worker.options(**self.worker_options).remote(r, world) for r in range(world)]
        master, port = self._rendezvous()
        self.backend = ray.get([w.init_dist.remote(master, port, timeout_s) for w in self.workers])[0]
        ray.get([w.init_comm.remote(min(timeout_s, 120.0)) for w in self.workers])
        self.layouts: dict[str, tuple[Layout, list[int]]] = {}
        self.specs: dict[str, KeySpec] = {}  # what each key holds, for transitions
        self._graphs: dict[tuple, object] = {}
        self._init_failover()

    def _rendezvous(self) -> tuple[str, int]:
        """Where a new world meets: a fresh file under Ray's temp folder when Ray is local (nothing listens),
        else a free port on worker 0's host."""
        if self._store_dir is not None:
            self._store_dir.mkdir(parents=True, exist_ok=True)
            return f"file://{self._store_dir / f'world-{uuid.uuid4().hex}'}", 0
        return ray.get(self.workers[0].address.remote())

    def load(self, key: str, cfg: ModelConfig, layout: Layout, ranks: list[int] | None = None,
             checkpoint: str | Path | None = None, state: dict | None = None, dtype: str = "float32",
             schedule: str = "1f1b", model: str | None = None, stage: str | None = None) -> None:
        """Place ``cfg``'s model under ``layout`` on workers ``ranks`` (default the first ``layout.world``),
        each reading its boxes from an HF ``checkpoint`` directory or cutting them from whole ``state``.
        ``model``/``stage`` name what the key holds in a plan (default: from a key "model/stage")."""
        ranks = list(range(layout.world)) if ranks is None else list(ranks)
        ckpt = str(checkpoint) if checkpoint else None
        ray.get([w.load.remote(key, cfg, layout, ranks, ckpt, state, dtype, schedule) for w in self.workers])
        self.layouts[key] = (layout, ranks)
        head, _, tail = key.partition("/")
        self.specs[key] = KeySpec(key, model or head, stage or tail or "inference", cfg, layout, tuple(ranks), dtype)

    # ----- live transitions -----------------------------------------------------------------------
    def transition(self, new_specs: list[KeySpec], job: object, fault: tuple[str, int] | None = None) -> dict:
        """Move the keys of ``new_specs`` (all currently loaded) to their new layouts and workers, weights and
        Adam state, following the transition graph; other keys are untouched. Returns the per-worker
        measurements; raises ``TransitionExecutionError`` (every worker still on the old layout) on failure.
        ``fault`` = (phase, worker) injects a failure, for tests."""
        old_specs = [self.specs[s.key] for s in new_specs]
        out = self._move(job, old_specs, new_specs, old_specs, fault)
        for s in new_specs:
            self.specs[s.key] = s
            self.layouts[s.key] = (s.layout, list(s.ranks))
        return out

    def sync_weights(self, model: str, job: object) -> dict:
        """The training key's weights to every other key of ``model`` (the per-step training → generation
        and inference sync), through the same executor: boxes that coincide on a device become one shared
        tensor, the rest move point to point."""
        train = next(s for s in self.specs.values() if s.model == model and s.training)
        keys = [train] + [s for s in self.specs.values() if s.model == model and not s.training]
        return self._move(job, keys, keys, [train]) if len(keys) > 1 else {"wall_s": 0.0}

    def _move(self, job: object, old_specs: list[KeySpec], new_specs: list[KeySpec], sources: list[KeySpec],
              fault: tuple[str, int] | None = None) -> dict:
        """Groups ahead, then every worker replaces the keys of ``old_specs`` by ``new_specs``, state read from
        the keys of ``sources``, as the (cached) graph between the two says."""
        from nereus.runtime.holdings import TransitionExecutionError

        graph = self._graph(job, sources, new_specs)
        ray.get([w.prepare_groups.remote(new_specs) for w in self.workers])
        results = self._get([w.transition.remote(graph, old_specs, new_specs,
                                                 fault[0] if fault and fault[1] == r else None, sources)
                             for r, w in enumerate(self.workers)])
        if not all(r["ok"] for r in results):
            raise TransitionExecutionError(next(r["error"] for r in results if not r["ok"]))
        return {"wall_s": max(r["wall_s"] for r in results), "workers": [r["measured"] for r in results],
                "graph": graph}

    def resize(self, n: int) -> None:
        """Grow or shrink to ``n`` workers without losing state: new Ray actors join (or the highest-ranked
        ones, which must hold nothing — transition off them first — are stopped), every worker joins a
        fresh torch.distributed world of ``n`` and rebuilds its shards on new groups around the same
        tensors. Workers keep their ranks."""
        cur = len(self.workers)
        if n == cur:
            return
        if n < 1:
            raise ValueError(f"cannot resize to {n} workers")
        busy = sorted({s.key for s in self.specs.values() if max(s.ranks) >= n})
        if busy:
            raise ValueError(f"workers {n}..{cur - 1} still hold {busy}: transition off them before shrinking")
        if n < cur:
            for w in self.workers[n:]:
                ray.kill(w)
            self.workers = self.workers[:n]
        else:
            self.workers += [Worker.options(**self.worker_options).remote(r, n) for r in range(cur, n)]
        master, port = self._rendezvous()
        ray.get([w.reinit.remote(master, port, n, self.timeout_s) for w in self.workers])
        ray.get([w.regroup.remote(list(self.specs.values())) for w in self.workers])
        self._graphs.clear()

    def _graph(self, job: object, old: list[KeySpec], new: list[KeySpec]) -> object:
        from nereus.elastic.graph import build_graph
        from nereus.runtime.live import plan_of

        key = (tuple(old), tuple(new))
        if key not in self._graphs:
            world = len(self.workers)
            self._graphs[key] = build_graph(_world_job(job, world), plan_of(old, world), plan_of(new, world))
        return self._graphs[key]

    def _run(self, key: str, op: str, *args: object, **kwargs: object) -> list:
        _, ranks = self.layouts[key]
        if op == "train_step":
            self.dirty.add(self.specs[key].model)
        results = self._get([self.workers[r].call.remote(key, op, *args, **kwargs) for r in ranks])
        return [out for _, out in sorted(r for r in results if r is not None)]

    def logprobs(self, key: str, tokens: torch.Tensor) -> torch.Tensor:
        return torch.cat(self._run(key, "logprobs", tokens))

    def values(self, key: str, tokens: torch.Tensor) -> torch.Tensor:
        return torch.cat(self._run(key, "values", tokens))

    def train_step(self, key: str, batch: dict, loss_fn: object, lr: float = 1e-3,
                   max_grad_norm: float | None = None) -> list[float]:
        """One optimizer step; ``max_grad_norm`` clips the global gradient norm first (``ShardedModel.step``)."""
        return [x for part in self._run(key, "train_step", batch, loss_fn, lr, max_grad_norm) for x in part]

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
        return self._get([self.workers[r].apply.remote(key, fn, *args) for r in ranks])

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
        self.specs.pop(key, None)

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)
        self.workers = []
