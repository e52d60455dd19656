"""One rank's shard of a model under a layout, and the operations every layout supports: logits,
log-probs of given tokens, values, and a training step with a caller-supplied loss and Adam.

Every rank of the layout receives the whole batch and takes its DP replica's rows (the batch splits
evenly over DP, then into micro-batches of ``layout.micro_batch_size``). Results are complete on the last
pipeline stage of each replica (``is_output_rank``: TP rank 0 there returns them).

The objective of a training step is the mean over all micro-batches of all replicas of
``loss_fn(out, micro_batch)``, where ``out`` is the log-probabilities [b, T−1] of each next token (LM
models) or the values [b, T] (value-head models) and ``micro_batch`` is the ``TrainBatch`` cut to the
same rows (``TrainBatch.select``; for a ``loss_fn`` whose ``needs_entropy`` is true with ``entropy``
[b, T−1] set: each next-token distribution's full-vocabulary entropy, differentiable). A single process
running the same micro-batches computes the same objective.

A layout with ``max_token_len`` packs instead (``parallel.packing``): a training batch's rows are dealt to
the replicas by tokens and each replica's rows packed into micro-batches of at most that many tokens; each
micro-batch's loss then counts by its share of the batch's rows (rows · dp / batch rows instead of one over
the number of micro-batches), so with the loss functions' mini-batch weights (``rl.core.agg_weights``: Σ
weight·ℓ / rows) the objective is the same aggregate over the mini-batch however it was split. Inference
packs each replica's consecutive rows (they come back in order); outputs are in the padded frame.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cached_property

import torch
import torch.distributed as dist

from nereus.runtime.comm.groups import ParallelGroups
from nereus.runtime.model.decoder import CausalLM, ModelConfig, rope_inv_freq
from nereus.runtime.model.memory import ActivationMeter, MemoryReport, tensor_bytes
from nereus.runtime.model.moe import RoutingRecord
from nereus.runtime.model.routes import replay_record, sparse_layer_ids
from nereus.runtime.parallel import parallelize
from nereus.runtime.parallel.batch import TrainBatch
from nereus.runtime.parallel.dp import ShardedAdam, sum_gradients
from nereus.runtime.parallel.ep import (
    ExpertShardedAdam,
    even_packing,
    expert_grad_square,
    is_expert,
    reduce_gradients,
)
from nereus.runtime.parallel.packing import PackedRows, row_lengths
from nereus.runtime.parallel.pp import StageComm, train_pipeline
from nereus.runtime.parallel.sharded_forward import ForwardOps
from nereus.runtime.parallel.tp import (
    parallel_entropy,
    parallel_logprobs,
    reduce_tp_replicated,
    vocab_range,
)
from nereus.runtime.parallel.zero3 import Zero3, Zero3Adam
from nereus.spec.packing import replica_shares, token_budget_groups
from nereus.spec.sharding import Box, model_tensors, rank_order, rank_tensors, tp_box


@dataclass
class Loss:
    """What a loss function may return instead of a bare scalar: the scalar and a record of its
    micro-batch's statistics (e.g. ``rl.losses.ActorLossStats``: clip fractions), handed back with the
    step's result (``ReplicaStats.metrics``)."""

    value: torch.Tensor
    stats: object = None


LossFn = Callable[[torch.Tensor, TrainBatch], "torch.Tensor | Loss"]
# per-token quantities of next-token logit shards [.., n, V_local] and the next tokens [.., n]


@dataclass(frozen=True)
class ReplicaStats:
    """One data-parallel replica's part of a training step, from its output rank: micro-batch losses,
    the statistics its loss function reported per micro-batch (in the order it ran them), and the global
    gradient norm before clipping (None when not clipping)."""

    losses: tuple[float, ...]
    metrics: tuple[object, ...]  # the loss function's statistics records (``Loss.stats``)
    grad_norm: float | None


@dataclass(frozen=True)
class TrainStats:
    """A training step's result over every replica, in data-parallel order."""

    replicas: tuple[ReplicaStats, ...]

    @property
    def losses(self) -> list[float]:
        return [x for r in self.replicas for x in r.losses]

    @property
    def metrics(self) -> list[object]:
        return [m for r in self.replicas for m in r.metrics]

    @property
    def grad_norm(self) -> float | None:
        """The same on every replica (gradients are DP-averaged before the norm)."""
        return self.replicas[0].grad_norm if self.replicas else None


def tied_head(cfg: ModelConfig) -> bool:
    """Whether the last pipeline stage keeps a copy of the embedding as its LM head (pass this as
    ``ParallelGroups(tied_embeddings=...)``)."""
    return cfg.arch.tied_embeddings and not cfg.value_head


def shard_boxes(cfg: ModelConfig, groups: ParallelGroups) -> dict[str, Box]:
    """Global boxes this rank loads: ``rank_tensors`` plus, on the last stage of a tied model under PP,
    ``tied_head`` (its copy of the embedding's vocabulary rows)."""
    dims, arch = groups.dims, cfg.arch
    boxes = rank_tensors(arch, dims, groups.rank, cfg.value_head)
    if dims.pp > 1 and groups.last_stage and tied_head(cfg):
        boxes["tied_head"] = tp_box(model_tensors(arch)[0], arch, dims.tp, groups.coords.tp_rank)
    return boxes


class ShardedModel(ForwardOps):
    """The shard of ``cfg``'s model that rank ``groups.rank`` holds, loaded from ``tensors`` (name → the
    local box of ``shard_boxes``, e.g. from ``hf.load_boxes``; with ``assign`` they become the parameters
    themselves). Under ZeRO-3 ``zero3_weights`` may give the rank's range of the weights instead (adopted
    as it is; ``tensors`` then holds only a last stage's ``tied_head``)."""

    def __init__(self, cfg: ModelConfig, groups: ParallelGroups, tensors: dict[str, torch.Tensor],
                 dtype: torch.dtype = torch.float32, schedule: str = "1f1b", assign: bool = False,
                 zero3_weights: torch.Tensor | None = None) -> None:
        if not groups.member:
            raise ValueError("this rank is not part of the layout")
        self.cfg, self.groups, self.dtype, self.schedule = cfg, groups, dtype, schedule
        with torch.device("meta"):  # shapes only: the shard's tensors are loaded (or adopted) below
            whole = CausalLM(cfg)
        model = parallelize(whole, groups)
        if zero3_weights is not None:  # the whole local tensors are never built: shapes stay on meta
            model.to(dtype=dtype).load_state_dict(tensors, strict=False, assign=True)
        elif assign:  # adopt the given tensors as the parameters (a transition's new buffers): no copy
            model.load_state_dict({k: v.to(dtype) for k, v in tensors.items()}, strict=True, assign=True)
        else:  # parameters in ``dtype`` as the adopted ones are (load_state_dict casts into the target's dtype)
            model.to(dtype=dtype).to_empty(device=groups.device)
            model.load_state_dict({k: v.to(dtype) for k, v in tensors.items()}, strict=True)
        model.inv_freq = rope_inv_freq(cfg).to(groups.device)
        self.model: CausalLM = model
        self.vocab_start = vocab_range(cfg.arch, groups.dims.tp, groups.coords.tp_rank)[0]
        self.optimizer: ShardedAdam | None = None
        self.zero3: Zero3 | None = None  # ZeRO-3: only this rank's range of the weights is kept (``parallel.zero3``)
        if groups.layout.fsdp:
            self.zero3 = Zero3(model, [n for n, _ in self.optimizer_params()], groups, zero3_weights)
        self.comm = StageComm(groups)
        self.meter = ActivationMeter(self.zero3)
        self.last_report: MemoryReport | None = None

    # ----- batch handling -------------------------------------------------------------------------
    @property
    def is_output_rank(self) -> bool:
        return self.groups.last_stage and self.groups.coords.tp_rank == 0

    def replica_rows(self, batch_size: int) -> slice:
        dp, d = self.groups.dims.dp, self.groups.coords.dp_rank
        if batch_size % dp:
            raise ValueError(f"batch of {batch_size} does not split over dp={dp}")
        per = batch_size // dp
        return slice(d * per, (d + 1) * per)

    def micro_batches(self, batch: TrainBatch) -> list[TrainBatch]:
        mine = batch.select(self.replica_rows(len(batch))).to(self.groups.device)
        n, mbs = len(mine), self.groups.layout.micro_batch_size
        if n % mbs:
            raise ValueError(f"{n} sequences per replica do not split into micro-batches of {mbs}")
        return [mine.select(slice(i, i + mbs)) for i in range(0, n, mbs)]

    @property
    def token_budget(self) -> int:
        """Tokens per packed micro-batch (the layout's ``max_token_len``); 0: padded micro-batches."""
        return self.groups.layout.max_token_len

    def packed_micro_batches(self, batch: TrainBatch) -> list[tuple[TrainBatch, PackedRows]]:
        """This replica's rows of ``batch`` as packed micro-batches of at most ``token_budget`` tokens, each with
        its packing (rows into ``batch``), the rows dealt over DP by tokens (``spec.packing.replica_shares``: in
        training and inference alike; the driver restores a packed inference's batch order)."""
        lengths = row_lengths(batch.lengths, len(batch), batch.tokens.shape[1])
        shares = replica_shares(lengths, self.groups.dims.dp)
        rows = shares[self.groups.coords.dp_rank]
        if self.groups.dims.ep > 1:  # every rank of an EP group runs as many MoE forwards (all-to-alls)
            groups = even_packing(lengths, shares, self.groups.coords.dp_rank, self.token_budget)
        else:
            groups = token_budget_groups([lengths[r] for r in rows], self.token_budget)
        out = []
        for group in groups:
            idx = [rows[j] for j in group]
            pack = PackedRows(torch.tensor(idx, dtype=torch.long), tuple(lengths[r] for r in idx))
            out.append((batch.select(pack.rows).to(self.groups.device), pack))
        return out

    def _packed_stage_fn(self, packs: list[PackedRows], loss_weights: list[float] | None = None,
                         mbs: list[TrainBatch] | None = None):
        """``mbs``: the packs' micro-batches, whose routes (router replay) are packed as their tokens."""
        def run(x: torch.Tensor, i: int) -> torch.Tensor:
            routes = None if mbs is None or mbs[i].routes is None else packs[i].pack(mbs[i].routes)
            return self._stage_forward(x, loss_weights, i, None, routes, seq_lens=packs[i].lengths)
        shape = lambda i: (1, packs[i].tokens, self.cfg.arch.hidden)  # noqa: E731
        return run, shape

    def _stage_fn(self, mbs: list[TrainBatch], loss_weights: list[float] | None = None):
        def run(x: torch.Tensor, i: int) -> torch.Tensor:
            return self._stage_forward(x, loss_weights, i, mbs[i].lengths, mbs[i].routes)
        shape = lambda i: (*mbs[i].tokens.shape, self.cfg.arch.hidden)  # noqa: E731
        return run, shape

    def _stage_forward(self, x: torch.Tensor, loss_weights: list[float] | None, i: int,
                       lengths: torch.Tensor | None, routes: torch.Tensor | None = None,
                       **kwargs: object) -> torch.Tensor:
        """The stage's forward of micro-batch ``i``. In training (``loss_weights``: each micro-batch's weight in
        the step's loss) an MoE model's load-balancing loss -- the mean over its sparse layers of each layer's,
        over the micro-batch's tokens (not the padding past ``lengths``) -- joins the backward at the
        checkpoint's ``router_aux_loss_coef`` (``moe.RoutingRecord.join_aux_loss``: each pipeline stage its
        own layers' part). ``routes`` [b, T | L, sparse layers, k] (router replay, ``model.routes``): the
        experts each sparse layer routes the micro-batch's positions to, in the order of ``x``'s positions."""
        arch = self.cfg.arch
        coef = arch.moe.aux_loss_coef if arch.moe is not None and loss_weights is not None else 0.0
        if not coef and routes is None:
            return self.model(x, **kwargs)
        aux = {}
        if coef:
            at = torch.arange(x.shape[1], device=x.device)
            mask = None if lengths is None else at < lengths.to(x.device)[:, None]
            aux = {"aux": True, "token_mask": mask, "aux_weight": coef * loss_weights[i] / arch.sparse_layers()}
        record = (RoutingRecord(**aux) if routes is None
                  else replay_record(routes.to(x.device), sparse_layer_ids(arch), **aux))
        return record.join_aux_loss(self.model(x, routing=record, **kwargs))

    # ----- training -------------------------------------------------------------------------------
    def backward(self, batch: TrainBatch, loss_fn: LossFn, metrics: list[object] | None = None) -> list[float]:
        """Gradients of the step's objective in every local parameter (TP, PP, tied copies and DP
        reduced); returns this replica's micro-batch losses on the last stage. Statistics a loss function
        reports (``Loss.stats``) are appended to ``metrics`` in the order the micro-batches ran."""
        self.model.zero_grad(set_to_none=True)
        if self.zero3 is not None:
            self.zero3.grads.zero_()
        if self.token_budget:
            pairs = self.packed_micro_batches(batch)
            mbs, packs = [mb for mb, _ in pairs], [p for _, p in pairs]
            inputs = [p.pack(mb.tokens) for mb, p in pairs]
            # each micro-batch counts by its share of the batch's rows (the DP average then divides by dp)
            parts = [len(batch) / (len(mb) * self.groups.dims.dp) for mb in mbs]
            run, shape = self._packed_stage_fn(packs, [1 / p for p in parts], mbs)
        else:
            mbs, packs = self.micro_batches(batch), None
            inputs = [mb.tokens for mb in mbs]
            parts = [len(mbs)] * len(mbs)
            run, shape = self._stage_fn(mbs, [1 / p for p in parts])

        def loss(y: torch.Tensor, i: int) -> torch.Tensor:
            y, mb = self._loss_inputs(y, mbs[i], None if packs is None else packs[i], inputs[i], loss_fn)
            out = loss_fn(y, mb)
            if isinstance(out, Loss):
                if metrics is not None:
                    metrics.append(out.stats)
                out = out.value
            return out / parts[i]

        with self.meter.track(exclude=self.model.parameters()):
            losses = train_pipeline(run, self.comm, inputs, shape, self.dtype, loss, self.schedule)
        self._activations = self.meter.peak
        # under ZeRO-3 each unit's backward has done this and the DP reduction (``zero3``): no gradients here
        grads = {n: p.grad for n, p in self.model.named_parameters() if p.grad is not None}
        reduce_tp_replicated(self.cfg, grads, self.groups.tp_group, self.groups.dims.tp, self.groups.coords.tp_rank)
        if self.zero3 is not None:  # the last stage's averaged tied copy's gradient joins the first stage's range
            reduce_gradients(self.model, self.groups)
            self.zero3.sum_tied_gradient(self.model.tied_head, self.groups)
            return [x * p for x, p in zip(losses, parts, strict=False)]
        tied = [p for p in (self.model.tied_head, self.embedding_weight()) if p is not None]
        if self.groups.embed_group is not None and tied_head(self.cfg):
            sum_gradients(tied, self.groups.embed_group)
        reduce_gradients(self.model, self.groups)  # over DP (experts: over their expert-data-parallel group)
        return [x * p for x, p in zip(losses, parts, strict=False)]

    def _loss_inputs(self, y: torch.Tensor, mb: TrainBatch, pack: PackedRows | None, inputs: torch.Tensor,
                     loss_fn: LossFn) -> tuple[torch.Tensor, TrainBatch]:
        """What ``loss_fn`` reads of the last stage's output ``y``: the log-probs [b, T−1] of each next token
        (with the entropies in ``mb.entropy`` for a loss that ``needs_entropy``: verl's entropy_coeff) or the
        values [b, T], in the padded frame also when packed (0 past each row's length)."""
        width = mb.tokens.shape[1]
        if self.cfg.value_head:
            return (y if pack is None else pack.unpack(y, width, next_token=False)), mb
        logits, targets = (y[:, :-1], mb.tokens[:, 1:]) if pack is None else (y, pack.next_tokens(inputs))
        logp = parallel_logprobs(logits, targets, self.vocab_start, self.groups.tp_group)
        entropy = parallel_entropy(logits, self.groups.tp_group) if getattr(loss_fn, "needs_entropy", False) else None
        if pack is not None:
            logp = pack.unpack(logp, width - 1, next_token=True)
            entropy = None if entropy is None else pack.unpack(entropy, width - 1, next_token=True)
        return logp, (mb if entropy is None else replace(mb, entropy=entropy))

    def embedding_weight(self) -> torch.Tensor | None:
        """The first stage's embedding under PP (the source of a last stage's tied head), else None."""
        emb = self.model.model.embed_tokens
        if emb is None or self.groups.dims.pp == 1:
            return None
        return emb.weight if self.zero3 is None else self.zero3.tensor("model.embed_tokens.weight")  # a DP gather

    def optimizer_params(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The parameters Adam updates, in the contract's flat order (``sharding.rank_order``). The last
        stage's ``tied_head`` is not among them: it follows the embedding (``sync_tied_head``)."""
        named = self.shards()
        dims, c = self.groups.dims, self.groups.coords
        order = [n for n, _ in rank_order(self.cfg.arch, dims, c.pp_rank, c.tp_rank, self.cfg.value_head, c.dp_rank)]
        if sorted(order) != sorted(named):
            raise RuntimeError(f"stage {c.pp_rank} holds {sorted(named)}, the contract says {sorted(order)}")
        return [(n, named[n]) for n in order]

    def make_optimizer(self, lr: float = 1e-3, init_master: bool = True, **adam) -> ShardedAdam:
        if self.zero3 is not None:
            self.optimizer = Zero3Adam(self.zero3, lr=lr, init_master=init_master, **adam)
            return self.optimizer
        if self.groups.dims.ep > 1:  # experts' state over their own group (``ep.ExpertShardedAdam``)
            self.optimizer = ExpertShardedAdam(self.optimizer_params(), self.groups, self.groups.layout.zero1,
                                               lr=lr, init_master=init_master, **adam)
            return self.optimizer
        self.optimizer = ShardedAdam(self.optimizer_params(), self.groups.dp_group, self.groups.layout.zero1,
                                     lr=lr, init_master=init_master, **adam)
        return self.optimizer

    @cached_property
    def _tp_multiplicity(self) -> dict[str, int]:
        """Per local tensor, how many ranks of this rank's TP group hold the same box (replicated norms and
        KV heads count once in a global norm)."""
        dims, c = self.groups.dims, self.groups.coords
        boxes = [rank_tensors(self.cfg.arch, dims, dims.rank(c.pp_rank, c.dp_rank, t), self.cfg.value_head)
                 for t in range(dims.tp)]
        mine = boxes[c.tp_rank]
        return {name: sum(b.get(name) == box for b in boxes) for name, box in mine.items()}

    @torch.no_grad()
    def clip_gradients(self, max_norm: float) -> float:
        """Scale the step's gradients so that their global L2 norm — over the whole model, every element
        once: TP shards and PP stages summed, TP-replicated tensors and the tied head's copy counted once —
        is at most ``max_norm`` (``torch.nn.utils.clip_grad_norm_``'s rule); returns the norm before.
        After ``backward`` the gradients are DP-averaged, so every replica computes the same norm."""
        if self.zero3 is not None:
            groups = (self.groups.tp_group, self.groups.pp_group)
            return self.zero3.clip_gradients(max_norm, self._tp_multiplicity, groups)
        params = self.optimizer_params()
        sq = torch.zeros((), dtype=torch.float64)
        ep = self.groups.dims.ep > 1  # each EP rank holds other experts: theirs are summed over the EP group
        for name, p in params:
            if p.grad is not None and not (ep and is_expert(name)):
                sq += p.grad.double().pow(2).sum() / self._tp_multiplicity[name]
        if ep:
            sq += expert_grad_square(params, self.groups)
        for group in (self.groups.tp_group, self.groups.pp_group):
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(sq, group=group)
        norm = float(sq.sqrt())
        scale = max_norm / (norm + 1e-6)
        if scale < 1.0:
            for _, p in params:
                if p.grad is not None:
                    p.grad.mul_(scale)
        return norm

    def step(self, lr: float = 1e-3, max_grad_norm: float | None = None, weight_decay: float = 0.0,
             **adam) -> float | None:
        """One Adam step on the gradients of ``backward`` (state sharded over DP with ZeRO-1), after clipping
        their global norm to ``max_grad_norm`` when given, with decoupled ``weight_decay`` (AdamW); returns
        the norm before clipping (else None)."""
        norm = self.clip_gradients(max_grad_norm) if max_grad_norm else None
        if self.optimizer is None:
            self.make_optimizer(lr, **adam)
        self.optimizer.set_lr(lr, weight_decay)
        self.optimizer.step()
        self.sync_tied_head()
        self.record_memory("train", activations=self._activations)
        return norm

    @torch.no_grad()
    def sync_tied_head(self) -> None:
        """Copy the first stage's updated embedding rows to the last stage's ``tied_head`` (both got the
        same summed gradient; one optimizer state, the embedding's, keeps the contract's flat buffer)."""
        group = self.groups.embed_group
        if group is None or not tied_head(self.cfg):
            return
        src = self.groups.pp_peer(0)
        target = self.model.tied_head if self.groups.last_stage else self.embedding_weight()
        if target is not None:
            dist.broadcast(target.data, src=src, group=group)

    def train_step(self, batch: TrainBatch, loss_fn: LossFn, lr: float = 1e-3,
                   max_grad_norm: float | None = None, weight_decay: float = 0.0) -> list[float]:
        losses = self.backward(batch, loss_fn)
        self.step(lr, max_grad_norm, weight_decay)
        return losses

    # ----- shards and memory ----------------------------------------------------------------------
    def shards(self) -> dict[str, torch.Tensor]:
        """Local parameters by checkpoint name (the tied-embedding copy ``tied_head`` excluded); under ZeRO-3
        gathered over DP, so every DP rank calls it."""
        if self.zero3 is not None:
            return self.zero3.full_weights()
        return {k: v for k, v in self.model.named_parameters() if k != "tied_head"}

    def record_memory(self, op: str, activations: int = 0, kv_cache: int = 0) -> MemoryReport:
        params = list(self.model.parameters())  # none outside a gather under ZeRO-3: its ranges instead
        grads = [p.grad for p in params if p.grad is not None]
        if self.zero3 is not None:
            params, grads = [*params, self.zero3.weights], [*grads, self.zero3.grads]
        opt = self.optimizer.state_bytes() if self.optimizer is not None and op == "train" else 0
        self.last_report = MemoryReport(op, tensor_bytes(params), tensor_bytes(grads) if op == "train" else 0,
                                        opt, activations, kv_cache)
        return self.last_report
