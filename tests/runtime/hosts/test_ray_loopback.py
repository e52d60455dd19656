"""Every TCP socket that Ray's processes (and the runtime's workers) listen on is loopback (127.0.0.0/8, ::1).

Uses the session's Ray instance (the ``ray_runtime`` fixture of tests/conftest.py, started by ``Runtime`` with
``raylocal.start_local_ray``'s settings).
"""

import os
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from nereus.runtime.hosts import raylocal  # noqa: E402

pytestmark = pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux /proc")


@ray.remote(num_cpus=0)  # fits beside the session's workers, which hold every CPU
class Probe:
    def pid(self) -> int:
        return os.getpid()


def _title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
    except OSError:
        return ""


def test_ray_listens_on_loopback_only(ray_runtime):
    probe = Probe.remote()
    try:
        probe_pid = ray.get(probe.pid.remote(), timeout=60)
        # The actor's server may start listening after it answered, later on a loaded machine: wait for it
        # rather than for a fixed time (the deadline only guards against a hang).
        deadline = time.monotonic() + 120
        while True:
            pids = raylocal.ray_pids()
            # The session's nereus Worker actors (when running) are included: their torch.distributed world
            # meets through a file (no TCP store) and gloo binds to the loopback node address.
            listening = raylocal.listening_addresses(pids)
            if probe_pid in {p for p, _, _ in listening} or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert probe_pid in pids and len(pids) >= 3, pids  # driver, GCS, raylet, ... and the probe actor
        kinds = {_title(p).rsplit("/", 1)[-1] for p, _, _ in listening}
        assert {"gcs_server", "raylet"} <= kinds, listening  # the scan sees Ray's daemons
        assert probe_pid in {p for p, _, _ in listening}, listening
        exposed = [(p, _title(p)[-60:], ip, port) for p, ip, port in listening if not raylocal.is_loopback(ip)]
        assert not exposed, (f"node IP {ray.util.get_node_ip_address()}; Ray listens beyond loopback "
                             f"(start it with raylocal.start_local_ray's settings): {exposed}")
    finally:
        ray.kill(probe)
