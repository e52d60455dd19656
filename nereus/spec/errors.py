"""The one error type of a job spec, plan or layout: it names the key path and the fix.

Messages are built with bounded work and bounded size whatever the input (docs/reliability.md, "One-line
errors"): a value is shown through ``brief`` (a few items of a container, a few dozen characters of a
string, never the expansion of a YAML alias), and a ``SpecError`` cuts its key path and message.
"""

from __future__ import annotations

from typing import Any

# A key path or message longer than this is cut: no sensible key path nears it, and one line of an error
# stays readable on a terminal. A message names a value through ``brief``, so only file paths are long.
MAX_PATH_CHARS = 300
MAX_MESSAGE_CHARS = 2000


def cut(text: str, limit: int) -> str:
    """``text`` on one line, at most ``limit`` characters (an ellipsis marks the cut)."""
    text = text.replace("\r", "\\r").replace("\n", "\\n")
    return text if len(text) <= limit else text[: max(0, limit - 3)] + "..."


def brief(value: Any, limit: int = 60) -> str:
    """A short ``repr`` of ``value`` built in bounded work: at most 4 items per container and 3 levels
    deep, strings and numbers cut, integers past 64 bits described by their size (their decimal form is
    quadratic to build). A container shared many times (a YAML alias bomb) is never walked in full."""
    return cut(_brief(value, 3), limit)


def _brief(value: Any, depth: int) -> str:
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, int):
        return f"an integer of {value.bit_length()} bits" if value.bit_length() > 64 else repr(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (str, bytes)):
        return repr(value[:50]) + ("..." if len(value) > 50 else "")
    if isinstance(value, (list, tuple, dict, set, frozenset)):
        if depth == 0:
            return "[...]" if isinstance(value, list) else "{...}" if isinstance(value, dict) else "(...)"
        if isinstance(value, dict):
            items = [f"{_brief(k, depth - 1)}: {_brief(v, depth - 1)}" for k, v in _first(value.items())]
            open_, close = "{", "}"
        else:
            items = [_brief(v, depth - 1) for v in _first(value)]
            open_, close = ("[", "]") if isinstance(value, list) else ("(", ")")
        more = ", ..." if len(value) > 4 else ""
        return open_ + ", ".join(items) + more + close
    return f"<{type(value).__name__}>"


def _first(items: Any) -> list:
    out = []
    for item in items:
        if len(out) == 4:
            break
        out.append(item)
    return out


class SpecError(ValueError):
    """Bad input in a spec; ``path`` is the dotted key path (``models.actor.layers``)."""

    def __init__(self, path: str, message: str) -> None:
        self.path = cut(str(path), MAX_PATH_CHARS)
        self.message = cut(str(message), MAX_MESSAGE_CHARS)
        super().__init__(f"{self.path}: {self.message}" if self.path else self.message)


class InfeasibleError(ValueError):
    """No layout of some model-stage fits the devices it may use.

    Carries the model-stage, the smallest per-device memory any layout needs and the capacity, so the
    message tells the user how far off the job is.
    """

    def __init__(self, model_stage: str, needed_bytes: float, capacity_bytes: float, detail: str = "") -> None:
        self.model_stage = model_stage
        self.needed_bytes = needed_bytes
        self.capacity_bytes = capacity_bytes
        if needed_bytes > 0:
            msg = (f"{model_stage}: no layout fits: it needs at least {needed_bytes / 1e9:.1f} GB per device, "
                   f"capacity is {capacity_bytes / 1e9:.1f} GB" + (f" ({detail})" if detail else ""))
        else:
            msg = f"{model_stage}: {detail}"
        super().__init__(msg)


class RuntimeFailure(RuntimeError):
    """The machine or cluster failed the run (a wait past its deadline, workers that never answered), not
    the input and not the code: the CLI prints one line and exits 1; checkpoints already written stay
    valid for ``--resume``."""


def check_format(d: object, expected: str, known: set[str], where: str) -> None:
    """A serialised value's ``format`` tag is ``expected`` and its keys are among ``known`` (plus the tag):
    a one-line error naming the key otherwise."""
    if not isinstance(d, dict) or d.get("format") != expected:
        got = d.get("format") if isinstance(d, dict) else type(d).__name__
        raise SpecError(f"{where}.format", f"expected {expected!r}, got {got!r}")
    extra = sorted(set(d) - known - {"format"})
    if extra:
        raise SpecError(f"{where}.{extra[0]}", f"unknown key; known: {', '.join(sorted(known))}")
