"""What a runtime can run, as a plain value: the planner and the controller ask it which layouts to
propose, the job setup asks it whether a hand-written layout runs, instead of each rewriting layouts.

A layout option the runtime does not implement is *unsupported* when it would change what runs: in
training, activation recomputation and sequence parallelism with TP > 1; in every stage, interleaved
pipeline stages and FSDP. Elsewhere those options change nothing (inference and generation have no
backward pass to recompute for, and sequence parallelism over one TP rank is plain execution), so the
runtime runs such a layout as written, with those options off (``as_run``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from nereus.spec.job import Options
from nereus.spec.layout import Layout


class UnsupportedLayout(ValueError):
    """A layout asks for something the runtime does not implement; the message names each field."""

    def __init__(self, reasons: list[str]) -> None:
        super().__init__("; ".join(reasons))
        self.reasons = reasons


@dataclass(frozen=True)
class RuntimeCapability:
    """The layout options a runtime implements (TP, PP, DP, micro-batch size and ZeRO-1 are always)."""

    recompute: tuple[str, ...] = ("none",)
    sequence_parallel: bool = False
    max_interleave: int = 1
    fsdp: bool = False
    # expert parallelism (ep > 1) of MoE layouts in inference and training; False: the planner proposes ep=1
    # only. ``ep_generation``: in generation too (each replica decodes a different number of steps, so an
    # all-to-all per step needs an engine that keeps its EP group in lockstep)
    expert_parallel: bool = False
    ep_generation: bool = False
    # model-stages of one phase on disjoint workers run at the same time (the planner's step-time sum)
    concurrent_stages: bool = False
    # each step's rollouts are padded to its longest response for inference and training where a layout
    # has no token budget (no remove-padding): a round of shorter responses costs less there too (the lever
    # rule prices tail batching so); the planner prices such layouts so (``Options.padded_batches``)
    padded_rollouts: bool = False

    def supports(self, layout: Layout, stage: str = "training") -> list[str]:
        """Why this runtime cannot run ``layout`` for ``stage``: one reason per field, naming the fix;
        empty when it can."""
        out = []
        training = stage == "training"
        if training and layout.recompute not in self.recompute:
            out.append(f"recompute={layout.recompute!r}: the runtime implements {list(self.recompute)}; "
                       f"set recompute={self.recompute[0]}")
        if training and layout.sequence_parallel and layout.tp > 1 and not self.sequence_parallel:
            out.append("sequence_parallel with tp > 1: the runtime has no sequence parallelism; set "
                       "sequence_parallel=false")
        if layout.interleave > self.max_interleave:
            out.append(f"interleave={layout.interleave}: the runtime runs at most {self.max_interleave} virtual "
                       f"stages per device; set interleave={self.max_interleave}")
        if layout.fsdp and not self.fsdp:
            out.append("fsdp: the runtime shards only the optimizer state over DP (zero1); set fsdp=false")
        if layout.ep > 1:
            out.extend(self._ep_problems(layout, stage))
        return out

    def _ep_problems(self, layout: Layout, stage: str) -> list[str]:
        if not self.expert_parallel:
            return [f"ep={layout.ep}: the runtime has no expert parallelism; set ep=1"]
        if stage == "generation" and not self.ep_generation:
            return [f"ep={layout.ep} in generation: the engine decodes each replica alone, experts replicated "
                    "(its weights come from the EP training layout by the weight sync); set ep=1"]
        if layout.fsdp:
            return [f"ep={layout.ep} with fsdp: the runtime's ZeRO-3 buffers span all DP ranks, not expert "
                    "groups; set fsdp=false (ZeRO-1 shards the experts' optimizer state) or ep=1"]
        return []

    def as_run(self, layout: Layout, stage: str = "training") -> Layout:
        """``layout`` as this runtime runs it: the options that change nothing for ``stage`` (see the module
        docstring) set to what the runtime does. Raises ``UnsupportedLayout`` when ``supports`` objects."""
        reasons = self.supports(layout, stage)
        if reasons:
            raise UnsupportedLayout(reasons)
        kept = stage == "training" and layout.recompute in self.recompute  # no backward pass elsewhere
        recompute = layout.recompute if kept else self.recompute[0]
        sp = layout.sequence_parallel and self.sequence_parallel
        return replace(layout, recompute=recompute, sequence_parallel=sp)

    def planning_options(self, options: Options) -> Options:
        """The planner's option space narrowed to what this runtime runs, so that the candidates it
        enumerates include runnable layouts (an option fixed to an unsupported value would leave none)."""
        # "auto" (the planner picks per layout, pricing time and memory) where there is a choice
        choices = (*self.recompute, "auto") if len(self.recompute) > 1 else self.recompute
        recompute = options.recompute if options.recompute in choices else self.recompute[0]
        interleave = options.interleave
        if self.max_interleave == 1 or (isinstance(interleave, int) and interleave > self.max_interleave):
            interleave = 1
        return replace(options, recompute=recompute,
                       sequence_parallel=options.sequence_parallel and self.sequence_parallel,
                       fsdp=options.fsdp if self.fsdp else False, interleave=interleave,
                       ep=options.ep if self.expert_parallel else 1,
                       concurrent_stages=options.concurrent_stages and self.concurrent_stages,
                       padded_batches=self.padded_rollouts)
