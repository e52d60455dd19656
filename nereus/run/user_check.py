"""The job's user code (``run.algorithm_modules``, ``run.reward_function``) imported and checked in a
short-lived child process before ``nereus run`` prints its header or starts anything.

The child runs the same checks the run repeats once it starts (``rl.user_registry.load_algorithm_modules``,
``rl.rewards.load_user_function``): a missing name, something not callable, a builtin, a wrong signature,
or a module that raises or exits at import is one ``SpecError`` naming the key, raised here in the parent.
Importing in a child keeps what the module does at import (a ``sys.exit``, a changed working directory,
threads, a hang) out of the driver; the driver's ``sys.path`` goes with it, so a module is found exactly
where the run will look for it.

Run as ``python -m nereus.run.user_check`` with one JSON line on stdin; prints one JSON line, the refusal
or ``{}``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from nereus.spec.errors import SpecError, cut
from nereus.spec.run import RunSpec

# beyond the import deadline of each module (rl.rewards.IMPORT_TIMEOUT_S): starting Python and importing Nereus
CHILD_START_S = 60.0


def check_user_code(run: RunSpec) -> None:
    """Refuse the job's user code as a one-line ``SpecError`` before anything starts (module docstring)."""
    if run.reward_function is None and not run.algorithm_modules:
        return
    from nereus.rl.rewards import IMPORT_TIMEOUT_S

    request = {"reward_function": run.reward_function, "algorithm_modules": list(run.algorithm_modules),
               "sys_path": sys.path, "import_timeout_s": IMPORT_TIMEOUT_S}
    where = "run.reward_function" if run.reward_function else "run.algorithm_modules"
    timeout = CHILD_START_S + IMPORT_TIMEOUT_S * (1 + len(run.algorithm_modules))
    answer = _ask_child(request, where, timeout)
    if answer:
        raise SpecError(str(answer.get("path", where)), str(answer.get("message", "refused")))


def _ask_child(request: dict, where: str, timeout: float) -> dict:
    """The child's answer to ``request`` (``_check_in_child`` run by ``python -m nereus.run.user_check``)."""
    try:
        done = subprocess.run([sys.executable, "-m", "nereus.run.user_check"], input=json.dumps(request),
                              capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise SpecError(where, f"importing the job's user code took more than {timeout:.0f} s; a module should "
                               "only define functions (move work into the function)") from None
    lines = done.stdout.strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        answer = None
    if not isinstance(answer, dict):  # the child died before answering (killed, out of memory)
        detail = cut(done.stderr.strip().splitlines()[-1], 200) if done.stderr.strip() else "no output"
        raise SpecError(where, f"checking the job's user code in a child process failed (exit {done.returncode}: "
                               f"{detail}); fix the module")
    return answer


def _check_in_child(request: dict) -> dict:
    """What the child answers: ``{}``, or the refusal's key and message."""
    from nereus.rl import rewards
    from nereus.rl.user_registry import load_algorithm_modules

    sys.path[:] = request["sys_path"]
    rewards.IMPORT_TIMEOUT_S = float(request["import_timeout_s"])
    try:
        load_algorithm_modules(tuple(request["algorithm_modules"]))
        if request["reward_function"]:
            rewards.load_user_function(request["reward_function"])
    except SpecError as err:
        return {"path": err.path, "message": err.message}
    return {}


def main() -> None:
    answer = _check_in_child(json.loads(sys.stdin.readline()))
    sys.stdout.flush()  # what user code printed at import comes first; the answer is the last line
    print(json.dumps(answer), flush=True)
    os._exit(0)  # threads the user's module started must not hold the child until the parent's timeout


if __name__ == "__main__":
    main()
