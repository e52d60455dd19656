"""The runtime on a Ray cluster of several nodes (issue 19 item 5): a head and two worker nodes of two CPUs
each, every node its own raylet and object store (``ray.cluster_utils.Cluster`` on this machine). A GRPO
job runs on 4 workers, two per node; in step 2 the node of workers 2 and 3 is killed (raylet, object
store and workers, ``remove_node(allow_graceful=False)``), taking the primary copy of their snapshot
images with it. The job re-forms its world at the head node's store on the two survivors, reads the lost
node's images from their copies on the head, redoes the step and finishes with verified checkpoints.

The cluster runs in a child process (``python -m tests.runtime.test_multinode OUT``): a process connects
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

ROOT = Path(__file__).resolve().parents[2]
LOSE_AT = 1  # 0-based step in whose first optimizer update the second node is killed

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def run_on_two_nodes(out: Path) -> dict:
    """The job on a fresh two-node cluster, losing the second node; what happened, as plain data."""
    import ray

    from nereus.run.driver import Stepper
    from nereus.run.job import RLJob
    from nereus.runtime.nodes import PlacementError, start_local_cluster
    from nereus.runtime.workers import Runtime
    from nereus.spec.layout import Layout
    from tests.rl.jobs import tiny_job

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
        real_update, killed = Stepper.update, []

        def update_losing_a_node(self, model, batch, loss_fn, lr, step):
            if step == LOSE_AT and not killed:
                killed.append(model)
                cluster.remove_node(second, allow_graceful=False)
            return real_update(self, model, batch, loss_fn, lr, step)

        Stepper.update = update_losing_a_node
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


def test_job_survives_losing_a_node(tmp_path: Path) -> None:
    from nereus.run.manifest import verify_manifest

    proc = subprocess.run([sys.executable, "-m", "tests.runtime.test_multinode", str(tmp_path)], cwd=ROOT,
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
