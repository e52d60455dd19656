"""``run.filter_groups`` and ``run.overlong_buffer`` (DAPO's sampling side, spec.run_dapo) and
``workload.filter_keep_rate``: read, and refused before any process starts with the key and the fix."""

from __future__ import annotations

import pytest

from nereus.spec.errors import SpecError
from nereus.spec.run_dapo import FilterGroupsSpec, OverlongBufferSpec
from tests.run.jobs import tiny_job


def test_off_by_default(tmp_path):
    run = tiny_job("grpo", str(tmp_path)).run
    assert run.filter_groups == FilterGroupsSpec() and not run.filter_groups.enable
    assert run.overlong_buffer == OverlongBufferSpec() and not run.overlong_buffer.enable


def test_read_as_verls_keys(tmp_path):
    run = tiny_job("grpo", str(tmp_path), filter_groups={"enable": True, "metric": "score", "max_num_gen_batches": 5},
                   overlong_buffer={"enable": True, "len": 2, "penalty_factor": 0.5}).run
    assert run.filter_groups == FilterGroupsSpec(True, "score", 5) and run.filter_groups.limit == 5
    assert run.overlong_buffer == OverlongBufferSpec(True, 2, 0.5)


def test_non_positive_max_num_gen_batches_means_no_limit(tmp_path):
    fg = tiny_job("grpo", str(tmp_path), filter_groups={"enable": True, "max_num_gen_batches": -1}).run.filter_groups
    assert fg.max_num_gen_batches == 0 and fg.limit is None


def test_the_dapo_example_loads(examples):
    from nereus.spec.job import load_job

    run = load_job(examples / "dapo_tiny.yaml").run
    assert run.filter_groups.enable and run.overlong_buffer.enable
    assert (run.clip_ratio_low, run.clip_ratio_high, run.loss_agg_mode) == (0.2, 0.28, "token-mean")


@pytest.mark.parametrize("run, pattern", [
    ({"filter_groups": {"enable": True, "metric": "accuracy"}}, r"run\.filter_groups\.metric: .*choose one of"),
    ({"filter_groups": {"enabled": True}}, r"run\.filter_groups\.enabled: unknown key; did you mean 'enable'"),
    ({"overlong_buffer": {"enable": True}}, r"run\.overlong_buffer\.len: 0: give the buffer's length"),
    ({"overlong_buffer": {"enable": True, "len": 5}},
     r"run\.overlong_buffer\.len: 5 exceeds the maximum response length \(4, workload\.response_length\.max\)"),
    ({"overlong_buffer": {"enable": True, "len": 2, "penalty_factor": -1}}, r"penalty_factor: .*>= 0"),
    ({"filter_groups": {"enable": True}, "async": {"enabled": True}},
     r"run\.filter_groups\.enable: dynamic sampling with run\.async\.enabled is not supported"),
    ({"filter_groups": {"enable": True}, "rollout": {"tail_batching": {"over_launch": 1.5}}},
     r"run\.filter_groups\.enable: .*run\.rollout\.tail_batching"),
])
def test_refused_with_the_key_and_the_fix(tmp_path, run, pattern):
    with pytest.raises(SpecError, match=pattern):
        tiny_job("grpo", str(tmp_path), **run)


def test_filter_groups_needs_groups(tmp_path):
    from nereus.spec.job import job_from_dict

    spec = _grpo_dict(tmp_path, samples=1, run={"filter_groups": {"enable": True}})
    spec["algorithm"]["adv_estimator"] = "gae"
    spec["algorithm"]["name"] = "ppo"
    spec["models"]["critic"] = dict(spec["models"]["actor"])
    spec["algorithm"]["models"] = ["actor", "critic"]
    with pytest.raises(SpecError, match=r"run\.filter_groups\.enable: .*samples_per_prompt is 1: give it at least 2"):
        job_from_dict(spec)


def test_score_metrics_refused_with_a_reward_model(tmp_path):
    with pytest.raises(SpecError, match=r"run\.filter_groups\.metric: 'score' would need the reward model"):
        tiny_job("ppo", str(tmp_path), filter_groups={"enable": True, "metric": "score"})
    assert tiny_job("ppo", str(tmp_path), filter_groups={"enable": True, "metric": "acc"}).run.filter_groups.enable


def test_keep_rate_is_a_share_and_prices_only_dynamic_sampling(tmp_path):
    from nereus.spec.job import job_from_dict

    for bad in (0.0, 1.5):
        with pytest.raises(SpecError, match=r"workload\.filter_keep_rate: .* give a value in \(0, 1\]"):
            job_from_dict(_grpo_dict(tmp_path, keep_rate=bad))
    with pytest.raises(SpecError, match=r"workload\.filter_keep_rate: 0\.5 prices dynamic sampling.*enable: true"):
        job_from_dict(_grpo_dict(tmp_path, keep_rate=0.5))
    job = job_from_dict(_grpo_dict(tmp_path, keep_rate=0.5, run={"filter_groups": {"enable": True}}))
    assert job.workload.filter_keep_rate == 0.5
    planning_only = _grpo_dict(tmp_path, keep_rate=0.5)
    del planning_only["run"]
    assert job_from_dict(planning_only).workload.filter_keep_rate == 0.5


def _grpo_dict(tmp_path, samples: int = 4, keep_rate: float | None = None, run: dict | None = None) -> dict:
    arch = {"layers": 2, "hidden": 32, "ffn_hidden": 64, "heads": 2, "kv_heads": 2, "vocab": 64}
    workload = {"prompts_per_step": 2, "prompt_length": 10, "response_length": {"mean": 3, "max": 4}}
    if keep_rate is not None:
        workload["filter_keep_rate"] = keep_rate
    return {"name": "t", "models": {"actor": dict(arch)},
            "algorithm": {"name": "grpo", "samples_per_prompt": samples, "models": ["actor"]},
            "workload": workload, "cluster": {"gpu": "H100", "nodes": 1, "gpus_per_node": 4},
            "run": {"steps": 2, "checkpoint": {"dir": str(tmp_path)}, **(run or {})}}
