"""``engines.pool.IdleEngines``' bookkeeping: which idle engine a worker's next open takes, how many stay
idle, and what happens to one whose process died. Its engines here are stand-ins that record what they
were asked (a real vLLM engine is reused in tests/run/test_vllm_job.py, whose jobs assert the counts)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from ray.exceptions import RayActorError

from nereus.runtime.engines.pool import IdleEngines
from nereus.runtime.engines.protocol import EngineConfig, EngineOpened, EnginesOpened
from nereus.runtime.model.decoder import ModelConfig
from nereus.spec.model import ModelArch

CONFIG = EngineConfig(ModelConfig(ModelArch(layers=1, hidden=64, ffn_hidden=128, heads=2, kv_heads=1, vocab=64)), 32)


class Recorded:
    """An engine stand-in: its config, the weights it was given, whether it was closed."""

    def __init__(self, config: EngineConfig, weights: dict, dead: bool = False) -> None:
        self.config, self.weights, self.dead, self.closed = config, weights, dead, False

    def reuse(self, weights: dict) -> float:
        if self.dead:
            raise RayActorError()
        self.weights = weights
        return 0.0

    def close(self) -> None:
        self.closed = True


def test_an_idle_engine_of_the_same_config_is_reloaded_not_started():
    pool, old = IdleEngines(), Recorded(CONFIG, {"w": 1})
    pool.park(old)
    engine, reused = pool.open(CONFIG, {"w": 2}, start=Recorded)
    assert engine is old and reused and old.weights == {"w": 2} and not old.closed and not pool.engines
    other, reused = pool.open(replace(CONFIG, tp=2), {"w": 3}, start=Recorded)  # nothing idle: started
    assert not reused and other is not old and other.config.tp == 2


def test_another_config_is_started_and_the_idle_one_kept_on_cpu():
    pool, idle = IdleEngines(), Recorded(CONFIG, {})
    pool.park(idle)
    engine, reused = pool.open(replace(CONFIG, max_num_seqs=4), {}, start=Recorded)
    assert not reused and pool.engines == [idle] and not idle.closed


def test_at_most_keep_stay_idle_the_oldest_closed_first():
    pool = IdleEngines(keep=2)
    engines = [Recorded(replace(CONFIG, seed=i), {}) for i in range(3)]
    for e in engines:
        pool.park(e)
    assert [e.closed for e in engines] == [True, False, False] and pool.engines == engines[1:]
    pool.close()
    assert all(e.closed for e in engines) and not pool.engines


def test_an_idle_engine_whose_process_died_is_dropped_and_one_started():
    pool, dead = IdleEngines(), Recorded(CONFIG, {}, dead=True)
    pool.park(dead)
    engine, reused = pool.open(CONFIG, {"w": 1}, start=Recorded)
    assert not reused and engine is not dead and dead.closed and not pool.engines


@pytest.mark.parametrize("answers,counts", [([], (0, 0)), (["started", "none", "reused", "reused"], (1, 2))])
def test_a_runtime_counts_the_engines_its_workers_started_and_reused(answers, counts):
    opened = EnginesOpened.of([EngineOpened(a) for a in answers])
    assert (opened.started, opened.reused) == counts
