"""The small records a run folder holds for other commands: ``ray_session.json`` (the local Ray instance a
driver started, for ``nereus cleanup`` and ``nereus scale``) and ``scale.json`` (a ``nereus scale N``
request the running job reads at its next step boundary).

Both are read with the strict readers (``spec.files``: a regular file only, opened without blocking, at
most ``MAX_RECORD_BYTES``, JSON without duplicate keys or deep nesting) and checked key by key, so a FIFO,
a directory, a huge or deeply nested file, or an extreme number is one line naming the file, never a hang
or a traceback. ``scale.json`` is written through a temporary that a failed write removes.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from nereus.runtime.hosts.raylocal import SESSION
from nereus.spec.errors import SpecError
from nereus.spec.fields import Fields
from nereus.spec.files import atomic_write_text, read_json_file
from nereus.spec.run import MAX_WORKERS

SCALE = "scale.json"
# A session record lists a few dozen pids; a scale request is one number.
MAX_RECORD_BYTES = 2**20
# Linux pids stay below 2^22 (``/proc/sys/kernel/pid_max`` at most 4,194,304).
MAX_PID = 2**22


def read_session_record(run_dir: Path, need: tuple[str, ...], fix: str, flag: str = "--dir") -> dict | None:
    """The ``ray_session.json`` of ``run_dir``, checked; None when the run wrote none (it joined a cluster).
    Every key the readers use is checked when present; those of ``need`` must be present. A bad record is
    a SpecError naming it, with ``fix``."""
    path = run_dir / SESSION
    if not os.path.lexists(path):
        return None
    try:
        f = Fields(read_json_file(path, "Ray session record", MAX_RECORD_BYTES), str(path))
        for key in need:
            if not f.has(key) or f.data[key] is None:
                raise SpecError(f.key_path(key), "required key is missing (the record a run's driver writes has it)")
        record = {"owner": f.get("owner", str, None),
                  "driver_pid": f.get("driver_pid", int, None, minimum=1, maximum=MAX_PID),
                  "num_cpus": f.get("num_cpus", int, None, minimum=0, maximum=MAX_WORKERS * 1024),
                  "pids": f.get_list("pids", int, [])}
        pid, _, start = (record["owner"] or "0-0").partition("-")
        if not (pid.isascii() and pid.isdigit() and start.isascii() and start.isdigit()):
            raise SpecError(f.key_path("owner"), "is not <pid>-<start time> as a driver writes it")
    except SpecError as err:
        raise SpecError(flag, f"{err}; {fix}") from None
    return record


def write_scale_request(run_dir: Path, workers: int) -> Path:
    """Write ``{"workers": N}`` to ``run_dir/scale.json`` atomically; something other than a file in its
    place is refused by name, and a failed write leaves no temporary behind."""
    path = run_dir / SCALE
    if os.path.lexists(path) and not stat.S_ISREG(os.lstat(path).st_mode):
        raise SpecError("--dir", f"{path} exists and is not a regular file; remove it so the request can be written")
    atomic_write_text(path, json.dumps({"workers": workers}), flag="--dir")
    return path


def read_scale_request(path: Path) -> tuple[int | None, str | None]:
    """(the workers a ``nereus scale`` request asks for, or None; why it was ignored, or None). The file
    is removed once read, valid or not, so a bad request is reported once."""
    if not os.path.lexists(path):
        return None, None
    try:
        f = Fields(read_json_file(path, "scale request", MAX_RECORD_BYTES), str(path))
        workers = f.get("workers", int, minimum=1, maximum=MAX_WORKERS)
        f.finish()
        return workers, None
    except SpecError as err:
        return None, f"ignoring {err}; expected {{\"workers\": N}} as `nereus scale N` writes it"
    finally:
        try:
            if stat.S_ISREG(os.lstat(path).st_mode):
                path.unlink()
        except OSError:
            pass
