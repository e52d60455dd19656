"""The job as ``nereus run`` runs it: the job file's tree with every command-line override applied
(``overrides.resolve_overrides``), what Nereus did with each verl key, and which key the user typed for each
Nereus key an override set (``typed_keys``), so that every later error names the key as typed.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from nereus.spec.overrides import resolve_overrides
from nereus.spec.typed_keys import TypedKeys


@dataclass(frozen=True)
class EffectiveConfig:
    """The raw job tree after the overrides; ``fates``: (override as written, what Nereus does with it) for
    each verl key; ``notes``: what was ignored, one line each."""

    tree: Any
    overrides: tuple[str, ...] = ()
    fates: tuple[tuple[str, str], ...] = ()
    notes: tuple[str, ...] = ()
    typed: TypedKeys = field(default_factory=TypedKeys)


def effective_config(data: Any, overrides: Sequence[str]) -> EffectiveConfig:
    """``data`` (a job file's raw tree) with ``overrides`` applied; the first problem is raised under the key
    the user typed, each ignored verl key is noted on stderr."""
    result = resolve_overrides(data, overrides)
    typed = TypedKeys.of(result.touched, overrides)
    if result.problems:
        raise typed.rename(result.problems[0])
    for note in result.notes:
        print(note, file=sys.stderr)
    return EffectiveConfig(result.tree, tuple(overrides), tuple(result.fates), tuple(result.notes), typed)
