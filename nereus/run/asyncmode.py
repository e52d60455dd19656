"""``run.async``: generation of step k+1 overlaps inference and training of step k (one-step off-policy).

The step (``RLStep.async_step``, which ``RLStep.run_step`` runs while the mode is on, with this module's
``AsyncRollouts`` keeping the generation issued ahead):

1. take step k's rollout: the one generated during step k−1 if there is one, else generate it now;
2. issue the generation of step k+1 (``Calls.submit``, a Ray future) with the weights the generation
   layout holds now — those of step k's start, one update older than the policy step k's training produces;
3. inference, advantages and training of step k, exactly as the synchronous step; the actor's loss weights
   each token by π_old/π_rollout (``rl.offpolicy``; π_old is the inference stage's recomputed log-prob);
4. collect the generation issued in 2, then the weight sync of step k.

Why it cannot deadlock and why the weights are the ones said: every Ray actor runs its calls in the order
they were issued (``run.overlap``'s argument). The driver issues generation k+1 before any call of step
k's inference and training, and the sync of step k after them, so on a generation worker generation k+1
runs before the sync that would bring it the new weights, and the earliest unfinished call in the global
order always has every worker of its layout free of earlier calls. Generation overlaps only the stages
whose workers it does not share; stages on its workers queue behind it (allowed, but then nothing is
gained: a warning says so).

Staleness: the weights at the start of step k have taken k updates (a resumed or recovered run starts
from a checkpoint or snapshot of step k's start), so a rollout generated during step k−1 is one version
behind the policy step k trains (``async/staleness/*``), never more (asserted: at most one generation is
in flight, and the sync of step k waits for it).

Checkpoints and recovery: the generation of step k+1 is not issued when a checkpoint follows step k
(``run.checkpoint.every``) or when k is the last step, so every checkpoint is written with no generation
in flight and a run resumed from it generates its first step afresh — exactly what the uninterrupted run
did there. A step redone after a lost worker (``Runtime.recover``) drops the queued rollout and generates
anew with the snapshot's weights (staleness 0 for that step).

``auto``: the first ``AUTO_WARMUP`` steps run synchronously; from their measured stage times (the first
step excluded) the predicted async step is max(generation, everything else) + weight sync, against the
measured sequential step; async is switched on for the rest of the run when it is predicted at least
``AUTO_MARGIN`` shorter and generation shares no worker with another stage (otherwise nothing can
overlap). The decision and both predictions are in that step's metric line.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from nereus.rl.offpolicy import correction_metrics, raw_weights, rollout_is_weights
from nereus.run.generated import Generated
from nereus.run.overlap import Calls
from nereus.run.rollout import Rollout
from nereus.run.stage_keys import StageKeys
from nereus.run.step_clock import StepClock
from nereus.runtime.parallel.batch import TrainBatch
from nereus.spec.run import RunSpec

if TYPE_CHECKING:  # the step's generation issues the generation ahead; it does not import this module
    from nereus.run.generation import Issued, StepGeneration

AUTO_WARMUP = 4  # synchronous steps before `auto` decides; the first one (warm caches, first calls) is not used
AUTO_MARGIN = 0.05  # the predicted async step must be at least 5% shorter than the measured sequential one


@dataclass
class Pending:
    """A generation issued ahead: step ``step``'s rollout from the weights of version ``version``."""

    step: int
    issued: Issued
    version: int
    answer: list | None = None


def shared_workers(placed: list) -> set[int]:
    """Workers of the actor's generation layout that also run another model-stage (nothing overlaps there)."""
    gen = {r for p in placed if (p.model, p.stage) == ("actor", "generation") for r in p.ranks}
    return gen & {r for p in placed if p.stage != "generation" for r in p.ranks}


def predict(steps: list[dict[str, float]], shared: bool) -> tuple[float, float]:
    """(measured sequential step, predicted async step) in seconds from synchronous steps' metrics: the
    async step is max(generation, the rest) + weight sync; with a shared worker nothing overlaps."""
    def mean(key: str) -> float:
        return sum(m.get(key, 0.0) for m in steps) / len(steps)

    step, gen, sync = mean("timing_s/step"), mean("timing_s/gen"), mean("timing_s/update_weights")
    rest = max(0.0, step - gen - sync)
    return step, (step if shared else max(gen, rest) + sync)


class AsyncRollouts:
    """The asynchronous mode of run ``run``'s steps, whose models ``keys`` places: the generation issued
    ahead by ``generation`` through ``calls``, its time on ``clock``. ``events`` records, in order, when
    each step's generation was issued and answered and when each step's training answered."""

    def __init__(self, run: RunSpec, keys: StageKeys, generation: StepGeneration, calls: Calls,
                 clock: StepClock) -> None:
        self.run, self.spec, self.keys = run, run.async_mode, keys
        self.generation, self.calls, self.clock = generation, calls, clock
        self.enabled = self.spec.enabled == "true"
        self.pending: Pending | None = None
        self.events: list[tuple[str, int]] = []
        self.warmup: list[dict[str, float]] = []  # auto: the synchronous steps' metrics
        self.decided = self.spec.enabled != "auto"
        shared = shared_workers(keys.placed)
        if self.enabled and shared:
            print(f"nereus: warning: run.async: actor/generation shares workers {sorted(shared)} with other "
                  "model-stages; generation cannot overlap them there, so the step gains nothing (give generation "
                  "its own workers in run.layouts)", file=sys.stderr, flush=True)

    # ----- auto ---------------------------------------------------------------------------------------
    def observe(self, step: int, m: dict[str, float]) -> None:
        """After a synchronous step: ``async/enabled`` 0 and, in ``auto``, the decision once warmed up."""
        m["async/enabled"] = 0.0
        if self.decided:
            return
        self.warmup.append({k: v for k, v in m.items() if k.startswith("timing_s/")})
        if len(self.warmup) < AUTO_WARMUP:
            return
        shared = bool(shared_workers(self.keys.placed))
        seq_s, async_s = predict(self.warmup[1:], shared)
        self.enabled, self.decided = async_s < (1 - AUTO_MARGIN) * seq_s, True
        m.update({"async/decision/sequential_s": seq_s, "async/decision/predicted_async_s": async_s,
                  "async/decision/enabled": float(self.enabled)})
        print(f"nereus: run.async auto after step {step + 1}: sequential step {seq_s:.3f} s measured, async "
              f"{async_s:.3f} s predicted{' (generation shares a worker)' if shared else ''} -> "
              f"{'on' if self.enabled else 'off'}", file=sys.stderr, flush=True)

    # ----- the step -----------------------------------------------------------------------------------
    def ahead(self, step: int) -> bool:
        """Whether step ``step`` issues the next step's generation: not after the last step, and not when
        a checkpoint follows (it is written with nothing in flight)."""
        every = self.run.checkpoint_every
        return step + 1 < self.run.steps and not (every and (step + 1) % every == 0)

    def issue(self, step: int, version: int) -> None:
        """Submit step ``step``'s generation, with the same sampling parameters ``StepGeneration.generate``
        uses."""
        self.pending = Pending(step, self.generation.issue(step), version)
        self.events.append(("generation_issued", step))

    def collect(self) -> None:
        """Wait for the generation issued ahead (its time counts as this step's ``timing_s/gen``)."""
        p = self.pending
        p.answer = self.calls.wait([p.issued.call])[0]
        self.clock.add("gen", self.calls.seconds(p.issued.call))
        self.events.append(("generation_answered", p.step))

    def rollout(self, step: int, generate: Callable[[int], Generated]) -> tuple[Generated, int]:
        """Step ``step``'s generation and the policy version that generated it: the one issued ahead, or
        (the first step, after a checkpoint, a redone step) ``generate(step)`` now."""
        p, self.pending = self.pending, None
        if p is not None and p.step == step and p.answer is not None:
            roll = self.generation.packed(p.issued.prompts, p.answer, p.issued.fixed)
            return Generated(roll, p.issued.rows), p.version
        self.events.append(("generation_issued", step))
        gen = generate(step)
        self.events.append(("generation_answered", step))
        return gen, step

    def correct(self, roll: Rollout, old_logp: torch.Tensor, batch: TrainBatch) -> tuple[TrainBatch, dict[str, float]]:
        """The actor's batch with the importance weights π_old/π_rollout (π_old: ``old_logp``, the inference
        stage's; ``rl.losses.actor_loss``); with ``rollout_is_mode: mask`` the dropped tokens leave its mask.
        With it verl's ``rollout_corr/*``."""
        s = self.spec
        prox, behav, mask = old_logp, roll.gen_logp, roll.mask
        if s.rollout_is == "none":  # metrics only, as verl's rollout_is: null
            w = raw_weights(prox, behav, mask) * mask
            return batch, correction_metrics(prox, behav, mask, w, mask, s.rollout_is_threshold)
        w, keep = rollout_is_weights(prox, behav, mask, s.rollout_is, s.rollout_is_threshold, s.rollout_is_mode)
        batch = replace(batch, is_weight=w, mask=mask * keep if s.rollout_is_mode == "mask" else batch.mask)
        return batch, correction_metrics(prox, behav, mask, w, keep, s.rollout_is_threshold, s.rollout_is)

    def staleness(self, step: int, versions: torch.Tensor) -> dict[str, float]:
        """``async/staleness/{max,mean}`` over the step's samples (policy versions behind the trained one)."""
        lag = (step - versions).float()
        if float(lag.max()) > self.spec.staleness:
            raise RuntimeError(f"run.async: a sample {int(lag.max())} versions stale exceeds the bound "
                               f"{self.spec.staleness} (a bug in the run-ahead bookkeeping)")
        return {"async/enabled": 1.0, "async/staleness/max": float(lag.max()),
                "async/staleness/mean": float(lag.mean()), "async/generation_ahead": float(self.pending is not None)}
