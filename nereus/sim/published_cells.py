"""A published-runs row's cells read as values (``sim.published_runs``): text, numbers, whole counts, one of
a column's known words, and yes/no settings a row states in its notes. A cell that is none of what its
column holds skips the row with the reason (``RowSkipped``), never a crash or a silent guess."""

from __future__ import annotations

import math
import re

# The largest whole number a row's count may hold (GPUs, tokens, sequences): the largest published runs
# count ~10^5 GPUs or 10^6 tokens a sequence, so a cell beyond 2^31 - 1 is a typo.
LARGEST_COUNT = 2**31 - 1
# The most layers a row's model may have: the deepest published LLMs have ~10^2 (Llama-3.1-405B 126), and
# the architecture is built layer by layer, so a typo's count would stall the validation, not price a model.
LARGEST_LAYERS = 10_000
# A yes/no setting a schema without its column states in ``notes`` as ``key=True|False`` (the shared
# verl rows: "checkpoint_engine=False, default CE config").
NOTE_SETTING = r"\b{key}\s*=\s*(true|false|yes|no)\b"


class RowSkipped(Exception):
    """A row the model cannot price; the message is the reason the validation prints."""


def text(row: dict, key: str) -> str:
    return (row.get(key) or "").strip()


def number(row: dict, key: str) -> float | None:
    """A numeric cell: None when empty; a cell that is not a number skips the row."""
    value = text(row, key)
    if not value:
        return None
    try:
        out = float(value)
    except ValueError:
        raise RowSkipped(f"{key}={value!r} is not a number") from None
    if not math.isfinite(out) or out < 0:
        raise RowSkipped(f"{key}={value!r} is not a finite non-negative number")
    return out


def count(row: dict, key: str, required: str = "", largest: int = LARGEST_COUNT) -> int | None:
    """A positive whole number up to ``largest``; with ``required`` (why it is needed) an empty cell skips
    the row."""
    value = number(row, key)
    if value is None:
        if required:
            raise RowSkipped(f"{key} is empty ({required})")
        return None
    if value < 1 or value != int(value):
        raise RowSkipped(f"{key}={text(row, key)!r} is not a positive whole number")
    if value > largest:
        raise RowSkipped(f"{key}={text(row, key)!r} is larger than any run's (at most {largest:,})")
    return int(value)


def layer_count(row: dict) -> int:
    """The model's ``n_layers`` (required), at most ``LARGEST_LAYERS``."""
    layers = count(row, "n_layers", "the architecture", LARGEST_LAYERS)
    assert layers is not None  # required: an empty cell raised
    return layers


def enum(row: dict, key: str, choices, default: str = "") -> str:
    value = text(row, key).lower() or default
    if value not in choices:
        raise RowSkipped(f"{key}={text(row, key)!r} is not modelled (known: {', '.join(choices)})")
    return value


def setting(row: dict, key: str, default: str) -> str:
    """An optional yes/no setting: the row's column, else a ``key=True|False`` its notes state, else
    ``default``."""
    if text(row, key):
        return enum(row, key, ("yes", "no"))
    stated = re.search(NOTE_SETTING.format(key=key), text(row, "notes"), re.IGNORECASE)
    if stated is None:
        return default
    return "yes" if stated.group(1).lower() in ("true", "yes") else "no"
