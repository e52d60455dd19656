"""docs/rl.md's table of verl keys, written from ``nereus.spec.verl_keys`` so the two cannot drift apart.

Mapped and derived keys get a row each (verl key, Nereus key, note); ignored and refused keys that share one
reason share a row, so the table stays readable at a few hundred keys. ``tests/spec/test_overrides.py``
checks that docs/rl.md holds exactly this text; after changing the table, rewrite it between docs/rl.md's
``verl-keys`` markers with

    python -m nereus.devtools.verl_keys_table docs/rl.md
"""

from __future__ import annotations

import sys
from pathlib import Path

from nereus.spec.verl_keys import DERIVED, MAPPED, PREFIXES, REFUSED, TABLE, VerlKey

BEGIN = "<!-- verl-keys: written by python -m nereus.devtools.verl_keys_table -->"
END = "<!-- end verl-keys -->"


def _fate(entry: VerlKey) -> str:
    if entry.kind == MAPPED:
        return f"`{entry.target}`"
    if entry.kind == DERIVED:
        return f"`{entry.target}` (derived)"
    if entry.kind == REFUSED and entry.accept:
        return "refused unless " + " or ".join(f"`{_yaml(a)}`" for a in entry.accept)
    return entry.kind


def _yaml(value: object) -> str:
    """A value as a command line writes it (``true``, ``null``, ``{}``)."""
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown() -> str:
    """The table, between its markers."""
    rows = ["| verl | Nereus | note |", "|---|---|---|"]
    shared: dict[str, tuple[VerlKey, list[str]]] = {}  # an ignored or refused fate -> its keys, in table order
    for key, entry in [*TABLE.items(), *((p + "*", e) for p, e in PREFIXES.items())]:
        if entry.kind in (MAPPED, DERIVED):
            rows.append(f"| `{key}` | {_fate(entry)} | {_cell(entry.reason)} |")
        else:
            shared.setdefault(repr(entry), (entry, []))[1].append(key)
    for entry, keys in shared.values():
        rows.append(f"| {', '.join(f'`{k}`' for k in keys)} | {_fate(entry)} | {_cell(entry.reason)} |")
    return "\n".join([BEGIN, *rows, END])


def write(path: Path) -> None:
    """Replace the table between its markers in the Markdown file ``path``."""
    text = path.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    path.write_text(text[:start] + markdown() + text[end:])


if __name__ == "__main__":
    if len(sys.argv) > 1:
        write(Path(sys.argv[1]))
    else:
        print(markdown())
