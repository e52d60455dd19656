"""Pipeline parallelism: a manual split of the decoder into contiguous stages and micro-batch schedules.

Stages hold the layer ranges of ``nereus.spec.sharding.layer_range`` (remainder to the first stages), the
embedding on the first stage, the final norm and head on the last. Schedules are GPipe (all forwards,
then all backwards; Huang et al. 2019) and 1F1B (PipeDream-Flush; Narayanan et al. 2021, Sec. 2.2),
exchanging activations and their gradients with point-to-point sends between neighbouring stages.

We write the schedules ourselves rather than use ``torch.distributed.pipelining``: every rank already
holds the whole batch (so activation shapes are known without metadata exchange and may change from step
to step), the loss reads arbitrary per-sample tensors of each micro-batch, and forward-only inference and
KV-cached generation reuse the same stage object and send/recv path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from nereus.runtime.comm.groups import ParallelGroups
from nereus.runtime.model.decoder import CausalLM, ModelConfig
from nereus.spec.sharding import layer_range

FWD, BWD = 1, 2  # message tags: activations downstream, their gradients upstream


def split_stage(model: CausalLM, pp: int, stage: int) -> CausalLM:
    """Cut a plain whole ``model`` in place down to pipeline stage ``stage`` of ``pp``: its layer range,
    the embedding on the first stage, the final norm and head on the last."""
    cfg = model.cfg
    keep = layer_range(cfg.arch.layers, pp, stage)
    first, last = stage == 0, stage == pp - 1
    dec = model.model
    dec.layers = torch.nn.ModuleDict({k: v for k, v in dec.layers.items() if int(k) in keep})
    if not first:
        dec.embed_tokens = None
    if not last:
        dec.norm, model.lm_head, model.score = None, None, None
    model.first, model.last = first, last
    if pp > 1 and last and cfg.arch.tied_embeddings and not cfg.value_head:
        # The last stage keeps its own copy of the tied embedding (Megatron-LM); gradients of the two
        # copies are summed over the first/last-stage group so they stay equal.
        device = next(model.parameters()).device
        model.tied_head = torch.nn.Parameter(torch.empty(cfg.arch.vocab, cfg.arch.hidden, device=device))
    return model


def build_stage(cfg: ModelConfig, pp: int, stage: int, device: torch.device | str = "cpu") -> CausalLM:
    """The (uninitialised, on ``device``) part of the model that pipeline stage ``stage`` of ``pp`` holds."""
    with torch.device(device):
        return split_stage(CausalLM(cfg), pp, stage)


@dataclass
class StageComm:
    """Point-to-point sends between this rank's pipeline neighbours (same DP and TP coordinates)."""

    groups: ParallelGroups
    pending: list = field(default_factory=list)

    def send(self, tensor: torch.Tensor, downstream: bool, tag: int) -> None:
        c = self.groups.coords
        peer = self.groups.pp_peer(c.pp_rank + 1 if downstream else c.pp_rank - 1)
        tensor = tensor.detach().contiguous()
        self.pending.append((dist.isend(tensor, dst=peer, group=self.groups.pp_group, tag=tag), tensor))

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, upstream: bool, tag: int) -> torch.Tensor:
        c = self.groups.coords
        peer = self.groups.pp_peer(c.pp_rank - 1 if upstream else c.pp_rank + 1)
        out = torch.empty(shape, dtype=dtype, device=self.groups.device)
        dist.recv(out, src=peer, group=self.groups.pp_group, tag=tag)
        return out

    def flush(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()


StageFn = Callable[[torch.Tensor, int], torch.Tensor]  # (stage input, micro-batch index) -> stage output


def forward_only(stage: StageFn, comm: StageComm, inputs: list[torch.Tensor], shape: Callable[[int], tuple],
                 dtype: torch.dtype) -> list[torch.Tensor]:
    """Run every micro-batch through the pipeline; returns the last stage's outputs (else an empty list).
    ``inputs`` are the first stage's inputs; ``shape(i)`` is micro-batch i's activation shape."""
    g = comm.groups
    outs = []
    for i, tokens in enumerate(inputs):
        x = tokens if g.first_stage else comm.recv(shape(i), dtype, upstream=True, tag=FWD)
        y = stage(x, i)
        if g.last_stage:
            outs.append(y)
        else:
            comm.send(y, downstream=True, tag=FWD)
    comm.flush()
    return outs


def train_pipeline(stage: StageFn, comm: StageComm, inputs: list[torch.Tensor], shape: Callable[[int], tuple],
                   dtype: torch.dtype, loss: Callable[[torch.Tensor, int], torch.Tensor],
                   schedule: str = "1f1b") -> list[float]:
    """Forward and backward of every micro-batch under ``schedule`` ("gpipe" or "1f1b"). ``loss(out, i)``
    is micro-batch i's contribution to the objective (already divided by the number of micro-batches).
    Gradients accumulate in the stage's parameters; returns the losses on the last stage."""
    g = comm.groups
    m, p, s = len(inputs), g.dims.pp, g.coords.pp_rank
    saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    losses: list[float] = []

    def fwd(i: int) -> None:
        if g.first_stage:
            x = inputs[i]
        else:
            x = comm.recv(shape(i), dtype, upstream=True, tag=FWD).requires_grad_()
        y = stage(x, i)
        if g.last_stage:
            y = loss(y, i)
            losses.append(float(y.detach()))
        else:
            comm.send(y, downstream=True, tag=FWD)
        saved[i] = (x, y)

    def bwd(i: int) -> None:
        x, y = saved.pop(i)
        if g.last_stage:
            y.backward()
        else:
            y.backward(comm.recv(tuple(y.shape), y.dtype, upstream=False, tag=BWD))
        if not g.first_stage:
            comm.send(x.grad, downstream=False, tag=BWD)

    if schedule == "gpipe":
        order = [("f", i) for i in range(m)] + [("b", i) for i in range(m)]
    elif schedule == "1f1b":
        order = one_f_one_b(m, p, s)
    else:
        raise ValueError(f"schedule {schedule!r} is not gpipe or 1f1b")
    for kind, i in order:
        (fwd if kind == "f" else bwd)(i)
    comm.flush()
    return losses


def one_f_one_b(m: int, p: int, s: int) -> list[tuple[str, int]]:
    """Operation order of stage ``s`` of ``p`` for ``m`` micro-batches: p−s−1 warm-up forwards, then
    alternating forward/backward, then the remaining backwards (at most p−s micro-batches in flight)."""
    warm = min(p - s - 1, m)
    order = [("f", i) for i in range(warm)]
    for i in range(m - warm):
        order += [("f", warm + i), ("b", i)]
    order += [("b", i) for i in range(m - warm, m)]
    return order
