"""The Hydra overrides verl's example scripts set, as data (``tests/data/verl_examples.json``).

verl users launch with shell scripts under verl's ``examples/`` that pass ``key.path=value`` overrides to
a Hydra entry point (``python3 -m verl.trainer.main_ppo ...``). This reads every ``examples/**/*.sh`` of a
verl git checkout (or bare mirror) at one commit and writes, per script, the entry module and the
overrides exactly as the shell hands them over: continuation lines joined, quotes removed, shell
variables (``$VAR``, ``${VAR}``) left as opaque text, ``+key=value`` kept. Only tokens that look like a
Hydra key (a dotted path followed by ``=``) count; a variable or array that holds several overrides
(``ARGS="a.b=1 c.d=2"``, ``ARGS=(a.b=1 ...)``) is split into its overrides.

    python -m nereus.devtools.verl_examples /path/to/verl.git [COMMIT] > tests/data/verl_examples.json

Deterministic: scripts in path order, overrides in script order, duplicates kept (later ones win in Hydra).
The command lines of the documentation pages in ``DOC_PAGES`` (the quickstart's PPO run) are read the same
way, under ``docs``: each ``-m verl.trainer.*`` command, from its line to the next blank one.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys

SOURCE = "https://github.com/volcengine/verl"
# a Hydra override of a dotted key: optional + (add) or ++ (force add), then key.path=
OVERRIDE = re.compile(r"^\+{0,2}[A-Za-z_][\w-]*(\.[\w-]+)+=")
SHELL_ASSIGNMENT = re.compile(r"^[A-Za-z_]\w*=")
ENTRY = re.compile(r"(?<![\w-])-m\s+([A-Za-z_][\w.]*)")  # python3 -m MODULE, torchrun ... -m MODULE
SCRIPT_ENTRY = re.compile(r"\bpython3?\s+([\w./-]+\.py)\b")  # python3 main_ppo_split.py
# the documentation pages whose command lines a verl user copies first
DOC_PAGES = ("docs/start/quickstart.rst",)
DOC_COMMAND = re.compile(r"^.*-m\s+verl\.trainer\.\S+.*?(?=\n[ \t]*\n|\Z)", re.MULTILINE | re.DOTALL)


def _git(repo: str, *args: str) -> str:
    return subprocess.run(["git", "-C", repo, *args], check=True, capture_output=True, text=True).stdout


def _joined(text: str) -> str:
    """The script with backslash continuations joined and arithmetic ``$(( a + b ))`` kept as one word."""
    text = re.sub(r"\\\r?\n", " ", text)
    return re.sub(r"\$\(\((.*?)\)\)", lambda m: "$((" + "".join(m.group(1).split()) + "))", text)


def _tokens(line: str) -> list[str]:
    """Shell words of one line (quotes removed, comments dropped); unbalanced quotes: split on spaces."""
    try:
        return shlex.split(line, comments=True)
    except ValueError:
        return line.split("#", 1)[0].split()


def _words(text: str) -> list[str]:
    """The shell words of a whole script (a quoted string may span lines); line by line where the script
    does not tokenize as a whole (unbalanced quotes in a here-document)."""
    try:
        return shlex.split(text, comments=True)
    except ValueError:
        return [w for line in text.splitlines() for w in _tokens(line)]


def _overrides_in(token: str) -> list[str]:
    """The overrides one shell word holds: itself, or those of a variable or array holding several."""
    token = token.strip().lstrip("(")  # an array's first item: ARGS=(a.b=1
    while token.endswith(")") and token.count(")") > token.count("("):  # its last: c.d=2)
        token = token[:-1]
    if OVERRIDE.match(token):
        return [token]
    if SHELL_ASSIGNMENT.match(token):
        value = token.partition("=")[2].lstrip("(")
        if any(ch.isspace() for ch in value) or OVERRIDE.match(value):
            return [o for word in _tokens(value) for o in _overrides_in(word)]
    return []


def script_overrides(text: str) -> dict[str, object]:
    """The entry module (the first ``-m MODULE``, else the first ``python3 FILE.py``) and the overrides of
    one script, in order."""
    text = _joined(text)
    entry = ENTRY.search(text) or SCRIPT_ENTRY.search(text)
    overrides = [o for word in _words(text) for o in _overrides_in(word)]
    return {"entry": entry.group(1) if entry else "", "overrides": overrides}


def doc_commands(text: str) -> list[dict[str, object]]:
    """Each verl trainer command of a documentation page (``script_overrides`` of its text: from the line
    that runs ``-m verl.trainer.<entry>`` to the next blank line), in page order."""
    return [script_overrides(m.group(0)) for m in DOC_COMMAND.finditer(text)]


def extract(repo: str, commit: str = "HEAD") -> dict[str, object]:
    commit = _git(repo, "rev-parse", commit).strip()
    paths = sorted(p for p in _git(repo, "ls-tree", "-r", "--name-only", commit).splitlines()
                   if p.startswith("examples/") and p.endswith(".sh"))
    scripts = {p: script_overrides(_git(repo, "show", f"{commit}:{p}")) for p in paths}
    docs = {p: doc_commands(_git(repo, "show", f"{commit}:{p}")) for p in DOC_PAGES}
    return {"source": SOURCE, "commit": commit, "scripts": scripts, "docs": docs}


if __name__ == "__main__":
    data = extract(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "HEAD")
    json.dump(data, sys.stdout, indent=1)
    sys.stdout.write("\n")
