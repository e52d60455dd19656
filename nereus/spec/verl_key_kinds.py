"""What Nereus does with one verl key (``nereus.spec.verl_keys``): the value type and its constructors,
shared by the table's modules."""

from __future__ import annotations

from dataclasses import dataclass

MAPPED, IGNORED, REFUSED, DERIVED = "mapped", "ignored", "refused", "derived"


@dataclass(frozen=True)
class VerlKey:
    kind: str  # MAPPED, IGNORED, REFUSED or DERIVED
    target: str = ""  # the Nereus key path (mapped)
    reason: str = ""  # why ignored or refused; for a mapped key, a note for the docs
    accept: tuple = ()  # refused keys: values meaning what Nereus does anyway


def mapped(target: str, note: str = "") -> VerlKey:
    return VerlKey(MAPPED, target, note)


def ignored(reason: str) -> VerlKey:
    return VerlKey(IGNORED, reason=reason)


def refused(reason: str, *accept: object) -> VerlKey:
    return VerlKey(REFUSED, reason=reason, accept=accept)


def derived(target: str, note: str) -> VerlKey:
    return VerlKey(DERIVED, target, note)
