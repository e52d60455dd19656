"""A local Ray instance bound to loopback, and what Ray's processes listen on (read from Linux ``/proc``).

``ray.init(_node_ip_address="127.0.0.1")`` alone is not enough: ray.init passes the address through
``services.resolve_ip_for_localhost``, which swaps a loopback address for ``get_node_ip_address()`` -- the
host's routable IP -- unless ``ray_constants.ENABLE_RAY_CLUSTER`` is false. That flag comes from the
environment variable ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` when ray is imported (default: true except on
Windows/macOS). With the flag off the node IP stays 127.0.0.1, and the GCS, the raylet, every core worker
(driver and actors) and the runtime-env agent bind to it rather than to [::] or the host's IP.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

import ray

LOOPBACK = "127.0.0.1"
LOOPBACK_ENV: dict[str, str] = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def start_local_ray(num_cpus: int, temp_dir: Path) -> None:
    """Start a single-node Ray instance under ``temp_dir`` (no dashboard) that listens on loopback only."""
    os.environ.update(LOOPBACK_ENV)  # for Ray's child processes, which import ray afresh
    ray._private.ray_constants.ENABLE_RAY_CLUSTER = False  # for this process, where ray is already imported
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=num_cpus, include_dashboard=False, _temp_dir=str(Path(temp_dir).absolute()),
             _node_ip_address=LOOPBACK, log_to_driver=False)


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
