"""``run.router_replay`` (spec.run_moe): on by default for a Mixture-of-Experts actor, off for a dense one, and
refused on a dense actor when asked for, before any process starts; verl's keys for it."""

from __future__ import annotations

import pytest

from nereus.spec.errors import SpecError
from nereus.spec.overrides import fate
from nereus.spec.run_moe import router_replay_on
from tests.run.jobs import tiny_job


def test_default_follows_the_actor():
    assert router_replay_on(None, moe=True) and not router_replay_on(None, moe=False)
    assert not router_replay_on(False, moe=True)


def test_read_and_refused_on_a_dense_actor(tmp_path):
    assert tiny_job("grpo", str(tmp_path)).run.router_replay is None
    assert tiny_job("grpo", str(tmp_path), router_replay=False).run.router_replay is False
    with pytest.raises(SpecError, match=r"run\.router_replay: true on a dense model, no experts.*set it false"):
        tiny_job("grpo", str(tmp_path), router_replay=True)


def test_verls_keys():
    assert fate("actor_rollout_ref.rollout.enable_rollout_routing_replay", True) == "-> run.router_replay"
    assert fate("actor_rollout_ref.actor.router_replay.mode", "R3").startswith("passes")
    assert "enable_rollout_routing_replay" in fate("actor_rollout_ref.actor.router_replay.mode", "R2")
