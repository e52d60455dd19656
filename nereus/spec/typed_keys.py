"""Errors under the key the user typed: a verl override (``actor_rollout_ref.rollout.n=1``) sets a Nereus key
(``algorithm.samples_per_prompt``), and the check that refuses its value names the Nereus key. ``TypedKeys``
renames such an error: its key path becomes the key as typed (the Nereus key it set is said in the message),
every Nereus key the message names that an override set is written as typed, and a key under no known
section (``actor_rollout_rf.actor.clip_ratio``) gets the closest verl key as a did-you-mean. A Nereus key
typed as such keeps its name.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from nereus.spec.errors import SpecError
from nereus.spec.overrides import did_you_mean
from nereus.spec.verl_keys import lookup


def override_key(override: str) -> str:
    """The key path an override names (``+a.b=1`` -> ``a.b``, ``~a.b`` -> ``a.b``)."""
    return override.lstrip("+~").partition("=")[0].strip()


def _under(path: str, key: str) -> bool:
    """``path`` is ``key`` or a key inside it (``key.x``, ``key[0]``)."""
    return path == key or path.startswith((key + ".", key + "["))


@dataclass(frozen=True)
class TypedKeys:
    """Nereus key path -> the overrides' keys, as typed, that set it (verl keys only); ``typed``: every key
    the command line named."""

    by_path: dict[str, tuple[str, ...]] = field(default_factory=dict)
    typed: tuple[str, ...] = ()

    @classmethod
    def of(cls, touched: dict[str, set[str]], overrides: Sequence[str]) -> TypedKeys:
        """From ``overrides.Resolution.touched`` (key -> the Nereus key paths it set) and the overrides."""
        typed = tuple(dict.fromkeys(override_key(o) for o in overrides))
        by_path: dict[str, tuple[str, ...]] = {}
        for key, paths in touched.items():
            if key not in typed or lookup(key) is None:
                continue  # a Nereus key: errors already name it as typed
            for path in sorted(paths):
                if path != key:
                    by_path[path] = (*by_path.get(path, ()), key)
        return cls(by_path, typed)

    def name(self, path: str) -> str:
        """``path`` as the user typed it: the verl key(s) that set it, or ``path`` itself."""
        keys = self.by_path.get(path)
        return " / ".join(keys) if keys else path

    def rename(self, err: SpecError) -> SpecError:
        """``err`` under the key the user typed (itself when no verl override set the key it names)."""
        message = self._in_message(err.message)
        for path in sorted(self.by_path, key=len, reverse=True):  # the most specific key first
            if _under(err.path, path):
                typed = self.name(path) + err.path[len(path):]
                return SpecError(typed, f"{message} ({path} in Nereus's terms)")
        if err.message.startswith("unknown key") and "did you mean" not in err.message:
            for key in self.typed:  # a key under a section no job has: a verl key misspelt?
                hint = did_you_mean(key) if key.startswith(err.path + ".") and lookup(key) is None else ""
                if hint:
                    return SpecError(key, f"a key neither Nereus nor verl has ({err.path} is no section of "
                                          f"either){hint}")
        return err if message == err.message else SpecError(err.path, message)

    def _in_message(self, message: str) -> str:
        """Each Nereus key ``message`` names that a verl override set, written as typed."""
        for path in sorted(self.by_path, key=len, reverse=True):
            message = re.sub(rf"(?<![\w./]){re.escape(path)}(?![\w/])", self.name(path), message)
        return message
