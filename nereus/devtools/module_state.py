"""Module-level mutable state, found on the source with ``ast`` (nothing is imported or run).

State kept in a module outlives the objects that use it, is shared by every caller in the process and
cannot coexist in two versions (two layouts, two runs, two tests): the project keeps state in objects.
Reported:

* a ``global`` statement (a function rebinding a module's name);
* a module-level name bound to a mutable container — a list, dict or set display or comprehension, or a
  call of ``list``, ``dict``, ``set``, ``bytearray``, ``defaultdict``, ``OrderedDict``, ``deque`` or
  ``Counter`` — that a function mutates: assigns or deletes an item (``NAME[k] = v``), or calls a mutating
  method (``NAME.append(...)``, ``NAME.update(...)``, ...), in the module itself or in a module that
  imports the name (``from m import NAME`` or ``import m`` and ``m.NAME``).

Tables built once at import time and only read are not state; immutable ones (``tuple``, ``frozenset``,
``types.MappingProxyType``) say so and are preferred. What may stay is listed in ``ALLOWED`` with its reason.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from nereus.devtools.dispatch import Source, sources

CONTAINER_CALLS = ("list", "dict", "set", "bytearray", "defaultdict", "OrderedDict", "deque", "Counter")
MUTATORS = frozenset({
    "append", "extend", "insert", "remove", "pop", "clear", "sort", "reverse",  # list
    "update", "setdefault", "popitem",  # dict
    "add", "discard", "difference_update", "intersection_update", "symmetric_difference_update",  # set
    "appendleft", "extendleft", "popleft", "rotate",  # deque
    "subtract",  # Counter
    "__setitem__", "__delitem__",
})

# (file relative to the package's parent, module-level name or "global NAME") -> why it may stay
ALLOWED: Mapping[tuple[str, str], str] = MappingProxyType({})


@dataclass(frozen=True)
class Container:
    """A module-level name bound to a mutable container."""

    path: str
    module: str  # dotted
    name: str
    line: int


def _module_name(path: str) -> str:
    parts = list(Path(path).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_container(value: ast.AST | None) -> bool:
    if isinstance(value, ast.List | ast.Dict | ast.Set | ast.ListComp | ast.DictComp | ast.SetComp):
        return True
    if isinstance(value, ast.Call):
        f = value.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
        return name in CONTAINER_CALLS
    return False


def _top_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """A module's statements, descending into module-level ``if``/``try``/``with`` (not functions, classes)."""
    for stmt in body:
        yield stmt
        if isinstance(stmt, ast.If | ast.With | ast.For | ast.While):
            yield from _top_level(stmt.body + getattr(stmt, "orelse", []))
        elif isinstance(stmt, ast.Try):
            yield from _top_level(stmt.body + stmt.orelse + stmt.finalbody
                                  + [s for h in stmt.handlers for s in h.body])


def containers(src: Source) -> list[Container]:
    """The module-level names of one file bound to mutable containers."""
    out = []
    for stmt in _top_level(src.tree.body):
        if isinstance(stmt, ast.Assign):
            targets, value = stmt.targets, stmt.value
        elif isinstance(stmt, ast.AnnAssign):
            targets, value = [stmt.target], stmt.value
        else:
            continue
        if _is_container(value):
            out += [Container(src.path, _module_name(src.path), t.id, stmt.lineno)
                    for t in targets if isinstance(t, ast.Name)]
    return out


def _aliases(src: Source, known: dict[tuple[str, str], Container]) -> dict[str, Container]:
    """Names under which this file's code reaches a module-level container: its own, ``from m import
    NAME [as x]`` (key ``x``) and ``import m [as y]`` (key ``y.NAME``)."""
    here = _module_name(src.path)
    out = {c.name: c for (m, _), c in known.items() if m == here}
    for node in ast.walk(src.tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                if (node.module, a.name) in known:
                    out[a.asname or a.name] = known[node.module, a.name]
        elif isinstance(node, ast.Import):
            for a in node.names:
                for (m, name), c in known.items():
                    if m == a.name:
                        out[f"{a.asname or a.name}.{name}"] = c
    return out


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _mutated(node: ast.AST) -> Iterator[tuple[str, ast.AST]]:
    """(dotted name, node) of every container this node mutates in place."""
    if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign | ast.Delete):
        targets = node.targets if isinstance(node, ast.Assign | ast.Delete) else [node.target]
        for t in targets:
            if isinstance(t, ast.Subscript) and _dotted(t.value):
                yield _dotted(t.value), node
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
        name = _dotted(node.func.value)
        if name:
            yield name, node


def _functions(tree: ast.Module) -> Iterator[ast.AST]:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            yield node


def _locals(fn: ast.AST) -> set[str]:
    """Names a function binds itself (parameters, assignments): those shadow a module's name."""
    args = fn.args
    out = {a.arg for a in args.args + args.posonlyargs + args.kwonlyargs}
    out |= {a.arg for a in (args.vararg, args.kwarg) if a is not None}
    for node in ast.walk(fn):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
    return out


def file_state(src: Source, known: dict[tuple[str, str], Container]) -> list[str]:
    """``global`` statements of one file, and its functions' mutations of module-level containers."""
    problems = []
    aliases = _aliases(src, known)
    for fn in _functions(src.tree):
        declared = [node for node in ast.walk(fn) if isinstance(node, ast.Global)]
        own = _locals(fn) - {name for node in declared for name in node.names}
        for node in declared:
            problems += [f"{src.path}:{node.lineno} module state: `global {name}` rebinds a module-level name "
                         "from a function; keep the state in an object"
                         for name in node.names if (src.path, f"global {name}") not in ALLOWED]
        for node in ast.walk(fn):
            for name, where in _mutated(node):
                c = aliases.get(name)
                if c is None or name.split(".")[0] in own or (c.path, c.name) in ALLOWED:
                    continue
                problems.append(f"{src.path}:{where.lineno} module state: `{src.segment(where)}` mutates the "
                                f"module-level `{c.name}` ({c.path}:{c.line}); keep the state in an object, or "
                                "make a table immutable (tuple, frozenset, MappingProxyType)")
    return problems


def module_state(package_dir: str | Path) -> list[str]:
    """Module-level mutable state anywhere in the package."""
    files = list(sources(package_dir))
    known = {(c.module, c.name): c for src in files for c in containers(src)}
    problems = {p for src in files for p in file_state(src, known)}
    return sorted(problems, key=lambda m: (m.split(":")[0], int(m.split(":")[1].split(" ")[0])))


def stale_allowances(package_dir: str | Path) -> list[str]:
    """Allow-list entries naming no module-level container or ``global`` any more."""
    files = list(sources(package_dir))
    have = {(c.path, c.name) for src in files for c in containers(src)}
    have |= {(src.path, f"global {n}") for src in files for node in ast.walk(src.tree)
             if isinstance(node, ast.Global) for n in node.names}
    return [f"{path}: allowed `{name}` no longer occurs; remove it from module_state.ALLOWED"
            for path, name in ALLOWED if (path, name) not in have]
