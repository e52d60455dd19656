"""``nereus run --address``: a bounded probe that an address is a Ray cluster this driver can join, before
anything is started.

``ray.init(address=...)`` gives no such answer: against a listener that is not Ray it retries for minutes
(its GCS client waits for the server to "become available"), a version mismatch surfaces only after the
connection, and a driver on a machine with no node of the cluster waits for a raylet that never appears.
``check_address`` instead asks, with a deadline of a few seconds per step:

1. *The address itself.* ``ray://`` (Ray Client) is refused up front: the driver pins workers to nodes and
   hosts a rendezvous store, which needs a driver on a node of the cluster. ``auto`` is read as Ray reads
   it (``RAY_ADDRESS``, then the cluster last started on this machine). A loopback spelling
   (``localhost``, ``127.0.0.1``, ``::1``) is resolved the way ``ray.init`` will resolve it (to this host's
   address, unless local-only mode is on), and that address is the one probed and returned.
2. *A listener.* A TCP connection within the deadline.
3. *A Ray GCS of the same version.* A gRPC ``InternalKVGet`` of Ray's cluster metadata (Ray's own version
   check reads the same key, ``ray._private.utils.check_version_info``), with the token metadata when this
   process has one: a listener that does not speak Ray's gRPC, a cluster that wants a token, and a
   cluster of another Ray or Python version are each refused in one line.
4. *A node here.* The cluster's alive nodes include one on this machine's address, so ``ray.init`` finds a
   raylet to attach to.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import sys

from nereus.spec.errors import SpecError, brief, cut

PROBE_TIMEOUT_S = 5.0


def _fail(message: str) -> SpecError:
    return SpecError("--address", message)


def _split(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):  # [::1]:6379
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise _fail(f"{brief(address)} is not host:port; give the address `ray start --head` printed (for example "
                    "10.0.0.1:6379)")
    return host, int(port)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def canonical_address(address: str) -> tuple[str, str | None]:
    """(the host:port ``ray.init`` will connect to, a note when it differs from ``address``)."""
    from ray._private import services

    if address.startswith("ray://"):
        raise _fail(f"{brief(address)}: Ray Client (ray://) is not supported: the driver pins workers to nodes and "
                    "hosts a rendezvous store on the head node, so it must run on a node of the cluster. Run nereus "
                    "there with --address <head-ip>:6379")
    if address == "auto":
        found = services.get_ray_address_from_environment("auto", None)
        if not found or found == "auto":  # "auto" back: Ray found nothing it could name
            raise _fail("auto: no Ray cluster found (RAY_ADDRESS is unset and no cluster was started on this "
                        "machine with `ray start --head`); give the head's host:port")
        address = found
    host, port = _split(address)
    if host in ("0.0.0.0", "::"):
        raise _fail(f"{address}: {host} is where a server listens, not an address to connect to; give the "
                    "head's address")
    if _is_loopback(host):
        resolved = services.resolve_ip_for_localhost(host)
        if resolved != host:
            return f"{_join(resolved, port)}", (f"{address} is a loopback address; Ray connects to it as "
                                                f"{_join(resolved, port)}, this host's address")
    return _join(host, port), None


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def check_address(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> str:
    """The address to give ``ray.init`` once the probe above passed; a one-line SpecError otherwise.
    Each of its steps waits at most ``timeout_s``."""
    target, note = canonical_address(address)
    host, port = _split(target)
    seen = f"{target} ({note})" if note else target
    if not _answers(host, port, timeout_s):
        if note and _answers(*_split(address), timeout_s):
            raise _fail(f"{address} answers on loopback only, but Ray connects to a loopback address through this "
                        f"host's address ({target}), where nothing answers: start the cluster with `ray start --head "
                        f"--node-ip-address {host}`, or run nereus with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 as the "
                        "cluster was started")
        raise _fail(f"nothing answers at {seen}: start the cluster with `ray start --head` there, or check the "
                    "address")
    metadata = _cluster_metadata(target, seen, timeout_s)
    _check_versions(metadata, seen)
    _check_node_here(target, seen, timeout_s)
    if note:
        print(f"nereus run: {note}", file=sys.stderr)
    return target


def _answers(host: str, port: int, timeout_s: float) -> bool:
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError:
        return False
    return True


def _rpc_error(err: Exception, seen: str, timeout_s: float) -> SpecError:
    import grpc

    code = err.code() if isinstance(err, grpc.RpcError) else None
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return _fail(f"the Ray cluster at {seen} requires a token (token authentication): set RAY_AUTH_MODE=token "
                     "and RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH) to the cluster's token")
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return _fail(f"{seen} answers gRPC but is not a Ray cluster's GCS (it does not implement Ray's calls); give "
                     "the address `ray start --head` printed")
    what = code.name if code is not None else type(err).__name__
    return _fail(f"{seen} is not a Ray cluster: it did not answer Ray's gRPC within {timeout_s:g} s ({what}); "
                 "give the GCS address `ray start --head` printed (port 6379 unless --port was given)")


def _channel_call(target: str, timeout_s: float, seen: str, call: str) -> object:
    """One unary call to the GCS at ``target`` with the token metadata this process has, if any."""
    import grpc
    from ray._private.authentication.grpc_authentication_client_interceptor import (
        _get_authentication_metadata_tuple,
    )
    from ray.core.generated import gcs_service_pb2 as pb
    from ray.core.generated import gcs_service_pb2_grpc as rpc

    try:
        auth = tuple(_get_authentication_metadata_tuple())
    except Exception:  # noqa: BLE001 - no token configured, or an unreadable token file: probe without one
        auth = ()
    with grpc.insecure_channel(target, options=[("grpc.enable_retries", 0)]) as channel:
        try:
            if call == "metadata":
                request = pb.InternalKVGetRequest(key=b"CLUSTER_METADATA", namespace=b"cluster")
                return rpc.InternalKVGcsServiceStub(channel).InternalKVGet(request, timeout=timeout_s, metadata=auth)
            return rpc.NodeInfoGcsServiceStub(channel).GetAllNodeInfo(pb.GetAllNodeInfoRequest(), timeout=timeout_s,
                                                                      metadata=auth)
        except grpc.RpcError as err:
            raise _rpc_error(err, seen, timeout_s) from None


def _cluster_metadata(target: str, seen: str, timeout_s: float) -> dict:
    """Ray's cluster metadata (``ray_version``, ``python_version``), {} when the cluster never wrote it."""
    reply = _channel_call(target, timeout_s, seen, "metadata")
    if not reply.value:
        return {}
    try:
        data = json.loads(reply.value.decode("utf-8"))
    except (ValueError, UnicodeDecodeError):
        raise _fail(f"{seen} answered Ray's gRPC with cluster metadata that is not JSON; is it a Ray cluster?") \
            from None
    return data if isinstance(data, dict) else {}


def _check_versions(metadata: dict, seen: str) -> None:
    """The cluster's Ray and Python versions match this process's, as ``ray.init`` will demand."""
    from ray._private.utils import compute_version_info

    ours = compute_version_info()
    theirs = (metadata.get("ray_version"), metadata.get("python_version"))
    if theirs[0] is None:
        return  # a cluster that never wrote its metadata: Ray does not check either
    level = os.environ.get("RAY_DEFAULT_PYTHON_VERSION_MATCH_LEVEL", "patch")
    digits = 2 if level == "minor" else 3
    same_python = str(theirs[1]).split(".")[:digits] == str(ours[1]).split(".")[:digits]
    if theirs[0] != ours[0] or not same_python:
        ray_v, python_v = cut(str(theirs[0]), 20), cut(str(theirs[1]), 20)
        raise _fail(f"the Ray cluster at {seen} runs Ray {ray_v} on Python {python_v}; this nereus runs Ray "
                    f"{ours[0]} on Python {ours[1]}: Ray needs the same versions on the driver (pip install "
                    f"ray=={ray_v} here, or start the cluster with Ray {ours[0]})")


def _check_node_here(target: str, seen: str, timeout_s: float) -> None:
    """An alive node of the cluster runs on this machine's address (the raylet ``ray.init`` attaches to)."""
    from ray._private import services

    reply = _channel_call(target, timeout_s, seen, "nodes")
    alive = [n.node_manager_address for n in reply.node_info_list if n.state == 0]  # GcsNodeInfo.ALIVE
    here = services.get_node_ip_address(target)
    if here not in alive:
        raise _fail(f"no node of the Ray cluster at {seen} runs on this machine ({here}; its nodes: "
                    f"{sorted(alive)[:4]}): run `ray start --address {target}` here first, or run nereus on the "
                    "head node")
