"""Expert parallelism through `nereus run`'s own code path: the tiny-MoE GRPO job (examples/grpo_moe_tiny.yaml) with
the actor's training and inference at ``dp=2,ep=2`` against the same job at ``dp=2``, on one 2-worker Ray runtime.

A tiny random checkpoint (``examples/make_tiny_hf.py --arch ARCH``: 4 experts, 2 per token) is written to a
temporary folder; both jobs read it, train 2 steps with a learning rate and an entropy bonus large enough to
move the weights in step 1 (``actor_lr`` 1e-3, ``entropy_coeff`` 0.01), save a checkpoint every step, and are
then resumed from their step-2 checkpoints (``nereus run --resume``) to a third step. Printed, side by side:

- ``step1_loss_rel_diff``: the step-1 KL loss, EP against DP (relative); ``step1_grad_norm_rel_diff`` likewise;
- ``max_weight_rel_diff``: per saved step (1, 2 and the resumed 3), the largest difference of any actor tensor
  over that tensor's largest value;
- ``hf_class`` and ``hf_logit_max_diff``: the EP job's step-2 checkpoint loaded by transformers'
  ``AutoModelForCausalLM`` (the class it comes back as, and its logits against Nereus's own model loaded from
  the same directory).

The final line is JSON with those keys and ``arch``. The bar is 1e-4 (relative) on the step-1 loss and
weights.

    python benchmarks/moe_ep.py [--arch qwen3_moe|mixtral|qwen2_moe] [--json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "grpo_moe_tiny.yaml"
LAYOUTS = {"dp": {"actor/inference": "dp=2,micro_batch_size=4", "actor/training": "dp=2,micro_batch_size=2"},
           "ep": {"actor/inference": "dp=2,ep=2,micro_batch_size=4", "actor/training": "dp=2,ep=2,micro_batch_size=2"}}


def tiny_checkpoint(folder: Path, arch: str) -> Path:
    spec = importlib.util.spec_from_file_location("make_tiny_hf", ROOT / "examples" / "make_tiny_hf.py")
    maker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(maker)
    return maker.make(folder, rows=24, val=4, arch=arch)


def job_file(data: Path, out: Path, mode: str, steps: int) -> Path:
    """The example job on ``data``'s checkpoint and rows, ``mode``'s actor layouts, ``steps`` steps."""
    spec = yaml.safe_load(EXAMPLE.read_text())
    model = str(data / "model")
    spec["models"] = {"actor": {"path": model}, "reference": {"path": model}}
    run = spec["run"]
    run.update(steps=steps, actor_lr=1e-3, entropy_coeff=0.01, eval_every=0,
               data={"train": str(data / "train.parquet"), "val": str(data / "val.parquet")},
               checkpoint={"dir": str(out), "every": 1})
    for key, layout in LAYOUTS[mode].items():
        run["layouts"][key]["layout"] = layout
    path = out.parent / f"{mode}-{steps}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def run_job(rt, path: Path, out: Path, resume: bool) -> None:
    from nereus.run.job import RLJob
    from nereus.spec.job import load_job

    rl = RLJob(load_job(path), runtime=rt, out_dir=out, quiet=True)
    try:
        rl.execute(resume=resume)
    finally:
        rl.release()


def weights_in(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the HF checkpoint in ``folder``, whole."""
    from nereus.runtime.model.hf import load_boxes, read_config
    from nereus.spec.parallel_dims import ParallelDims
    from nereus.spec.sharding import rank_tensors

    return load_boxes(folder, rank_tensors(read_config(folder).arch, ParallelDims(), 0))


def actor_weights(out: Path, step: int) -> dict[str, torch.Tensor]:
    return weights_in(out / f"step_{step}" / "actor")


def rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest difference of any tensor over the larger of its two largest values (0 where both are 0)."""
    return max(float((a[k] - b[k]).abs().max() / torch.maximum(a[k].abs().max(), b[k].abs().max()).clamp(min=1e-30))
               for k in b)


def hf_check(folder: Path) -> tuple[str, float]:
    """The class transformers loads ``folder`` as, and its logits' largest difference from Nereus's model."""
    import transformers

    from nereus.runtime.model.decoder import CausalLM
    from nereus.runtime.model.hf import read_config

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    cfg = read_config(folder)
    ours = CausalLM(cfg)
    ours.load_state_dict(weights_in(folder), strict=True)
    x = torch.randint(3, cfg.arch.vocab, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return type(hf).__name__, float((hf(x).logits - ours.eval()(x)).abs().max())


def step_metrics(out: Path, step: int) -> dict:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in rows if r["step"] == step)


def measure(arch: str) -> dict:
    from nereus.runtime.cluster.workers import Runtime

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = tiny_checkpoint(tmp / "data", arch)
        rt = Runtime(2, temp_dir=ROOT / ".tmp" / "ray", timeout_s=300)
        try:
            for mode in ("dp", "ep"):
                out = tmp / mode / "out"
                out.mkdir(parents=True)
                print(f"{mode}: 2 steps, then resumed to 3", file=sys.stderr)
                run_job(rt, job_file(data, out, mode, 2), out, resume=False)
                run_job(rt, job_file(data, out, mode, 3), out, resume=True)
        finally:
            rt.shutdown()
        dp, ep = tmp / "dp" / "out", tmp / "ep" / "out"
        m_dp, m_ep = step_metrics(dp, 1), step_metrics(ep, 1)
        hf_class, hf_diff = hf_check(ep / "step_2" / "actor")
        return {
            "arch": arch,
            "step1_loss_rel_diff": _rel(m_ep["actor/kl_loss"], m_dp["actor/kl_loss"]),
            "step1_grad_norm_rel_diff": _rel(m_ep["actor/grad_norm"], m_dp["actor/grad_norm"]),
            "max_weight_rel_diff": {s: rel_diff(actor_weights(ep, s), actor_weights(dp, s)) for s in (1, 2, 3)},
            "weights_moved": rel_diff(actor_weights(dp, 1), weights_in(data / "model")),
            "hf_class": hf_class,
            "hf_logit_max_diff": hf_diff,
        }


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="qwen3_moe", choices=["qwen3_moe", "mixtral", "qwen2_moe"])
    p.add_argument("--json", action="store_true", help="only the final JSON line")
    args = p.parse_args(argv)
    out = measure(args.arch)
    if not args.json:
        print(f"{args.arch}: step-1 KL loss EP vs DP {out['step1_loss_rel_diff']:.2e} (relative), grad norm "
              f"{out['step1_grad_norm_rel_diff']:.2e}; weights per step {out['max_weight_rel_diff']} (step 1 "
              f"moved them by {out['weights_moved']:.2e}); checkpoint loads as {out['hf_class']}, logits within "
              f"{out['hf_logit_max_diff']:.2e}", file=sys.stderr)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
