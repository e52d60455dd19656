"""The supervised warm-start that gives RL a policy to start from (as SFT does before RLHF), and the
initial weights of the other three models, written as HF checkpoints the workers load.

- actor: next-token cross-entropy on the answer tokens of training prompts (prompt tokens not scored);
- reference: the warm-started actor, frozen;
- critic: the actor's decoder with a zero ``score`` head (verl initialises the critic from the actor);
- reward model: the same decoder trained to output 1 at the last token of a correct answer and 0 of a
  corrupted one (a verifier learned from labelled pairs, as a reward model is learned from preferences).

A job whose models name HF directories (``models.<name>.path``) starts from those instead: actor,
reference and a reward model (a sequence-classification checkpoint) load straight from their directory;
a critic whose directory is a causal LM gets its decoder and a zero ``score`` head, written once to
``init/critic`` (``pretrained_checkpoints``).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import torch

from nereus.rl.data import EOS, PAD, CharTokenizer, Prompt
from nereus.runtime.model.decoder import CausalLM, ModelConfig, build_model
from nereus.runtime.model.hf import load_boxes, read_config, save_checkpoint
from nereus.spec.layout import Layout
from nereus.spec.run import WarmStart
from nereus.spec.sharding import rank_tensors


def _pad_right(seqs: list[list[int]]) -> torch.Tensor:
    out = torch.full((len(seqs), max(map(len, seqs))), PAD, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.tensor(s)
    return out


def _adam_loop(model: CausalLM, data: list[Prompt], steps: int, batch: int, lr: float, seed: int,
               batch_loss: Callable[[list[Prompt], random.Random], torch.Tensor]) -> float:
    """``steps`` Adam steps on random batches of ``data``; returns the last loss."""
    rng = random.Random(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    loss = torch.tensor(0.0)
    for _ in range(steps):
        loss = batch_loss(rng.sample(data, min(batch, len(data))), rng)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return float(loss.detach())


def sft(model: CausalLM, data: list[Prompt], tok: CharTokenizer, steps: int, batch: int, lr: float,
        seed: int) -> float:
    """``steps`` Adam steps of answer-token cross-entropy; returns the last loss."""

    def batch_loss(rows: list[Prompt], rng: random.Random) -> torch.Tensor:
        seqs = [list(p.ids) + tok.encode(p.ground_truth) + [EOS] for p in rows]
        x = _pad_right(seqs)
        target = x[:, 1:].clone()
        for i, p in enumerate(rows):  # score only the answer (and EOS), as SFT masks the prompt
            target[i, : len(p.ids) - 1] = -100
        target[target == PAD] = -100
        logits = model(x)[:, :-1]
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                                 ignore_index=-100)

    return _adam_loop(model, data, steps, batch, lr, seed, batch_loss)


def _corrupt(answer: str, rng: random.Random) -> str:
    """A wrong answer of the kinds a policy produces: a changed digit, a dropped or an extra one."""
    kind = rng.randrange(3)
    if kind == 0 and answer:
        i = rng.randrange(len(answer))
        return answer[:i] + str((int(answer[i]) + rng.randint(1, 9)) % 10) + answer[i + 1:]
    if kind == 1 and len(answer) > 1:
        i = rng.randrange(len(answer))
        return answer[:i] + answer[i + 1:]
    return answer + str(rng.randrange(10))


def train_verifier(model: CausalLM, data: list[Prompt], tok: CharTokenizer, steps: int, batch: int, lr: float,
                   seed: int) -> float:
    """Regress the score at the last token to 1 for correct answers, 0 for corrupted ones."""

    def batch_loss(rows: list[Prompt], rng: random.Random) -> torch.Tensor:
        labels = [rng.random() < 0.5 for _ in rows]
        seqs = [list(p.ids) + tok.encode(p.ground_truth if ok else _corrupt(p.ground_truth, rng)) + [EOS]
                for p, ok in zip(rows, labels, strict=True)]
        values = model(_pad_right(seqs))
        last = torch.tensor([len(s) - 1 for s in seqs])
        score = values[torch.arange(len(seqs)), last]
        return ((score - torch.tensor(labels, dtype=torch.float32)) ** 2).mean()

    return _adam_loop(model, data, steps, batch, lr, seed, batch_loss)


def value_model_from(actor: CausalLM, cfg: ModelConfig) -> CausalLM:
    """A value-head model with the actor's decoder weights and a zero ``score`` head."""
    model = CausalLM(cfg.with_value_head())
    state = {k: v for k, v in actor.state_dict().items() if not k.startswith("lm_head")}
    state["score.weight"] = torch.zeros(1, cfg.arch.hidden)
    model.load_state_dict(state, strict=True)
    return model


def initial_checkpoints(root: Path, cfgs: dict[str, ModelConfig], data: list[Prompt], tok: CharTokenizer,
                        warm: WarmStart, seed: int) -> dict[str, float]:
    """Write ``root/<model>`` for every model in ``cfgs``; returns the warm-start losses."""
    torch.manual_seed(seed)
    actor = build_model(cfgs["actor"], seed=seed)
    out = {"warmstart/actor_loss": sft(actor, data, tok, warm.actor_steps, warm.batch, warm.lr, seed)}
    save_checkpoint(root / "actor", cfgs["actor"], actor.state_dict())
    if "reference" in cfgs:
        save_checkpoint(root / "reference", cfgs["reference"], actor.state_dict())
    if "critic" in cfgs:
        save_checkpoint(root / "critic", cfgs["critic"], value_model_from(actor, cfgs["actor"]).state_dict())
    if "reward" in cfgs:
        rm = value_model_from(actor, cfgs["actor"])
        with torch.no_grad():
            rm.score.weight.normal_(0, 0.02, generator=torch.Generator().manual_seed(seed + 1))
        out["warmstart/reward_loss"] = train_verifier(rm, data, tok, warm.reward_steps, warm.batch, warm.lr,
                                                      seed + 1)
        save_checkpoint(root / "reward", cfgs["reward"], rm.state_dict())
    return out


def pretrained_checkpoints(root: Path, cfgs: dict[str, ModelConfig], paths: dict[str, str]) -> None:
    """``root/critic`` for a critic whose HF directory holds a causal LM: its decoder weights and a zero
    ``score`` head (verl initialises the critic from the actor's weights with a new value head). Other
    models need no copy; ``initial_sources`` points at their directories."""
    root.mkdir(parents=True, exist_ok=True)
    if "critic" not in cfgs or read_config(paths["critic"]).value_head:
        return
    cfg = cfgs["critic"]
    boxes = rank_tensors(cfg.arch, Layout(), 0, value_head=True)
    state = load_boxes(paths["critic"], {k: box for k, box in boxes.items() if k != "score.weight"})
    state["score.weight"] = torch.zeros(1, cfg.arch.hidden)
    save_checkpoint(root / "critic", cfg, state, source=paths["critic"])


def initial_sources(root: Path, models: tuple[str, ...], paths: dict[str, str]) -> dict[str, Path]:
    """Where each model's initial weights are: ``root/<model>`` when written there (warm-start, or a
    critic's new value head), else the model's HF directory."""
    return {m: root / m if (root / m / "config.json").exists() or m not in paths else Path(paths[m])
            for m in models}
