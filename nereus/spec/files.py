"""Reading and writing the files a user hands the CLI, so that a bad file is one ``SpecError`` naming it.

Every spec-like file (job, trace, profile, plan, run record) goes through ``read_text_file``: a directory,
a device or FIFO, a file too large, unreadable or not UTF-8 is refused by name before parsing. YAML goes
through ``load_yaml``, a ``SafeLoader`` that also refuses duplicate mapping keys (PyYAML keeps the last one
silently) and nesting deeper than ``MAX_DEPTH`` (the composer recurses once per level, so 20,000 levels
exhaust Python's stack). JSON goes through ``load_json``, which refuses duplicate keys too, and nesting
deeper than the C decoder's recursion guard allows.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from nereus.spec.errors import SpecError

# No spec, plan or trace comes near this nesting (a job is about 5 levels deep); bounding it keeps the
# recursive YAML composer and JSON decoder far from Python's recursion limit (1,000 frames).
MAX_DEPTH = 64
# Spec-like files are kilobytes; run records of 10^6 steps (the simulator's cap) are about 300 MB.
MAX_SPEC_BYTES = 64 * 2**20
MAX_RECORD_BYTES = 1 << 30


def read_text_file(path: str | Path, kind: str, max_bytes: int = MAX_SPEC_BYTES) -> str:
    """The UTF-8 text of the regular file ``path``; anything else is a SpecError naming the file."""
    p = Path(path)
    try:
        if p.is_dir():
            raise SpecError(str(p), f"is a directory; give a {kind} file")
        if p.exists() and not p.is_file():
            raise SpecError(str(p), f"is not a regular file; give a {kind} file")
        size = p.stat().st_size
        if size > max_bytes:
            raise SpecError(str(p), f"is {size / 2**20:.0f} MiB, larger than any {kind} file "
                                    f"(at most {max_bytes / 2**20:.0f} MiB); give the right file")
        raw = p.read_bytes()
    except FileNotFoundError:
        raise SpecError(str(p), f"{kind} file not found") from None
    except PermissionError:
        raise SpecError(str(p), f"cannot read the {kind} file: permission denied") from None
    except OSError as err:
        raise SpecError(str(p), f"cannot read the {kind} file: {err.strerror or err}") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise SpecError(str(p), f"is not a text {kind} file (byte {err.start} is not UTF-8); "
                                "give the YAML or JSON file itself") from None


class StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses duplicate keys in a mapping and nesting deeper than ``MAX_DEPTH``."""

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
        return yaml.load(text, Loader=StrictLoader)  # noqa: S506 - StrictLoader is a SafeLoader
    except yaml.YAMLError as err:
        raise SpecError(where, f"not valid YAML: {_yaml_error_line(err)}") from None
    except (ValueError, RecursionError) as err:  # e.g. an integer of more digits than Python converts
        raise SpecError(where, f"not valid YAML: {str(err).splitlines()[0] if str(err) else type(err).__name__}") \
            from None


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
