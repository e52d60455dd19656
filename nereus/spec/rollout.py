"""``run.rollout.engine``: which inference engine generates the rollouts, and its settings; and the
tail levers a job fixes in ``run.rollout`` (speculative decoding, tail batching, partial rollout).

``native`` is the runtime's own engine (``runtime.engines.native``: any TP·PP·DP layout, the exact
reference); ``vllm`` runs one vLLM engine per generation replica (``runtime.engines.vllm``). What each can
do is declared in ``spec.engines`` (``RolloutEngine.traits``). Names follow verl's
``actor_rollout_ref.rollout`` (``name``, ``gpu_memory_utilization``, ``enforce_eager``, ``enable_chunked_prefill``,
``max_num_batched_tokens``).

Speculation and tail batching read straight into the plan's lever types (``spec.levers``): the value the
engine carries out is the one the policy would decide. The checks here need the job's models and layouts,
so they run once the whole job is read (``check_rollout_engine``); they only ask whether the engine's
package is installed (``importlib``), never import it.
"""

from __future__ import annotations

from dataclasses import dataclass

from nereus.spec.engines import DEFAULT_ENGINE, ENGINE_TRAITS, RUNNABLE, EngineTraits
from nereus.spec.errors import SpecError
from nereus.spec.fields import Fields
from nereus.spec.levers import Speculation, TailBatching

ENGINES = RUNNABLE  # the run.rollout.engine choices
SPECULATION_METHODS = ("ngram",)  # run.rollout.speculative.method: vLLM's n-gram proposer's name
# no live-batch bound unless run.rollout.speculative.max_live gives one
UNBOUNDED_LIVE = 2**31
# run.rollout.native_decode: how the native engine decodes a fixed batch (runtime.engines.native.graphed_decode)
NATIVE_DECODES = ("auto", "graphed", "static", "loop")


def read_speculation(rollout: Fields) -> Speculation | None:
    """``run.rollout.speculative`` (vLLM's ``speculative_config`` keys: ``method: ngram``,
    ``num_speculative_tokens``, ``prompt_lookup_max``, ``prompt_lookup_min``) as the speculation lever.
    ``max_live``: speculate only while at most this many sequences are live (an engine whose speculation
    is fixed at its start speculates always)."""
    if not rollout.has("speculative"):
        rollout.sub("speculative")  # read: an absent section is no unknown key
        return None
    f = rollout.sub("speculative")
    lo = f.get("prompt_lookup_min", int, 1, minimum=1, maximum=64)
    out = Speculation(draft=f.get("method", str, "ngram", choices=SPECULATION_METHODS),
                      draft_tokens=f.get("num_speculative_tokens", int, 4, minimum=1, maximum=64),
                      live_at_most=f.get("max_live", int, UNBOUNDED_LIVE, minimum=1),
                      prompt_lookup_max=f.get("prompt_lookup_max", int, max(3, lo), minimum=lo, maximum=64),
                      prompt_lookup_min=lo)
    f.finish()
    return out


def _over_launch(rollout: Fields, key: str, maximum: float) -> float | None:
    """``run.rollout.<key>.over_launch`` of a lever section (None: the section is absent)."""
    f = rollout.sub(key)
    if not rollout.has(key):
        return None
    value = f.get("over_launch", float, 1.5, minimum=1.0, maximum=maximum)
    f.finish()
    return value


def read_tail_batching(rollout: Fields) -> TailBatching | None:
    """``run.rollout.tail_batching``: over-launch, keep the first groups that finish, defer the rest
    (RollPacker, arXiv 2509.21009; priced by ``cost.tail.tail_batching``). A short round launches
    ``over_launch`` × the step's prompts and keeps the first step's worth of whole groups; once a step's
    worth of deferred prompts has accumulated, a long round regenerates them from scratch (``run.tail``)."""
    over_launch = _over_launch(rollout, "tail_batching", 16.0)
    return None if over_launch is None else TailBatching(over_launch=over_launch)


@dataclass(frozen=True)
class PartialRolloutConfig:
    """``run.rollout.partial_rollout``: over-launch, keep the first groups that finish, carry the others'
    partial responses to the next step and resume them there (``run.partial``; needs ``run.policy_lag:
    1``). ``over_launch`` ≤ 2: a carried group must finish in the next step."""

    over_launch: float = 1.5


def read_partial_rollout(rollout: Fields) -> PartialRolloutConfig | None:
    over_launch = _over_launch(rollout, "partial_rollout", 2.0)  # a carried group finishes in the next step
    return None if over_launch is None else PartialRolloutConfig(over_launch=over_launch)


@dataclass(frozen=True)
class RolloutEngine:
    """``run.rollout``'s engine keys. ``cpu_kv_cache_gib``: the KV cache a CPU engine preallocates (vLLM's
    ``kv_cache_memory_bytes``; its ``VLLM_CPU_KVCACHE_SPACE`` in whole GiB); ``gpu_memory_utilization`` is
    vLLM's share of a GPU's memory (verl's default 0.5: the trainer shares the device)."""

    engine: str = DEFAULT_ENGINE
    gpu_memory_utilization: float = 0.5
    cpu_kv_cache_gib: float = 1.0
    enforce_eager: bool = True
    speculative: Speculation | None = None  # run.rollout.speculative
    # vLLM's scheduler (verl's rollout keys of the same names); None: vLLM's own default
    enable_chunked_prefill: bool | None = None
    max_num_batched_tokens: int | None = None
    # the native engine's fixed batch: CUDA graphs over static buffers (graphed), the same buffers eager
    # (static), the per-step loop (loop); auto: graphed on a CUDA device, the loop elsewhere
    native_decode: str = "auto"

    def scheduler_args(self) -> dict[str, object]:
        """The vLLM scheduler arguments the job sets (``LLM(**...)``); the native engine has no prefill budget."""
        return {k: v for k, v in (("enable_chunked_prefill", self.enable_chunked_prefill),
                                  ("max_num_batched_tokens", self.max_num_batched_tokens)) if v is not None}

    @property
    def traits(self) -> EngineTraits:
        """What the engine can do and costs (``spec.engines``): everything outside the engine asks these."""
        return ENGINE_TRAITS[self.engine]

    @property
    def live_speculation(self) -> Speculation | None:
        """The speculation each generation call carries (``run.rollout.speculative``) for an engine that
        takes it per call; None for one that fixed it when it started (or none at all)."""
        return self.speculative if self.traits.speculation == "live" else None


def read_engine(rollout: Fields) -> RolloutEngine:
    return RolloutEngine(engine=rollout.get("engine", str, DEFAULT_ENGINE, choices=ENGINES),
                         gpu_memory_utilization=rollout.get("gpu_memory_utilization", float, 0.5, minimum=0.01,
                                                            maximum=1.0),
                         cpu_kv_cache_gib=rollout.get("cpu_kv_cache_gib", float, 1.0, minimum=0.001,
                                                      maximum=1024),
                         enforce_eager=rollout.get("enforce_eager", bool, True),
                         enable_chunked_prefill=rollout.get("enable_chunked_prefill", bool, None),
                         max_num_batched_tokens=rollout.get("max_num_batched_tokens", int, None, minimum=1),
                         native_decode=rollout.get("native_decode", str, "auto", choices=NATIVE_DECODES),
                         speculative=read_speculation(rollout))


def check_rollout_engine(engine: RolloutEngine, head_dims: dict[str, int], layouts: dict[str, object],
                         installed: str | None, moe: bool = False) -> None:
    """One-line errors, before any process starts, for an engine this installation cannot run: its package
    missing, a head size its CPU build refuses, a Mixture-of-Experts actor (``moe``) whose weights it cannot
    take from the trainer, a generation layout it does not run. ``installed``:
    ``spec.engines.installed_distribution(engine.traits)``."""
    t, native = engine.traits, f"run.rollout.engine: {DEFAULT_ENGINE}"
    if t.package is not None and installed is None:
        raise SpecError("run.rollout.engine", f"{t.package} is not installed: {t.install_hint}; or use engine: "
                        f"{DEFAULT_ENGINE}")
    if moe and not t.syncs_moe:
        raise SpecError("run.rollout.engine", f"the actor is a Mixture-of-Experts model, whose expert and router "
                        f"weights the {t.label} engine does not take from the trainer in place yet; use engine: "
                        f"{DEFAULT_ENGINE}")
    actor = head_dims["actor"]
    if t.cpu_head_sizes and installed == t.cpu_distribution and actor not in t.cpu_head_sizes:
        raise SpecError("models.actor", f"head size {actor} (hidden / heads) is not one {t.label}'s CPU attention "
                        f"supports ({', '.join(map(str, t.cpu_head_sizes))}): change hidden or heads, or use {native}")
    gen = layouts.get("actor/generation")
    if gen is not None and not t.runs_pp(gen.pp):
        raise SpecError("run.layouts.actor/generation", f"{gen.short()}: {one_engine_per_replica(t)} (give tp and "
                        f"dp), or use {native}")


def one_engine_per_replica(t: EngineTraits) -> str:
    """Why a generation layout with pipeline stages is refused for an engine that runs without them."""
    return (f"the {t.label} engine runs one engine per data-parallel replica, tensor-parallel at the layout's "
            f"TP, with pp={t.max_pp}")
