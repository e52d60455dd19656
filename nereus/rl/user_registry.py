"""Advantage estimators and policy losses a user adds to the built-in ones, as verl users do with
``register_adv_est`` / ``register_policy_loss`` (verl/trainer/ppo/core_algos.py).

A job names the modules that hold them (``run.algorithm_modules``); validating the job reads their names from
the decorators without running the code (``nereus.spec.user_algorithms``), and the run imports them once the
job is accepted (``load_algorithm_modules``), checking that each declared name was registered with a
callable of the entry's signature:

    from nereus.rl.core import register_adv_est, register_policy_loss

    @register_adv_est("my_baseline")
    def my_baseline(x):                      # x: nereus.rl.core.AdvantageInputs
        ...; return {"adv": adv, "returns": adv}

    @register_policy_loss("my_loss")
    def my_loss(logp, old_logp, adv, mask, *, loss_agg_mode, rollout_is_weights=None, **options):
        ...; return loss, {"actor/pg_clipfrac": 0.0}

A user policy loss aggregates the micro-batch it is given (``loss_agg_mode`` over its rows), as verl's
losses do without global batch information; built-in losses aggregate over the whole mini-batch under
any layout (``rl.losses``).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from pathlib import Path

from nereus.spec.algorithms import ADVANTAGE_ESTIMATORS, POLICY_LOSSES
from nereus.spec.errors import SpecError, brief
from nereus.spec.user_algorithms import ADV_DECORATOR, LOSS_DECORATOR, declared_algorithms

# name -> function, filled by the decorators when a user module is imported
USER_ADVANTAGE_ESTIMATORS: dict[str, Callable] = {}
USER_POLICY_LOSSES: dict[str, Callable] = {}


def _register(table: dict[str, Callable], kind: str, name: str) -> Callable[[Callable], Callable]:
    if not isinstance(name, str) or not name:
        raise ValueError(f"{kind} takes the name to register, a non-empty string; got {brief(name, 40)}")
    if name in (ADVANTAGE_ESTIMATORS if kind == ADV_DECORATOR else POLICY_LOSSES):
        raise ValueError(f"{kind}({name!r}): {name} is a built-in name; choose another")

    def decorate(fn: Callable) -> Callable:
        # the same function imported again (a module loaded twice) may re-register its name
        if name in table and _qualname(table[name]) != _qualname(fn):
            raise ValueError(f"{kind}({name!r}) is already registered by {_qualname(table[name])}")
        table[name] = fn
        return fn

    return decorate


def _qualname(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', brief(fn, 40))}"


def register_adv_est(name: str) -> Callable[[Callable], Callable]:
    """Decorator: register ``fn(AdvantageInputs) -> {"adv": [B, R], "returns": [B, R], ...}`` as ``name``."""
    return _register(USER_ADVANTAGE_ESTIMATORS, ADV_DECORATOR, name)


def register_policy_loss(name: str) -> Callable[[Callable], Callable]:
    """Decorator: register ``fn(logp, old_logp, adv, mask, *, loss_agg_mode, rollout_is_weights=None,
    **options) -> (loss, metrics)`` as ``name``."""
    return _register(USER_POLICY_LOSSES, LOSS_DECORATOR, name)


def _check_signature(fn: Callable, kind: str, name: str, where: str) -> None:
    inner = fn.func if isinstance(fn, functools.partial) else fn
    if not callable(fn) or not (inspect.isfunction(inner) or inspect.ismethod(inner)):
        raise SpecError(where, f"{kind}({name!r}) decorates {brief(fn, 40)}, not a Python function")
    try:
        sig = inspect.signature(fn)
        if kind == ADV_DECORATOR:
            sig.bind(object())
        else:
            sig.bind(None, None, None, None, loss_agg_mode="token-mean", rollout_is_weights=None)
    except (TypeError, ValueError) as err:
        want = ("(x) taking nereus.rl.core.AdvantageInputs" if kind == ADV_DECORATOR else
                "(logp, old_logp, adv, mask, *, loss_agg_mode, rollout_is_weights=None, **options)")
        raise SpecError(where, f"{kind}({name!r}): {_qualname(fn)} must accept {want}: {err}") from None


def load_algorithm_modules(targets: tuple[str, ...], where: str = "run.algorithm_modules") -> None:
    """Import the job's algorithm modules (user code: call only once the job is accepted) and check that
    every name their decorators declare is registered with a function of the entry's signature."""
    from nereus.rl.rewards import import_user_module

    for i, target in enumerate(targets):
        at = f"{where}[{i}]"
        declared = declared_algorithms(target, at)
        import_user_module(target, at, prefix="nereus_user_algorithms")
        for kind, table, names in ((ADV_DECORATOR, USER_ADVANTAGE_ESTIMATORS, declared.adv_estimators),
                                   (LOSS_DECORATOR, USER_POLICY_LOSSES, declared.policy_losses)):
            for name in names:
                if name not in table:
                    raise SpecError(at, f"{Path(target).name} declares {kind}({name!r}) but importing it registered "
                                        f"no such name (is the decorator imported from nereus.rl.core?)")
                _check_signature(table[name], kind, name, at)
