"""A cluster section may override the cost model's priors and include a profile file (`nereus profile`)."""

import dataclasses

import pytest
import yaml

from nereus.cost.hardware import Hardware, Priors
from nereus.spec.cluster import GIB, PRIOR_KEYS, read_profile
from nereus.spec.errors import SpecError
from nereus.spec.job import job_from_dict, load_job
from tests.conftest import EXAMPLES

PROFILE = """\
# a measured profile, as `nereus profile --out` writes it
gpu: {name: cpu-local, peak_tflops: 0.02, hbm_tb_per_s: 0.004, memory_gb: 4.0,
      intra_node_gb_per_s: 0.5, inter_node_gb_per_s: 0.5}
priors: {gemm_efficiency: 1.0, hbm_efficiency: 1.0, intra_link_efficiency: 1.0, inter_link_efficiency: 1.0,
         intra_latency_s: 0.001, inter_latency_s: 0.001}
nodes: 1
gpus_per_node: 4
"""


def tiny_job(cluster: dict) -> dict:
    job = yaml.safe_load((EXAMPLES / "ppo_tiny_cpu.yaml").read_text())
    job["cluster"] = cluster
    return job


def test_prior_keys_name_every_priors_field():
    assert {attr for attr, *_ in PRIOR_KEYS.values()} == {f.name for f in dataclasses.fields(Priors)}


def test_without_priors_the_defaults_apply():
    job = load_job(EXAMPLES / "ppo_tiny_cpu.yaml")
    assert job.cluster.priors == ()
    assert Hardware(job.cluster).priors == Priors()
    assert "priors" not in job.cluster.to_dict()


def test_priors_override_the_defaults_key_by_key():
    job = job_from_dict(tiny_job({"gpu": "H100", "priors": {"gemm_efficiency": 0.6, "intra_latency_s": 2e-6,
                                                           "reserved_gib": 1}}))
    p = Hardware(job.cluster).priors
    assert (p.gemm_efficiency, p.intra_latency_s, p.reserved_bytes) == (0.6, 2e-6, GIB)
    assert p.hbm_efficiency == Priors().hbm_efficiency
    assert Hardware(job.cluster, Priors()).priors == Priors()  # explicit priors win
    assert job.with_gpus(2).cluster.priors == job.cluster.priors
    assert job.cluster.to_dict()["priors"] == {"gemm_efficiency": 0.6, "intra_latency_s": 2e-6, "reserved_gib": 1.0}


@pytest.mark.parametrize("priors,pattern", [
    ({"gemm_eficiency": 0.5}, r"cluster\.priors\.gemm_eficiency: unknown key; did you mean 'gemm_efficiency'"),
    ({"gemm_efficiency": 1.5}, r"cluster\.priors\.gemm_efficiency: 1\.5 is out of range; must be <= 1\.0"),
    ({"intra_latency_s": -1}, r"cluster\.priors\.intra_latency_s: -1\.0 is out of range; must be >= 0\.0"),
    ({"hbm_efficiency": "high"}, r"cluster\.priors\.hbm_efficiency: expected a number"),
])
def test_bad_priors_name_the_key(priors, pattern):
    with pytest.raises(SpecError, match=pattern):
        job_from_dict(tiny_job({"gpu": "H100", "priors": priors}))


def test_profile_file_relative_to_the_job_and_overridden_by_it(tmp_path):
    (tmp_path / "cpu.yaml").write_text(PROFILE)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(tiny_job({"profile": "cpu.yaml"})))
    cluster = load_job(tmp_path / "job.yaml").cluster
    assert cluster == read_profile(tmp_path / "cpu.yaml")
    assert (cluster.gpu.name, cluster.gpu.peak_flops, cluster.num_gpus) == ("cpu-local", 0.02e12, 4)
    assert Hardware(cluster).priors.intra_latency_s == 1e-3 and Hardware(cluster).priors.gemm_efficiency == 1.0
    over = {"profile": "cpu.yaml", "gpus_per_node": 2, "memory_gb": 8, "priors": {"intra_latency_s": 5e-4}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(tiny_job(over)))
    cluster = load_job(tmp_path / "job.yaml").cluster
    p = Hardware(cluster).priors
    assert (cluster.num_gpus, cluster.gpu.memory_bytes, p.intra_latency_s, p.hbm_efficiency) == (2, 8e9, 5e-4, 1.0)


def test_profile_errors_name_the_file_and_key(tmp_path):
    with pytest.raises(SpecError, match=r"cluster\.profile: profile file not found: .*missing\.yaml"):
        job_from_dict(tiny_job({"profile": "missing.yaml"}), tmp_path)
    (tmp_path / "bad.yaml").write_text(PROFILE.replace("peak_tflops: 0.02", "peak_tflops: -1"))
    with pytest.raises(SpecError, match=r"cluster\.profile \(.*bad\.yaml\) gpu\.peak_tflops: -1\.0 is out of range"):
        job_from_dict(tiny_job({"profile": "bad.yaml"}), tmp_path)
    (tmp_path / "loop.yaml").write_text("profile: loop.yaml\n")
    with pytest.raises(SpecError, match="cannot name another profile"):
        job_from_dict(tiny_job({"profile": "loop.yaml"}), tmp_path)
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(SpecError, match=r"cluster\.profile \(.*list\.yaml\) <root>: expected a mapping"):
        job_from_dict(tiny_job({"profile": "list.yaml"}), tmp_path)
