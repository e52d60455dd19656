"""The error of a transition that cannot fit: it names the device, the bytes needed and the capacity."""

from __future__ import annotations

from nereus.spec.errors import InfeasibleError


class TransitionMemoryError(InfeasibleError):
    """A device cannot hold what a transition needs on it, even with chunked staging and memory detours.

    A subclass of ``InfeasibleError`` (so callers that refuse infeasible plans refuse this too) with its
    own message: ``device``, ``needed_bytes``, ``capacity_bytes`` and what the bytes are for.
    """

    def __init__(self, device: int, needed_bytes: float, capacity_bytes: float, what: str) -> None:
        self.device = device
        self.model_stage = ""
        self.needed_bytes = needed_bytes
        self.capacity_bytes = capacity_bytes
        self.what = what
        ValueError.__init__(self, f"GPU {device}: the transition needs {human_bytes(needed_bytes)} for {what}, "
                                  f"capacity is {human_bytes(capacity_bytes)} (usable: device memory less the "
                                  f"runtime's reserve)")


def human_bytes(n: float) -> str:
    """Bytes in GB, MB or kB (decimal, as the rest of nereus reports memory), or plain bytes."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} bytes"
