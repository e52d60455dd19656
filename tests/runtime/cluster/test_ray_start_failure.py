"""A local Ray that does not start (nereus/runtime/hosts/raylocal.py) is the machine failing the run, not a bug:
`nereus run` ends with one line naming what to do and exit 1 (docs/reliability.md, "One-line errors").
No Ray starts here: ``ray.init`` is replaced by one that raises what Ray 2.60 raises."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.fuzz.cli_util import tiny_job_doc, write_yaml

# Ray 2.60's own words when its raylet misses the registration wait (ray/_private/node.py)
RAY_START_TIMEOUT = ("The current node timed out during startup. This could happen because some of the raylet "
                     "failed to startup or the GCS has become overloaded.")


def test_a_local_ray_that_never_starts_is_one_line_and_exit_1(tmp_path):
    """`nereus run` whose local Ray never comes up (ray.init replaced, in a subprocess of its own, by one
    raising what Ray raises): two retry warnings, then one error line naming what to do, exit 1."""
    pytest.importorskip("ray")
    doc = tiny_job_doc(tmp_path / "out")
    doc["run"]["warmstart"]["actor_steps"] = 1  # the workers start after the warm-start: keep it short
    job = write_yaml(tmp_path / "job.yaml", doc)
    code = ("import sys, ray\nfrom nereus.cli import main\ncalls = []\n"
            f"def fail(**kw):\n    calls.append(kw)\n    raise Exception({RAY_START_TIMEOUT!r})\n"
            "ray.init, ray.shutdown = fail, lambda: None\ncode = main(sys.argv[1:])\n"
            "print(len(calls))\nsys.exit(code)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "NEREUS_RAY_OWNER"))}
    done = subprocess.run([sys.executable, "-c", code, "run", str(job), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert (done.returncode, done.stdout) == (1, "3\n"), done.stderr[-2000:]
    lines = done.stderr.splitlines()
    assert [ln for ln in lines if "warning: local Ray did not start" in ln and "starting it again" in ln] == \
        lines[-3:-1], done.stderr
    assert lines[-1].startswith("nereus: error: local Ray did not start after 3 attempts (The current node timed")
    assert "`nereus cleanup`" in lines[-1] and "Traceback" not in done.stderr


@pytest.mark.parametrize("said, failure", [(RAY_START_TIMEOUT, True), ("Failed to start GCS. Last 1 lines of "
                                           "error files:\nE bind failed\n.", True), ("bad argument", False)])
def test_ray_start_failures_are_runtime_failures_and_others_are_not(monkeypatch, said, failure):
    """A failure of Ray's own processes is the machine's (RuntimeFailure, retried only for the raylet's
    registration timeout); anything else ray.init raises is a bug and goes through unchanged."""
    pytest.importorskip("ray")
    from nereus.runtime.hosts import raylocal
    from nereus.spec.errors import RuntimeFailure

    calls = []

    def fail(**kw):
        calls.append(kw)
        raise (Exception if failure else ValueError)(said)

    monkeypatch.setattr(raylocal.ray, "init", fail)
    monkeypatch.setattr(raylocal.ray, "shutdown", lambda: None)
    with pytest.raises(RuntimeFailure if failure else ValueError) as caught:
        raylocal._init_with_retries(1, "unused")
    assert len(calls) == (raylocal.START_ATTEMPTS if said == RAY_START_TIMEOUT else 1)
    if failure:
        assert "\n" not in str(caught.value) and "`nereus cleanup`" in str(caught.value)
