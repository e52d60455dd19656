"""Computed-name attribute dispatch, found on the source with ``ast`` (nothing is imported or run).

An operation chosen by a computed attribute name (``getattr(worker, op)``) cannot be followed by reading
the code, checked by a type checker or renamed safely; the project calls methods by name and maps an
enum or a config string to a callable or a value through an explicit table in one place. Reported:

* ``getattr``, ``setattr``, ``delattr`` and ``hasattr`` whose attribute name is not a string literal;
* ``operator.methodcaller`` and ``operator.attrgetter`` whose first name is not a string literal.

Not dispatch, and not reported: generic dataclass serialisation, i.e. a name ``f.name`` where ``f``
ranges over ``dataclasses.fields(...)`` in the enclosing loop or comprehension. What may stay anyway is
listed in ``ALLOWED`` with its reason.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

NAMED_BUILTINS = ("getattr", "setattr", "delattr", "hasattr")
NAMED_OPERATORS = ("methodcaller", "attrgetter")

# (file relative to the package's parent, the call as written) -> why it may stay
ALLOWED: Mapping[tuple[str, str], str] = MappingProxyType({
    ("nereus/rl/rewards.py", "getattr(import_user_module(module, where), name, None)"):
        "loads the user's reward function named in the job file (verl's custom_reward_function.path/name): "
        "an import of user code by its configured name, the one way user code comes in, not a choice among "
        "the package's own operations",
})


@dataclass(frozen=True)
class Source:
    """One parsed file of a package."""

    path: str  # relative to the package's parent, as messages print it
    text: str
    tree: ast.Module

    def segment(self, node: ast.AST) -> str:
        """The node's source text on one line."""
        return " ".join((ast.get_source_segment(self.text, node) or "").split())


def sources(package_dir: str | Path) -> Iterator[Source]:
    """Every ``.py`` file under ``package_dir``, parsed, in path order."""
    package_dir = Path(package_dir).resolve()
    for path in sorted(p for p in package_dir.rglob("*.py") if "__pycache__" not in p.parts):
        text = path.read_text()
        yield Source(str(path.relative_to(package_dir.parent)), text, ast.parse(text, str(path)))


def _called_name(call: ast.Call) -> str | None:
    """``getattr`` for ``getattr(...)``, ``methodcaller`` for ``operator.methodcaller(...)``; else None."""
    if isinstance(call.func, ast.Name):
        return call.func.id
    if isinstance(call.func, ast.Attribute) and isinstance(call.func.value, ast.Name):
        return call.func.attr if call.func.value.id == "operator" else None
    return None


def _is_fields_call(node: ast.AST) -> bool:
    """``fields(x)`` or ``dataclasses.fields(x)``."""
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    return (isinstance(f, ast.Name) and f.id == "fields") or (isinstance(f, ast.Attribute) and f.attr == "fields")


def _field_loops(tree: ast.Module) -> Iterator[tuple[str, list[ast.AST]]]:
    """(loop variable, the nodes it is in scope over) of every loop or comprehension over ``fields(...)``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.For | ast.AsyncFor) and _is_fields_call(node.iter) \
                and isinstance(node.target, ast.Name):
            yield node.target.id, list(node.body)
        elif isinstance(node, ast.ListComp | ast.SetComp | ast.GeneratorExp | ast.DictComp):
            body = [node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt]
            for gen in node.generators:
                if _is_fields_call(gen.iter) and isinstance(gen.target, ast.Name):
                    yield gen.target.id, body + [cond for g in node.generators for cond in g.ifs]


def _serialising(tree: ast.Module) -> set[int]:
    """Ids of the name arguments ``f.name`` whose ``f`` ranges over a dataclass's fields."""
    out: set[int] = set()
    for var, body in _field_loops(tree):
        for root in body:
            for node in ast.walk(root):
                if isinstance(node, ast.Attribute) and node.attr == "name" \
                        and isinstance(node.value, ast.Name) and node.value.id == var:
                    out.add(id(node))
    return out


def _name_argument(call: ast.Call, called: str) -> ast.AST | None:
    """The argument that names the attribute: the second of the builtins, the first of the operators."""
    index = 1 if called in NAMED_BUILTINS else 0
    return call.args[index] if len(call.args) > index else None


def _literal(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def file_dispatch(src: Source) -> list[str]:
    """The computed-name dispatch sites of one file, as ``path:line`` messages."""
    fields_names = _serialising(src.tree)
    problems = []
    for node in ast.walk(src.tree):
        if not isinstance(node, ast.Call):
            continue
        called = _called_name(node)
        if called not in NAMED_BUILTINS + NAMED_OPERATORS:
            continue
        if called in NAMED_OPERATORS:
            names = [a for a in node.args if not _literal(a)]
        else:
            arg = _name_argument(node, called)
            names = [] if arg is None or _literal(arg) or id(arg) in fields_names else [arg]
        text = src.segment(node)
        if names and (src.path, text) not in ALLOWED:
            problems.append(f"{src.path}:{node.lineno} computed-name dispatch `{text}`: the attribute name "
                            f"`{src.segment(names[0])}` is not a string literal; call the method by name, or map "
                            "the value to what it selects with an explicit table")
    return sorted(problems, key=_line_order)


def _line_order(message: str) -> tuple[str, int]:
    path, line = message.split(" ", 1)[0].rsplit(":", 1)
    return path, int(line)


def dispatch(package_dir: str | Path) -> list[str]:
    """Computed-name dispatch anywhere in the package."""
    return [p for src in sources(package_dir) for p in file_dispatch(src)]


def stale_allowances(package_dir: str | Path) -> list[str]:
    """Allow-list entries that match no call any more (so the list stays short and true)."""
    seen = set()
    for src in sources(package_dir):
        if any(path == src.path for path, _ in ALLOWED):
            seen |= {(src.path, src.segment(node)) for node in ast.walk(src.tree)
                     if isinstance(node, ast.Call) and _called_name(node) in NAMED_BUILTINS + NAMED_OPERATORS}
    return [f"{path}: allowed `{text}` no longer occurs; remove it from dispatch.ALLOWED"
            for path, text in ALLOWED if (path, text) not in seen]
