"""Reading a nested mapping with key paths, so every error says where it is and what is allowed."""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from nereus.spec import files
from nereus.spec.errors import SpecError, brief

_MISSING = object()

# Sizes checked before anything is allocated or looped over (docs/reliability.md, "One-line errors").
# Where a key has no tighter bound, an integer must fit in 64 bits: the cost model and numpy take it.
MAX_INT = 2**63 - 1
# The largest single-job clusters of 2024 have about 10^5 GPUs (e.g. 100k H100); the planner and the
# simulator keep per-device state, so a larger count is refused rather than allocated.
MAX_GPUS = 100_000
# Published RL runs are at most ~10^4 steps (DeepSeek-R1-Zero: ~10k); the simulator takes ~0.05 s a step
# and keeps a record per step, so 10^5 steps (about an hour, ~30 MB of run record) bounds its loop.
MAX_STEPS = 100_000
# The deepest published transformers have ~128 layers (GPT 1T: 128, Llama 3.1 405B: 126); the planner
# tries pipeline splits per layer count, so 10^9 layers would never finish.
MAX_LAYERS = 1_000
# Tokens of one sequence: 2^22 (4M) is beyond every model's context window.
MAX_TOKENS = 2**22
# Sequences of one step: the cost model and the simulator handle a step's batch as a whole; 10^7 is
# ~1,000x the largest published RL batches (verl, DAPO: 512 prompts x 16 samples).
MAX_SEQUENCES = 10**7
# Seeds go to numpy's generator (0 <= seed < 2^32).
MAX_SEED = 2**32 - 1


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false",
             dict: "a mapping", list: "a list"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def read_json_file(path: str | Path, kind: str, max_bytes: int = files.MAX_SPEC_BYTES) -> Any:
    """The JSON in ``path``; a missing, unreadable or malformed file is a SpecError naming it and the line."""
    return files.read_json_file(path, kind, max_bytes)


def check_number(value: Any, where: str) -> None:
    """Refuse NaN and infinities (every comparison with NaN is false, so no range check catches it) and
    integers beyond 64 bits."""
    if isinstance(value, float) and not math.isfinite(value):
        raise SpecError(where, f"{value!r} is not a finite number; give a finite value")
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
        raise SpecError(where, f"{_short(value)} is out of range; must fit in 64 bits")


def _short(value: Any) -> str:
    """``repr`` of a value cut to one short line, in bounded work (a pasted blob or a YAML alias bomb
    must not flood the error or take minutes to render: ``errors.brief``)."""
    return brief(value)


_YAML11_BOOLS = {"yes", "no", "on", "off", "y", "n"}
# YAML 1.1 numbers that YAML 1.2 reads as text: binary, sexagesimal (1:30) and with _ separators (1_000)
_YAML11_NUMBER = re.compile(r"[-+]?(?:0b[01_]+|[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?"
                            r"|[0-9][0-9_]*_[0-9_]*(?:\.[0-9_]*)?)")


def yaml11_hint(value: Any, kinds: tuple[type, ...]) -> str:
    """Why a YAML 1.1 spelling is text here: job files are read as YAML 1.2 (``files.StrictLoader``)."""
    if not isinstance(value, str):
        return ""
    if bool in kinds and value.lower() in _YAML11_BOOLS:
        return " (job files are YAML 1.2, where yes/no/on/off are text: write true or false)"
    if (int in kinds or float in kinds) and _YAML11_NUMBER.fullmatch(value):
        return " (job files are YAML 1.2: write the number without _ separators, 0b prefixes or : parts)"
    return ""


class Fields:
    """One mapping of a spec under a key path; ``finish()`` rejects keys nobody asked for."""

    def __init__(self, data: Any, path: str) -> None:
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise SpecError(path or "<root>", f"expected a mapping, got {type(data).__name__}")
        self.data = data
        self.path = path
        self._read: set[str] = set()

    def key_path(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def has(self, key: str) -> bool:
        return key in self.data

    def get(
        self,
        key: str,
        kind: type | tuple[type, ...],
        default: Any = _MISSING,
        *,
        choices: Iterable[Any] | None = None,
        minimum: float | None = None,
        maximum: float | None = None,
    ) -> Any:
        """The value under ``key``, checked for type, choices and range."""
        self._read.add(key)
        where = self.key_path(key)
        if key not in self.data or self.data[key] is None:
            if default is _MISSING:
                raise SpecError(where, f"required key is missing; expected {_kind_name(kind)}")
            return default
        value = self.data[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if isinstance(value, bool) and bool not in kinds:
            raise SpecError(where, f"expected {_kind_name(kind)}, got {value!r}")
        check_number(value, where)  # before float(): an integer past 1e308 does not convert
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kinds):
            raise SpecError(where, f"expected {_kind_name(kind)}, got {_short(value)}{yaml11_hint(value, kinds)}")
        if choices is not None:
            allowed = list(choices)
            if value not in allowed:
                raise SpecError(where, f"{_short(value)} is not allowed; choose one of {allowed}")
        if minimum is not None and value < minimum:
            raise SpecError(where, f"{_short(value)} is out of range; must be >= {minimum}")
        if maximum is not None and value > maximum:
            raise SpecError(where, f"{_short(value)} is out of range; must be <= {maximum}")
        return value

    def get_list(self, key: str, item_kind: type, default: Any = _MISSING) -> list:
        """A list whose every item has ``item_kind``; errors name the offending index."""
        items = self.get(key, list, default)
        for i, item in enumerate(items):
            if not isinstance(item, item_kind) or isinstance(item, bool) and item_kind is not bool:
                raise SpecError(f"{self.key_path(key)}[{i}]", f"expected {_kind_name(item_kind)}, got {_short(item)}")
            check_number(item, f"{self.key_path(key)}[{i}]")
        return items

    def sub(self, key: str, required: bool = False) -> Fields:
        self._read.add(key)
        if required and key not in self.data:
            raise SpecError(self.key_path(key), "required section is missing")
        return Fields(self.data.get(key), self.key_path(key))

    def finish(self) -> None:
        """Refuse keys that were never read: a typo must not pass silently."""
        known = sorted(self._read)
        for key in self.data:
            if key not in self._read:
                hint = difflib.get_close_matches(str(key)[:200], known, n=3)  # a pasted blob: bounded work
                fix = f"did you mean '{hint[0]}'?" if hint else f"allowed keys: {known}"
                if len(hint) > 1:  # the next nearest too (a command-line override is easy to mistype)
                    fix += " (also close: " + ", ".join(f"'{h}'" for h in hint[1:]) + ")"
                raise SpecError(self.key_path(str(key)), f"unknown key; {fix}")
