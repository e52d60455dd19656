"""The package's import rules (nereus/devtools/imports.py) hold on the real source, and the checker catches
each kind of violation when one is planted in a small synthetic package."""

from pathlib import Path

import pytest

from nereus.devtools.imports import (
    RUNTIME_ORDER,
    check,
    file_cycles,
    forbidden_imports,
    package_cycles,
    private_imports,
    runtime_layers,
    scan,
)
from tests.devtools.synthetic import write_package

PACKAGE = Path(__file__).resolve().parents[2] / "nereus"


def test_torch_and_ray_stay_out_of_the_planning_layers():
    problems = [p for p in forbidden_imports(scan(PACKAGE)) if "must not import torch" in p
                or "must not import ray" in p]
    assert not problems, "\n".join(problems)


def test_control_imports_no_backend_and_run_runtime_no_sim():
    problems = [p for p in forbidden_imports(scan(PACKAGE)) if "/):" in p]
    assert not problems, "\n".join(problems)


def test_no_package_cycles():
    problems = package_cycles(scan(PACKAGE))
    assert not problems, "\n".join(problems)


def test_no_file_cycles():
    problems = file_cycles(scan(PACKAGE))
    assert not problems, "\n".join(problems)


CLEAN = {
    "spec/__init__.py": "",
    "spec/layout.py": "import math\n",
    "cost/model.py": "from nereus.spec.layout import math\n",
    "control/controller.py": "from nereus.cost import model\n",
    "runtime/engine.py": "import torch\nfrom nereus.control.controller import model\n",
}


def test_checker_accepts_a_clean_package(tmp_path):
    assert check(write_package(tmp_path, CLEAN)) == []


def test_checker_reports_torch_in_spec_with_file_and_line(tmp_path):
    root = write_package(tmp_path, {**CLEAN, "spec/layout.py": "import math\n\n\ndef f():\n    import torch\n"})
    problems = forbidden_imports(scan(root))
    # the spec file itself, and cost and control that reach it
    assert any(p.startswith("nereus/spec/layout.py (spec/ must not import torch)")
               and "nereus/spec/layout.py:5 `import torch`" in p for p in problems), problems
    assert any(p.startswith("nereus/control/controller.py (control/ must not import torch)")
               and "nereus/cost/model.py:1 `from nereus.spec.layout import math`" in p for p in problems), problems


def test_checker_reports_ray_reached_through_a_package_init(tmp_path):
    # importing nereus.spec.layout runs nereus/spec/__init__.py, which imports ray
    root = write_package(tmp_path, {**CLEAN, "spec/__init__.py": "import ray\n"})
    problems = forbidden_imports(scan(root))
    assert any(p.startswith("nereus/cost/model.py (cost/ must not import ray)")
               and "nereus/spec/__init__.py:1 `import ray`" in p for p in problems), problems


def test_checker_reports_control_importing_a_backend(tmp_path):
    root = write_package(tmp_path, {**CLEAN, "control/controller.py": "from nereus.runtime import engine\n"})
    problems = forbidden_imports(scan(root))
    assert any(p.startswith("nereus/control/controller.py (control/ must not import runtime/)")
               and "nereus/control/controller.py:1 `from nereus.runtime import engine`" in p
               for p in problems), problems


def test_checker_reports_run_importing_sim(tmp_path):
    deferred = "def f():\n    from nereus.sim.run import x\n"  # inside a function: still counts
    root = write_package(tmp_path, {**CLEAN, "sim/run.py": "", "run/driver.py": deferred})
    problems = forbidden_imports(scan(root))
    assert any("(run/ must not import sim/)" in p and "nereus/run/driver.py:2" in p for p in problems), problems


@pytest.mark.parametrize("relative", [False, True])
def test_checker_reports_file_and_package_cycles(tmp_path, relative):
    back = "from . import model\n" if relative else "from nereus.cost import model\n"
    root = write_package(tmp_path, {**CLEAN, "spec/layout.py": "def f():\n    " + back.replace(
        "from . ", "from ..cost ")})
    files, packages = file_cycles(scan(root)), package_cycles(scan(root))
    assert len(files) == 1 and "nereus/cost/model.py -> nereus/spec/layout.py -> nereus/cost/model.py" in files[0]
    assert "nereus/spec/layout.py:2 `from " in files[0]
    assert len(packages) == 1 and "cost -> spec -> cost" in packages[0]


def test_checker_reports_a_cycle_inside_one_package(tmp_path):
    root = write_package(tmp_path, {**CLEAN, "spec/a.py": "from nereus.spec import b\n",
                               "spec/b.py": "import nereus.spec.c\n", "spec/c.py": "from nereus.spec.a import x\n"})
    files = file_cycles(scan(root))
    assert len(files) == 1, files
    assert "nereus/spec/a.py -> nereus/spec/b.py -> nereus/spec/c.py -> nereus/spec/a.py" in files[0]
    assert "nereus/spec/c.py:1 `from nereus.spec.a import x`" in files[0]
    assert package_cycles(scan(root)) == []


def test_a_type_checking_import_is_no_file_cycle_but_still_counts_for_layering(tmp_path):
    typed = "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from nereus.cost.model import X\n"
    root = write_package(tmp_path, {**CLEAN, "spec/layout.py": typed})
    assert file_cycles(scan(root)) == []  # it never runs
    assert len(package_cycles(scan(root))) == 1  # the packages still depend on each other
    torch_typed = "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    import torch\n"
    root = write_package(tmp_path / "b", {**CLEAN, "spec/layout.py": torch_typed})
    assert any(p.startswith("nereus/spec/layout.py (spec/ must not import torch)") and
               "nereus/spec/layout.py:4 `import torch`" in p for p in forbidden_imports(scan(root)))


def test_runtime_rooms_import_only_rooms_below_them_and_no_private_names():
    tree = scan(PACKAGE)
    assert runtime_layers(tree) == [], "\n".join(runtime_layers(tree))
    assert private_imports(tree) == [], "\n".join(private_imports(tree))
    rooms = {p.name for p in (PACKAGE / "runtime").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert rooms == set(RUNTIME_ORDER), rooms ^ set(RUNTIME_ORDER)


LAYERED = {
    "runtime/__init__.py": "",
    "runtime/comm/groups.py": "import torch\n",
    "runtime/model/decoder.py": "import torch\n",
    "runtime/engines/native.py": "from nereus.runtime.comm.groups import torch\n",
    "runtime/cluster/worker.py": "from nereus.runtime.engines import native\n",
}


def test_checker_accepts_downward_runtime_imports(tmp_path):
    assert check(write_package(tmp_path, LAYERED)) == []


@pytest.mark.parametrize("typing_only", [False, True])
def test_checker_reports_an_upward_import_between_runtime_rooms(tmp_path, typing_only):
    up = "from nereus.runtime.cluster.worker import Worker\n"
    if typing_only:
        up = "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    " + up
    root = write_package(tmp_path, {**LAYERED, "runtime/model/decoder.py": up})
    problems = runtime_layers(scan(root))
    assert len(problems) == 1 and "runtime/model/ must not import runtime/cluster/" in problems[0], problems
    assert "nereus/runtime/model/decoder.py" in problems[0]


def test_checker_reports_a_runtime_room_outside_the_order(tmp_path):
    root = write_package(tmp_path, {**LAYERED, "runtime/widgets/w.py": ""})
    assert any("runtime/widgets/ has no place in RUNTIME_ORDER" in p for p in runtime_layers(scan(root)))


def test_checker_reports_a_private_cross_module_import(tmp_path):
    private = "from nereus.runtime.engines.native import (\n    _install,\n    torch,\n)\n"
    root = write_package(tmp_path, {**LAYERED, "runtime/cluster/worker.py": private})
    problems = private_imports(scan(root))
    assert len(problems) == 1 and "private name _install imported from nereus.runtime.engines.native" in problems[0]
    assert check(root) == problems
