"""The runtime on a Ray cluster of several nodes: a head and two worker nodes of two CPUs
each, every node its own raylet and object store (``ray.cluster_utils.Cluster`` on this machine). A GRPO
job runs on 4 workers, two per node; in step 2 the node of workers 2 and 3 is killed (raylet, object
store and workers, ``remove_node(allow_graceful=False)``), taking the primary copy of their snapshot
images with it. The job re-forms its world at the head node's store on the two survivors, reads the lost
node's images from their copies on the head, redoes the step and finishes with verified checkpoints.

The cluster runs in a child process (``python -m tests.runtime.cluster.test_multinode OUT``): a process connects
to one Ray cluster, and the session's ``ray_runtime`` fixture may already hold the local one.
Objects above 1 KiB go to the object store (``max_direct_call_object_size``), so no image of the tiny
models is kept in the driver's own memory, where a lost node would not reach it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
LOSE_AT = 1  # 0-based step in whose first optimizer update the second node is killed


def run_on_two_nodes(out: Path) -> dict:
    """The job on a fresh two-node cluster, losing the second node; what happened, as plain data."""
    import ray

    from nereus.run.job import RLJob
    from nereus.run.training import StepTraining
    from nereus.runtime.cluster.workers import Runtime
    from nereus.runtime.hosts.nodes import PlacementError, start_local_cluster
    from nereus.spec.layout import Layout
    from tests.run.jobs import tiny_job

    cluster, nodes = start_local_cluster(2, 2, system_config={"max_direct_call_object_size": 1024})
    try:
        rt = Runtime(4, address=cluster.address, timeout_s=60)
        homes = rt.homes
        try:  # a TP group of ranks 1 and 2 would span both nodes: refused before anything is built
            rt.load("probe", None, Layout.parse("tp=2"), [1, 2])
            refused = ""
        except PlacementError as err:
            refused = str(err)
        second = next(n for n in nodes if n.node_id == homes[2])
        real_update, killed = StepTraining.update, []

        def update_losing_a_node(self, model, batch, loss_fn, lr, step):
            if step == LOSE_AT and not killed:
                killed.append(model)
                cluster.remove_node(second, allow_graceful=False)
            return real_update(self, model, batch, loss_fn, lr, step)

        StepTraining.update = update_losing_a_node
        job = tiny_job("grpo", str(out / "run"), steps=3)
        job = replace(job, cluster=replace(job.cluster, nodes=2, gpus_per_node=2))
        rl = RLJob(job, runtime=rt, quiet=True)
        summary = rl.execute()  # on failure the cluster's shutdown ends its workers
        placed = {p.key: list(p.ranks) for p in rl.placed}
        homes_after = rt.homes
        rl.release()
        rt.shutdown()
        return {"homes": homes, "second": second.node_id, "refused": refused, "killed_in": killed,
                "recoveries": summary["recoveries"], "placed": placed, "homes_after": homes_after}
    finally:
        ray.shutdown()
        cluster.shutdown()


# ----- placement, rings and the choice of images, without a cluster -----------------------------------
def test_ranks_fill_nodes_in_order_and_lost_nodes_are_never_chosen(monkeypatch) -> None:
    from nereus.runtime.hosts import nodes

    cluster = [nodes.NodeSlots("head", "10.0.0.1", 0, True), nodes.NodeSlots("a", "10.0.0.2", 2, False),
               nodes.NodeSlots("b", "10.0.0.3", 2, False)]
    monkeypatch.setattr(nodes, "alive_nodes", lambda resource: cluster)
    m = nodes.NodeMap("CPU")
    assert m.place(3) == ["a", "a", "b"] and m.place(1) == ["b"]
    with pytest.raises(nodes.PlacementError, match="run.workers: 5 workers need one CPU each; the Ray cluster has 4"):
        m.place(1)
    assert m.drop([2, 3]) == ["b"] and m.homes == ["a", "a"]  # node b emptied: taken for lost
    with pytest.raises(nodes.PlacementError):  # Ray may still list b as alive: it is not chosen again
        m.place(1)
    m.drop([0])
    assert m.place(1) == ["a"]  # a still hosts a worker: its free slot is used


def test_tp_groups_that_cross_nodes_are_named() -> None:
    from nereus.runtime.hosts.nodes import tp_groups, tp_split
    from nereus.spec.layout import Layout

    homes = ["a", "a", "b", "b"]
    assert tp_groups(Layout.parse("tp=2,dp=2"), [0, 1, 2, 3]) == [[0, 1], [2, 3]]
    assert tp_split(Layout.parse("tp=2,dp=2"), [0, 1, 2, 3], homes) is None
    assert tp_split(Layout.parse("tp=2,pp=2"), [3, 2, 1, 0], homes) is None  # [3, 2] and [1, 0]
    assert "TP group [1, 2]" in tp_split(Layout.parse("tp=2"), [1, 2], homes)
    assert "TP group [0, 2]" in tp_split(Layout.parse("tp=2,dp=2"), [0, 2, 1, 3], homes)
    assert tp_split(Layout.parse("dp=4"), [0, 1, 2, 3], homes) is None  # no TP: nothing to keep together
    assert tp_split(Layout.parse("tp=2"), [1, 2], []) is None  # one node


def test_replica_ring_sends_each_node_to_another() -> None:
    from nereus.runtime.hosts.nodes import replica_ring

    assert replica_ring(["a", "a", "b", "b"], "head") == {"a": "b", "b": "head", "head": "a"}
    assert replica_ring(["a", "b"], "a") == {"a": "b", "b": "a"}
    assert replica_ring(["a", "a"], "a") == {}  # one node: nowhere else to copy to


def test_snapshot_images_come_from_copies_when_their_node_is_lost() -> None:
    from nereus.runtime.recovery.failover import Failover, ImageCopy

    f = Failover()
    f.snapshots = {"actor": ["p0", "p1", "p2", "p3"]}
    f.homes = {"actor": ["a", "a", "b", "b"]}
    f.replicas = {"actor": [ImageCopy("c0", "b"), ImageCopy("c1", "b"), ImageCopy("c2", "head"),
                            ImageCopy("c3", "head")]}
    assert f._snapshot_images("actor", {"a", "b", "head"}) == ["p0", "p1", "p2", "p3"]
    assert f._snapshot_images("actor", {"a", "head"}) == ["p0", "p1", "c2", "c3"] and f.from_copies == 2
    assert f._snapshot_images("actor", {"a"}) == ["p0", "p1"]  # both copies of 2 and 3 gone: left out
    assert f._snapshot_images("actor", None) == ["p0", "p1", "p2", "p3"]  # one node: nothing is lost


def test_a_pending_snapshot_counts_when_each_image_is_readable_somewhere() -> None:
    from nereus.runtime.recovery.failover import ImageCopy, PendingSnapshot, Voucher, readable_images

    copies = [ImageCopy("c0", "b", "k0"), ImageCopy("c1", "b", "k1"), ImageCopy("c2", "head", "k2"),
              ImageCopy("c3", "head", "k3")]
    pending = PendingSnapshot(1, {"actor": ["p0", "p1", "p2", "p3"]}, {"actor": ["a", "a", "b", "b"]},
                              {"actor": copies})
    # node b lost with ranks 2 and 3: the survivors' images on a count once in (their copies on b are
    # gone and do not matter); 2's and 3's are read from their copies on the head, vouched by their acks
    assert readable_images(pending, {2, 3}, {"a", "head"}) == [
        Voucher("p0", False), Voucher("p1", False), Voucher("k2", True), Voucher("k3", True)]
    # rank 1 crashed, its node a is up: its copy's ack on b vouches for it
    assert readable_images(pending, {1}, {"a", "b", "head"})[1] == Voucher("k1", True)
    # rank 1 crashed and b is lost too: its image on a is read to see that it did not fail
    assert readable_images(pending, {1, 2, 3}, {"a", "head"})[1] == Voucher("p1", True)
    assert readable_images(pending, {0, 1, 2, 3}, {"head"}) is None  # a and b lost: 0's copy was on b
    one_node = PendingSnapshot(1, {"actor": ["p0", "p1"]}, {"actor": []})
    assert readable_images(one_node, {1}, None) == [Voucher("p0", False), Voucher("p1", True)]


# ----- the job on two nodes ----------------------------------------------------------------------------
@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.beside_ray  # its cluster lives in a child process: it may run beside the session's Ray
def test_job_survives_losing_a_node(tmp_path: Path) -> None:
    from nereus.run.manifest import verify_manifest

    proc = subprocess.run([sys.executable, "-m", "tests.runtime.cluster.test_multinode", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads((tmp_path / "result.json").read_text())
    homes = got["homes"]
    assert len(set(homes)) == 2 and homes[0] == homes[1] and homes[2] == homes[3]  # two workers per node
    assert "TP group [1, 2]" in got["refused"] and "inside a node" in got["refused"]
    assert got["second"] == homes[2] and got["killed_in"] == ["actor"]
    [rec] = got["recoveries"]
    assert rec["lost"] == [2, 3] and rec["workers"] == 2 and rec["resume_step"] == LOSE_AT
    assert rec["lost_nodes"] == [homes[2]]
    assert rec["images_from_copies"] > 0  # the lost node's snapshot images were read from their copies
    assert got["homes_after"] == homes[:2]
    assert max(r for ranks in got["placed"].values() for r in ranks) <= 1  # on the two survivors
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert "nereus/recovery_s" in rows[LOSE_AT]
    for step in (2, 3):
        verify_manifest(tmp_path / "run" / f"step_{step}")


if __name__ == "__main__":
    target = Path(sys.argv[1])
    (target / "result.json").write_text(json.dumps(run_on_two_nodes(target)))
