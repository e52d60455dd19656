"""The rollout-engine seam (``runtime.engines.protocol``, ``registry``): one implementation per runnable
engine name, each with every ``Engine`` method, and what an engine that owns nothing on a worker answers
(no vLLM needed: the engine's process is never started here)."""

from __future__ import annotations

import inspect

import pytest

from nereus.runtime.engines.native.engine import NativeEngine
from nereus.runtime.engines.pool import IdleEngines
from nereus.runtime.engines.protocol import Engine, EngineConfig, EngineOpened
from nereus.runtime.engines.registry import ENGINES, default_engine, engine_class
from nereus.runtime.engines.vllm.engine import VllmEngine
from nereus.runtime.engines.vllm.server import speculative_config
from nereus.runtime.model.decoder import ModelConfig
from nereus.spec.engines import RUNNABLE
from nereus.spec.levers import Speculation
from nereus.spec.model import ModelArch

CONFIG = EngineConfig(ModelConfig(ModelArch(layers=1, hidden=64, ffn_hidden=128, heads=2, kv_heads=1, vocab=64)), 32)


def _members(cls: type) -> set[str]:
    return {n for n in vars(cls) if not n.startswith("_")} | set(getattr(cls, "__annotations__", {}))


def test_the_registry_implements_exactly_the_runnable_engines_with_every_method():
    assert tuple(ENGINES) == RUNNABLE
    wanted = _members(Engine)
    for name, cls in ENGINES.items():
        assert engine_class(name) is cls
        assert wanted <= _members(cls), (name, wanted - _members(cls))
        for method in ("refresh", "generate", "session_open", "session_run", "speculate", "migrate",
                       "session_close", "close"):
            assert list(inspect.signature(getattr(cls, method)).parameters) == list(
                inspect.signature(getattr(Engine, method)).parameters), (name, method)
    assert isinstance(default_engine(), NativeEngine)
    with pytest.raises(KeyError, match="known: native, vllm"):
        engine_class("sglang")


def test_an_engine_that_owns_nothing_here_answers_nothing():
    idle = IdleEngines()
    native, opened = NativeEngine.open(None, CONFIG, idle)
    assert opened is EngineOpened.NONE and native.session is None and native.tensors() is None
    assert native.session_close(None) is None
    vllm, opened = VllmEngine.open(None, CONFIG, idle)  # a worker outside the key's layout: a bystander
    assert opened is EngineOpened.NONE and vllm.replica is None
    assert vllm.generate(None, [[1]], None, None) is None and vllm.session_run(None, 3) is None
    assert vllm.session_close(None) is None and vllm.tensors() is None
    with pytest.raises(ValueError, match="fixed when its engine starts"):
        vllm.speculate(None, None)
    vllm.close(idle)
    assert not idle.engines and (NativeEngine.outlives_world, VllmEngine.outlives_world) == (False, True)


def test_a_closed_vllm_engine_is_parked_for_its_worker_s_next_open():
    class Running:
        config = CONFIG

    idle, running = IdleEngines(), Running()
    engine = VllmEngine(running)
    engine.close(idle)
    assert idle.engines == [running] and engine.replica is None


def test_the_speculation_lever_is_vllm_s_speculative_config():
    spec = Speculation("ngram", 3, 8, prompt_lookup_max=4)
    assert speculative_config(spec) == {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
                                        "prompt_lookup_min": 1}
    with pytest.raises(ValueError, match="not suffix"):
        speculative_config(Speculation("suffix", 3, 8))
