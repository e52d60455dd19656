"""Reading and writing the files a user hands the CLI, so that a bad file is one ``SpecError`` naming it.

Every spec-like file (job, trace, profile, plan, run record) goes through ``read_text_file``: a directory,
a device or FIFO (opened without blocking, then refused), a file too large, unreadable or not UTF-8 is
refused by name before parsing. YAML goes through ``load_yaml``, a ``SafeLoader`` that reads scalars as
YAML 1.2's core schema does (``1e-6`` is a number, as verl's scripts write it; ``yes``/``on`` are text,
``010`` is refused as ambiguous), refuses duplicate mapping keys (PyYAML keeps the last one silently),
nesting deeper than ``MAX_DEPTH`` (the composer recurses once per level, so 20,000 levels exhaust Python's
stack), and aliases that expand past ``MAX_ALIAS_EXPANSION`` values or refer to themselves (an alias bomb:
every later walk of the tree, an error message included, would do exponential work). JSON goes through
``load_json``, which refuses duplicate keys too, and nesting deeper than the C decoder's recursion guard
allows. ``atomic_write_text`` writes through a temporary sibling that never outlives a failed write.
"""

from __future__ import annotations

import json
import os
import re
import stat
import tempfile
from pathlib import Path
from typing import IO, Any

import yaml

from nereus.spec.errors import SpecError

# No spec, plan or trace comes near this nesting (a job is about 5 levels deep); bounding it keeps the
# recursive YAML composer and JSON decoder far from Python's recursion limit (1,000 frames).
MAX_DEPTH = 64
# Spec-like files are kilobytes; run records of 10^6 steps (the simulator's cap) are about 300 MB.
MAX_SPEC_BYTES = 64 * 2**20
MAX_RECORD_BYTES = 1 << 30
# YAML aliases may repeat a value (``<<: *base`` merges a few keys); past this many values added by
# aliases a file is an alias bomb (9 levels of 9 aliases are 387 million values from 1 KB of text).
MAX_ALIAS_EXPANSION = 100_000


def open_regular(path: str | Path, kind: str) -> IO[bytes]:
    """``path`` opened for reading in binary, refused by name unless it is a regular file. The open does
    not block (``O_NONBLOCK``): a FIFO with no writer would wait forever, so it is opened and refused."""
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise SpecError(str(p), f"{kind} file not found") from None
    except IsADirectoryError:
        raise SpecError(str(p), f"is a directory; give a {kind} file") from None
    except PermissionError:
        raise SpecError(str(p), f"cannot read the {kind} file: permission denied") from None
    except OSError as err:
        raise SpecError(str(p), f"cannot read the {kind} file: {err.strerror or err}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        what = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
        raise SpecError(str(p), f"is {what}; give a {kind} file")
    return os.fdopen(fd, "rb")


def read_bytes_file(path: str | Path, kind: str, max_bytes: int = MAX_SPEC_BYTES) -> bytes:
    """The bytes of the regular file ``path``, at most ``max_bytes``; anything else is a SpecError."""
    with open_regular(path, kind) as f:
        size = os.fstat(f.fileno()).st_size
        if size > max_bytes:
            raise SpecError(str(path), f"is {size / 2**20:.0f} MiB, larger than any {kind} file "
                                       f"(at most {max_bytes / 2**20:.0f} MiB); give the right file")
        try:
            raw = f.read(max_bytes + 1)
        except OSError as err:
            raise SpecError(str(path), f"cannot read the {kind} file: {err.strerror or err}") from None
    if len(raw) > max_bytes:  # grew while being read
        raise SpecError(str(path), f"is larger than any {kind} file (at most {max_bytes / 2**20:.0f} MiB)")
    return raw


def read_text_file(path: str | Path, kind: str, max_bytes: int = MAX_SPEC_BYTES) -> str:
    """The UTF-8 text of the regular file ``path``; anything else is a SpecError naming the file."""
    raw = read_bytes_file(path, kind, max_bytes)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise SpecError(str(path), f"is not a text {kind} file (byte {err.start} is not UTF-8); "
                                   "give the YAML or JSON file itself") from None


# ----- YAML 1.2 scalars -----------------------------------------------------------------------------------
# The core schema of YAML 1.2 (spec section 10.3.2): what a plain scalar means. PyYAML implements YAML 1.1,
# where ``1e-6`` is text (a float needs a dot), ``yes``/``on`` are booleans, ``010`` is octal, ``1:30`` is
# sexagesimal and ``2024-01-01`` a date.
_YAML12 = {
    "tag:yaml.org,2002:null": (r"~|null|Null|NULL|", list("~nN") + [""]),
    "tag:yaml.org,2002:bool": (r"true|True|TRUE|false|False|FALSE", list("tTfF")),
    "tag:yaml.org,2002:int": (r"[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+", list("-+0123456789")),
    "tag:yaml.org,2002:float": (r"[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
                                r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN)", list("-+.0123456789")),
    "tag:yaml.org,2002:merge": (r"<<", ["<"]),  # merge keys (YAML 1.1) stay: job files use `<<: *base`
}


class StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` reading YAML 1.2 scalars, refusing duplicate keys in a mapping and nesting deeper
    than ``MAX_DEPTH``."""

    yaml_implicit_resolvers: dict = {}  # YAML 1.2's, filled below (not the 1.1 ones SafeLoader has)

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:  # type: ignore[override]
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise yaml.composer.ComposerError(None, None, f"nested deeper than {MAX_DEPTH} levels",
                                                  self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:  # type: ignore[override]
        seen: set = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` then overrides is not a duplicate
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:  # unhashable: the base class refuses it with its own message
                continue
            if duplicate:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r} (a key may appear "
                                                        "once per mapping)", key_node.start_mark)
        return super().construct_mapping(node, deep)


    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:  # type: ignore[override]
        text = self.construct_scalar(node)
        sign, digits = (-1, text[1:]) if text[0] == "-" else (1, text.lstrip("+"))
        if digits.startswith("0o"):
            return sign * int(digits[2:], 8)
        if digits.startswith("0x"):
            return sign * int(digits[2:], 16)
        if len(digits) > 1 and digits[0] == "0":
            raise yaml.constructor.ConstructorError(
                None, None, f"{text[:40]!r} has a leading zero: YAML 1.1 reads it as octal, YAML 1.2 as decimal; "
                f"write {text[:40].lstrip('+-0') or '0'} (or 0o... for octal)", node.start_mark)
        return sign * int(digits)

    def construct_yaml_float(self, node: yaml.ScalarNode) -> float:  # type: ignore[override]
        text = self.construct_scalar(node)
        lower = text.lower()
        if lower.endswith(".inf"):
            return float("-inf") if text.startswith("-") else float("inf")
        if lower == ".nan":
            return float("nan")
        return float(text)


for _tag, (_pattern, _first) in _YAML12.items():
    StrictLoader.add_implicit_resolver(_tag, re.compile(f"^(?:{_pattern})$"), _first)
StrictLoader.add_constructor("tag:yaml.org,2002:int", StrictLoader.construct_yaml_int)
StrictLoader.add_constructor("tag:yaml.org,2002:float", StrictLoader.construct_yaml_float)


def check_expansion(data: Any, where: str) -> None:
    """Refuse a parsed tree whose YAML aliases add more than ``MAX_ALIAS_EXPANSION`` values, nest deeper
    than ``MAX_DEPTH`` once expanded, or refer to themselves. Work is linear in the distinct containers:
    each one's expanded size and depth are computed once (an alias is the same Python object)."""
    done: dict[int, tuple[int, int]] = {}  # id -> (values once expanded, depth)
    parsed = 0  # values of the distinct containers walked so far: the tree without aliases repeated
    stack: list[tuple[Any, bool]] = [(data, False)]
    open_: set[int] = set()
    while stack:
        node, children_done = stack.pop()
        if not isinstance(node, (dict, list)) or id(node) in done and not children_done:
            continue
        items = list(node.keys()) + list(node.values()) if isinstance(node, dict) else node
        if not children_done:
            if id(node) in open_:
                raise SpecError(where, "not valid YAML: an alias refers to the value that holds it (a recursive "
                                       "structure); write the value out")
            open_.add(id(node))
            stack.append((node, True))
            for child in items:
                if isinstance(child, (dict, list)):
                    if id(child) in open_:
                        raise SpecError(where, "not valid YAML: an alias refers to the value that holds it (a "
                                               "recursive structure); write the value out")
                    if id(child) not in done:
                        stack.append((child, False))
            continue
        open_.discard(id(node))
        parsed += 1 + sum(not isinstance(child, (dict, list)) for child in items)
        size, depth = 1, 1
        for child in items:
            sub = done.get(id(child), (1, 0)) if isinstance(child, (dict, list)) else (1, 0)
            size, depth = size + sub[0], max(depth, sub[1] + 1)
        done[id(node)] = (size, depth)
        if size - parsed > MAX_ALIAS_EXPANSION:
            raise SpecError(where, f"not valid YAML: its aliases expand to more than {MAX_ALIAS_EXPANSION:,} "
                                   "values (an alias bomb); write the values out or use fewer aliases")
        if depth > MAX_DEPTH:
            raise SpecError(where, f"not valid YAML: its aliases nest values deeper than {MAX_DEPTH} levels")


def _yaml_error_line(err: yaml.YAMLError) -> str:
    """One line for a PyYAML error, whose ``str`` spans several lines with a caret drawing."""
    if isinstance(err, yaml.MarkedYAMLError):
        mark = err.problem_mark or err.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        what = err.problem or err.context or "syntax error"
        return f"{what}{where}"
    return str(err).splitlines()[0] if str(err) else type(err).__name__


def load_yaml(text: str, where: str) -> Any:
    """Parse YAML with ``StrictLoader``; a syntax error, duplicate key or deep nesting is a SpecError."""
    try:
        data = yaml.load(text, Loader=StrictLoader)  # noqa: S506 - StrictLoader is a SafeLoader
    except yaml.YAMLError as err:
        raise SpecError(where, f"not valid YAML: {_yaml_error_line(err)}") from None
    except (ValueError, RecursionError) as err:  # e.g. an integer of more digits than Python converts
        raise SpecError(where, f"not valid YAML: {str(err).splitlines()[0] if str(err) else type(err).__name__}") \
            from None
    check_expansion(data, where)
    return data


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r} (a key may appear once per object)")
        out[key] = value
    return out


def load_json(text: str, where: str, kind: str) -> Any:
    """Parse JSON refusing duplicate keys and deep nesting; errors are a SpecError naming ``where``."""
    try:
        return json.loads(text, object_pairs_hook=_unique_pairs)
    except json.JSONDecodeError as err:
        raise SpecError(where, f"not a valid {kind} file: invalid JSON ({err.msg} at line {err.lineno})") from None
    except RecursionError:
        raise SpecError(where, f"not a valid {kind} file: nested too deeply") from None
    except ValueError as err:  # a duplicate key, or an integer of more digits than Python converts
        raise SpecError(where, f"not a valid {kind} file: {str(err).splitlines()[0]}") from None


def read_json_file(path: str | Path, kind: str, max_bytes: int = MAX_SPEC_BYTES) -> Any:
    """The JSON in the file ``path``; any bad file is a SpecError naming it."""
    return load_json(read_text_file(path, kind, max_bytes), str(path), kind)


def read_yaml_file(path: str | Path, kind: str) -> Any:
    """The YAML in the file ``path`` (JSON is YAML too); any bad file is a SpecError naming it."""
    return load_yaml(read_text_file(path, kind), str(path))


def write_text_file(path: str | Path, text: str, flag: str) -> None:
    """Write ``text`` to ``path``; an unwritable path (missing folder, a directory, no permission, disk
    full) is a SpecError naming ``flag`` and the path."""
    p = Path(path)
    try:
        p.write_text(text)
    except OSError as err:
        raise SpecError(flag, f"cannot write {p}: {err.strerror or err}; give a writable file path") from None


def atomic_write_text(path: str | Path, text: str, flag: str | None = None) -> None:
    """Write ``path`` through a temporary sibling of a fresh name, flushed to disk and renamed over it: a
    reader sees the old file or the new one, never half of one, and a failed write (a directory in the
    way, a full disk) removes the temporary. With ``flag`` an OSError becomes a SpecError naming it."""
    p = Path(path)
    tmp: str | None = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
        tmp = None
    except OSError as err:
        if flag is None:
            raise
        raise SpecError(flag, f"cannot write {p}: {err.strerror or err}; give a writable path") from None
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
