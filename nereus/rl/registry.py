"""Read-only name -> function tables for the RL math's interchangeable parts; the names themselves live in
``nereus.spec.algorithms`` so that validating a spec needs no torch."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType


def name_table(names: tuple[str, ...], functions: dict[str, Callable]) -> Mapping[str, Callable]:
    """A read-only name -> function table in the spec's order; every name the spec accepts must have
    exactly one function, so a name added on one side only fails at import."""
    if set(names) != set(functions):
        raise RuntimeError(f"registry {sorted(functions)} does not match the spec's names {list(names)}")
    return MappingProxyType({name: functions[name] for name in names})
