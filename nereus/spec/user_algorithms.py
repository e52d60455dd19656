"""``run.algorithm_modules``: the user's modules that register advantage estimators and policy losses
(``nereus.rl.user_registry``), read without running them.

Each entry is ``"package.module"`` or ``"path/file.py"`` (a relative path resolves against the job file's
folder, as ``run.reward_function`` does). The names a module registers are read from its source: every
``@register_adv_est("name")`` and ``@register_policy_loss("name")`` decorator (also written as an attribute,
``@core.register_adv_est("name")``) with a string literal, so ``algorithm.adv_estimator`` and
``run.policy_loss.loss_mode`` can accept them before any process starts and before any user code runs.
"""

from __future__ import annotations

import ast
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from nereus.spec.errors import SpecError, brief
from nereus.spec.user_code import parse_user_file

ADV_DECORATOR, LOSS_DECORATOR = "register_adv_est", "register_policy_loss"


@dataclass(frozen=True)
class DeclaredAlgorithms:
    """The names a job's algorithm modules register, by kind."""

    adv_estimators: tuple[str, ...] = ()
    policy_losses: tuple[str, ...] = ()

    def __add__(self, other: DeclaredAlgorithms) -> DeclaredAlgorithms:
        return DeclaredAlgorithms(self.adv_estimators + other.adv_estimators,
                                  self.policy_losses + other.policy_losses)


def resolve_module(target: str, base_dir: Path) -> str:
    """``target`` with a relative ``.py`` path made relative to ``base_dir``."""
    if target.endswith(".py") and not Path(target).is_absolute():
        return str(base_dir / target)
    return target


def _module_file(module: str, where: str) -> Path:
    """The source file of ``package.module``, found without importing anything (``find_spec`` of a
    submodule would run its parents' ``__init__``)."""
    parts = module.split(".")
    if not all(p.isidentifier() for p in parts):
        raise SpecError(where, f"{brief(module)} is not a module name (or a path ending in .py)")
    try:
        spec = importlib.util.find_spec(parts[0])
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise SpecError(where, f"cannot import module {module!r}: {parts[0]!r} is not installed or on PYTHONPATH "
                               "(a file is written 'path/file.py')")
    if len(parts) == 1:
        if spec.origin is None or not spec.origin.endswith(".py"):
            raise SpecError(where, f"module {module!r} has no Python source to read its registrations from")
        return Path(spec.origin)
    for folder in spec.submodule_search_locations or ():
        base = Path(folder).joinpath(*parts[1:])
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
    raise SpecError(where, f"cannot find module {module!r} (no {'/'.join(parts[1:])}.py under {parts[0]})")


def _decorated_names(tree: ast.AST, path: Path, where: str) -> DeclaredAlgorithms:
    found: dict[str, list[str]] = {ADV_DECORATOR: [], LOSS_DECORATOR: []}
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        for dec in node.decorator_list:
            if not isinstance(dec, ast.Call):
                continue
            func = dec.func
            called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if called not in found:
                continue
            arg = dec.args[0] if dec.args else None
            if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value):
                raise SpecError(where, f"{path}:{dec.lineno}: {called}(...) needs the name as a string literal, "
                                       f"so the job can be checked before its code runs: write {called}(\"name\")")
            found[called].append(arg.value)
    return DeclaredAlgorithms(tuple(found[ADV_DECORATOR]), tuple(found[LOSS_DECORATOR]))


def declared_algorithms(target: str, where: str) -> DeclaredAlgorithms:
    """The names one module or file registers, read from its source (see the module docstring)."""
    path = Path(target) if target.endswith(".py") else _module_file(target, where)
    tree = parse_user_file(path, where)
    names = _decorated_names(tree, path, where)
    if not names.adv_estimators and not names.policy_losses:
        raise SpecError(where, f"{path} registers nothing: decorate a function with @{ADV_DECORATOR}(\"name\") or "
                               f"@{LOSS_DECORATOR}(\"name\") from nereus.rl.core")
    return names


def read_algorithm_modules(raw: object, base_dir: Path, where: str = "run.algorithm_modules"
                           ) -> tuple[tuple[str, ...], DeclaredAlgorithms]:
    """(resolved targets, every name they declare) of the raw ``run.algorithm_modules`` value (a string
    or a list of strings); a name declared twice, or a built-in name, is refused."""
    from nereus.spec.algorithms import ADVANTAGE_ESTIMATORS, POLICY_LOSSES

    items = [raw] if isinstance(raw, str) else raw
    if not isinstance(items, list) or not all(isinstance(t, str) and t for t in items):
        raise SpecError(where, f"{brief(raw, 60)}: give a list of 'package.module' or 'path/file.py' strings")
    targets = tuple(resolve_module(t, base_dir) for t in items)
    total = DeclaredAlgorithms()
    for i, target in enumerate(targets):
        total = total + declared_algorithms(target, f"{where}[{i}]")
    for kind, names, builtin in ((ADV_DECORATOR, total.adv_estimators, ADVANTAGE_ESTIMATORS),
                                 (LOSS_DECORATOR, total.policy_losses, POLICY_LOSSES)):
        for name in names:
            if name in builtin:
                raise SpecError(where, f"{kind}({name!r}): {name} is a built-in name; register under another name")
            if names.count(name) > 1:
                raise SpecError(where, f"{kind}({name!r}) is declared twice; give each a distinct name")
    return targets, total
