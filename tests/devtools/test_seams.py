"""The shape rules (nereus/devtools/seams.py): each checker reports a planted violation with its file and
line, and accepts what the rule allows."""

from pathlib import Path

import pytest

from nereus.devtools import seams
from tests.devtools.synthetic import write_package

PACKAGE = Path(__file__).resolve().parents[2] / "nereus"


@pytest.mark.parametrize("rule", [seams.engine_naming, seams.degree_holders, seams.duplicate_classes,
                                  seams.oversized])
def test_the_package_keeps_its_shape(rule):
    problems = rule(PACKAGE)
    assert not problems, "\n".join(problems)


def test_every_engine_naming_allowance_still_names_an_engine():
    stale = [rel for rel in seams.ENGINE_NAMING if not (PACKAGE / rel).is_file()
             or not seams.engine_mentions((PACKAGE / rel).read_text())]
    assert not stale, stale


@pytest.mark.parametrize("source", [
    "def open_engine(cfg):\n    if cfg.engine == 'vllm':\n        return 1\n",
    "from x import VllmEngine\n",
    "def f(run):\n    return run.rollout_engine.vllm\n",
    "ENGINES = {\"sglang\": 0}\n",
])
def test_a_module_outside_the_engines_naming_an_engine_is_reported(tmp_path, source):
    root = write_package(tmp_path, {"run/driver.py": source})
    problems = seams.engine_naming(root)
    assert len(problems) == 1 and problems[0].startswith("nereus/run/driver.py:"), problems


def test_engine_packages_the_job_config_and_prose_may_name_engines(tmp_path):
    root = write_package(tmp_path, {
        "runtime/engines/vllm/engine.py": "import vllm\n",
        "spec/engines.py": "ENGINE_TRAITS = {'native': 1, 'vllm': 2}\n",
        "run/driver.py": "# vLLM restarts its engines on a move\nX = 'a vllm engine'\n\"\"\"vLLM.\"\"\"\n",
    })
    assert seams.engine_naming(root) == []


def test_a_third_class_holding_parallel_degrees_is_reported(tmp_path):
    root = write_package(tmp_path, {
        "spec/layout.py": "class Layout:\n    tp: int\n    pp: int\n    dp: int\n",
        "runtime/groups.py": "class Coords:\n    def __init__(self):\n        self.tp_size = self.pp = self.dp = 1\n",
    })
    problems = seams.degree_holders(root)
    assert len(problems) == 1 and problems[0].startswith("nereus/runtime/groups.py:1 class Coords"), problems


def test_a_class_name_defined_twice_is_reported(tmp_path):
    root = write_package(tmp_path, {"spec/a.py": "class Speculation:\n    pass\n",
                                    "spec/b.py": "\n\nclass Speculation:\n    pass\n"})
    assert seams.duplicate_classes(root) == [
        "class Speculation is defined 2 times: nereus/spec/a.py:1, nereus/spec/b.py:3"]


def test_oversized_classes_and_files_are_reported(tmp_path):
    methods = "".join(f"    def m{i}(self):\n        pass\n" for i in range(seams.MAX_METHODS + 1))
    small = "".join(f"    def m{i}(self):\n        pass\n" for i in range(seams.MAX_METHODS))
    root = write_package(tmp_path, {"runtime/worker.py": "class Worker:\n" + methods,
                                    "runtime/ok.py": "class Ok:\n" + small,
                                    "run/long.py": "x = 1\n" * (seams.MAX_LINES + 1)})
    problems = seams.oversized(root)
    assert len(problems) == 2, problems
    assert problems[0].startswith(f"nereus/runtime/worker.py:1 class Worker has {seams.MAX_METHODS + 1} methods")
    assert problems[1] == f"nereus/run/long.py has {seams.MAX_LINES + 1} lines (at most {seams.MAX_LINES})"


def test_main_prints_and_fails_on_a_violation(tmp_path, capsys):
    root = write_package(tmp_path, {"spec/a.py": "class A:\n    pass\n", "spec/b.py": "class A:\n    pass\n"})
    assert seams.main([str(root)]) == 1
    assert "class A is defined 2 times" in capsys.readouterr().out
    assert seams.main([str(write_package(tmp_path / "ok", {"spec/a.py": "class A:\n    pass\n"}))]) == 0
