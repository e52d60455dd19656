"""Time and memory of one model-stage under one layout: generation, inference, training.

Each cost is a sum of named terms (seconds) so calibration can correct each term by its own factor:
``compute`` (GEMM and attention FLOPs), ``memory`` (HBM-bound kernels: norms, activations, decode weight
and KV reads), ``tp_comm``, ``pp_comm``, ``dp_comm``, ``optimizer`` and ``overhead`` (fixed per-iteration
costs of an inference engine). Pipeline bubbles scale the per-micro-batch terms, so they stay linear.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

from nereus.cost.decode import DecodePhases, EngineCosts, Precision, Replica, decode_phases
from nereus.cost.eager import eager_step_overhead_s
from nereus.cost.hardware import Hardware, kv_cache_budget
from nereus.cost.memory import (
    BF16,
    FP32,
    layer_activation_bytes,
    logits_bytes,
    stage_layers,
    stage_params,
    training_state_bytes,
)
from nereus.cost.moe import ParamPart, moe_micro_batch_terms, param_parts
from nereus.cost.offload import (
    host_update_time,
    offloads_optimizer,
    offloads_params,
    optimizer_swap_time,
    param_load_time,
    param_put_back_time,
    param_round_trip_time,
    updates_on_host,
)
from nereus.cost.stage_tokens import micro_batches
from nereus.cost.static_decode import decodes_static, static_batch_phases
from nereus.spec.algorithms import NEEDS_GREEDY_BASELINE
from nereus.spec.engines import PRICING_ENGINE, engine_traits
from nereus.spec.job import JobSpec, Options, ResponseLength
from nereus.spec.layout import Layout, ModelStage
from nereus.spec.model import ModelArch

TERMS = ("compute", "memory", "tp_comm", "pp_comm", "dp_comm", "optimizer", "overhead", "sync")
# Sequences a rollout engine keeps in flight at most: verl's default max_num_seqs (volcengine/verl,
# verl/trainer/config/ppo_trainer.yaml, actor_rollout_ref.rollout.max_num_seqs: 1024).
ENGINE_MAX_SEQUENCES = 1024
# Each activation a kernel writes is read once by the next one: HBM traffic ≈ 2 × stored bytes.
ELEMENTWISE_TRAFFIC = 2.0


@dataclass
class StageCost:
    model_stage: ModelStage
    layout: Layout
    terms: dict[str, float]  # seconds per step, before calibration factors
    resident_bytes: float  # held on the device for the whole step (weights, gradients, optimizer)
    transient_bytes: float  # held only while the stage runs (activations, logits, KV cache)
    memory: dict[str, float] = field(default_factory=dict)  # bytes per device by kind, fullest device
    detail: dict[str, float] = field(default_factory=dict)
    decode: DecodePhases | None = None  # generation: the decode model's bulk/tail phases and regime

    def time(self, factors: dict[str, float] | None = None) -> float:
        """Seconds per step; ``factors`` correct terms by ``"<stage>.<term>"`` or by ``"<term>"``."""
        if not factors:
            return sum(self.terms.values())
        stage = self.model_stage.stage
        return sum(v * factors.get(f"{stage}.{k}", factors.get(k, 1.0)) for k, v in self.terms.items())

    @property
    def peak_bytes(self) -> float:
        return self.resident_bytes + self.transient_bytes


@dataclass(frozen=True)
class _Pass:
    """One forward pass of a layer stack over one micro-batch, per device."""

    flops: float
    hbm_bytes: float
    tp_time: float


def _attention_flops(arch: ModelArch, tokens: float, context: float, attention: str) -> float:
    """QKᵀ and AV: 2·2·context·heads·head_dim FLOPs per token; causal flash kernels skip the masked half
    (Dao et al. 2022), Megatron 2021's kernels computed the full square (Narayanan et al. 2021, Eq. 3)."""
    full = 4 * tokens * context * arch.heads * arch.head_dim
    return full / 2 if attention == "flash" else full


@lru_cache(maxsize=65536)
def _layer_pass(hw: Hardware, arch: ModelArch, layout: Layout, seq: float, mbs: float, attention: str) -> _Pass:
    tokens = seq * mbs
    # 2 FLOPs per multiply-accumulate per weight per token (Kaplan et al. 2020, Sec. 2.1); an MoE layer's
    # token meets only its active parameters (``cost.moe``).
    flops = (2 * tokens * arch.active_layer_params() + _attention_flops(arch, tokens, seq, attention)) / layout.tp
    no_recompute = Layout(tp=layout.tp, sequence_parallel=layout.sequence_parallel, recompute="none")
    hbm = ELEMENTWISE_TRAFFIC * layer_activation_bytes(arch, no_recompute, seq, mbs, attention)
    # Megatron TP: two all-reduces of the s·b·h activations per layer in forward (Shoeybi et al. 2019,
    # Fig. 4); sequence parallelism turns each into an all-gather + reduce-scatter of the same volume.
    tp_time = 2 * hw.all_reduce_time(tokens * arch.hidden * BF16, layout.tp)
    return _Pass(flops, hbm, tp_time)


def _tp_only(layout: Layout) -> Layout:
    """The part of a layout a layer's forward pass depends on (a cache key)."""
    return Layout(tp=layout.tp, sequence_parallel=layout.sequence_parallel, recompute="none")


def _head_pass(hw: Hardware, arch: ModelArch, tp: int, tokens: float, value_head: bool) -> _Pass:
    if value_head:
        return _Pass(2 * tokens * arch.hidden, tokens * arch.hidden * BF16, 0.0)
    flops = 2 * tokens * arch.hidden * arch.vocab / tp
    hbm = 3 * logits_bytes(arch, tokens, tp, value_head, with_grad=False)  # logits, softmax in/out
    # Vocabulary-parallel cross-entropy / log-prob: three small all-reduces (max, sum-exp, target logit).
    tp_time = 3 * hw.all_reduce_time(tokens * FP32, tp)
    return _Pass(flops, hbm, tp_time)


def _p2p_time(hw: Hardware, arch: ModelArch, layout: Layout, tokens: float) -> float:
    """Activations sent between pipeline stages; with TP each rank sends 1/t (Megatron's scatter/gather
    optimisation, Narayanan et al. 2021, Sec. 4.1). Stages are tp·dp GPUs apart in rank order."""
    if layout.pp == 1:
        return 0.0
    cross = layout.tp * layout.dp >= hw.cluster.gpus_per_node
    return hw.p2p_time(tokens * arch.hidden * BF16 / layout.tp, cross)


def _shared_host(hw: Hardware, layout: Layout, terms: dict[str, float]) -> dict[str, float]:
    """Workers sharing ``priors.host_cores`` CPU cores (CPU runtime): with more workers busy than cores, each
    runs its compute, memory traffic and per-pass overhead that many times slower. 0: dedicated devices."""
    cores = hw.priors.host_cores
    slow = layout.world / cores if cores and layout.world > cores else 1.0
    if slow == 1.0:
        return terms
    return {k: v * slow if k in ("compute", "memory", "overhead") else v for k, v in terms.items()}


def _training_activation_bytes(arch: ModelArch, layout: Layout, seq: float, mbs: float, m: int,
                               attention: str) -> float:
    """Activations the first pipeline stage holds at its peak during one mini-batch update."""
    p, v = layout.pp, layout.interleave
    # 1F1B keeps p micro-batches in flight on the first stage; interleaving adds (p−1)/(p·v) of them
    # (Korthikanti et al. 2022, Sec. 4.2.3).
    in_flight = 1.0 if p == 1 else min(m, p) * (1 + (p - 1) / (p * v) if v > 1 else 1.0)
    acts = stage_layers(arch, p) * in_flight * layer_activation_bytes(arch, layout, seq, mbs, attention)
    if layout.fsdp:  # the layer in use and the prefetched next one are gathered in full
        acts += 2 * arch.layer_params() / layout.tp * BF16
    if layout.recompute == "full":  # the layer being recomputed holds its full activations
        working = Layout(tp=layout.tp, sequence_parallel=layout.sequence_parallel, recompute="none")
        acts += layer_activation_bytes(arch, working, seq, mbs, attention)
    return acts


def training_cost(hw: Hardware, job: JobSpec, ms: ModelStage, layout: Layout) -> StageCost | None:
    """One step of mini-batch updates; None when the layout cannot split the batch."""
    arch, value_head = job.models[ms.model], job.has_value_head(ms.model)
    alg, opts = job.algorithm, job.options
    if opts.training_efficiency:  # a framework whose training was measured below the prior (Options)
        hw = hw.with_priors(gemm_efficiency=opts.training_efficiency)
    batches = micro_batches(job, layout, job.sequences_per_step() // alg.mini_batches)
    if batches is None:
        return None
    m, seq, mbs, tokens = batches.count, batches.seq, batches.mbs, batches.tokens
    p, v = layout.pp, layout.interleave
    if v > 1 and (p == 1 or m % p or arch.layers % (p * v)):
        return None  # the interleaved schedule needs m divisible by p and whole layer chunks (Megatron-LM)
    layers = stage_layers(arch, p)
    one = _layer_pass(hw, arch, _tp_only(layout), seq, mbs, opts.attention)
    head = _head_pass(hw, arch, layout.tp, tokens, value_head)
    # Backward costs twice the forward GEMMs (input and weight gradients); full recompute adds a forward,
    # selective recompute re-runs only the attention core (Korthikanti et al. 2022, Sec. 5).
    attn = _attention_flops(arch, tokens, seq, opts.attention) / layout.tp
    recompute_flops = {"full": one.flops, "selective": attn, "none": 0.0}[layout.recompute]
    recompute_tp = one.tp_time if layout.recompute == "full" else 0.0
    recompute_hbm = one.hbm_bytes if layout.recompute == "full" else 0.0
    mb_layers = {
        "compute": hw.compute_time(layers * (3 * one.flops + recompute_flops)),
        "memory": hw.hbm_time(layers * (3 * one.hbm_bytes + recompute_hbm)),
        "tp_comm": layers * (2 * one.tp_time + recompute_tp),
        "pp_comm": 2 * v * _p2p_time(hw, arch, layout, tokens),
    }
    for k, t in moe_micro_batch_terms(hw, arch, layout, tokens, layers, training=True).items():
        mb_layers[k] = mb_layers.get(k, 0.0) + t
    mb_head = {"compute": hw.compute_time(3 * head.flops), "memory": hw.hbm_time(2 * head.hbm_bytes),
               "tp_comm": 2 * head.tp_time}
    # 1F1B with v virtual stages: m·t + (p−1)/v·t, the head's stage setting the steady pace
    # (Narayanan et al. 2021, Sec. 2.2, bubble fraction (p−1)/(v·m)).
    bubble = (p - 1) / v
    per_update_terms = {k: (m + bubble) * t for k, t in mb_layers.items()}
    for k, t in mb_head.items():
        per_update_terms[k] += m * t
    parts = param_parts(arch, layout, stage_params(arch, layout, value_head))  # dense + experts' DP groups
    per_update_terms["dp_comm"] = sum(_grad_sync_time(hw, q.layout, q.params, opts.grad_bytes, m, q.stride)
                                      for q in parts)
    per_update_terms["optimizer"] = sum(_optimizer_time(hw, q) for q in parts)
    updates = alg.mini_batches * alg.epochs
    terms = {k: updates * t for k, t in per_update_terms.items()}
    # forward and backward of every micro-batch on every stage of the pipeline schedule
    terms["overhead"] = terms.get("overhead", 0.0) + updates * 2 * (m + p - 1) * hw.priors.micro_batch_overhead_s
    state: dict[str, float] = {}
    for q in parts:
        for k, b in training_state_bytes(q.params, q.layout, opts.grad_bytes, opts.weight_bytes).items():
            state[k] = state.get(k, 0.0) + b
    acts = _training_activation_bytes(arch, layout, seq, mbs, m, opts.attention)
    logits = logits_bytes(arch, tokens, layout.tp, value_head, with_grad=True)
    on_host = _offloaded_training(hw, layout, parts, state, updates, opts, terms)
    held = {k: 0.0 if k in on_host else b for k, b in state.items()}  # on the GPU between stages
    loaded = on_host.get("weights", 0.0) + on_host.get("gradients", 0.0)  # on it only while the stage runs
    memory = {**held, "activations": acts + loaded, "logits": logits}
    terms = _shared_host(hw, layout, terms)
    return StageCost(ms, layout, terms, sum(held.values()), acts + loaded + logits, memory,
                     {"micro_batches": m, "bubble_fraction": bubble / m, "updates": updates,
                      "micro_batch_tokens": tokens})


def _offloaded_training(hw: Hardware, layout: Layout, parts: tuple[ParamPart, ...], state: dict[str, float],
                        updates: int, opts: Options, terms: dict[str, float]) -> dict[str, float]:
    """The training state ``opts.offload`` keeps on the host (``cost.offload``), its time added to ``terms``:
    a host optimizer replaces the GPU's Adam with PCIe transfers and CPU-Adam per update; offloaded weights
    and gradients are loaded and the weights put back once a step, each as ``opts.pageable_offload`` says."""
    offload, on_host = opts.offload, {}
    if offloads_optimizer(offload):
        on_host["optimizer"] = state.get("optimizer", 0.0)
        shard = [q.params / (q.layout.dp if (q.layout.fsdp or q.layout.zero1) else 1) for q in parts]
        if updates_on_host(offload):
            terms["optimizer"] = updates * sum(host_update_time(hw, n, layout.world) for n in shard)
        else:  # swapped in for the GPU's updates and out again, once a step
            pageable = offloads_optimizer(opts.pageable_offload)
            terms["optimizer"] += optimizer_swap_time(hw, on_host["optimizer"], pageable)
    if offloads_params(offload):
        on_host.update(weights=state.get("weights", 0.0), gradients=state.get("gradients", 0.0))
        moved = (param_load_time(hw, on_host["weights"] + on_host["gradients"])
                 + param_put_back_time(hw, on_host["weights"], offloads_params(opts.pageable_offload)))
        terms["overhead"] = terms.get("overhead", 0.0) + moved
    return on_host


def _grad_sync_time(hw: Hardware, layout: Layout, params: float, grad_bytes: int, micro_batches: int,
                    stride: int) -> float:
    """DP gradient all-reduce over ``layout.dp`` ranks ``stride`` apart; with ZeRO-1 a reduce-scatter of
    gradients plus an all-gather of bf16 weights (Rajbhandari et al. 2020, Sec. 7.1: same volume as
    all-reduce for P_os). FSDP / ZeRO-3 gathers the weights before each forward and backward and
    reduce-scatters gradients after each backward, per micro-batch (Sec. 7.2.2: 1.5× the all-reduce volume
    per pass; Zhao et al. 2023, FSDP)."""
    if layout.dp == 1:
        return 0.0
    if layout.fsdp:
        return micro_batches * (2 * hw.all_gather_time(params * BF16, layout.dp, stride)
                                + hw.all_gather_time(params * grad_bytes, layout.dp, stride))
    if layout.zero1:
        return (hw.all_gather_time(params * grad_bytes, layout.dp, stride)
                + hw.all_gather_time(params * BF16, layout.dp, stride))
    return hw.all_reduce_time(params * grad_bytes, layout.dp, stride)


def _optimizer_time(hw: Hardware, part: ParamPart) -> float:
    """Adam reads grad, master, m, v and writes master, m, v and the bf16 weight (Megatron optimizer);
    ZeRO-1 and FSDP shard the states over the part's DP group, FSDP the weights and gradients too."""
    layout, params = part.layout, part.params
    shard = layout.dp if (layout.zero1 or layout.fsdp) else 1
    if layout.fsdp:  # every state is sharded, so the update touches 1/dp of everything
        params /= layout.dp
    return hw.hbm_time(params * (FP32 + BF16 + 6 * FP32 / shard))


def _trains(job: JobSpec, model: str) -> bool:
    """The model has a training stage (its weights are the trainer's, not a frozen copy's)."""
    return ModelStage(model, "training") in job.model_stages()


def inference_cost(hw: Hardware, job: JobSpec, ms: ModelStage, layout: Layout) -> StageCost | None:
    """Forward pass over every sequence of the step (log-probs, values or scores)."""
    arch, value_head = job.models[ms.model], job.has_value_head(ms.model)
    batches = micro_batches(job, layout, job.sequences_per_step())
    if batches is None:
        return None
    m, seq, mbs, tokens = batches.count, batches.seq, batches.mbs, batches.tokens
    p = layout.pp
    layers = stage_layers(arch, p)
    one = _layer_pass(hw, arch, _tp_only(layout), seq, mbs, job.options.attention)
    head = _head_pass(hw, arch, layout.tp, tokens, value_head)
    fill = m + p - 1  # a forward-only pipeline (GPipe) fills and drains once
    weights = stage_params(arch, layout, value_head) * job.options.weight_bytes
    terms = {
        "compute": fill * hw.compute_time(layers * one.flops) + m * hw.compute_time(head.flops),
        "memory": fill * hw.hbm_time(layers * one.hbm_bytes) + m * hw.hbm_time(head.hbm_bytes),
        "tp_comm": fill * layers * one.tp_time + m * head.tp_time,
        "pp_comm": fill * _p2p_time(hw, arch, layout, tokens),
        "overhead": fill * hw.priors.micro_batch_overhead_s,
    }
    for k, t in moe_micro_batch_terms(hw, arch, layout, tokens, layers, training=False).items():
        terms[k] = terms.get(k, 0.0) + fill * t
    working = Layout(tp=layout.tp, sequence_parallel=layout.sequence_parallel, recompute="none")
    acts = 2 * layer_activation_bytes(arch, working, seq, mbs, job.options.attention)
    if layout.fsdp and layout.dp > 1:  # weights gathered layer by layer for every micro-batch
        terms["dp_comm"] = m * hw.all_gather_time(weights, layout.dp, layout.tp)
        acts += 2 * arch.layer_params() / layout.tp * BF16
        weights /= layout.dp
    logits = logits_bytes(arch, tokens, layout.tp, value_head, with_grad=True)  # logits + log-softmax
    resident = weights
    if offloads_params(job.options.offload):  # loaded for the stage only, put back after (``cost.offload``)
        pageable = offloads_params(job.options.pageable_offload) and _trains(job, ms.model)
        terms["overhead"] += param_round_trip_time(hw, weights, pageable)
        resident, acts = 0.0, acts + weights
    terms = _shared_host(hw, layout, terms)
    return StageCost(ms, layout, terms, resident, acts + logits,
                     {"weights": resident, "activations": acts, "logits": logits},
                     {"micro_batches": m, "micro_batch_tokens": tokens})


def generation_batches(job: JobSpec) -> float:
    """Generation batches a step draws in expectation under dynamic sampling (DAPO, Yu et al. 2025,
    arXiv:2503.14476, Sec. 3.2; ``run.filter_groups``): a batch of P prompts keeps keep-rate × P groups on
    average, so a step that trains P groups generates 1 / keep-rate batches' responses (the renewal-reward
    rate; the last batch's surplus, at most one batch, is left out). ``workload.filter_keep_rate`` is the
    prior, the controller's measured steps update it (``control.controller.with_generation_batches``). Every
    term of the stage scales, a ReMax greedy pass too: verl's DAPO trainer generates it per batch."""
    return 1.0 / job.workload.filter_keep_rate


def generation_cost(
    hw: Hardware, job: JobSpec, ms: ModelStage, layout: Layout, others_resident: float = 0.0
) -> StageCost | None:
    """Rollout with a continuously batched, paged-KV inference engine (vLLM-like) per DP replica.

    Each replica generates its share of the step's sequences with at most ``slots`` in flight: the
    engine's sequence limit, or as many as its KV cache holds at the mean context. The decode model
    (``nereus.cost.decode``: weight and KV reads, GEMMs at a shard- and batch-dependent efficiency,
    two all-reduces per layer, per-sequence and per-step engine costs) prices a bulk phase at that
    batch, slots refilling as sequences end, then the tail as the batch drains down to the longest
    response. With PP the stages take turns on one batch, so a step costs the TP replica's step plus
    the activations sent between stages (Pope et al. 2022, Sec. 3.3). ``others_resident`` is memory on
    the same devices held by colocated models, which the KV cache cannot use.
    """
    arch, wl = job.models[ms.model], job.workload
    total = job.sequences_per_step()
    if total < layout.dp:
        return None
    b = math.ceil(total / layout.dp)
    tp, p = layout.tp, layout.pp
    weights = stage_params(arch, layout, False) * job.options.weight_bytes
    kv_split = p * min(tp, arch.kv_heads)  # KV heads beyond TP are replicated
    kv_token = arch.kv_bytes_per_token() / kv_split
    budget = kv_cache_budget(hw, weights, others_resident, job.options.gpu_memory_utilization)
    min_kv = kv_token * (wl.prompt_length + wl.response.max)  # one sequence at full length must fit
    if budget < min_kv:
        need = min_kv / hw.priors.kv_memory_fraction
        return StageCost(ms, layout, {"memory": math.inf}, weights, need, {"weights": weights, "kv_cache": need},
                         {"infeasible": 1.0})
    resp, engine, calls = wl.response, job.options.rollout_engine, job.options.rollout_call_sequences
    traits = engine_traits(engine)
    held = resp.mean if traits.paged_kv else resp.max  # without paging every row's cache is held at full length
    if decodes_static(job.options):  # an engine without paging, or calls each waited for to the end
        slots = min(int(budget // (kv_token * (wl.prompt_length + held))), calls or b)
        phases = static_batch_phases(generation_replica(hw, arch, tp, job.options.weight_bytes, layout.ep, engine),
                                     wl.prompt_length, b, max(1, min(slots, b)), resp,
                                     layout.dp if traits.lockstep else 1)
    else:
        slots = int(min(ENGINE_MAX_SEQUENCES, budget // (kv_token * (wl.prompt_length + held))))
        phases = _decode_phases(hw, arch, tp, job.options.weight_bytes, wl.prompt_length, b, max(1, min(slots, b)),
                                resp, resp.longest(total), layout.ep)
    terms = {**dict.fromkeys(("compute", "memory", "tp_comm", "pp_comm", "overhead"), 0.0), **phases.terms}
    greedy = math.ceil(greedy_responses(job) / layout.dp)
    if greedy:  # ReMax's greedy response per prompt: a generation pass of its own after the step's, with its own tail
        extra = _decode_phases(hw, arch, tp, job.options.weight_bytes, wl.prompt_length, greedy,
                               max(1, min(slots, greedy)), resp, resp.longest(greedy * layout.dp), layout.ep)
        terms = {k: v + extra.terms.get(k, 0.0) for k, v in terms.items()}
    if p > 1:  # each decode step hands the live batch's activations through the p stages
        bulk_p2p = hw.p2p_time(phases.batch * arch.hidden * BF16 / tp, cross_node=False)
        terms["pp_comm"] = p * (phases.bulk_steps * bulk_p2p
                                + phases.tail_steps * hw.p2p_time(arch.hidden * BF16 / tp, cross_node=False))
    kv_used = min(budget, phases.batch * kv_token * (wl.prompt_length + held))
    terms = {k: v * generation_batches(job) for k, v in terms.items()}  # dynamic sampling's further batches
    terms = _shared_host(hw, layout, terms)
    detail = {"batch_per_replica": b, "concurrent": phases.batch, "longest": resp.longest(total),
              "prefill_s": phases.prefill_s, "bulk_s": phases.bulk_s, "tail_s": phases.tail_s,
              "bulk_step_s": phases.bulk_step_s, "tail_step_s": phases.tail_step_s,
              "memory_bound": 1.0 if phases.regime == "memory" else 0.0,
              **({"greedy_s": extra.total_s} if greedy else {})}
    return StageCost(ms, layout, terms, weights, kv_used, {"weights": weights, "kv_cache": kv_used}, detail,
                     phases)


def greedy_responses(job: JobSpec) -> int:
    """Responses a step generates beyond those it trains: one greedy response per drawn prompt when the
    advantage estimator's baseline is its score (ReMax, Li et al. 2023, arXiv:2310.10505; verl's
    ``gen_max`` pass), else none."""
    return job.workload.prompts_per_step if job.algorithm.adv_estimator in NEEDS_GREEDY_BASELINE else 0


@lru_cache(maxsize=32768)  # a 40-step run on a 64-GPU trace asks for about 8,000 distinct ones
def _decode_phases(hw: Hardware, arch: ModelArch, tp: int, weight_bytes: int, prompt: int, sequences: int,
                   slots: int, resp: ResponseLength, longest: float, ep: int = 1) -> DecodePhases:
    """The decode model for one replica (cached: the planner prices each TP degree many times)."""
    replica = generation_replica(hw, arch, tp, weight_bytes, ep)
    return decode_phases(replica, prompt, sequences, slots, resp.quantiles(16), resp.mean, longest)


def generation_replica(hw: Hardware, arch: ModelArch, tp: int, weight_bytes: int, ep: int = 1,
                       engine: str = PRICING_ENGINE) -> Replica:
    """The rollout engine's replica as the planner prices it (also the intra-step model's, cost.generation);
    ``ep``: replicas whose experts are split over that many of them (attention data parallel). The pricing
    engine's fixed step cost is the cluster's prior (a measured profile overrides it); another engine
    (``Options.rollout_engine``) brings its declared host costs, plus the host's eager dispatch of every
    kernel when it launches them from Python (``EngineTraits.eager``, ``cost.eager``)."""
    precision = Precision.of("bf16") if weight_bytes <= 2 else Precision("fp32", weight_bytes, weight_bytes)
    traits = engine_traits(engine)
    if engine == PRICING_ENGINE:
        costs = EngineCosts(hw.priors.decode_step_overhead_s, traits.host.sequence_s)
    else:
        eager = eager_step_overhead_s(arch.layers) if traits.eager else 0.0
        costs = EngineCosts(traits.host.step_s + eager, traits.host.sequence_s)
    return Replica(hw, arch, tp, precision, engine, engine_costs=costs, ep=ep)


def stage_cost(hw: Hardware, job: JobSpec, ms: ModelStage, layout: Layout,
               others_resident: float = 0.0) -> StageCost | None:
    if ms.stage == "training":
        return training_cost(hw, job, ms, layout)
    if ms.stage == "inference":
        return inference_cost(hw, job, ms, layout)
    return generation_cost(hw, job, ms, layout, others_resident)
