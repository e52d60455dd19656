"""Small job builders and data readers shared by tests."""

import csv
from importlib import resources

from nereus.cost.published import gpt_training_job  # noqa: F401  (re-exported for tests)
from nereus.spec import job_from_dict


def ppo_job(gpus: int = 64, preset: str = "llama3-8b", **workload):
    wl = {"prompts_per_step": 256, "prompt_length": 512,
          "response_length": {"mean": 1024, "max": 4096}, **workload}
    return job_from_dict({
        "name": "ppo-test",
        "models": {m: {"preset": preset} for m in ("actor", "critic", "reference", "reward")},
        "algorithm": {"name": "ppo", "mini_batches": 4},
        "workload": wl,
        "cluster": {"gpu": "H100", "nodes": max(1, gpus // 8), "gpus_per_node": min(8, gpus)},
    })


def published_rows(name: str = "e2e_runs.csv") -> dict[str, dict]:
    """A packaged published-runs CSV of ``nereus.cost`` (the data set's copy by default), rows by ``run_id``;
    lines starting with '#' are comments."""
    text = resources.files("nereus.cost").joinpath(name).read_text()
    return {r["run_id"]: r for r in csv.DictReader(line for line in text.splitlines() if not line.startswith("#"))}
