"""Small PPO and GRPO job specs for the RL tests (seconds per step on four workers)."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from nereus.run.inference import StepInference
from nereus.run.job import RLJob
from nereus.spec.job import JobSpec, job_from_dict

ARCH = {"layers": 2, "hidden": 32, "ffn_hidden": 64, "heads": 4, "kv_heads": 2, "vocab": 64}


def tiny_job(algorithm: str, out_dir: str, steps: int = 3, arch: dict | None = None,
             recompute_old_log_prob: bool = True, **run: object) -> JobSpec:
    """``recompute_old_log_prob``: False takes the old log-probs from the engine (no actor/inference layout)."""
    ppo = algorithm == "ppo"
    models = ["actor", "critic", "reference", "reward"] if ppo else ["actor", "reference"]
    layouts = {
        "actor/generation": {"layout": "dp=2", "ranks": [0, 1]},
        "actor/inference": {"layout": "tp=2,micro_batch_size=4", "ranks": [2, 3]},
        "reference/inference": {"layout": "pp=2,micro_batch_size=2", "ranks": [1, 0]},
        "actor/training": {"layout": "pp=2,dp=2,micro_batch_size=1", "ranks": [0, 1, 2, 3]},
    }
    if not recompute_old_log_prob:
        del layouts["actor/inference"]
    if ppo:
        layouts |= {"critic/inference": {"layout": "dp=2,micro_batch_size=4", "ranks": [2, 3]},
                    "reward/inference": {"layout": "tp=2,micro_batch_size=8", "ranks": [0, 3]},
                    "critic/training": {"layout": "tp=2,dp=2,micro_batch_size=2", "ranks": [3, 2, 1, 0]}}
    spec = {
        "name": f"{algorithm}-test",
        "models": {m: dict(arch or ARCH) for m in models},
        "algorithm": {"name": algorithm, "samples_per_prompt": 2 if ppo else 4, "mini_batches": 2,
                      "recompute_old_log_prob": recompute_old_log_prob},
        "workload": {"prompts_per_step": 4 if ppo else 2, "prompt_length": 10,
                     "response_length": {"mean": 3, "max": 4}},
        "cluster": {"gpu": "H100", "nodes": 1, "gpus_per_node": 4},
        "run": {"seed": 3, "steps": steps, "workers": 4, "eval_every": 2,
                "data": {"train_size": 40, "val_size": 6, "max_digits": 3},
                "warmstart": {"actor_steps": 80, "reward_steps": 5, "batch": 16},
                "curriculum": [{"step": 0, "max_response_length": 3}, {"step": 2, "max_response_length": 4}],
                "kl_coef": 0.01 if ppo else 0.0, "use_kl_loss": not ppo, "reward_model_coef": 0.5 if ppo else 0.0,
                # partial credit gives a barely warm-started policy non-zero group advantages
                "rule_reward": "exact_match" if ppo else "digit_match",
                "checkpoint": {"dir": out_dir, "every": 2}, "layouts": layouts, **run},
    }
    return job_from_dict(spec)


# vLLM's CPU attention needs a head size of at least 32 (spec.rollout.VLLM_CPU_HEAD_SIZES)
VLLM_ARCH = {"layers": 2, "hidden": 64, "ffn_hidden": 128, "heads": 2, "kv_heads": 2, "vocab": 64}


def vllm_job(algorithm: str, out_dir: str, steps: int = 3, rollout: dict | None = None, **run: object) -> JobSpec:
    """``tiny_job`` generating with vLLM (two engines: actor/generation is dp=2 on workers 0 and 1), with
    ``rollout``'s further keys. Every such job builds the same engines (64 MiB of KV cache each: the tiny
    model's sequences need a few hundred KiB; 4 sequences at a time, as mid-step moves need slots), so a
    job on the tests' session runtime reuses the engines the previous one left idle (``engines.pool``)."""
    return tiny_job(algorithm, out_dir, steps, arch=VLLM_ARCH,
                    rollout={"engine": "vllm", "cpu_kv_cache_gib": 0.0625, "slots": 4, **(rollout or {})}, **run)


def run_recording_infer(job: JobSpec, runtime: object, out: Path, monkeypatch: pytest.MonkeyPatch,
                        rollout: tuple[str, ...] = ("tokens",)) -> tuple[list[dict], list[dict[str, torch.Tensor]]]:
    """Run ``job`` on ``runtime``: its metric lines and, at each step, what ``StepInference.infer`` returned
    (its fields that are there, by name), the rollout's fields named in ``rollout`` and ``early`` (the row
    blocks of each inference stage issued while generation was still running)."""
    seen: list[dict[str, torch.Tensor]] = []
    real = StepInference.infer

    def infer(self, roll, rows, early=None):
        got = real(self, roll, rows, early)
        seen.append(inferred(got) | {k: getattr(roll, k).clone() for k in rollout})
        seen[-1]["early"] = {t: sorted(calls) for t, calls in early.early.items()} if early else {}
        return got

    monkeypatch.setattr(StepInference, "infer", infer)
    rl = RLJob(job, runtime=runtime, out_dir=out, quiet=True)
    try:
        rl.execute()
    finally:
        rl.release()
        monkeypatch.undo()
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()], seen


def inferred(inf: object) -> dict[str, torch.Tensor]:
    """The fields of an ``Inferred`` that the step has (not None), by name, cloned."""
    return {f.name: getattr(inf, f.name).clone() for f in fields(inf) if getattr(inf, f.name) is not None}
