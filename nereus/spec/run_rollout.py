"""``run.rollout`` of a job spec: the generation engine's settings (continuous-batching slots, the fixed
batch's padding, mid-step moves, the engine, speculative decoding, tail batching, partial rollout, how the
held-out prompts are answered) and the policy lag they are allowed, read and checked together because each
lever needs the others' choices."""

from __future__ import annotations

from dataclasses import dataclass, replace

from nereus.spec.errors import SpecError
from nereus.spec.fields import MAX_STEPS, Fields
from nereus.spec.levers import TailBatching, check_policy_lag
from nereus.spec.rollout import (
    PartialRolloutConfig,
    RolloutEngine,
    read_engine,
    read_partial_rollout,
    read_tail_batching,
)

# Continuous-batching slots per generation replica: each slot holds one sequence's KV caches; vLLM's
# max_num_seqs defaults to 256, past which a tiny CPU model gains nothing.
MAX_SLOTS = 4096
MIDSTEP_TRANSFERS = ("auto", "kv", "refill")
LEVER_CHOICES = ("none", "auto")


@dataclass(frozen=True)
class MidstepSpec:
    """``run.rollout.midstep``: the controller moves unfinished sequences between generation replicas
    mid-step (``run.midstep``). ``trigger``: a replica takes sequences once its unfinished ones fill less
    than this share of its slots; ``margin``: a move is admitted when its predicted gain exceeds
    ``margin`` × its predicted cost; ``chunk``: iterations between two looks; ``transfer``: ``kv`` sends
    the caches, ``refill`` re-prefills them, ``auto`` picks the cheaper per sequence by the cost model."""

    trigger: float = 0.5
    margin: float = 1.5
    chunk: int = 4
    transfer: str = "auto"
    calibrate: bool = True  # False: decide on the cost model's priors alone (reproducible decisions)
    # the engine with mid-step moves generates every k-th step (0, k, 2k...); with k > 1 the steps between
    # generate with the fixed batch (on a CPU the engine's one-row micro-batches cost ~8x the fixed batch)
    every: int = 1


@dataclass(frozen=True)
class ValKwargs:
    """``run.rollout.val_kwargs`` (verl's ``actor_rollout_ref.rollout.val_kwargs``): how the held-out prompts
    are answered. The default is greedy, one response each; with ``do_sample`` each prompt gets ``n``
    responses sampled at ``temperature`` and ``top_p``, and the accuracy is their mean (verl's
    ``reward/mean@n``): an estimate of the sampled policy's success rate that moves smoothly with it, where
    greedy accuracy on a few distinct prompts jumps by each prompt's whole share when its argmax flips."""

    n: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    do_sample: bool = False

    @property
    def samples(self) -> int:
        return self.n if self.do_sample else 1

    @property
    def sampling_temperature(self) -> float:
        return self.temperature if self.do_sample else 0.0


@dataclass(frozen=True)
class RolloutSection:
    """What ``run.rollout`` (and ``run.policy_lag``) chose, checked against each other."""

    slots: int
    pad_to_max: bool
    midstep: MidstepSpec | None
    engine: RolloutEngine
    tail: TailBatching | None
    partial: PartialRolloutConfig | None
    policy_lag: int
    levers: str = "none"
    val_kwargs: ValKwargs = ValKwargs()


def _midstep(rollout: Fields, slots: int) -> MidstepSpec | None:
    """``run.rollout.midstep`` (None unless ``enabled``); it needs the continuous-batching engine."""
    if not rollout.has("midstep"):
        return None
    m = rollout.sub("midstep")
    enabled = m.get("enabled", bool, False)
    spec = MidstepSpec(trigger=m.get("trigger", float, 0.5, minimum=0, maximum=1),
                       margin=m.get("margin", float, 1.5, minimum=0),
                       chunk=m.get("chunk", int, 4, minimum=1, maximum=MAX_STEPS),
                       transfer=m.get("transfer", str, "auto", choices=MIDSTEP_TRANSFERS),
                       calibrate=m.get("calibrate", bool, True),
                       every=m.get("every", int, 1, minimum=1, maximum=MAX_STEPS))
    m.finish()
    if enabled and slots < 1:
        raise SpecError(m.key_path("enabled"), "mid-step moves run on the continuous-batching engine: set "
                                               "run.rollout.slots > 0 (sequences per replica)")
    return spec if enabled else None


def _val_kwargs(rollout: Fields) -> ValKwargs:
    """``run.rollout.val_kwargs``: greedy unless ``do_sample``; sampling needs a temperature above 0."""
    if not rollout.has("val_kwargs"):
        return ValKwargs()
    v = rollout.sub("val_kwargs")
    spec = ValKwargs(n=v.get("n", int, 1, minimum=1, maximum=1024),
                     temperature=v.get("temperature", float, 0.0, minimum=0),
                     top_p=v.get("top_p", float, 1.0, minimum=0, maximum=1),
                     do_sample=v.get("do_sample", bool, False))
    v.finish()
    if not spec.do_sample and spec.n > 1:
        raise SpecError(v.key_path("n"), f"{spec.n} greedy responses would all be the same: set do_sample: true "
                                         "to sample them, or n: 1")
    if spec.do_sample and (spec.temperature <= 0 or spec.top_p <= 0):
        key, value = ("temperature", spec.temperature) if spec.temperature <= 0 else ("top_p", spec.top_p)
        raise SpecError(v.key_path(key), f"{value} leaves nothing to sample with do_sample: true: give a value "
                                         "above 0 (verl's val_kwargs use temperature 1.0, top_p 1.0)")
    return spec


def _refill_only(midstep: MidstepSpec, engine: RolloutEngine, key: str) -> MidstepSpec:
    """An engine whose moves re-prefill (``migration: refill``: its KV blocks stay inside it, so a move
    aborts the request and re-prefills it on the other engine) reads ``auto`` as ``refill`` and refuses
    ``kv``."""
    if midstep.transfer == "kv":
        raise SpecError(key, f"kv: the {engine.traits.label} engine moves sequences by re-prefill (abort, then "
                        "prefill their prompt and tokens so far on the other engine): use refill or auto, or "
                        "engine: native")
    return replace(midstep, transfer="refill")


def _check_engine_runs(engine: RolloutEngine, midstep: MidstepSpec | None, tail: TailBatching | None,
                       partial: PartialRolloutConfig | None) -> None:
    """Each lever refused, naming its key, where the engine declares it cannot carry it out."""
    t = engine.traits
    refused = [("run.rollout.midstep", midstep is not None and t.migration == "none", "moves no sequences"),
               ("run.rollout.speculative", engine.speculative is not None and t.speculation == "none",
                "does not speculate"),
               ("run.rollout.tail_batching", tail is not None and not t.rounds, "runs no rounds"),
               ("run.rollout.partial_rollout", partial is not None and not t.rounds, "runs no rounds")]
    for key, no, why in refused:
        if no:
            raise SpecError(key, f"the {t.label} engine {why}: remove it, or use engine: native")


def read_rollout_section(f: Fields) -> RolloutSection:
    """``run.rollout`` and ``run.policy_lag`` of the ``run`` section ``f``: each lever refused, naming its
    key, where the engine or another lever cannot carry it out."""
    rollout = f.sub("rollout")
    slots = rollout.get("slots", int, 0, minimum=0, maximum=MAX_SLOTS)
    pad_to_max = rollout.get("pad_to_max", bool, False)
    midstep = _midstep(rollout, slots)
    engine = read_engine(rollout)
    if midstep is not None and engine.traits.migration == "refill":
        midstep = _refill_only(midstep, engine, rollout.key_path("midstep.transfer"))
    tail = read_tail_batching(rollout)
    if tail is not None and midstep is not None:
        raise SpecError("run.rollout.tail_batching", "and mid-step moves are two rules for the same tail: "
                        "remove midstep or tail_batching")
    partial = read_partial_rollout(rollout)
    lag = check_policy_lag(f.get("policy_lag", int, 0), f.key_path("policy_lag"))
    if partial is not None and (midstep is not None or tail is not None):
        raise SpecError("run.rollout.partial_rollout", "runs without midstep or tail_batching: remove the "
                        "others")
    if partial is not None and lag < 1:
        raise SpecError("run.policy_lag", "partial rollout trains tokens one policy version old: set "
                        "run.policy_lag: 1, or remove run.rollout.partial_rollout")
    _check_engine_runs(engine, midstep, tail, partial)
    levers = rollout.get("levers", str, "none", choices=LEVER_CHOICES)
    _check_auto_levers(levers, engine, midstep, tail, partial)
    val_kwargs = _val_kwargs(rollout)
    rollout.finish()
    return RolloutSection(slots, pad_to_max, midstep, engine, tail, partial, lag, levers, val_kwargs)


def _check_auto_levers(levers: str, engine: RolloutEngine, midstep: MidstepSpec | None, tail: TailBatching | None,
                       partial: PartialRolloutConfig | None) -> None:
    """``levers: auto`` leaves speculation and tail batching to the controller: each fixed lever key, an
    engine that cannot switch speculation inside a step (vLLM's is fixed at its start) and mid-step moves
    (a rule of their own) are refused."""
    if levers != "auto":
        return
    fixed = [k for k, v in (("speculative", engine.speculative), ("tail_batching", tail),
                            ("partial_rollout", partial), ("midstep", midstep)) if v is not None]
    if fixed:
        raise SpecError("run.rollout.levers", f"auto: the controller chooses the levers; remove run.rollout."
                        f"{fixed[0]}, or set levers: none to keep it fixed")
    t = engine.traits
    if t.speculation != "live":
        why = "speculation is fixed when its engine starts" if t.speculation == "fixed" else "engine does not speculate"
        # under the engine's key: it is what a command line (verl's rollout.name=vllm) most often changes
        raise SpecError("run.rollout.engine", f"{t.name} cannot run run.rollout.levers: auto ({t.label}'s {why}): "
                        "set run.rollout.levers: none, or engine: native")
