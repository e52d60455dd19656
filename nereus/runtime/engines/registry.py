"""The runtime's rollout engines by ``run.rollout.engine`` name: one line per engine.

The names are those ``spec.engines.ENGINE_TRAITS`` declares runnable (``EngineTraits.runs``), where each
engine's capabilities and costs live as plain data; this table only says which class implements it.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from nereus.runtime.engines.native.engine import NativeEngine
from nereus.runtime.engines.protocol import Engine
from nereus.runtime.engines.vllm.engine import VllmEngine
from nereus.spec.engines import DEFAULT_ENGINE

ENGINES: Mapping[str, type[Engine]] = MappingProxyType({
    "native": NativeEngine,
    "vllm": VllmEngine,
})


def engine_class(name: str) -> type[Engine]:
    """The implementation of the engine ``name`` (a ``KeyError`` naming the known ones otherwise)."""
    if name not in ENGINES:
        raise KeyError(f"no rollout engine {name!r} in this runtime; known: {', '.join(ENGINES)}")
    return ENGINES[name]


def default_engine() -> Engine:
    """A key's engine before one is opened on it: the default engine's, holding nothing yet."""
    return engine_class(DEFAULT_ENGINE).bystander()
