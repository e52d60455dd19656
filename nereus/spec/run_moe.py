"""``run.router_replay``: whether training replays the experts generation routed each token to (docs/moe.md,
"Router replay"). Unset, it is on for a Mixture-of-Experts actor; true on a dense actor is refused (no router
to replay). verl's ``actor_rollout_ref.rollout.enable_rollout_routing_replay`` sets it (with
``actor.router_replay.mode: R3``, verl's name for replaying the rollout's routing)."""

from __future__ import annotations

from nereus.spec.errors import SpecError
from nereus.spec.fields import Fields

KEY = "run.router_replay"


def read_router_replay(f: Fields) -> bool | None:
    """``run.router_replay`` as given (None: the default, on for an MoE actor)."""
    return f.get("router_replay", bool, None)


def router_replay_on(configured: bool | None, moe: bool) -> bool:
    """Whether the job records and replays routes: ``configured``, else whether the actor is an MoE model."""
    return moe if configured is None else configured


def check_router_replay(configured: bool | None, moe: bool) -> None:
    """A dense actor with router replay asked for is refused, naming the key."""
    if configured and not moe:
        raise SpecError(KEY, "true on a dense model, no experts: router replay needs a Mixture-of-Experts actor; "
                             "remove the key or set it false")
