"""run.algorithm_modules: the names a user module registers are read from its decorators without running it."""

from __future__ import annotations

from pathlib import Path

import pytest

from nereus.spec.errors import SpecError
from nereus.spec.user_algorithms import declared_algorithms, read_algorithm_modules

GOOD = '''
import nereus.rl.core as core
from nereus.rl.core import register_adv_est, register_policy_loss

raise SystemExit("never run while validating")

@register_adv_est("mean_baseline")
def mean_baseline(x):
    return {}

@core.register_policy_loss("plain_pg")
def plain_pg(logp, old_logp, adv, mask, *, loss_agg_mode, rollout_is_weights=None, **options):
    return None, {}
'''


def write(tmp_path: Path, text: str, name: str = "algos.py") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_names_come_from_the_decorators_without_running_the_file(tmp_path: Path) -> None:
    declared = declared_algorithms(str(write(tmp_path, GOOD)), "run.algorithm_modules[0]")
    assert declared.adv_estimators == ("mean_baseline",)
    assert declared.policy_losses == ("plain_pg",)


def test_a_relative_file_resolves_against_the_job_folder(tmp_path: Path) -> None:
    write(tmp_path, GOOD)
    targets, declared = read_algorithm_modules(["algos.py"], tmp_path)
    assert targets == (str(tmp_path / "algos.py"),)
    assert declared.policy_losses == ("plain_pg",)


@pytest.mark.parametrize("text, words", [
    ("@register_adv_est(NAME)\ndef f(x): pass\n", "string literal"),
    ("def f(x): pass\n", "registers nothing"),
    ("@register_adv_est('grpo')\ndef f(x): pass\n", "built-in"),
    ("@register_policy_loss('a')\ndef f(*a, **k): pass\n@register_policy_loss('a')\ndef g(*a, **k): pass\n",
     "declared twice"),
    ("def broken(:\n", "syntax error"),
])
def test_bad_modules_are_refused_naming_the_entry(tmp_path: Path, text: str, words: str) -> None:
    write(tmp_path, text)
    with pytest.raises(SpecError) as err:
        read_algorithm_modules(["algos.py"], tmp_path)
    assert err.value.path.startswith("run.algorithm_modules") and words in str(err.value)


def test_a_missing_module_or_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="not found"):
        read_algorithm_modules(["nope.py"], tmp_path)
    with pytest.raises(SpecError, match="not installed"):
        read_algorithm_modules(["no_such_package_xyz.algos"], tmp_path)
    with pytest.raises(SpecError, match="list of"):
        read_algorithm_modules(3, tmp_path)


def test_a_job_selects_the_declared_names_and_refuses_others(tmp_path: Path) -> None:
    from nereus.spec.job import load_job

    root = Path(__file__).resolve().parents[2]
    job_file = tmp_path / "job.yaml"
    job_file.write_text((root / "examples" / "grpo_tiny.yaml").read_text())
    write(tmp_path, GOOD)
    job = load_job(job_file, ["run.algorithm_modules=[algos.py]", "algorithm.adv_estimator=mean_baseline",
                              "run.policy_loss.loss_mode=plain_pg"])
    assert job.run.algorithm_modules == (str(tmp_path / "algos.py"),)
    assert (job.algorithm.adv_estimator, job.run.policy_loss.loss_mode) == ("mean_baseline", "plain_pg")
    with pytest.raises(SpecError) as err:  # without the module the name is unknown, listed with the built-ins
        load_job(job_file, ["algorithm.adv_estimator=mean_baseline"])
    assert err.value.path == "algorithm.adv_estimator" and "rloo" in err.value.message
    with pytest.raises(SpecError) as err:
        load_job(job_file, ["run.policy_loss.loss_mode=nope"])
    assert err.value.path == "run.policy_loss.loss_mode" and "gspo" in err.value.message
