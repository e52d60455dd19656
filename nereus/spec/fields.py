"""Reading a nested mapping with key paths, so every error says where it is and what is allowed."""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from nereus.spec.errors import SpecError

_MISSING = object()


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false",
             dict: "a mapping", list: "a list"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def read_json_file(path: str | Path, kind: str) -> Any:
    """The JSON in ``path``; a missing or malformed file is a SpecError naming it and the line."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise SpecError(str(path), f"{kind} file not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        where = f" ({err.msg} at line {err.lineno})" if isinstance(err, json.JSONDecodeError) else ""
        raise SpecError(str(path), f"not a valid {kind} file: invalid JSON{where}") from None


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
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if isinstance(value, bool) and bool not in kinds:
            raise SpecError(where, f"expected {_kind_name(kind)}, got {value!r}")
        if not isinstance(value, kinds):
            raise SpecError(where, f"expected {_kind_name(kind)}, got {value!r}")
        if choices is not None:
            allowed = list(choices)
            if value not in allowed:
                raise SpecError(where, f"{value!r} is not allowed; choose one of {allowed}")
        if minimum is not None and value < minimum:
            raise SpecError(where, f"{value!r} is out of range; must be >= {minimum}")
        if maximum is not None and value > maximum:
            raise SpecError(where, f"{value!r} is out of range; must be <= {maximum}")
        return value

    def get_list(self, key: str, item_kind: type, default: Any = _MISSING) -> list:
        """A list whose every item has ``item_kind``; errors name the offending index."""
        items = self.get(key, list, default)
        for i, item in enumerate(items):
            if not isinstance(item, item_kind) or isinstance(item, bool) and item_kind is not bool:
                raise SpecError(f"{self.key_path(key)}[{i}]", f"expected {_kind_name(item_kind)}, got {item!r}")
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
                hint = difflib.get_close_matches(str(key), known, n=1)
                fix = f"did you mean '{hint[0]}'?" if hint else f"allowed keys: {known}"
                raise SpecError(self.key_path(str(key)), f"unknown key; {fix}")
