"""``nereus run JOB [key=value ...] --cfg job`` (Hydra's ``--cfg job``): the job as the overrides make it,
with what Nereus does with every verl key, and every problem at once, one line each. Nothing starts: the
job file and the overrides are read and validated as ``nereus run`` would (a model's ``path`` reads only its
``config.json``, the architecture), and no data file, weights, torch model or Ray is touched.

Problems are found in two passes. Each override on its own (``overrides.resolve_overrides``): malformed,
unknown (with the closest verl key), refused, or a derived key that cannot be honoured. Then the job is
validated with the rest; a validation error naming a key some override set is reported and that override
left out, and validation runs again, until the job validates or an error names no override.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nereus.spec.data_files import check_data_files
from nereus.spec.effective import config_text
from nereus.spec.errors import SpecError
from nereus.spec.files import read_yaml_file
from nereus.spec.job import job_from_dict
from nereus.spec.overrides import resolve_overrides
from nereus.spec.typed_keys import TypedKeys, override_key


@dataclass
class JobReport:
    """The resolved job tree, each verl key's fate (override as written, fate) and the problems (one line
    each, as ``KEY: message``)."""

    tree: Any
    fates: list[tuple[str, str]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def text(self) -> str:
        """The job as YAML, then each verl key's fate as YAML comments (the output stays valid YAML)."""
        return config_text(self.tree, self.fates)


def _names(err: SpecError, touched: set[str]) -> bool:
    """``err`` is about one of the key paths ``touched`` (the key itself, one inside it or one above it)."""
    return any(err.path == t or err.path.startswith(t + ".") or t.startswith(err.path + ".") for t in touched)


def resolve_job(path: str | Path, overrides: Sequence[str]) -> JobReport:
    """The job file ``path`` with ``overrides`` applied and validated, every problem collected."""
    path = Path(path)
    raw = read_yaml_file(path, "job")
    parsed: dict = {}  # each override's value is parsed once, however often validation goes round
    first = resolve_overrides(raw, overrides, parsed)
    typed = TypedKeys.of(first.touched, overrides)  # each problem under the key the user typed
    report = JobReport(first.tree, first.fates, [str(typed.rename(p)) for p in first.problems])
    active, result = list(overrides), first
    for _ in range(len(overrides) + 1):
        try:
            job = job_from_dict(result.tree, path.parent)
        except SpecError as err:
            report.problems.append(str(typed.rename(err)))
            culprits = {key for key, paths in result.touched.items() if _names(err, paths)}
            if not culprits:
                break
            active = [o for o in active if override_key(o) not in culprits]
            result = resolve_overrides(raw, active, parsed)
            continue
        if job.run is None:
            report.problems.append(f"run: {path} has no `run:` section; see docs/rl.md and examples/ppo_tiny.yaml")
        else:
            try:
                check_data_files(job.run)  # by name: no data file is opened
            except SpecError as err:
                report.problems.append(str(typed.rename(err)))
        break
    report.problems = list(dict.fromkeys(report.problems))
    return report
