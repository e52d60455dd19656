"""The job's data files (``run.data.train`` / ``val``, verl's ``data.train_files`` / ``val_files``) checked
by their names and ``stat`` alone, before anything heavy is imported: a missing file, a folder, a FIFO or a
format Nereus does not read is one line at once, not after the runtime's libraries load. Their rows are
read, and checked row by row, by ``rl.data.read_rows`` once the job is accepted.
"""

from __future__ import annotations

from pathlib import Path

from nereus.spec.errors import SpecError
from nereus.spec.run import RunSpec

# what rl.data.read_rows reads: JSON lines, or Parquet (a file, or a folder of them as pyarrow's dataset)
SUFFIXES = (".jsonl", ".json", ".parquet")


def check_data_files(run: RunSpec) -> None:
    """Every data file of ``run`` is there and of a kind Nereus reads; relative paths are from the current
    folder, as the run reads them."""
    for key, files in (("train", run.data.train), ("val", run.data.val)):
        for i, name in enumerate(files):
            _check(Path(name), f"run.data.{key}" + (f"[{i}]" if len(files) > 1 else ""))


def _check(path: Path, where: str) -> None:
    if path.suffix not in SUFFIXES:
        raise SpecError(where, f"{str(path)!r} is not a .parquet or .jsonl file (verl's data format)")
    try:
        exists, is_file, is_dir = path.exists(), path.is_file(), path.is_dir()
    except OSError as err:  # a path too long, a folder without permission
        raise SpecError(where, f"{str(path)!r} cannot be read: {err.strerror or err}") from None
    if not exists:
        raise SpecError(where, f"{str(path)!r} does not exist; check the path (relative paths are from the "
                               f"current folder, {Path.cwd()})")
    if is_dir and path.suffix != ".parquet" or not (is_file or is_dir):
        raise SpecError(where, f"{str(path)!r} is not a regular file")
