"""``nereus run --address``: a bounded probe that the address is a Ray cluster this driver can join
(``runtime.hosts.address``). Listeners that are not Ray and clusters of another version are real servers
in this process: a socket that answers HTTP, one that never answers, a gRPC server with no Ray service,
and gRPC servers implementing the two calls of Ray's GCS the probe makes (``InternalKVGet`` of the cluster
metadata, ``GetAllNodeInfo``) with what another cluster would answer. The session's real local Ray is
probed too."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent import futures

import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("ray")

from ray._private import services  # noqa: E402
from ray._private.utils import compute_version_info  # noqa: E402
from ray.core.generated import gcs_pb2  # noqa: E402
from ray.core.generated import gcs_service_pb2 as pb  # noqa: E402
from ray.core.generated import gcs_service_pb2_grpc as rpc  # noqa: E402

from nereus.runtime.hosts.address import check_address  # noqa: E402
from nereus.spec.errors import SpecError  # noqa: E402

RAY_VERSION, PYTHON_VERSION = compute_version_info()


class _KV(rpc.InternalKVGcsServiceServicer):
    def __init__(self, metadata: dict | None, refuse: bool) -> None:
        self.metadata, self.refuse = metadata, refuse

    def InternalKVGet(self, request, context):  # noqa: N802 - the gRPC method's name
        if self.refuse:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "token required")
        value = json.dumps(self.metadata).encode() if self.metadata is not None else b""
        return pb.InternalKVGetReply(value=value)


class _Nodes(rpc.NodeInfoGcsServiceServicer):
    def __init__(self, addresses: list[str]) -> None:
        self.addresses = addresses

    def GetAllNodeInfo(self, request, context):  # noqa: N802
        return pb.GetAllNodeInfoReply(node_info_list=[gcs_pb2.GcsNodeInfo(node_manager_address=a, state=0)
                                                      for a in self.addresses])


@pytest.fixture
def gcs():
    """Start a gRPC server speaking Ray's GCS calls with the given answers; yields a starter."""
    servers = []

    def start(metadata: dict | None = None, nodes: list[str] | None = None, refuse: bool = False,
              services_on: bool = True) -> str:
        server = grpc.server(futures.ThreadPoolExecutor(2))
        if services_on:
            rpc.add_InternalKVGcsServiceServicer_to_server(_KV(metadata, refuse), server)
            rpc.add_NodeInfoGcsServiceServicer_to_server(_Nodes(nodes if nodes is not None else [_here()]), server)
        port = server.add_insecure_port("0.0.0.0:0")
        server.start()
        servers.append(server)
        return f"{_here()}:{port}"

    yield start
    for server in servers:
        server.stop(0)


def _here() -> str:
    """The address the probe looks for among the cluster's nodes: this machine's as Ray's driver sees it
    (loopback while the session's local-only Ray runs in this process)."""
    return services.get_node_ip_address("192.0.2.1:1")


def _host() -> str:
    """This machine's routable address (what Ray rewrites a loopback address to when joining a cluster)."""
    from ray._raylet import node_ip_address_from_perspective

    return node_ip_address_from_perspective("192.0.2.1:1")


def _refused(address: str, *needles: str, within_s: float = 30) -> str:
    t0 = time.monotonic()
    with pytest.raises(SpecError) as err:
        check_address(address, timeout_s=2)
    assert err.value.path == "--address" and time.monotonic() - t0 < within_s
    for needle in needles:
        assert needle in err.value.message, err.value.message
    return err.value.message


def test_addresses_that_are_not_host_port_are_refused_by_form():
    for bad in ("garbage", "host:99999", ":6379", "10.0.0.1:", "[::1]:"):
        _refused(bad, "is not host:port")
    _refused("0.0.0.0:6379", "is where a server listens")
    _refused("ray://10.0.0.1:10001", "Ray Client (ray://) is not supported", "Run nereus there")


def test_nothing_listening_is_refused_at_once():
    _refused(f"{_here()}:1", "nothing answers at")


def test_a_listener_that_is_not_ray_is_refused_not_retried_forever():
    http, silent = socket.create_server(("0.0.0.0", 0)), socket.create_server(("0.0.0.0", 0))

    def answer() -> None:
        while True:
            try:
                conn, _ = http.accept()
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
                conn.close()
            except OSError:
                return

    threading.Thread(target=answer, daemon=True).start()
    try:
        _refused(f"{_here()}:{http.getsockname()[1]}", "is not a Ray cluster")
        _refused(f"{_here()}:{silent.getsockname()[1]}", "is not a Ray cluster", "within 2 s")  # deadline, not hang
    finally:
        http.close()
        silent.close()


def test_a_grpc_server_without_rays_services_is_refused(gcs):
    _refused(gcs(services_on=False), "answers gRPC but is not a Ray cluster's GCS")


def test_a_cluster_of_another_ray_version_is_refused_with_both_versions(gcs):
    message = _refused(gcs({"ray_version": "2.9.0", "python_version": PYTHON_VERSION}), "runs Ray 2.9.0")
    assert f"this nereus runs Ray {RAY_VERSION}" in message and "pip install ray==2.9.0" in message
    _refused(gcs({"ray_version": RAY_VERSION, "python_version": "3.8.10"}), "on Python 3.8.10")


def test_a_cluster_that_wants_a_token_is_refused_naming_the_variables(gcs):
    _refused(gcs(refuse=True), "requires a token", "RAY_AUTH_TOKEN")


def test_a_cluster_without_a_node_on_this_machine_is_refused(gcs):
    _refused(gcs({"ray_version": RAY_VERSION, "python_version": PYTHON_VERSION}, nodes=["10.9.9.9"]),
             "no node of the Ray cluster", "runs on this machine", "ray start --address")


def test_a_matching_cluster_passes_and_its_address_is_what_ray_will_connect_to(gcs):
    address = gcs({"ray_version": RAY_VERSION, "python_version": PYTHON_VERSION})
    assert check_address(address) == address
    assert check_address(gcs(None)) is not None  # a cluster that never wrote its metadata: Ray checks nothing


def test_a_loopback_spelling_is_probed_where_ray_will_connect(gcs, monkeypatch):
    """Ray rewrites a loopback address to this host's address for a cluster it joins; the probe resolves it
    the same way, probes there and returns that address (so nothing is rewritten after the probe)."""
    port = gcs({"ray_version": RAY_VERSION, "python_version": PYTHON_VERSION}).rsplit(":", 1)[1]
    monkeypatch.setattr(services, "resolve_ip_for_localhost", lambda host: _host() if host in (
        "127.0.0.1", "localhost", "::1") else host)
    for spelling in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}"):
        assert check_address(spelling) == f"{_host()}:{port}"
    loop_only = socket.create_server(("127.0.0.1", 0))
    try:
        _refused(f"127.0.0.1:{loop_only.getsockname()[1]}", "answers on loopback only", "--node-ip-address")
    finally:
        loop_only.close()


@pytest.mark.slow
def test_the_sessions_real_local_ray_passes_the_probe(ray_runtime):
    import ray

    gcs_address = ray._private.worker._global_node.gcs_address
    assert check_address(gcs_address) == gcs_address
