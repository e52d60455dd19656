"""The job as ``nereus run`` runs it: the job file's tree with every command-line override applied
(``overrides.resolve_overrides``), what Nereus did with each verl key, and which key the user typed for each
Nereus key an override set (``typed_keys``), so that every later error names the key as typed.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from nereus.spec.files import atomic_write_text
from nereus.spec.overrides import resolve_overrides
from nereus.spec.typed_keys import TypedKeys

if TYPE_CHECKING:
    from nereus.spec.job import JobSpec

# beside metrics.jsonl in a run's output folder: the job as it ran, overrides applied
EFFECTIVE_CONFIG = "effective_config.yaml"


def config_text(tree: Any, fates: Sequence[tuple[str, str]] = (), overrides: Sequence[str] = ()) -> str:
    """The job tree as YAML, the overrides that made it and each verl key's fate as comments (the text stays
    valid YAML; relative paths in it are the job file's)."""
    out = "".join(f"# override: {o}\n" for o in overrides)
    out += yaml.safe_dump(tree, sort_keys=False, width=120, allow_unicode=True, default_flow_style=None)
    if fates:
        out += f"# verl keys ({len(fates)}):\n"
        out += "".join(f"#   {text}  {fate}\n" for text, fate in fates)
    return out


@dataclass(frozen=True)
class EffectiveConfig:
    """The raw job tree after the overrides; ``fates``: (override as written, what Nereus does with it) for
    each verl key; ``notes``: what was ignored, one line each."""

    tree: Any
    overrides: tuple[str, ...] = ()
    fates: tuple[tuple[str, str], ...] = ()
    notes: tuple[str, ...] = ()
    typed: TypedKeys = field(default_factory=TypedKeys)

    def save(self, folder: Path, job: JobSpec) -> Path:
        """Write ``folder/effective_config.yaml``: the tree with what ``nereus run``'s flags changed
        (``--workers``: ``job.run.workers``)."""
        tree = self.tree
        run = tree.get("run") if isinstance(tree, dict) else None
        if isinstance(run, dict) and job.run is not None and run.get("workers") != job.run.workers:
            tree = {**tree, "run": {**run, "workers": job.run.workers}}
        atomic_write_text(folder / EFFECTIVE_CONFIG, config_text(tree, self.fates, self.overrides))
        return folder / EFFECTIVE_CONFIG


def header_line(job: JobSpec) -> str:
    """The run header's line of the algorithm as it runs (overrides applied): the keys a command line most
    often changes and the job file must agree with."""
    a = job.algorithm
    return (f"algorithm.name={a.name} adv_estimator={a.adv_estimator} samples_per_prompt={a.samples_per_prompt} "
            f"mini_batches={a.mini_batches} epochs={a.epochs} models=[{', '.join(a.models)}]")


def effective_config(data: Any, overrides: Sequence[str]) -> EffectiveConfig:
    """``data`` (a job file's raw tree) with ``overrides`` applied; the first problem is raised under the key
    the user typed, each ignored verl key is noted on stderr."""
    result = resolve_overrides(data, overrides)
    typed = TypedKeys.of(result.touched, overrides)
    if result.problems:
        raise typed.rename(result.problems[0])
    for note in result.notes:
        print(note, file=sys.stderr)
    return EffectiveConfig(result.tree, tuple(overrides), tuple(result.fates), tuple(result.notes), typed)
