"""A user's own estimator and loss, registered with verl's decorators in a module the job names."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from nereus.rl import user_registry
from nereus.rl.core import AdvantageInputs, advantage_estimator, policy_loss_fn
from nereus.rl.user_registry import load_algorithm_modules, register_adv_est
from nereus.spec.errors import SpecError

MODULE = '''
import torch
from nereus.rl.core import agg_loss, register_adv_est, register_policy_loss

@register_adv_est("batch_mean_baseline")
def batch_mean_baseline(x):
    adv = (x.scores - x.scores.mean())[:, None] * x.mask
    return {"adv": adv, "returns": adv}

@register_policy_loss("plain_pg")
def plain_pg(logp, old_logp, adv, mask, *, loss_agg_mode, rollout_is_weights=None, **options):
    ratio = torch.exp(logp - old_logp)
    return agg_loss(-adv * ratio, mask, loss_agg_mode), {"actor/pg_clipfrac": 0.0}
'''


@pytest.fixture(autouse=True)
def clean_tables() -> Iterator[None]:
    yield
    user_registry.USER_ADVANTAGE_ESTIMATORS.clear()
    user_registry.USER_POLICY_LOSSES.clear()


def test_registered_names_run_through_the_public_entries(tmp_path: Path) -> None:
    (tmp_path / "algos.py").write_text(MODULE)
    load_algorithm_modules((str(tmp_path / "algos.py"),))
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    x = AdvantageInputs(scores=torch.tensor([1.0, 0.0]), mask=mask, groups=torch.tensor([0, 0]),
                        old_logp=torch.zeros(2, 3))
    out = advantage_estimator("batch_mean_baseline")(x)
    assert torch.equal(out["adv"], torch.tensor([[0.5, 0.5, 0.0], [-0.5, 0.0, 0.0]]))
    loss, metrics = policy_loss_fn("plain_pg")(torch.zeros(2, 3), torch.zeros(2, 3), out["adv"], mask,
                                               loss_agg_mode="token-mean")
    assert float(loss) == pytest.approx(-(0.5 + 0.5 - 0.5) / 3)
    assert metrics == {"actor/pg_clipfrac": 0.0}


def test_a_wrong_signature_is_refused_naming_the_module(tmp_path: Path) -> None:
    (tmp_path / "algos.py").write_text(
        "from nereus.rl.core import register_policy_loss\n"
        "@register_policy_loss('two_args')\ndef f(logp, adv):\n    return 0, {}\n")
    with pytest.raises(SpecError, match=r"run\.algorithm_modules\[0\]: .*two_args.*must accept"):
        load_algorithm_modules((str(tmp_path / "algos.py"),))


def test_a_declared_name_the_import_does_not_register_is_refused(tmp_path: Path) -> None:
    (tmp_path / "algos.py").write_text(  # a look-alike decorator: registers nothing with Nereus
        "def register_adv_est(name):\n    return lambda fn: fn\n@register_adv_est('ghost')\ndef f(x):\n    return {}\n")
    with pytest.raises(SpecError, match="registered no such name"):
        load_algorithm_modules((str(tmp_path / "algos.py"),))


def test_built_in_names_cannot_be_replaced() -> None:
    with pytest.raises(ValueError, match="built-in"):
        register_adv_est("grpo")
    with pytest.raises(ValueError, match="unknown advantage estimator 'nope'; choose one of .*'rloo'"):
        advantage_estimator("nope")


def test_a_user_loss_trains_through_the_actor_loss_and_ships_by_value(tmp_path: Path) -> None:
    import pickle

    import cloudpickle

    from nereus.rl import losses
    from nereus.rl.core import agg_weights
    from nereus.runtime.parallel.batch import TrainBatch

    (tmp_path / "algos.py").write_text(MODULE)
    load_algorithm_modules((str(tmp_path / "algos.py"),))
    fn = losses.policy_loss(clip_low=0.2, clip_high=0.2, kl_loss_coef=0.0, kl_loss_type="k3",
                            loss_mode="plain_pg", loss_agg_mode="token-mean")
    # the workers get the function itself: the file is no importable module, so it travels by value
    fn = pickle.loads(cloudpickle.dumps(fn))
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    adv = torch.tensor([[0.5, 0.5, 0.0], [-0.5, 0.0, 0.0]])
    out = torch.zeros(2, 4, requires_grad=True)  # per-position log-probs; response token j at position j
    mb = TrainBatch(torch.zeros(2, 5, dtype=torch.long), index=torch.arange(3).repeat(2, 1), mask=mask,
                    weight=agg_weights(mask), advantages=adv, old_logp=torch.zeros(2, 3))
    result = fn(out, mb)
    assert float(result.value) == pytest.approx(-0.5 / 3)
    assert result.stats.pg_clipfrac == 0.0 and result.stats.tokens == 3.0
