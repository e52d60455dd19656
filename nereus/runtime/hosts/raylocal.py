"""A local Ray instance bound to loopback, and what Ray's processes listen on (read from Linux ``/proc``).

``ray.init(_node_ip_address="127.0.0.1")`` alone is not enough: ray.init passes the address through
``services.resolve_ip_for_localhost``, which swaps a loopback address for ``get_node_ip_address()`` -- the
host's routable IP -- unless ``ray_constants.ENABLE_RAY_CLUSTER`` is false. That flag comes from the
environment variable ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` when ray is imported (default: true except on
Windows/macOS). With the flag off the node IP stays 127.0.0.1, and the GCS, the raylet, every core worker
(driver and actors) and the runtime-env agent bind to it rather than to [::] or the host's IP.

*Token authentication*: Ray 2.60 authenticates every gRPC call to its control store, raylet and
agents with a bearer token when ``RAY_AUTH_MODE=token``
(ray/_private/authentication/authentication_token_setup.py; https://docs.ray.io/en/latest/ray-security/token-auth.html).
``start_local_ray`` turns it on with a fresh random token for each instance, passed to Ray's processes in
``RAY_AUTH_TOKEN`` (readable only by the same user), unless the caller set ``RAY_AUTH_MODE`` itself.

*Clean exits*: every process a local instance starts inherits ``NEREUS_RAY_OWNER`` — the
driver's pid and start time. A process whose owner is gone is a leftover of a driver that died (SIGKILL
skips every handler); the next ``start_local_ray`` and ``nereus cleanup`` kill them (``reap``), and a
driver that exits normally or on SIGTERM/SIGINT shuts Ray down and reaps its own before it goes.
"""

from __future__ import annotations

import atexit
import ipaddress
import os
import secrets
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import FrameType, MappingProxyType

import ray

from nereus.spec.errors import RuntimeFailure

LOOPBACK = "127.0.0.1"
LOOPBACK_ENV: Mapping[str, str] = MappingProxyType({"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"})


OWNER_ENV = "NEREUS_RAY_OWNER"
SESSION = "ray_session.json"  # in a run folder: the local Ray instance its driver started (``session_record``)


def start_local_ray(num_cpus: int, temp_dir: Path) -> None:
    """Start a single-node Ray instance under ``temp_dir`` (no dashboard) that listens on loopback only and
    authenticates with a token of its own; first reap the leftovers of drivers that died."""
    try:
        reap(leftovers())
    except RuntimeError as err:  # a leftover stuck in the kernel must not keep this run from starting
        print(f"nereus: warning: {err}", file=sys.stderr)
    os.environ.update(LOOPBACK_ENV)  # for Ray's child processes, which import ray afresh
    ray._private.ray_constants.ENABLE_RAY_CLUSTER = False  # for this process, where ray is already imported
    os.environ[OWNER_ENV] = owner_tag(os.getpid())
    os.environ[PRIVATE_ENV] = str(Path(temp_dir).absolute())  # Ray's processes inherit it (make_private)
    if "RAY_AUTH_MODE" not in os.environ or os.environ["RAY_AUTH_MODE"] == "token":
        _use_token(secrets.token_hex(32))
    kept = _signal_handlers()
    try:
        _init_with_retries(num_cpus, temp_dir)
    except RuntimeFailure:
        try:  # what the failed starts left running (their processes carry this driver's tag)
            shutdown_local_ray()
        except RuntimeError as err:  # one stuck in the kernel: said, and the start's own error goes through
            print(f"nereus: warning: {err}", file=sys.stderr)
        raise
    for sig, handler in kept.items():  # ray.init installs its own (log and die): the caller's come back
        signal.signal(sig, handler)
    atexit.register(shutdown_local_ray)  # after ray.init's own: runs first, shuts Ray down, then reaps
    make_private()


# Ray makes its temp folder and every folder of a session world-writable (mode 0777,
# ``ray._common.utils.try_make_directory_shared``, so that several users can share /tmp/ray), and every
# Python worker it starts does so again as it starts. A local instance of one driver has no such users:
# the driver, and each worker through Ray's ``worker_process_setup_hook`` (run once the worker is up),
# makes them the owner's only (0700).
PRIVATE_ENV = "NEREUS_RAY_PRIVATE"  # the temp folder of this driver's local Ray, for the hook
PRIVATE_HOOK = "nereus.runtime.hosts.raylocal.make_private"


def make_private() -> None:
    """Mode 0700 for the local Ray's temp folder (``$NEREUS_RAY_PRIVATE``), its sessions and their folders."""
    root = os.environ.get(PRIVATE_ENV)
    if not root:
        return
    folders = [Path(root)]
    for session in Path(root).glob("session_*"):
        if session.is_dir() and not session.is_symlink():
            folders += [session, *(p for p in session.iterdir() if p.is_dir() and not p.is_symlink())]
    for folder in folders:
        try:
            if folder.stat().st_mode & 0o077:
                folder.chmod(0o700)
        except OSError:  # removed meanwhile, or not ours
            pass


# Ray 2.60 waits a fixed 30 s for its raylet to register with the GCS (ray/_private/node.py,
# ``raylet_start_wait_time_s = 30``, not configurable); on a machine whose cores are all busy that can
# pass. A bounded number of fresh starts keeps such a run (and tests run under load) from failing at once.
START_ATTEMPTS = 3
# What Ray 2.60 says when its own processes did not come up (ray/_private/node.py: the raylet's wait above;
# ``_init_gcs_client``'s "Failed to start GCS"; the head node's info missing): the machine, not our code.
_RETRIED = "timed out during startup"
_START_FAILURES = (_RETRIED, "Failed to start GCS", "may not have started successfully")


def _init_with_retries(num_cpus: int, temp_dir: Path) -> None:
    """``ray.init`` of a local instance; raises ``RuntimeFailure`` (one line for the CLI, exit 1) when Ray's
    processes do not come up — after ``START_ATTEMPTS`` tries when the raylet missed its registration wait."""
    for attempt in range(1, START_ATTEMPTS + 1):
        try:
            ray.init(num_cpus=num_cpus, include_dashboard=False, _temp_dir=str(Path(temp_dir).absolute()),
                     _node_ip_address=LOOPBACK, log_to_driver=False,
                     runtime_env={"worker_process_setup_hook": PRIVATE_HOOK})
            return
        except Exception as err:  # noqa: BLE001 - Ray raises a bare Exception for this timeout
            said = " ".join(str(err).split())[:200]  # Ray's messages span lines (the GCS's log tail)
            if not any(failure in str(err) for failure in _START_FAILURES):
                raise
            if _RETRIED not in str(err) or attempt == START_ATTEMPTS:
                tries = f"after {attempt} attempts" if attempt > 1 else "at the first attempt"
                raise RuntimeFailure(f"local Ray did not start {tries} ({said}); free CPU or memory, or run "
                                     f"`nereus cleanup` to kill leftovers of earlier runs, then retry") from err
            print(f"nereus: warning: local Ray did not start (attempt {attempt} of {START_ATTEMPTS}: {said}); "
                  "starting it again", file=sys.stderr)
            ray.shutdown()


# what ``signal.getsignal`` answers: a Python handler, or ``signal.SIG_DFL``/``SIG_IGN``
SignalHandler = Callable[[int, FrameType | None], object] | int | signal.Handlers


def _signal_handlers() -> dict[int, SignalHandler]:
    """The Python-level handlers of the termination signals, when this is the main thread (else none)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    found = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    return {sig: h for sig, h in found.items() if h is not None}


def _use_token(token: str) -> None:
    """Token mode with ``token`` for this process (Ray's cached config re-read) and the processes it starts."""
    from ray._raylet import AuthenticationTokenLoader, Config

    os.environ.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token})
    os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def auth_mode() -> str:
    """The authentication mode this process's Ray uses: "token" or "disabled"."""
    from ray._private.authentication.authentication_utils import is_token_auth_enabled

    return "token" if is_token_auth_enabled() else "disabled"


def shutdown_local_ray() -> list[int]:
    """Shut down this driver's Ray and kill whatever of it is still running; returns the pids it killed."""
    if ray.is_initialized():
        ray.shutdown()
    return reap(leftovers(owner=os.environ.get(OWNER_ENV)))


def exit_on_signals(signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
                    ) -> Callable[[], int | None]:
    """Turn ``signals`` into ``SystemExit(128 + signum)`` in the main thread, so ``finally`` blocks and
    ``atexit`` (``shutdown_local_ray``) run. Returns a function that tells which signal came: Ray turns an
    exception raised while it waits (``KeyboardInterrupt`` included) into ``SystemExit(1)``, losing it."""
    received: list[int] = []

    def stop(signum: int, _frame: FrameType | None) -> None:
        received.append(signum)
        raise SystemExit(128 + signum)

    for sig in signals:
        signal.signal(sig, stop)
    return lambda: received[0] if received else None


# ----- finding and reaping leftovers --------------------------------------------------------------------
def _stat(pid: int) -> tuple[int, str, int] | None:
    """(parent pid, state, start time in clock ticks) from /proc/<pid>/stat, or None if it is gone."""
    raw = _read(f"/proc/{pid}/stat")
    if not raw:
        return None
    fields = raw.rsplit(b")", 1)[1].split()  # after "(comm)": state, ppid, ..., starttime is field 22
    return int(fields[1]), fields[0].decode(), int(fields[19])


def owner_tag(pid: int) -> str:
    """``<pid>-<start time>``: names one process, never a later one that reuses its pid."""
    stat = _stat(pid)
    return f"{pid}-{stat[2] if stat else 0}"


def _alive(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[1] not in ("Z", "X")  # a zombie has exited; only its parent's wait is left


def _owner_alive(tag: str) -> bool:
    pid, _, start = tag.partition("-")
    return pid.isdigit() and _alive(int(pid)) and owner_tag(int(pid)) == tag


def _env_owner(pid: int) -> str | None:
    """``NEREUS_RAY_OWNER`` in the environment ``pid`` started with (only a same-user process is readable)."""
    for item in _read(f"/proc/{pid}/environ").split(b"\0"):
        if item.startswith(OWNER_ENV.encode() + b"="):
            return item.split(b"=", 1)[1].decode(errors="replace")
    return None


def leftovers(owner: str | None = None) -> dict[int, str]:
    """pid → owner tag of every live process started by a local Ray instance of ours: of ``owner`` when
    given, else of every owner that is no longer running. Never this process or one of its ancestors."""
    spare = {os.getpid()}
    pid = os.getpid()
    while (stat := _stat(pid)) is not None and stat[0] > 0:
        pid = stat[0]
        spare.add(pid)
    out = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        pid = int(entry)
        if pid in spare or not _alive(pid):
            continue
        tag = _env_owner(pid)
        if tag and (tag == owner if owner else not _owner_alive(tag)):
            out[pid] = tag
    return out


def reap(pids: dict[int, str] | set[int], wait_s: float = 10.0) -> list[int]:
    """SIGKILL ``pids`` and wait (at most ``wait_s``) until they have exited; returns those killed. Raises
    ``RuntimeError`` naming any still running after ``wait_s``."""
    killed = []
    for pid in sorted(pids):
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + wait_s
    while (alive := [p for p in killed if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    if alive:
        raise RuntimeError(f"Ray processes {alive} were still running {wait_s:.0f} s after SIGKILL")
    return killed


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError:  # the process ended, or is not ours to read
        return b""


def ray_pids(root: int | None = None, session_dir: str | None = None) -> set[int]:
    """Ray's processes: ``root`` (default: this process, the driver) and its descendants -- the GCS, raylet,
    agents and workers, all started below the driver -- plus any process whose command line names
    ``session_dir`` (default: the current session's directory, e.g. the GCS's ``--session-dir``) and its
    descendants, which catches daemons re-parented away from the driver. Parents come from /proc/<pid>/stat."""
    parents: dict[int, int] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        stat = _read(f"/proc/{entry}/stat")
        if stat:
            parents[int(entry)] = int(stat.rsplit(b")", 1)[1].split()[1])  # ppid follows "(comm) state"
    if session_dir is None and ray.is_initialized():
        node = ray._private.worker._global_node  # set in the driver
        session_dir = node.get_session_dir_path() if node is not None else None
    seeds = {root or os.getpid()}
    if session_dir:
        seeds |= {pid for pid in parents if session_dir.encode() in _read(f"/proc/{pid}/cmdline")}
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    found: set[int] = set()
    stack = list(seeds)
    while stack:
        pid = stack.pop()
        if pid not in found:
            found.add(pid)
            stack.extend(children.get(pid, []))
    return found


def _decode(hex_addr: str) -> str:
    """An address in /proc/net/tcp{,6}: 32-bit words, each in host (little-endian) byte order."""
    raw = bytes.fromhex(hex_addr)
    addr = ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))
    mapped = getattr(addr, "ipv4_mapped", None)
    return f"::ffff:{mapped}" if mapped else str(addr)


def _listen_sockets() -> dict[int, tuple[str, int]]:
    """Socket inode -> (ip, port) of every TCP socket in state LISTEN (0A), IPv4 and IPv6."""
    out: dict[int, tuple[str, int]] = {}
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in _read(name).decode().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":
                addr, port = fields[1].split(":")
                out[int(fields[9])] = (_decode(addr), int(port, 16))
    return out


def listening_addresses(pids: set[int] | None = None) -> list[tuple[int, str, int]]:
    """(pid, ip, port) of every TCP LISTEN socket held by ``pids`` (default ``ray_pids()``), sorted: the
    sockets of /proc/net/tcp{,6} whose inode one of the processes holds as an fd ("socket:[inode]")."""
    sockets = _listen_sockets()
    out: set[tuple[int, str, int]] = set()
    for pid in ray_pids() if pids is None else pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:[") and int(target[8:-1]) in sockets:
                out.add((pid, *sockets[int(target[8:-1])]))
    return sorted(out)


def is_loopback(ip: str) -> bool:
    """True for 127.0.0.0/8 and ::1, also written IPv4-mapped (::ffff:127.0.0.1)."""
    addr = ipaddress.ip_address(ip)
    mapped = getattr(addr, "ipv4_mapped", None)
    return (mapped or addr).is_loopback


def session_record(num_cpus: int | None = None) -> dict | None:
    """What ``nereus cleanup`` and ``nereus scale`` need to know of the local Ray instance this driver
    started (None when it joined a cluster or started none): owner tag, session folder, CPUs, auth mode,
    and the pids of its processes now."""
    if not ray.is_initialized() or os.environ.get(OWNER_ENV) != owner_tag(os.getpid()):
        return None
    node = ray._private.worker._global_node
    cpus = num_cpus if num_cpus is not None else int(ray.cluster_resources().get("CPU", 0))
    return {"owner": os.environ[OWNER_ENV], "driver_pid": os.getpid(), "session_dir": node.get_session_dir_path(),
            "gcs_address": node.gcs_address,
            "num_cpus": cpus, "auth": auth_mode(), "pids": sorted(ray_pids() - {os.getpid()})}


def cleanup_run(record: dict | None) -> tuple[str, list[int]]:
    """Kill what is left of the local Ray instance ``record`` describes (``session_record``), or, with no
    record, of every instance whose driver is gone. Returns (what was done, the pids killed); a record
    whose driver is still running is left alone."""
    if record is None:
        return "leftovers of every driver that is gone", reap(leftovers())
    owner = str(record.get("owner", ""))
    if not owner.partition("-")[0].isdigit():
        return "nothing: the record names no driver", []
    if _owner_alive(owner):
        return f"nothing: the run's driver (pid {record.get('driver_pid')}) is still running; stop it first", []
    return f"leftovers of driver {record.get('driver_pid')}", reap(leftovers(owner=owner))
