"""A few steps of PPO and GRPO on the shared 4-worker runtime: finite losses, verl's metric names, shapes,
weight sync between layouts, checkpoints, and resume reproducing an uninterrupted run."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch
from safetensors.torch import load_file

from nereus.rl.data import CharTokenizer
from nereus.run.job import RLJob
from tests.run.jobs import tiny_job

pytestmark = pytest.mark.distributed

COMMON = ("timing_s/gen", "timing_s/old_log_prob", "timing_s/ref", "timing_s/update_actor", "timing_s/step",
          "perf/throughput", "response_length/mean", "response_length/clip_ratio", "critic/score/mean",
          "critic/advantages/mean", "actor/pg_loss", "actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl",
          "actor/kl_loss", "actor/entropy", "timing_s/update_weights", "critic/rewards/mean",
          "rollout/logprob_diff_max", "curriculum/max_response_length", "critic/returns/mean",
          "actor/ppo_kl_last", "actor/ppo_ratio_max_deviation", "actor/lr")
PPO_ONLY = ("critic/vf_loss", "critic/values/mean", "timing_s/update_critic",
            "timing_s/values", "reward_model/score/mean", "actor/reward_kl_penalty", "critic/vpred_mean")
TIMING = ("timing_s/", "perf/throughput", "perf/time_per_step", "perf/idle_fraction/", "nereus/snapshot_s")


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _run(job, runtime, out, resume=False) -> None:
    rl = RLJob(job, runtime=runtime, out_dir=out, quiet=True)
    try:
        rl.execute(resume=resume)
        _check_synced(rl)
    finally:
        rl.release()


def _check_synced(rl: RLJob) -> None:
    """After a step, every layout of a trained model holds the training layout's weights."""
    for model in ("actor", "critic"):
        keys = sorted({p.key for p in rl.placed if p.model == model})
        whole = [rl.rt.read_weights(k) for k in keys]
        for other in whole[1:]:
            for name, t in whole[0].items():
                torch.testing.assert_close(other[name], t, rtol=0, atol=0)


@pytest.mark.parametrize("algorithm", ["ppo", "grpo"])
def test_smoke(ray_runtime, tmp_path, algorithm):
    job = tiny_job(algorithm, str(tmp_path))
    _run(job, ray_runtime, tmp_path)
    rows = _lines(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    want = COMMON + (PPO_ONLY if algorithm == "ppo" else ("actor/kl_loss",))
    for r in rows:
        missing = [k for k in want if k not in r]
        assert not missing, missing
        assert all(math.isfinite(v) for v in r.values())
        assert r["rollout/logprob_diff_max"] < 1e-4  # generation and the actor's inference layout agree
    assert [r["curriculum/max_response_length"] for r in rows] == [3, 3, 4]
    assert max(r["response_length/max"] for r in rows[:2]) <= 3
    assert "val/accuracy" in rows[1] and "val/accuracy" in rows[2]
    for r in rows:  # the first mini-batch is on-policy: the step's mean ppo_kl is half the last one's or less
        assert r["actor/ppo_ratio_max_deviation"] > 0 and abs(r["actor/ppo_kl"]) <= abs(r["actor/ppo_kl_last"]) + 1e-5
    if algorithm == "grpo":
        assert any(r["actor/kl_loss"] > 0 for r in rows[1:])  # the policy moved off the reference
        for r in rows:  # verl's GRPO returns are its advantages
            assert r["critic/returns/mean"] == pytest.approx(r["critic/advantages/mean"])
    # checkpoints: HF safetensors per trained model, optimizer state per training worker (no pickle)
    ckpt = tmp_path / "step_2"
    assert (tmp_path / "latest").read_text() == "3"
    actor = load_file(str(ckpt / "actor" / "model.safetensors"))
    assert actor["model.embed_tokens.weight"].shape == (64, 32)
    optim = sorted(p.name for p in (ckpt / "optim" / "actor").iterdir())
    assert optim == [f"rank{r}.safetensors" for r in range(4)]
    assert set(load_file(str(ckpt / "optim" / "actor" / "rank0.safetensors"))) == {
        "master", "exp_avg", "exp_avg_sq", "step"}
    # the run's tokenizer in every checkpoint, initial ones included (tests/rl/test_char_tokenizer_files.py)
    for folder in (ckpt / "actor", tmp_path / "init" / "actor", tmp_path / "step_3" / "actor"):
        assert (folder / "tokenizer.json").is_file() and (folder / "tokenizer_config.json").is_file(), folder
    if importlib.util.find_spec("transformers") is not None:
        from nereus.rl.tokenizer import HFTokenizer

        assert HFTokenizer(ckpt / "actor").encode("12+34=46") == CharTokenizer().encode("12+34=46")


def test_resume_continues_like_an_uninterrupted_run(ray_runtime, tmp_path):
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    _run(tiny_job("ppo", str(straight), steps=4), ray_runtime, straight)
    _run(tiny_job("ppo", str(cut), steps=2), ray_runtime, cut)  # stops after the step-2 checkpoint
    _run(tiny_job("ppo", str(cut), steps=4), ray_runtime, cut, resume=True)
    a, b = _lines(straight / "metrics.jsonl"), _lines(cut / "metrics.jsonl")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b, strict=True):
        for k, v in ra.items():
            if not k.startswith(TIMING):
                assert rb[k] == pytest.approx(v, rel=1e-4, abs=1e-5), (ra["step"], k)


def test_sampled_evaluation_is_a_mean_over_n_and_leaves_training_as_it_is(ray_runtime, tmp_path):
    """``run.rollout.val_kwargs`` with ``do_sample``: each held-out prompt answered ``n`` times, the accuracy
    their mean (a multiple of 1/(n·prompts)), drawn from a seed of the run's and the step's alone, so the
    same step evaluates the same and the training's own draws are those of a greedily evaluated run."""
    sampled, greedy = tmp_path / "sampled", tmp_path / "greedy"
    n = 3
    kwargs = {"n": n, "do_sample": True, "temperature": 1.0}
    job = tiny_job("grpo", str(sampled), steps=2, eval_every=1, rollout={"val_kwargs": kwargs})
    rl = RLJob(job, runtime=ray_runtime, out_dir=sampled, quiet=True)
    try:
        rl.execute()
        asked, generate = [], rl.rt.generate
        rl.rt.generate = lambda key, ids, params: asked.append((len(ids), params.temperature)) or generate(
            key, ids, params)
        again = [rl.evaluate(rl.val, 2) for _ in range(2)]
    finally:
        vars(rl.rt).pop("generate", None)  # the runtime is the session's: its own method again
        rl.release()
    _run(tiny_job("grpo", str(greedy), steps=2, eval_every=1), ray_runtime, greedy)
    a, b = _lines(sampled / "metrics.jsonl"), _lines(greedy / "metrics.jsonl")
    rows = n * len(rl.val)
    for ra, rb in zip(a, b, strict=True):
        assert round(ra["val/accuracy"] * rows, 6).is_integer()
        for k, v in rb.items():
            if not k.startswith(TIMING) and k != "val/accuracy":
                assert ra[k] == pytest.approx(v, rel=1e-6, abs=1e-7), (ra["step"], k)
    assert again[0] == again[1] == a[-1]["val/accuracy"]
    dp = 2  # the generation layout's: rows are padded to a multiple of it
    assert asked == [(rows + (-rows) % dp, 1.0)] * 2
