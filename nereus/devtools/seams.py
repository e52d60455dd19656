"""The package's shape rules, checked with ``ast`` and ``tokenize`` (nothing is imported or run):

* **one seam per rollout engine**: outside ``runtime/engines/`` only the modules in ``ENGINE_NAMING``
  (the engines' declared traits, which the job config reads by ``run.rollout.engine``) name an engine:
  an identifier containing an engine's name, or a string literal that is exactly one. Everything else
  asks an engine's declared capabilities, so a new engine is one module and one registry line;
* **one owner of parallel degrees**: only the classes in ``DEGREE_HOLDERS`` (the chosen ``Layout`` and
  the validated ``ParallelDims``) hold ``tp``, ``pp`` and ``dp`` together;
* **one name, one class**: no class name is defined in two modules;
* **sizes a reader can hold**: no class with more than ``MAX_METHODS`` methods, no file over
  ``MAX_LINES`` lines.

Comments and docstrings may name engines: they are prose, and prose says which engine does what.
``python -m nereus.devtools.seams`` prints every violation and exits 1 when there is one.
"""

from __future__ import annotations

import ast
import io
import re
import sys
import tokenize
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

ENGINE_NAMES = ("vllm", "sglang")
ENGINE_PACKAGE = "runtime/engines/"
# modules (relative to the package) that may name an engine outside the engine packages, with why
ENGINE_NAMING: Mapping[str, str] = MappingProxyType({
    "spec/engines.py": "the engines' declared traits and capabilities, one entry per engine",
    "devtools/seams.py": "this rule, which has to say what it looks for",
})
DEGREE_FIELDS = ("tp", "pp", "dp")
DEGREE_HOLDERS = ("Layout", "ParallelDims")
MAX_METHODS = 25
MAX_LINES = 500


def _files(package_dir: Path) -> list[Path]:
    return sorted(p for p in package_dir.rglob("*.py") if "__pycache__" not in p.parts)


def _rel(path: Path, package_dir: Path) -> str:
    return path.relative_to(package_dir).as_posix()


def engine_mentions(source: str) -> list[tuple[int, str]]:
    """(line, token) of every identifier naming an engine and every string literal that is one."""
    pattern = re.compile("|".join(ENGINE_NAMES), re.IGNORECASE)
    literal = re.compile(r"[rbuRBU]*(['\"])(" + "|".join(ENGINE_NAMES) + r")\1", re.IGNORECASE)
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if (tok.type == tokenize.NAME and pattern.search(tok.string)) or (
                tok.type == tokenize.STRING and literal.fullmatch(tok.string)):
            out.append((tok.start[0], tok.string))
    return out


def engine_naming(package_dir: str | Path) -> list[str]:
    """Modules outside the engine packages and ``ENGINE_NAMING`` that name an engine."""
    package_dir = Path(package_dir)
    problems = []
    for path in _files(package_dir):
        rel = _rel(path, package_dir)
        if rel.startswith(ENGINE_PACKAGE) or rel in ENGINE_NAMING:
            continue
        hits = engine_mentions(path.read_text())
        if hits:
            line, token = hits[0]
            problems.append(f"{package_dir.name}/{rel}:{line} names an engine (`{token}`, {len(hits)} in the file): "
                            "ask the engine's declared traits instead")
    return problems


def _class_fields(node: ast.ClassDef) -> set[str]:
    """Annotated class-level names and ``self.x`` assigned in ``__init__``."""
    names = {s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    for fn in node.body:
        if isinstance(fn, ast.FunctionDef) and fn.name == "__init__":
            for sub in ast.walk(fn):
                targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target] if isinstance(
                    sub, ast.AnnAssign) else []
                names |= {t.attr for t in targets if isinstance(t, ast.Attribute)
                          and isinstance(t.value, ast.Name) and t.value.id == "self"}
    return {re.sub("_(size|degree)$", "", n) for n in names}


def _classes(package_dir: Path) -> list[tuple[str, ast.ClassDef]]:
    out = []
    for path in _files(package_dir):
        tree = ast.parse(path.read_text(), str(path))
        out += [(f"{package_dir.name}/{_rel(path, package_dir)}", n) for n in ast.walk(tree)
                if isinstance(n, ast.ClassDef)]
    return out


def degree_holders(package_dir: str | Path) -> list[str]:
    """Classes outside ``DEGREE_HOLDERS`` that hold tp, pp and dp together."""
    return [f"{path}:{node.lineno} class {node.name} holds parallel degrees ({', '.join(DEGREE_FIELDS)}): "
            "derive them from the validated ParallelDims" for path, node in _classes(Path(package_dir))
            if node.name not in DEGREE_HOLDERS and set(DEGREE_FIELDS) <= _class_fields(node)]


def duplicate_classes(package_dir: str | Path) -> list[str]:
    """Class names defined in more than one module."""
    where: dict[str, list[str]] = defaultdict(list)
    for path, node in _classes(Path(package_dir)):
        where[node.name].append(f"{path}:{node.lineno}")
    return [f"class {name} is defined {len(places)} times: {', '.join(places)}"
            for name, places in sorted(where.items()) if len(places) > 1]


def oversized(package_dir: str | Path) -> list[str]:
    """Classes over ``MAX_METHODS`` methods and files over ``MAX_LINES`` lines."""
    package_dir = Path(package_dir)
    problems = []
    for path, node in _classes(package_dir):
        methods = [n for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
        if len(methods) > MAX_METHODS:
            problems.append(f"{path}:{node.lineno} class {node.name} has {len(methods)} methods "
                            f"(at most {MAX_METHODS}): split it by role")
    for path in _files(package_dir):
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES:
            problems.append(f"{package_dir.name}/{_rel(path, package_dir)} has {lines} lines (at most {MAX_LINES})")
    return problems


def check(package_dir: str | Path) -> list[str]:
    """Every violation of every shape rule."""
    return (engine_naming(package_dir) + degree_holders(package_dir) + duplicate_classes(package_dir)
            + oversized(package_dir))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    problems = check(Path(args[0]) if args else Path(__file__).resolve().parents[1])
    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
