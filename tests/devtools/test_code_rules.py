"""The source rules beyond imports (nereus/devtools/dispatch.py, module_state.py) hold on the real package,
and each checker reports a planted violation with its file and line."""

from pathlib import Path

import pytest

from nereus.devtools import dispatch, module_state
from nereus.devtools.imports import check, main
from tests.devtools.synthetic import write_package

PACKAGE = Path(__file__).resolve().parents[2] / "nereus"


def test_no_computed_name_dispatch_in_the_package():
    problems = dispatch.dispatch(PACKAGE)
    assert not problems, "\n".join(problems)


def test_no_module_level_mutable_state_in_the_package():
    problems = module_state.module_state(PACKAGE)
    assert not problems, "\n".join(problems)


def test_every_allowance_still_matches_something():
    stale = dispatch.stale_allowances(PACKAGE) + module_state.stale_allowances(PACKAGE)
    assert not stale, "\n".join(stale)


# ----- computed-name dispatch ----------------------------------------------------------------------------
@pytest.mark.parametrize(("source", "line", "shown"), [
    ("def call(w, op, key):\n    return getattr(w, op).remote(key)\n", 2, "getattr(w, op)"),
    ("def put(o, name):\n    setattr(o, name, 1)\n", 2, "setattr(o, name, 1)"),
    ("def drop(o, name):\n    delattr(o, name)\n", 2, "delattr(o, name)"),
    ("def maybe(o, op):\n    if hasattr(o, op):\n        return 1\n", 2, "hasattr(o, op)"),
    ("import torch\n\n\ndef dtype(cfg):\n    return getattr(torch, cfg.dtype)\n", 5, "getattr(torch, cfg.dtype)"),
    ("def kind(o, op):\n    return getattr(o, f'gen_{op}')()\n", 2, "getattr(o, f'gen_{op}')"),
    ("import operator\n\n\ndef f(op):\n    return operator.methodcaller(op)\n", 5, "operator.methodcaller(op)"),
    ("from operator import attrgetter\n\n\ndef f(name):\n    return attrgetter(name)\n", 5, "attrgetter(name)"),
])
def test_checker_reports_computed_name_dispatch_with_file_and_line(tmp_path, source, line, shown):
    root = write_package(tmp_path, {"runtime/workers.py": source})
    problems = dispatch.dispatch(root)
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"nereus/runtime/workers.py:{line} computed-name dispatch `{shown}`"), problems


def test_checker_accepts_literal_names_and_dataclass_serialisation(tmp_path):
    source = (
        "from dataclasses import fields\nimport dataclasses\nimport operator\n\n\n"
        "def f(o):\n    return getattr(o, 'parts', ()), hasattr(o, 'to_json'), operator.attrgetter('a', 'b')\n\n\n"
        "def to_dict(self):\n    return {f.name: getattr(self, f.name) for f in fields(self)}\n\n\n"
        "def rows(records):\n    return [[getattr(r, f.name) for f in dataclasses.fields(r)] for r in records]\n\n\n"
        "def copy(a, b):\n    for f in fields(a):\n        setattr(b, f.name, getattr(a, f.name))\n")
    assert dispatch.dispatch(write_package(tmp_path, {"spec/plan.py": source})) == []


def test_a_fields_loop_does_not_excuse_another_name(tmp_path):
    source = "from dataclasses import fields\n\n\ndef f(o, op):\n    return [getattr(o, op) for f in fields(o)]\n"
    problems = dispatch.dispatch(write_package(tmp_path, {"spec/plan.py": source}))
    assert len(problems) == 1 and problems[0].startswith("nereus/spec/plan.py:5 "), problems


# ----- module-level mutable state ------------------------------------------------------------------------
@pytest.mark.parametrize(("files", "where", "name"), [
    ({"rl/rewards.py": "SOURCES = {}\n\n\ndef register(k, v):\n    SOURCES[k] = v\n"},
     "nereus/rl/rewards.py:5", "SOURCES"),
    ({"run/log.py": "SEEN = []\n\n\ndef note(x):\n    SEEN.append(x)\n"}, "nereus/run/log.py:5", "SEEN"),
    ({"run/log.py": "from collections import defaultdict\n\nBY = defaultdict(list)\n\n\n"
                    "def note(k, x):\n    BY[k].append(x)\n    del BY[k]\n"}, "nereus/run/log.py:8", "BY"),
    ({"run/log.py": "NAMES = set()\n\n\nclass Log:\n    def add(self, n):\n        NAMES.add(n)\n"},
     "nereus/run/log.py:6", "NAMES"),
    ({"spec/kinds.py": "KINDS = {c: c for c in 'ab'}\n",
      "elastic/steps.py": "from nereus.spec.kinds import KINDS\n\n\ndef register(c):\n    KINDS.update({c: c})\n"},
     "nereus/elastic/steps.py:5", "KINDS"),
    ({"spec/kinds.py": "KINDS: dict[str, int] = dict()\n",
      "elastic/steps.py": "import nereus.spec.kinds as k\n\n\ndef register(c):\n    k.KINDS[c] = 1\n"},
     "nereus/elastic/steps.py:5", "KINDS"),
])
def test_checker_reports_a_mutated_module_container_with_file_and_line(tmp_path, files, where, name):
    problems = module_state.module_state(write_package(tmp_path, files))
    assert problems and problems[0].startswith(f"{where} module state:"), problems
    assert f"the module-level `{name}` (" in problems[0]


def test_checker_reports_a_global_statement(tmp_path):
    source = "_RUNTIME = None\n\n\ndef runtime():\n    global _RUNTIME\n    _RUNTIME = object()\n    return _RUNTIME\n"
    problems = module_state.module_state(write_package(tmp_path, {"run/cache.py": source}))
    assert problems == ["nereus/run/cache.py:5 module state: `global _RUNTIME` rebinds a module-level name from a "
                        "function; keep the state in an object"]


def test_checker_accepts_read_only_tables_and_local_containers(tmp_path):
    source = ("from types import MappingProxyType\n\nTIMERS = {'a': 'gen'}\nKINDS = ('a', 'b')\n"
              "TABLE = MappingProxyType({'x': 1})\nBUILT = {}\n"
              "for k in KINDS:\n    BUILT[k] = len(k)  # at import\n\n\n"
              "def f(TIMERS):\n    TIMERS['b'] = 1  # a parameter, not the module's\n"
              "    out = []\n    out.append(BUILT['a'])\n"
              "    seen = {}\n    seen.update(TABLE)\n    return TIMERS.get('a'), out, seen\n")
    assert module_state.module_state(write_package(tmp_path, {"run/backend.py": source})) == []


def test_the_command_prints_every_rule(tmp_path, capsys):
    root = write_package(tmp_path, {"spec/layout.py": "import torch\n\nSEEN = []\n\n\ndef f(w, op):\n"
                                                 "    SEEN.append(op)\n    return getattr(w, op)\n"})
    assert main([str(root)]) == 1
    out = capsys.readouterr().out
    assert "(spec/ must not import torch)" in out
    assert "nereus/spec/layout.py:8 computed-name dispatch `getattr(w, op)`" in out
    assert "nereus/spec/layout.py:7 module state: `SEEN.append(op)`" in out
    assert len(check(root)) == 3
