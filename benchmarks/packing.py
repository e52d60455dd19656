"""Padded vs packed sequences, measured: the same long-tail GRPO step on real workers, side by side in one run.

One Ray runtime of two workers holds the actor and the reference twice, once under padded layouts and once
under the same layouts packed (``run.packing.enable``: each micro-batch holds at most the tokens of the padded
micro-batch it replaces, ``spec.packing.token_budget``, applied by ``run.setup.packed`` as a run applies it).
Each round runs, per mode, the part of a GRPO step that packing changes, on the same rollout:

- ``old_log_prob``: the actor's log-probs and entropies (actor/inference, DP2);
- ``ref``: the reference's log-probs (reference/inference, DP2);
- GRPO advantages from seeded scores, then ``mini_batches`` optimizer steps of the actor with verl's PPO
  loss and a k3 KL term, token-mean (actor/training, DP2).

Generation is the same in both modes (packing does not touch the decoding engine) and is not run: the
rollout is synthetic, prompts of ``--prompt`` tokens and responses with a long tail (most a few dozen
tokens, one in ten several hundred, the longest ``--max-response``), packed into a ``run.rollout.Rollout``
as generated ones are. The modes run in alternating order over ``--rounds`` rounds; times are medians.

The final line is JSON: ``padded_s`` and ``packed_s`` (median step seconds), ``ratio`` (packed / padded),
``padding_fraction`` (padding tokens / all tokens of the padded batch), ``max_abs_logprob_diff`` (largest
difference of the actor's and reference's log-probs over response tokens, first round, before any update),
``max_abs_loss_diff`` (of the first optimizer steps' token-mean objectives), ``peak_mem_ratio`` (packed /
padded peak activation bytes over workers and operations, the runtime's memory meter).

    python benchmarks/packing.py [--rows 32] [--rounds 3] [--max-response 1024] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from nereus.rl import losses
from nereus.rl.core import AdvantageInputs, advantage_estimator
from nereus.run.rollout import Rollout, draw_uids, mini_batches, pack
from nereus.run.setup import packed
from nereus.runtime.model.decoder import ModelConfig, build_model
from nereus.runtime.parallel.batch import TrainBatch
from nereus.spec.layout import Layout
from nereus.spec.model import ModelArch
from nereus.spec.packing import PackingSpec, replica_shares, token_budget_groups

ROOT = Path(__file__).resolve().parent.parent
CFG = ModelConfig(ModelArch(layers=4, hidden=128, ffn_hidden=344, heads=4, kv_heads=2, vocab=256), eos_token_id=2)
LAYOUTS = {  # (model, stage): layout on workers [0, 1]
    ("actor", "inference"): Layout(dp=2, micro_batch_size=4, recompute="none", sequence_parallel=False),
    ("reference", "inference"): Layout(dp=2, micro_batch_size=4, recompute="none", sequence_parallel=False),
    ("actor", "training"): Layout(dp=2, micro_batch_size=2, recompute="none", sequence_parallel=False),
}
SAMPLES, MINI_BATCHES, LR = 8, 2, 1e-5


@dataclass(frozen=True)
class Workload:
    rows: int
    prompt: int
    max_response: int
    seed: int = 0


def long_tail_lengths(w: Workload) -> list[int]:
    """Response lengths: nine in ten uniform in [16, 96], one in ten in [max/3, max]; the longest is ``max``."""
    g = torch.Generator().manual_seed(w.seed)
    out = []
    for _ in range(w.rows):
        if torch.rand((), generator=g) < 0.1:
            out.append(int(torch.randint(w.max_response // 3, w.max_response + 1, (), generator=g)))
        else:
            out.append(int(torch.randint(16, 97, (), generator=g)))
    out[int(torch.randint(0, w.rows, (), generator=g))] = w.max_response
    return out


def rollout(w: Workload) -> Rollout:
    """Random prompts and responses of ``long_tail_lengths`` (no EOS inside), packed as a step packs them."""
    g = torch.Generator().manual_seed(w.seed + 1)
    vocab = CFG.arch.vocab
    prompts = [torch.randint(3, vocab, (w.prompt,), generator=g).tolist() for _ in range(w.rows)]
    responses = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in long_tail_lengths(w)]
    return pack(prompts, responses, None, CFG.eos_token_id)


def padding_fraction(roll: Rollout) -> float:
    return 1.0 - float(roll.lengths.sum()) / roll.tokens.numel()


def layouts(packing: bool, max_seq: int) -> dict[tuple[str, str], Layout]:
    spec = PackingSpec(enable=packing)
    return {(m, s): packed(spec, m, s, lay, max_seq) for (m, s), lay in LAYOUTS.items()}


def step(rt, mode: str, roll: Rollout, seed: int) -> dict:
    """The packable part of one GRPO step on ``mode``'s keys: timings, log-probs, objectives, memory."""
    t0 = time.perf_counter()
    logp, _ = rt.logprobs_and_entropy(f"{mode}/actor/inference", roll.tokens, roll.lengths)
    ref = rt.logprobs(f"{mode}/reference/inference", roll.tokens, roll.lengths)
    old, ref_logp = roll.response_frame(logp), roll.response_frame(ref)
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 2, (len(roll.tokens),), generator=g).float()
    adv = advantage_estimator("grpo")(AdvantageInputs(scores=scores, mask=roll.mask, groups=draw_uids(
        len(roll.tokens), SAMPLES), old_logp=old))["adv"]
    batch = TrainBatch(roll.tokens, roll.index, roll.mask, old_logp=old, advantages=adv, ref_logp=ref_logp,
                       lengths=roll.lengths)
    loss = losses.policy_loss(clip_low=0.2, clip_high=0.2, kl_loss_coef=0.001, kl_loss_type="k3")
    objectives = []
    for mb in mini_batches(batch, MINI_BATCHES, torch.Generator().manual_seed(seed), "token-mean"):
        stats = rt.train_step(f"{mode}/actor/training", mb, loss, lr=LR, max_grad_norm=1.0)
        objectives.append(objective(stats, mb, rt.specs[f"{mode}/actor/training"].layout))
    seconds = time.perf_counter() - t0
    peak = max(r.activations for key in ("actor/inference", "reference/inference", "actor/training")
               for r in rt.memory(f"{mode}/{key}") if r is not None)
    return {"seconds": seconds, "old": old, "ref": ref_logp, "objectives": objectives, "peak_activations": peak}


def objective(stats, mb: TrainBatch, layout: Layout) -> float:
    """The mini-batch's token-mean loss from its micro-batch losses: each counts by its share of the rows
    (padded: equal micro-batches; packed: the runtime's plan, ``parallel.packing``)."""
    if not layout.max_token_len:
        return statistics.fmean(stats.losses)
    lengths = mb.lengths.tolist()
    sizes = [len(g) for share in replica_shares(lengths, layout.dp)
             for g in token_budget_groups([lengths[i] for i in share], layout.max_token_len)]
    return sum(x * n for x, n in zip(stats.losses, sizes, strict=True)) / len(mb)


def load(rt, w: Workload) -> dict[str, dict[tuple[str, str], Layout]]:
    """Both modes' keys on workers [0, 1], every model from the same seeded weights."""
    state = build_model(CFG, seed=7).state_dict()
    max_seq = w.prompt + w.max_response
    modes = {"padded": layouts(False, max_seq), "packed": layouts(True, max_seq)}
    for mode, lays in modes.items():
        for (model, stage), lay in lays.items():
            rt.load(f"{mode}/{model}/{stage}", CFG, lay, ranks=[0, 1], state=state, model=model, stage=stage)
    return modes


def run(w: Workload, rounds: int) -> dict:
    from nereus.runtime.cluster.workers import Runtime

    roll = rollout(w)
    rt = Runtime(2, temp_dir=ROOT / ".tmp" / "ray", timeout_s=600)
    try:
        modes = load(rt, w)
        got: dict[str, list[dict]] = {m: [] for m in modes}
        for rnd in range(rounds):
            for mode in (list(modes) if rnd % 2 == 0 else list(modes)[::-1]):
                got[mode].append(step(rt, mode, roll, seed=rnd))
    finally:
        rt.shutdown()
    pad, pk = got["padded"], got["packed"]
    diff = max(float((pk[0][k] - pad[0][k]).abs().max()) for k in ("old", "ref"))
    return {
        "padded_s": statistics.median(r["seconds"] for r in pad),
        "packed_s": statistics.median(r["seconds"] for r in pk),
        "padding_fraction": padding_fraction(roll),
        "max_abs_logprob_diff": diff,
        "max_abs_loss_diff": max(abs(a - b) for a, b in zip(pk[0]["objectives"], pad[0]["objectives"], strict=True)),
        "peak_mem_ratio": max(r["peak_activations"] for r in pk) / max(r["peak_activations"] for r in pad),
        "layouts": {m: {f"{k[0]}/{k[1]}": v.short() for k, v in lays.items()} for m, lays in modes.items()},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=32, help="responses per step (GRPO groups of 8)")
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    p.add_argument("--max-response", type=int, default=1024, help="the long tail's longest response")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", action="store_true", help="only the final JSON line")
    args = p.parse_args(argv)
    if args.rows % (SAMPLES * MINI_BATCHES) or args.rows < SAMPLES * MINI_BATCHES:
        p.error(f"--rows must be a multiple of {SAMPLES * MINI_BATCHES} (GRPO groups in {MINI_BATCHES} mini-batches)")
    out = run(Workload(args.rows, args.prompt, args.max_response), args.rounds)
    out["ratio"] = out["packed_s"] / out["padded_s"]
    if not args.json:
        for mode in ("padded", "packed"):
            print(f"{mode:<7} {out[f'{mode}_s']:8.2f} s   {out['layouts'][mode]}", file=sys.stderr)
        print(f"packed/padded {out['ratio']:.3f}; padding {out['padding_fraction']:.1%} of the padded tokens; "
              f"max |Δ log-prob| {out['max_abs_logprob_diff']:.2e}; peak activations x{out['peak_mem_ratio']:.3f}",
              file=sys.stderr)
    keys = ("padded_s", "packed_s", "ratio", "padding_fraction", "max_abs_logprob_diff", "max_abs_loss_diff",
            "peak_mem_ratio")
    print(json.dumps({k: out[k] for k in keys}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
