"""The package's source rules, checked with ``ast`` (nothing is imported or run): import layering and
cycles here, computed-name dispatch in ``dispatch``, module-level mutable state in ``module_state``.

Every ``import`` statement counts, including those inside functions: an import deferred into a function
still couples the two files, and hiding a cycle that way only moves the failure from import time to call
time. An import under ``if TYPE_CHECKING`` counts for the layering rules (a torch-free layer names no
torch type either) but not for file cycles: it never runs, and a type-only reference from a helper back
to its owner (``run.rounds`` typing the ``StepGeneration`` that runs its rounds) is how the two are
annotated. The rules (see ``docs`` and the design's dependency rules):

* the torch-free layers (spec, cost, planner, elastic, control, sim) never reach torch or ray, directly
  or through other nereus modules (importing ``nereus.a.b`` also runs ``nereus/a/__init__.py``);
* control reaches none of runtime, run, sim, rl; run and runtime never reach sim;
* the package graph (first component under ``nereus``) and the file graph have no cycle;
* runtime's rooms (its subfolders) import only rooms below them in ``RUNTIME_ORDER``, each room once
  (type-only imports count: they are arrows in the house too);
* no module imports another nereus module's private name (``from nereus.x import _name``).

``python -m nereus.devtools.imports`` prints every violation of every rule and exits 1 when there are any.
"""

from __future__ import annotations

import ast
import sys
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

TORCH_FREE = ("spec", "cost", "planner", "elastic", "control", "sim")
HEAVY = ("torch", "ray")
# package -> packages it must not reach, directly or transitively
FORBIDDEN_PACKAGES: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "control": ("runtime", "run", "sim", "rl"),
    "run": ("sim",),
    "runtime": ("sim",),
})
# runtime's rooms, lowest first: a room imports only the rooms before it. hosts (Ray nodes, placement,
# bounded waits, the local Ray), comm (process groups, the transfer communicator, fault hooks), model (the
# plain decoder, knowing nothing of parallelism), parallel (TP/PP/DP applied to it, the sharded model),
# engines (rollout engines), transitions (live moves), recovery (snapshots, failover), cluster (the
# worker actor and the driver's runtime)
RUNTIME_ORDER = ("hosts", "comm", "model", "parallel", "engines", "transitions", "recovery", "cluster")


@dataclass(frozen=True)
class Import:
    """One import statement of one file, resolved to a module name (a nereus module or a top-level name)."""

    source: str  # importing module, dotted
    target: str  # a module of the package (dotted), or the top-level name of an outside module
    line: int
    text: str  # the statement as written, for messages
    path: str  # the importing file, relative to the package's parent
    typing_only: bool = False  # under ``if TYPE_CHECKING``: never runs
    names: tuple[str, ...] = ()  # ``from x import a, b``: the names imported

    def where(self) -> str:
        return f"{self.path}:{self.line} `{self.text}`"


@dataclass
class Tree:
    """The modules of one package and their imports."""

    root: str  # top-level package name
    modules: dict[str, str]  # dotted module -> file path (relative to the package's parent)
    imports: dict[str, list[Import]]  # dotted module -> its imports

    def package(self, module: str) -> str:
        """First component under the root: ``nereus.spec.job`` -> ``spec``, ``nereus.cli`` -> ``cli``."""
        parts = module.split(".")
        return parts[1] if len(parts) > 1 else parts[0]

    def internal(self, imp: Import) -> bool:
        return imp.target in self.modules

    def loads(self, module: str) -> list[tuple[str, Import | None]]:
        """Modules executed when ``module`` runs: its explicit imports, plus the ``__init__`` of each
        package above an imported module (``None`` as the statement: Python runs them implicitly)."""
        out: list[tuple[str, Import | None]] = []
        for imp in self.imports.get(module, []):
            if not self.internal(imp):
                continue
            out.append((imp.target, imp))
            parts = imp.target.split(".")
            out += [(".".join(parts[:i]), imp) for i in range(1, len(parts)) if ".".join(parts[:i]) in self.modules]
        return out


def _module_name(path: Path, base: Path) -> str:
    parts = list(path.relative_to(base).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    keep = len(parts) - node.level + (1 if is_package else 0)
    base = parts[:keep]
    return ".".join(base + ([node.module] if node.module else []))


def _targets(node: ast.AST, module: str, is_package: bool, modules: dict[str, str], root: str) -> list[str]:
    """Dotted targets of one import node: nereus modules as the deepest existing module, others by top name."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = _resolve(node, module, is_package)
        # ``from pkg import name``: name may be a submodule (then that file is the dependency) or an attribute
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
    out = []
    for name in names:
        if name.split(".")[0] != root:
            out.append(name.split(".")[0])
            continue
        while name not in modules and "." in name:
            name = name.rsplit(".", 1)[0]
        out.append(name)
    return list(dict.fromkeys(out))


def _is_type_checking(test: ast.expr) -> bool:
    """``TYPE_CHECKING`` or ``typing.TYPE_CHECKING``."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST) -> list[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement with whether it sits under ``if TYPE_CHECKING`` (its body, not its else)."""
    out: list[tuple[ast.Import | ast.ImportFrom, bool]] = []
    todo: list[tuple[ast.AST, bool]] = [(tree, False)]
    while todo:
        node, typing_only = todo.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            out.append((node, typing_only))
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            todo += [(n, True) for n in node.body] + [(n, typing_only) for n in node.orelse]
            continue
        todo += [(child, typing_only) for child in ast.iter_child_nodes(node)]
    return out


def scan(package_dir: str | Path) -> Tree:
    """Parse every ``.py`` file under ``package_dir`` (a package directory such as ``.../nereus``)."""
    package_dir = Path(package_dir).resolve()
    base, root = package_dir.parent, package_dir.name
    files = sorted(p for p in package_dir.rglob("*.py") if "__pycache__" not in p.parts)
    modules = {_module_name(p, base): str(p.relative_to(base)) for p in files}
    # namespace packages (no __init__.py) are importable names too, with nothing to run
    imports: dict[str, list[Import]] = {}
    for path in files:
        module = _module_name(path, base)
        source = path.read_text()
        lines = source.splitlines()
        found = []
        for node, typing_only in _import_nodes(ast.parse(source, str(path))):
            text = " ".join(line.strip() for line in lines[node.lineno - 1:node.end_lineno])
            for target in _targets(node, module, path.name == "__init__.py", modules, root):
                if target != module:
                    names = tuple(a.name for a in node.names) if isinstance(node, ast.ImportFrom) else ()
                    found.append(Import(module, target, node.lineno, text, str(path.relative_to(base)),
                                        typing_only, names))
        imports[module] = sorted(found, key=lambda i: i.line)
    return Tree(root, modules, imports)


def _chain(steps: list[Import | None], last: Import) -> str:
    parts = [s.where() for s in steps if s is not None] + [last.where()]
    return " -> ".join(parts)


def _reach(tree: Tree, start: str, bad) -> tuple[list[Import | None], Import] | None:
    """Breadth-first over what ``start`` loads; the first import ``bad`` accepts, with the path to it."""
    seen, queue = {start}, deque([(start, [])])
    while queue:
        module, path = queue.popleft()
        for imp in tree.imports.get(module, []):
            if bad(imp):
                return path, imp
        for nxt, imp in tree.loads(module):
            if nxt not in seen:
                seen.add(nxt)
                queue.append((nxt, path + [imp]))
    return None


def forbidden_imports(tree: Tree) -> list[str]:
    """Rules (a) and (b): torch/ray out of the torch-free layers, backends out of control, sim out of run."""
    problems = []
    for module in sorted(tree.modules):
        pkg = tree.package(module)
        if pkg in TORCH_FREE:
            hit = _reach(tree, module, lambda i: not tree.internal(i) and i.target in HEAVY)
            if hit:
                problems.append(f"{tree.modules[module]} ({pkg}/ must not import {hit[1].target}): "
                                f"{_chain(*hit)}")
        banned = FORBIDDEN_PACKAGES.get(pkg, ())
        if banned:
            hit = _reach(tree, module, lambda i, banned=banned: tree.internal(i) and tree.package(i.target) in banned)
            if hit:
                problems.append(f"{tree.modules[module]} ({pkg}/ must not import "
                                f"{tree.package(hit[1].target)}/): {_chain(*hit)}")
    return problems


def _cycles(nodes: list[str], edges: dict[str, dict[str, Import]]) -> list[tuple[list[str], list[str]]]:
    """(one cycle, all members) per strongly connected component of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    comps: list[list[str]] = []
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, {}))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        top = stack.pop()
                        on.discard(top)
                        comp.append(top)
                        if top == node:
                            break
                    if len(comp) > 1:
                        comps.append(comp)
            elif nxt not in index:
                index[nxt] = low[nxt] = len(index)
                stack.append(nxt)
                on.add(nxt)
                work.append((nxt, iter(sorted(edges.get(nxt, {})))))
            elif nxt in on:
                low[node] = min(low[node], index[nxt])
    return [(_one_cycle(sorted(c), edges), sorted(c)) for c in comps]


def _one_cycle(comp: list[str], edges: dict[str, dict[str, Import]]) -> list[str]:
    """A shortest cycle through the component's first node, staying inside the component."""
    members, start = set(comp), comp[0]
    prev: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for nxt in sorted(edges.get(node, {})):
            if nxt == start:
                path = [node]
                while path[-1] != start:
                    path.append(prev[path[-1]])
                return list(reversed(path)) + [start]
            if nxt in members and nxt not in prev:
                prev[nxt] = node
                queue.append(nxt)
    raise AssertionError("a strongly connected component without a cycle")


def _describe(cycle: list[str], members: list[str], edges: dict[str, dict[str, Import]]) -> str:
    note = "" if len(members) == len(cycle) - 1 else f" (the cycle joins {', '.join(members)})"
    return " -> ".join(cycle) + note + "\n    " + "\n    ".join(
        edges[a][b].where() for a, b in zip(cycle, cycle[1:], strict=False))


def package_cycles(tree: Tree) -> list[str]:
    """Rule (c): cycles between the first-level packages, each edge shown by one import that makes it."""
    edges: dict[str, dict[str, Import]] = {}
    for imps in tree.imports.values():
        for imp in imps:
            a, b = tree.package(imp.source), tree.package(imp.target) if tree.internal(imp) else None
            if b is not None and a != b and b != tree.root:
                edges.setdefault(a, {}).setdefault(b, imp)
    nodes = sorted({tree.package(m) for m in tree.modules})
    return ["package cycle " + _describe(c, members, edges) for c, members in _cycles(nodes, edges)]


def file_cycles(tree: Tree) -> list[str]:
    """Rule (d): cycles between files through explicit imports that run (a package's implicit ``__init__``
    run is left out: Python has the package object in place before its submodules run; so are imports
    under ``if TYPE_CHECKING``, which never run)."""
    edges: dict[str, dict[str, Import]] = {}
    for module, imps in tree.imports.items():
        for imp in imps:
            if tree.internal(imp) and not imp.typing_only:
                edges.setdefault(module, {}).setdefault(imp.target, imp)
    by_path = {tree.modules[a]: {tree.modules[b]: imp for b, imp in tgt.items()} for a, tgt in edges.items()}
    return ["file cycle " + _describe([tree.modules[m] for m in cycle], [tree.modules[m] for m in members], by_path)
            for cycle, members in _cycles(sorted(tree.modules), edges)]


def _room(tree: Tree, module: str) -> str | None:
    """The runtime room of ``module`` (``nereus.runtime.engines.native`` -> ``engines``), None outside one."""
    parts = module.split(".")
    return parts[2] if len(parts) > 3 and parts[1] == "runtime" else None


def runtime_layers(tree: Tree) -> list[str]:
    """Rule (e): a runtime room imports only rooms below it in ``RUNTIME_ORDER``; an unknown room is
    reported too (it needs a place in the order)."""
    problems = []
    rooms = {r for m in tree.modules if (r := _room(tree, m))}
    for room in sorted(rooms - set(RUNTIME_ORDER)):
        problems.append(f"nereus/runtime/{room}/ has no place in RUNTIME_ORDER (nereus/devtools/imports.py)")
    for module, imps in sorted(tree.imports.items()):
        src = _room(tree, module)
        for imp in imps:
            dst = _room(tree, imp.target) if tree.internal(imp) else None
            if src in RUNTIME_ORDER and dst in RUNTIME_ORDER and RUNTIME_ORDER.index(dst) > RUNTIME_ORDER.index(src):
                problems.append(f"runtime/{src}/ must not import runtime/{dst}/ (above it): {imp.where()}")
    return problems


def private_imports(tree: Tree) -> list[str]:
    """Rule (f): ``from nereus.x import _name`` of another module's private name."""
    problems = []
    for module, imps in sorted(tree.imports.items()):
        for imp in imps:
            if not imp.names or not tree.internal(imp):
                continue
            private = [n for n in imp.names if n.startswith("_") and not n.startswith("__")]
            if private and imp.target != module:
                problems.append(f"private name {', '.join(private)} imported from {imp.target}: {imp.where()}")
    return problems


def check(package_dir: str | Path) -> list[str]:
    """Every violation of every rule (layering, cycles, computed-name dispatch, module state), as
    messages naming files and lines."""
    from nereus.devtools.dispatch import dispatch
    from nereus.devtools.module_state import module_state

    tree = scan(package_dir)
    return (forbidden_imports(tree) + package_cycles(tree) + file_cycles(tree) + runtime_layers(tree)
            + private_imports(tree) + dispatch(package_dir) + module_state(package_dir))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    package = Path(args[0]) if args else Path(__file__).resolve().parents[1]
    problems = check(package)
    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
