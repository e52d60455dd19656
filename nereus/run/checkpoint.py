"""A run folder's checkpoints on disk: written so that a driver killed between any two writes leaves a
resumable run, and chosen at resume so that a broken one is skipped by name (resume integrity).

Writing ``step_<N>`` (``StepWriter``): every file goes into a temporary sibling ``.step_<N>.partial``;
``MANIFEST.json`` is written last inside it; the folder is then renamed to ``step_<N>`` (an existing one —
a step redone after a recovery — is first renamed aside and removed after); ``latest`` is then replaced
through a temporary file and a rename. So at any instant ``latest`` names a complete checkpoint or the
one before it, and a half-written folder never carries a ``step_<N>`` name.

Choosing (``resumable``): ``latest``'s step when its folder verifies (``manifest.verify_manifest``), else
the newest ``step_<N>`` folder that does, with a warning naming each broken one it skipped.
"""

from __future__ import annotations

import json
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

from nereus.run.manifest import verify_manifest, write_manifest, write_text_atomic
from nereus.spec.errors import SpecError
from nereus.spec.layout import Layout

LATEST = "latest"
STATE = "state.json"
_STEP = re.compile(r"step_(\d+)")

WriteHook = Callable[[str], None]  # called after each write with what was written (tests stop the writer there)


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / f"step_{step}"


class StepWriter:
    """One checkpoint being written: ``folder`` is the temporary folder the caller writes files into (calling
    ``wrote`` after each), ``commit`` makes it ``step_<N>`` and points ``latest`` at it."""

    def __init__(self, run_dir: Path, step: int, hook: WriteHook | None = None) -> None:
        self.run_dir, self.step, self.hook = run_dir, step, hook
        self.folder = run_dir / f".step_{step}.partial"
        if self.folder.exists():  # left by a driver killed while writing it
            shutil.rmtree(self.folder)
        self.folder.mkdir(parents=True)

    def wrote(self, what: str) -> None:
        if self.hook is not None:
            self.hook(what)

    def discard(self) -> None:
        """Remove the temporary folder of a write that failed (a full disk, an error): nothing half-written
        stays behind. A driver killed mid-write leaves it; the next write of that step removes it."""
        shutil.rmtree(self.folder, ignore_errors=True)

    def commit(self) -> Path:
        write_manifest(self.folder)  # last inside the folder: a manifest says the files are all there
        self.wrote("MANIFEST.json")
        final = step_dir(self.run_dir, self.step)
        aside = None
        if final.exists():  # the same step written again (redone after a recovery): swap, then remove the old
            aside = self.run_dir / f".step_{self.step}.old-{uuid.uuid4().hex[:8]}"
            final.rename(aside)
            self.wrote("rename aside")
        self.folder.rename(final)
        self.wrote(f"rename to {final.name}")
        write_text_atomic(self.run_dir / LATEST, str(self.step))
        self.wrote(LATEST)
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
        return final


def _steps_on_disk(run_dir: Path) -> list[int]:
    steps = [int(m.group(1)) for p in run_dir.iterdir() if p.is_dir() and (m := _STEP.fullmatch(p.name))]
    return sorted(steps, reverse=True)


def _latest_step(run_dir: Path) -> tuple[int | None, str | None]:
    """``latest``'s step, or None and why it cannot be used."""
    path = run_dir / LATEST
    if not path.is_file():
        return None, f"{path} does not exist"
    try:
        text = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as err:
        return None, f"{path} cannot be read ({err})"
    if not text.isdigit():
        return None, f"{path} holds {text[:40]!r}, not a step number"
    return int(text), None


def resumable(run_dir: Path) -> tuple[int, Path, list[str]]:
    """(step, folder, warnings): the checkpoint to resume from — ``latest``'s if it verifies, else the newest
    complete ``step_<N>`` — and one warning per broken checkpoint (or unusable ``latest``) skipped. Raises
    ``SpecError`` naming every problem when no checkpoint verifies."""
    if not run_dir.is_dir():
        raise SpecError("--resume", f"{run_dir} does not exist: nothing to resume (check --out)")
    latest, why = _latest_step(run_dir)
    warnings = [] if why is None else [f"{why}; looking for the newest complete checkpoint instead"]
    order = ([latest] if latest is not None else []) + [s for s in _steps_on_disk(run_dir) if s != latest]
    for step in order:
        folder = step_dir(run_dir, step)
        try:
            verify_manifest(folder, required=(STATE,))
        except SpecError as err:
            warnings.append(f"checkpoint {folder.name} is broken ({err.message}); skipping it")
            continue
        return step, folder, warnings
    problems = "; ".join(warnings) or "no step_<N> folder"
    raise SpecError("--resume", f"no complete checkpoint under {run_dir} ({problems})")


# ----- what a checkpoint's optimizer shards were written under ------------------------------------------
def placement_record(placed: list) -> dict[str, dict]:
    """model/stage → the layout, workers (in layout rank order) and runtime key it ran on: ``state.json``
    keeps it so that a resume knows which shard each ``optim/<model>/rank<r>`` file holds."""
    return {f"{p.model}/{p.stage}": {"layout": p.layout.to_dict(), "ranks": list(p.ranks), "key": p.key}
            for p in placed}


def written_training(state: dict, path: Path, models: list[str]) -> dict[str, tuple[Layout, tuple[int, ...]]]:
    """model → (layout, ranks) of its training key when ``path`` was written; refuses a checkpoint that
    does not record them (written by an older format) by name."""
    where = f"{path / STATE}.placements"
    record = state.get("placements")
    if not isinstance(record, dict):
        raise SpecError("--resume", f"{path / STATE} does not record the layouts its optimizer shards were written "
                                    "under (a checkpoint from an older nereus): it cannot be resumed safely")
    out = {}
    for model in models:
        entry = record.get(f"{model}/training")
        if not isinstance(entry, dict) or not isinstance(entry.get("ranks"), list):
            raise SpecError("--resume", f"{where} has no valid entry for {model}/training")
        out[model] = (Layout.from_dict(entry.get("layout"), f"{where}.{model}/training.layout"),
                      tuple(int(r) for r in entry["ranks"]))
    return out


def optimizer_tag(model: str, layout: Layout, ranks: tuple[int, ...], worker: int) -> dict[str, str]:
    """Safetensors metadata of one optimizer shard file: which shard of which layout it holds."""
    return {"nereus.model": model, "nereus.layout": layout.short(), "nereus.ranks": json.dumps(list(ranks)),
            "nereus.worker": str(worker), "nereus.position": str(ranks.index(worker))}


def read_optimizer_files(folder: Path, model: str, layout: Layout, ranks: tuple[int, ...]) -> dict[int, dict]:
    """worker → its Adam state from ``optim/<model>/rank<w>.safetensors``, each file checked to be the
    shard of ``layout`` on ``ranks`` it claims to be; a missing, extra or mislabelled file is refused by name."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    want = {f"rank{w}.safetensors" for w in ranks}
    have = {p.name for p in folder.iterdir()} if folder.is_dir() else set()
    if have != want:
        odd = sorted(want - have) or sorted(have - want)
        raise SpecError("--resume", f"{folder}: the {model} optimizer shards of workers {list(ranks)} are expected, "
                                    f"found {sorted(have)} ({odd[0]} is {'missing' if want - have else 'extra'})")
    states = {}
    for w in ranks:
        f = folder / f"rank{w}.safetensors"
        with safe_open(str(f), "pt") as handle:
            tag = handle.metadata() or {}
        if tag != optimizer_tag(model, layout, ranks, w):
            raise SpecError("--resume", f"{f} is labelled {tag or 'nothing'}, not as worker {w}'s {model} shard of "
                                        f"{layout.short()} on workers {list(ranks)}: the checkpoint is inconsistent")
        states[w] = load_file(str(f))
    return states


def placement_change(model: str, old: tuple[Layout, tuple[int, ...]], new: tuple[Layout, tuple[int, ...]],
                     workers: int) -> str | None:
    """None when ``model``'s training placement is unchanged; else what differs. Raises ``SpecError`` when
    the checkpoint's placement cannot be rebuilt on ``workers`` workers to re-shard from."""
    if old == new:
        return None
    what = (f"the checkpoint's {model}/training ran as {old[0].short()} on workers {list(old[1])}; this run places "
            f"it as {new[0].short()} on workers {list(new[1])}")
    if max(old[1]) >= workers:
        raise SpecError("--resume", f"{what}, and its optimizer shards cannot be re-sharded on {workers} workers: "
                                    f"resume with --workers {max(old[1]) + 1} or the checkpoint's layouts")
    return what
