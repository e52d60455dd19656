"""A single-process replica of the tiny examples' RL runs (examples/grpo_tiny.yaml, examples/ppo_tiny_fixed.yaml),
for trying a setting on many seeds without Ray: the same job file and overrides, data, warm-start (the
runtime's ``initial_checkpoints``, loaded from the files the workers would load), prompt order, mini-batch
split (the runtime's ``mini_batches``), learning-rate schedule, gradient clipping and RL math
(``nereus.rl.core``), in one process with whole models. How it differs from `nereus run`:

- sampling: one generator per step, seeded ``derive_seed(seed, SAMPLING, step)``, draws every row, the
  prompts batched by length without padding; the runtime's fixed batch gives each generation replica its
  own stream of that seed and pads the prompts. From the first step on the replica's responses are a
  different draw of the same distribution, so a seed's run is not the runtime's run: compare the spread
  over seeds, not one seed's figure (GRPO seed 1 ended at 99.0% in both, seed 0 at 90.5% here and 84.0%
  on the runtime);
- whole models in one process: no TP/PP/DP sharding, no weight sync, no controller (so no
  examples/ppo_tiny.yaml, whose layouts adapt), float sums in another order than the sharded runtime's;
- ``torch.optim.AdamW`` where the workers run the runtime's AdamW (equal to torch's,
  tests/runtime/parallel/test_dp.py); the PPO advantages are whitened over the batch's response tokens
  with torch's unbiased variance (``rl.core.masked_whiten`` is the runtime's);
- only the held-out exact-match accuracy is measured (every ``eval_every`` steps and per answer length),
  no step metrics.

docs/rl.md ("Learning settings and why") marks the figures that come from it *replica*.

    python benchmarks/rl_replica.py --example grpo --seeds 0-4 [--set run.actor_lr=0.001 ...]
    python benchmarks/rl_replica.py --example ppo-fixed --seeds 0,3
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rl_learning import EXAMPLES, seed_list  # noqa: E402

from nereus.rl.core import (  # noqa: E402
    clipped_policy_loss,
    clipped_value_loss,
    gae,
    grpo_advantages,
    kl_estimate,
    token_rewards,
)
from nereus.rl.data import EOS, PAD, Prompt  # noqa: E402
from nereus.rl.rewards import correct  # noqa: E402
from nereus.rl.tokenizer import Tokenizer  # noqa: E402
from nereus.run.rollout import mini_batches  # noqa: E402
from nereus.run.setup import MINI_BATCH_ORDER, PROMPT_ORDER, SAMPLING, datasets, model_configs, tokenizer_for  # noqa: E402
from nereus.run.warmstart import greedy_accuracy, initial_checkpoints  # noqa: E402
from nereus.runtime.engines.sampling import derive_seed  # noqa: E402
from nereus.runtime.model.decoder import CausalLM  # noqa: E402
from nereus.runtime.model.hf import load_boxes  # noqa: E402
from nereus.runtime.parallel.batch import TrainBatch  # noqa: E402
from nereus.spec.job import JobSpec, load_job  # noqa: E402
from nereus.spec.parallel_dims import ParallelDims  # noqa: E402
from nereus.spec.sharding import rank_tensors  # noqa: E402

Groups = dict[int, dict[str, torch.Tensor | list[int]]]  # per prompt length: the rows' tensors


def warm_models(job: JobSpec, tok: Tokenizer, train: list[Prompt], root: Path) -> dict[str, CausalLM]:
    """Every model of the job as the runtime's workers start it: ``initial_checkpoints`` writes the
    warm-started weights under ``root`` and each model loads whole from its files."""
    cfgs = {m: c for m, c in model_configs(job, tok).items() if m in job.algorithm.models}
    initial_checkpoints(root, cfgs, train, tok, job.run.warmstart, job.run.seed, job.workload.response.max)
    models = {}
    for name, cfg in cfgs.items():
        model = CausalLM(cfg)
        model.load_state_dict(load_boxes(root / name, rank_tensors(cfg.arch, ParallelDims(), 0, cfg.value_head)))
        models[name] = model
    return models


def response_logp(model: CausalLM, seq: torch.Tensor, plen: int) -> torch.Tensor:
    """log p of each response token of ``seq`` [b, plen + R] (prompts of one length)."""
    logits = model(seq)[:, plen - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, seq[:, plen:, None])[..., 0]


@torch.no_grad()
def sample(model: CausalLM, rows: list[Prompt], max_new: int, gen: torch.Generator, tok: Tokenizer) -> Groups:
    """Responses of ``rows`` (prompts), batched by prompt length: per length the row indices, full sequences,
    sampling log-probs, response mask and the score of each row's rule."""
    by_len: dict[int, list[int]] = defaultdict(list)
    for i, p in enumerate(rows):
        by_len[len(p.ids)].append(i)
    out = {}
    for plen, idx in by_len.items():
        seq = torch.tensor([list(rows[i].ids) for i in idx])
        done = torch.zeros(len(idx), dtype=torch.bool)
        logps = []
        for _ in range(max_new):
            lp = torch.log_softmax(model(seq)[:, -1].float(), -1)
            t = torch.multinomial(lp.exp(), 1, generator=gen)[:, 0]
            t = torch.where(done, torch.full_like(t, PAD), t)
            logps.append(lp.gather(1, t[:, None])[:, 0])
            seq, done = torch.cat([seq, t[:, None]], 1), done | (t == EOS)
            if done.all():
                break
        resp = seq[:, plen:]
        mask, score = torch.zeros(resp.shape), torch.zeros(len(idx))
        for k, i in enumerate(idx):
            row = resp[k].tolist()
            end = row.index(EOS) + 1 if EOS in row else len(row)
            mask[k, :end] = 1
            text = tok.decode([t for t in row[:end] if t != EOS])
            score[k] = correct(rows[i].data_source, text, rows[i].ground_truth, EOS in row, rows[i].extra_info)
        out[plen] = {"idx": idx, "seq": seq, "logp": torch.stack(logps, 1), "mask": mask, "score": score}
    return out


def step_prompts(job: JobSpec, train: list[Prompt], step: int) -> list[Prompt]:
    """The step's prompts, as ``PromptDraws.prompts`` draws them."""
    per, out = job.workload.prompts_per_step, []
    for i in range(step * per, (step + 1) * per):
        epoch, pos = divmod(i, len(train))
        g = torch.Generator().manual_seed(derive_seed(job.run.seed, PROMPT_ORDER, epoch))
        out.append(train[int(torch.randperm(len(train), generator=g)[pos])])
    return out


def mini_batch_rows(job: JobSpec, n: int, step: int) -> list[list[int]]:
    """The rows of each of the step's mini-batches, split by the runtime's ``mini_batches`` with the
    runtime's seed."""
    g = torch.Generator().manual_seed(derive_seed(job.run.seed, MINI_BATCH_ORDER, step))
    index = TrainBatch(torch.arange(n)[:, None], mask=torch.ones(n, 1))
    return [mb.tokens[:, 0].tolist() for mb in mini_batches(index, job.algorithm.mini_batches, g)]


@torch.no_grad()
def advantages(job: JobSpec, models: dict[str, CausalLM], groups: Groups, rows: int) -> None:
    """Each group's ``ref`` log-probs and ``adv`` (PPO: GAE over the critic's values with the reward model's
    score and the KL penalty, whitened over the batch; GRPO: group-normalised scores), in place."""
    r = job.run
    for g in groups.values():
        g["ref"] = response_logp(models["reference"], g["seq"], g["seq"].shape[1] - g["mask"].shape[1])
    if "critic" not in models:
        scores = torch.zeros(rows)
        for g in groups.values():
            scores[g["idx"]] = g["score"]
        uids = torch.arange(rows) // job.algorithm.samples_per_prompt  # one group per drawn prompt
        adv = grpo_advantages(scores, uids, torch.ones(rows, 1))[:, 0]
        for g in groups.values():
            g["adv"] = adv[g["idx"]][:, None] * g["mask"]
        return
    for plen, g in groups.items():
        last = plen + g["mask"].sum(1).long() - 1
        g["values"] = models["critic"](g["seq"])[:, plen - 1:plen - 1 + g["mask"].shape[1]] * g["mask"]
        s = g["score"] + r.reward_model_coef * models["reward"](g["seq"])[torch.arange(len(last)), last]
        kl = kl_estimate(g["logp"], g["ref"], r.kl_penalty) if r.kl_coef else None
        g["adv"], g["returns"] = gae(token_rewards(s, g["mask"], kl, r.kl_coef), g["values"], g["mask"],
                                     r.gamma, r.lam)
    flat = torch.cat([g["adv"][g["mask"].bool()] for g in groups.values()])
    for g in groups.values():  # whitened over the whole batch's tokens, as rl.core.masked_whiten
        g["adv"] = (g["adv"] - flat.mean()) * torch.rsqrt(flat.var() + 1e-8) * g["mask"]


def mini_batch_losses(job: JobSpec, models: dict[str, CausalLM], groups: Groups,
                      picked: dict[int, list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The actor's and the critic's loss on one mini-batch (``picked``: per prompt length the rows' places
    in their group), token-mean over the mini-batch."""
    r = job.run
    low = r.clip_ratio if r.clip_ratio_low is None else r.clip_ratio_low
    high = r.clip_ratio if r.clip_ratio_high is None else r.clip_ratio_high
    tokens = sum(float(groups[p]["mask"][k].sum()) for p, ks in picked.items() for k in ks)
    loss, vloss = torch.zeros(()), torch.zeros(())
    for plen, ks in picked.items():
        g, kt = groups[plen], torch.tensor(ks)
        m = g["mask"][kt]
        lp = response_logp(models["actor"], g["seq"][kt], plen)
        pg, _, _ = clipped_policy_loss(lp, g["logp"][kt], g["adv"][kt], low, high, r.clip_ratio_c)
        if r.use_kl_loss:
            pg = pg + r.kl_loss_coef * kl_estimate(lp, g["ref"][kt], r.kl_loss_type)
        loss = loss + (pg * m).sum() / tokens
        if "critic" in models:
            v = models["critic"](g["seq"][kt])[:, plen - 1:plen - 1 + m.shape[1]]
            vloss = vloss + (clipped_value_loss(v, g["values"][kt], g["returns"][kt], r.value_clip)[0]
                             * m).sum() / tokens
    return loss, vloss


def optimise(opt: torch.optim.Optimizer, model: CausalLM, loss: torch.Tensor, lr: float, clip: float) -> None:
    for group in opt.param_groups:
        group["lr"] = lr
    opt.zero_grad()
    loss.backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()


def rl_step(job: JobSpec, models: dict[str, CausalLM], opts: dict[str, torch.optim.Optimizer],
            train: list[Prompt], tok: Tokenizer, step: int) -> None:
    """One RL step: sample, score, advantages, ``epochs`` × ``mini_batches`` updates of actor (and critic)."""
    r, alg = job.run, job.algorithm
    rows = [p for p in step_prompts(job, train, step) for _ in range(alg.samples_per_prompt)]
    gen = torch.Generator().manual_seed(derive_seed(r.seed, SAMPLING, step))
    groups = sample(models["actor"], rows, r.max_response_length(step, job.workload.response.max), gen, tok)
    advantages(job, models, groups, len(rows))
    where = {i: (plen, k) for plen, g in groups.items() for k, i in enumerate(g["idx"])}
    for _ in range(alg.epochs):
        for chosen in mini_batch_rows(job, len(rows), step):
            picked: dict[int, list[int]] = defaultdict(list)
            for i in chosen:
                picked[where[i][0]].append(where[i][1])
            loss, vloss = mini_batch_losses(job, models, groups, picked)
            optimise(opts["actor"], models["actor"], loss, r.lr_at(r.actor_lr, step), r.grad_clip)
            if "critic" in opts:
                optimise(opts["critic"], models["critic"], vloss, r.lr_at(r.critic_lr, step), r.grad_clip)


def run_seed(job: JobSpec) -> dict:
    """The job's run: held-out accuracy after the warm-start, every ``eval_every`` steps and at the end
    (also per answer length), and the wall time."""
    r, t0 = job.run, time.perf_counter()
    tok = tokenizer_for(job)
    root = Path(tempfile.mkdtemp(prefix="nereus-replica-"))
    train, val = datasets(job, tok, root / "data")
    models = warm_models(job, tok, train, root / "init")
    final_len = job.workload.response.max
    warm = greedy_accuracy(models["actor"], val, tok, final_len)
    opts = {m: torch.optim.AdamW(models[m].parameters(), lr=0.0, weight_decay=r.weight_decay, foreach=False)
            for m in ("actor", "critic") if m in models}
    curve = []
    for step in range(r.steps):
        rl_step(job, models, opts, train, tok, step)
        if (step + 1) % r.eval_every == 0 or step + 1 == r.steps:
            curve.append(greedy_accuracy(models["actor"], val, tok, final_len))
    by_len: dict[int, list[Prompt]] = defaultdict(list)
    for p in val:
        by_len[len(p.ground_truth)].append(p)
    lengths = {n: greedy_accuracy(models["actor"], ps, tok, final_len) for n, ps in sorted(by_len.items())}
    return {"seed": r.seed, "warm": warm, "final": curve[-1] if curve else warm, "curve": curve,
            "lengths": lengths, "wall_s": time.perf_counter() - t0}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--example", choices=["grpo", "ppo-fixed"], default="grpo")
    parser.add_argument("--seeds", type=seed_list, default=[0])
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="overrides for every seed")
    args = parser.parse_args()
    torch.set_num_threads(1)
    base = load_job(EXAMPLES[args.example], args.set)
    for seed in args.seeds:
        job = replace(base, run=replace(base.run, seed=seed))
        res = run_seed(job)
        curve = " ".join(f"{100 * a:.1f}" for a in res["curve"])
        lengths = " ".join(f"{n}:{100 * a:.0f}%" for n, a in res["lengths"].items())
        print(f"{args.example} seed {seed}: {100 * res['warm']:.1f}% -> {100 * res['final']:.1f}% "
              f"(every {job.run.eval_every} steps: {curve}; by answer length {lengths}; {res['wall_s']:.0f} s)",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
