"""`nereus profile`: the measurement runs on local gloo workers and its YAML is a job spec's cluster section."""

import math

import pytest
import yaml

from nereus.cli import main
from nereus.cost.hardware import Hardware
from nereus.runtime.cluster import profile
from nereus.runtime.cluster.profile import ProfileSizes, measure
from nereus.spec.cluster import read_profile
from tests.conftest import EXAMPLES

pytestmark = [pytest.mark.distributed, pytest.mark.rayless]  # no Ray: may run beside the Ray tests

# Tiny sizes: the whole measurement takes well under a second after the fork.
TINY = ProfileSizes(tokens=32, hidden=64, matmul_layers=1, stream_mib=1, stream_iters=1, small_bytes=64,
                    small_iters=2, large_mib=0.25, large_iters=1, repeats=2)


@pytest.fixture(scope="module")
def measured() -> profile.Profile:
    return measure(2, memory_gb=2.0, sizes=TINY, timeout_s=60)


def _positive_finite(x: float) -> bool:
    return math.isfinite(x) and x > 0


def test_figures_are_positive_and_finite(measured):
    p = measured
    for x in (p.matmul_flops_per_s, p.stream_bytes_per_s, p.copy_bytes_per_s, p.all_reduce_small_s,
              p.all_reduce_large_s, p.p2p_s, p.latency_per_step_s, p.all_reduce_bus_bytes_per_s, p.p2p_bytes_per_s):
        assert _positive_finite(x)
    assert all(_positive_finite(lo) and lo <= hi for lo, hi in p.spread.values())
    section = p.cluster_section()
    assert all(_positive_finite(v) for k, v in section["gpu"].items() if k != "name")
    assert all(_positive_finite(v) for v in section["priors"].values())
    assert section["gpus_per_node"] == 2 and section["gpu"]["memory_gb"] == 2.0


def test_yaml_loads_back_as_a_cluster_with_measured_priors(measured, tmp_path):
    path = tmp_path / "cpu-local.yaml"
    path.write_text(measured.to_yaml())
    cluster = read_profile(path)
    section = measured.cluster_section()
    assert cluster.gpu.name == "cpu-local" and cluster.num_gpus == 2
    assert cluster.gpu.peak_flops == pytest.approx(section["gpu"]["peak_tflops"] * 1e12)
    assert cluster.gpu.hbm_bytes_per_s == pytest.approx(section["gpu"]["hbm_tb_per_s"] * 1e12)
    priors = Hardware(cluster).priors
    assert priors.gemm_efficiency == priors.hbm_efficiency == priors.intra_link_efficiency == 1.0
    assert priors.intra_latency_s == pytest.approx(measured.latency_per_step_s, rel=1e-3)
    # The cost model's all-reduce of the large message reproduces the measured time (the alpha-beta fit),
    # unless the small message's latency exceeds half of it (noise on tiny sizes): then the bandwidth term
    # keeps half the measured time.
    predicted = Hardware(cluster).all_reduce_time(TINY.large_mib * 2**20, 2)
    large, latency = measured.all_reduce_large_s, measured.all_reduce_small_s
    assert predicted == pytest.approx(max(large, latency + 0.5 * large), rel=1e-2)


@pytest.mark.parametrize("how", ["profile", "paste"])
def test_a_job_on_the_profile_plans(measured, tmp_path, capsys, how):
    (tmp_path / "cpu-local.yaml").write_text(measured.to_yaml())
    job = yaml.safe_load((EXAMPLES / "ppo_tiny_cpu.yaml").read_text())
    if how == "profile":
        job["cluster"] = {"profile": "cpu-local.yaml"}  # relative to the job file
    else:
        job["cluster"] = yaml.safe_load(measured.to_yaml())
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    assert main(["plan", str(tmp_path / "job.yaml")]) == 0
    out = capsys.readouterr().out
    assert "on 2 x cpu-local (1 node(s) x 2)" in out and "predicted step time" in out


def test_cli_prints_and_writes_the_profile(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(profile, "DEFAULT_SIZES", TINY)
    out_file = tmp_path / "cpu-local.yaml"
    assert main(["profile", "--workers", "2", "--memory-gb", "3", "--out", str(out_file)]) == 0
    out = capsys.readouterr().out
    assert out == out_file.read_text()
    section = yaml.safe_load(out)
    assert section["gpu"]["memory_gb"] == 3.0 and section["gpus_per_node"] == 2
    assert set(section) == {"gpu", "priors", "nodes", "gpus_per_node"}


@pytest.mark.parametrize("argv,message", [
    (["--workers", "1"], "nereus: error: --workers: must be >= 2"),
    (["--memory-gb", "0"], "nereus: error: --memory-gb: must be > 0"),
    (["--out", "/no/such/folder/p.yaml"], "nereus: error: --out: folder /no/such/folder does not exist"),
])
def test_cli_errors_are_one_line(capsys, argv, message):
    assert main(["profile", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1
