"""A user function named in a job (``run.reward_function``): where it is and what can be known of it
without running it.

``"package.module:function"`` names an importable module; ``"path/file.py:function"`` a file, whose
relative path resolves against the job file's folder, as ``models.<name>.path`` does. Validating a job
never executes user code: a file must be a readable regular ``.py`` file that compiles, and must bind
``function`` at its top level (``def``, an assignment or an import); a module's top-level package must be
findable. The code runs once the job and the run's set-up are accepted, first in a child process before
the run's header (``run.user_check``), then in the run (``rl.rewards.load_user_function``): a job refused
when it loads never ran it.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

from nereus.spec.errors import SpecError, brief
from nereus.spec.files import read_text_file

# A reward module is a few hundred lines; verl's own scorers are under 100 KB. Past this it is not one.
MAX_SOURCE_BYTES = 16 * 2**20


def split_target(target: str, where: str) -> tuple[str, str]:
    """(module or file, function) of ``"module:function"`` / ``"file.py:function"``."""
    module, sep, name = target.rpartition(":")
    if not sep or not module or not name or not name.isidentifier():
        raise SpecError(where, f"{brief(target)} is not 'package.module:function' or 'path/file.py:function'")
    return module, name


def resolve_target(target: str, base_dir: Path, where: str) -> str:
    """``target`` with a relative ``.py`` path made relative to ``base_dir`` (the job file's folder)."""
    module, name = split_target(target, where)
    if module.endswith(".py") and not Path(module).is_absolute():
        return f"{base_dir / module}:{name}"
    return target


def check_target(target: str, where: str) -> None:
    """Everything about ``target`` that can be checked without running it (see the module docstring)."""
    module, name = split_target(target, where)
    if module.endswith(".py"):
        _check_file(Path(module), name, where)
        return
    parts = module.split(".")
    if not all(part.isidentifier() for part in parts):
        raise SpecError(where, f"{brief(module)} is not a module name (or a path ending in .py)")
    try:  # the top-level package only: finding a submodule imports (runs) its parents
        found = importlib.util.find_spec(parts[0])
    except (ImportError, ValueError):
        found = None
    if found is None:
        raise SpecError(where, f"cannot import module {module!r}: {parts[0]!r} is not installed or on PYTHONPATH "
                               "(a file is written 'path/file.py:function')")


def parse_user_file(path: Path, where: str) -> ast.Module:
    """The syntax tree of the user's Python file ``path``, read without running it; a missing, unreadable
    or unparsable file is one SpecError naming ``where``."""
    if not path.exists():
        raise SpecError(where, f"file {str(path)!r} not found (a relative path starts at the job file's folder)")
    try:  # a directory, FIFO or binary file is refused here
        text = read_text_file(path, "Python", MAX_SOURCE_BYTES)
    except SpecError as err:
        raise SpecError(where, str(err)) from None
    try:
        return ast.parse(text, filename=str(path))
    except SyntaxError as err:
        raise SpecError(where, f"{path}:{err.lineno}: syntax error ({err.msg}); fix the file") from None
    except (ValueError, RecursionError, MemoryError) as err:  # a NUL byte; nesting past the parser's limit
        raise SpecError(where, f"{path}: not a Python file ({brief(str(err))})") from None


def _check_file(path: Path, name: str, where: str) -> None:
    tree = parse_user_file(path, where)
    bound = _top_level_bindings(tree.body)
    if name not in bound:
        defined = sorted(n for n, kind in bound.items() if kind == "def")
        raise SpecError(where, f"{str(path)!r} has no function {name!r} at its top level" +
                        (f" (it defines {defined[:6]})" if defined else ""))
    if bound[name] == "async def":
        raise SpecError(where, f"{path}: {name} is an async function; a reward function returns its score: use def")


def _top_level_bindings(body: list[ast.stmt]) -> dict[str, str]:
    """Names a module binds at its top level (inside top-level ``if``/``try`` too), and how."""
    out: dict[str, str] = {}
    for node in body:
        if isinstance(node, ast.FunctionDef):
            out[node.name] = "def"
        elif isinstance(node, ast.AsyncFunctionDef):
            out[node.name] = "async def"
        elif isinstance(node, ast.ClassDef):
            out[node.name] = "class"
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                out.update((n.id, "assign") for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out.update(((a.asname or a.name).split(".")[0], "import") for a in node.names)
        elif isinstance(node, (ast.If, ast.Try)):
            for block in (node.body, node.orelse, getattr(node, "finalbody", []),
                          *(h.body for h in getattr(node, "handlers", []))):
                out.update(_top_level_bindings(block))
    return out
