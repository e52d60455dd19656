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
``init/critic`` (``pretrained_checkpoints``). ``init/sources.json`` records what each such directory held
(``source_record``), so a resumed run refuses one that changed since (it reloads the reference from there).
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable
from pathlib import Path

import torch

from nereus.rl.data import EOS, PAD, CharTokenizer, Prompt
from nereus.runtime.model.decoder import CausalLM, ModelConfig, build_model
from nereus.runtime.model.hf import TOKENIZER_FILES, load_boxes, read_config, save_checkpoint
from nereus.spec.errors import SpecError
from nereus.spec.parallel_dims import ParallelDims
from nereus.spec.run import WarmStart
from nereus.spec.sharding import rank_tensors


def _pad_right(seqs: list[list[int]]) -> torch.Tensor:
    out = torch.full((len(seqs), max(map(len, seqs))), PAD, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.tensor(s)
    return out


CHECK_EVERY = 10  # warm-start steps between two looks at the training accuracy (``WarmStart.target_accuracy``)
CHECK_PROMPTS = 128  # training prompts the look decodes greedily


def _adam_loop(model: CausalLM, data: list[Prompt], steps: int, batch: int, lr: float, seed: int,
               batch_loss: Callable[[list[Prompt], random.Random], torch.Tensor],
               done: Callable[[], bool] | None = None) -> tuple[float, int]:
    """Adam steps on random batches of ``data``: ``steps`` of them, or fewer when ``done()`` (asked every
    ``CHECK_EVERY`` steps) says so; returns the last loss and the steps taken."""
    rng = random.Random(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    loss = torch.tensor(0.0)
    for step in range(steps):
        if done is not None and step and step % CHECK_EVERY == 0 and done():
            return float(loss.detach()), step
        loss = batch_loss(rng.sample(data, min(batch, len(data))), rng)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return float(loss.detach()), steps


@torch.no_grad()
def greedy_accuracy(model: CausalLM, prompts: list[Prompt], tok: CharTokenizer, max_new: int) -> float:
    """The share of ``prompts`` whose greedy response (at most ``max_new`` tokens) the row's rule scores
    correct; prompts of one length decode together, so no padding enters."""
    from nereus.rl.rewards import correct

    was_training = model.training
    model.eval()
    hits = 0
    by_length: dict[int, list[Prompt]] = {}
    for p in prompts:
        by_length.setdefault(len(p.ids), []).append(p)
    for rows in by_length.values():
        seq = torch.tensor([list(p.ids) for p in rows])
        for _ in range(max_new):
            seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
        for p, row in zip(rows, seq[:, len(rows[0].ids):].tolist(), strict=True):
            answer = row[: row.index(EOS) + 1] if EOS in row else row
            finished = bool(answer) and answer[-1] == EOS
            hits += correct(p.data_source, tok.decode([t for t in answer if t != EOS]), p.ground_truth, finished,
                            p.extra_info) >= 1.0
    model.train(was_training)
    return hits / max(len(prompts), 1)


def sft(model: CausalLM, data: list[Prompt], tok: CharTokenizer, steps: int, batch: int, lr: float,
        seed: int, label_smoothing: float = 0.0, target_accuracy: float = 0.0,
        max_new: int = 16) -> tuple[float, int]:
    """Adam steps of answer-token cross-entropy (with ``label_smoothing``: the target puts that share of its
    mass uniformly over the vocabulary, Szegedy et al. 2016): ``steps`` of them, or with ``target_accuracy``
    until greedy decoding (``max_new`` tokens) solves that share of ``CHECK_PROMPTS`` training prompts.
    Returns the last loss and the steps taken."""
    probe = random.Random(seed + 1).sample(data, min(CHECK_PROMPTS, len(data)))
    done = (lambda: greedy_accuracy(model, probe, tok, max_new) >= target_accuracy) if target_accuracy else None

    def batch_loss(rows: list[Prompt], rng: random.Random) -> torch.Tensor:
        seqs = [list(p.ids) + tok.encode(p.ground_truth) + [EOS] for p in rows]
        x = _pad_right(seqs)
        target = x[:, 1:].clone()
        for i, p in enumerate(rows):  # score only the answer (and EOS), as SFT masks the prompt
            target[i, : len(p.ids) - 1] = -100
        target[target == PAD] = -100
        logits = model(x)[:, :-1]
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                                 ignore_index=-100, label_smoothing=label_smoothing)

    return _adam_loop(model, data, steps, batch, lr, seed, batch_loss, done)


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

    return _adam_loop(model, data, steps, batch, lr, seed, batch_loss)[0]


def value_model_from(actor: CausalLM, cfg: ModelConfig) -> CausalLM:
    """A value-head model with the actor's decoder weights and a zero ``score`` head."""
    model = CausalLM(cfg.with_value_head())
    state = {k: v for k, v in actor.state_dict().items() if not k.startswith("lm_head")}
    state["score.weight"] = torch.zeros(1, cfg.arch.hidden)
    model.load_state_dict(state, strict=True)
    return model


def initial_checkpoints(root: Path, cfgs: dict[str, ModelConfig], data: list[Prompt], tok: CharTokenizer,
                        warm: WarmStart, seed: int, max_new: int = 16) -> dict[str, float]:
    """Write ``root/<model>`` for every model in ``cfgs``; returns the warm-start losses and the actor's
    steps (``max_new``: the response length the target accuracy is measured at)."""
    torch.manual_seed(seed)
    actor = build_model(cfgs["actor"], seed=seed)
    loss, steps = sft(actor, data, tok, warm.actor_steps, warm.batch, warm.lr, seed, warm.label_smoothing,
                      warm.target_accuracy, max_new)
    out = {"warmstart/actor_loss": loss, "warmstart/actor_steps": float(steps)}
    files = tok.tokenizer_files()  # every initial checkpoint loads with AutoTokenizer, as step_<N>'s do
    save_checkpoint(root / "actor", cfgs["actor"], actor.state_dict(), tokenizer=files)
    if "reference" in cfgs:
        save_checkpoint(root / "reference", cfgs["reference"], actor.state_dict(), tokenizer=files)
    if "critic" in cfgs:
        save_checkpoint(root / "critic", cfgs["critic"], value_model_from(actor, cfgs["actor"]).state_dict(),
                        tokenizer=files)
    if "reward" in cfgs:
        rm = value_model_from(actor, cfgs["actor"])
        with torch.no_grad():
            rm.score.weight.normal_(0, 0.02, generator=torch.Generator().manual_seed(seed + 1))
        out["warmstart/reward_loss"] = train_verifier(rm, data, tok, warm.reward_steps, warm.batch, warm.lr,
                                                      seed + 1)
        save_checkpoint(root / "reward", cfgs["reward"], rm.state_dict(), tokenizer=files)
    return out


def pretrained_checkpoints(root: Path, cfgs: dict[str, ModelConfig], paths: dict[str, str]) -> None:
    """``root/critic`` for a critic whose HF directory holds a causal LM: its decoder weights and a zero
    ``score`` head (verl initialises the critic from the actor's weights with a new value head). Other
    models need no copy; ``initial_sources`` points at their directories."""
    root.mkdir(parents=True, exist_ok=True)
    if "critic" not in cfgs or read_config(paths["critic"]).value_head:
        return
    cfg = cfgs["critic"]
    boxes = rank_tensors(cfg.arch, ParallelDims(), 0, value_head=True)
    state = load_boxes(paths["critic"], {k: box for k, box in boxes.items() if k != "score.weight"})
    state["score.weight"] = torch.zeros(1, cfg.arch.hidden)
    save_checkpoint(root / "critic", cfg, state, source=paths["critic"])


def initial_sources(root: Path, models: tuple[str, ...], paths: dict[str, str]) -> dict[str, Path]:
    """Where each model's initial weights are: ``root/<model>`` when written there (warm-start, or a
    critic's new value head), else the model's HF directory."""
    return {m: root / m if (root / m / "config.json").exists() or m not in paths else Path(paths[m])
            for m in models}


SOURCES = "sources.json"
# files of an HF directory whose contents are fingerprinted (small); weight files by name and size only,
# since hashing a 7B model's 15 GB on every start and resume would cost minutes
_HASHED = ("config.json", "model.safetensors.index.json", *TOKENIZER_FILES)


def source_record(path: str | Path) -> dict[str, dict]:
    """What an HF directory holds: SHA-256 of its config, index and tokenizer files, size of each weight file."""
    root = Path(path)
    out = {}
    for f in sorted(root.iterdir()):
        if f.name in _HASHED and f.is_file():
            out[f.name] = {"sha256": hashlib.sha256(f.read_bytes()).hexdigest()}
        elif f.suffix == ".safetensors" and f.is_file():
            out[f.name] = {"bytes": f.stat().st_size}
    return out


def write_sources(root: Path, paths: dict[str, str]) -> Path:
    """``root/sources.json``: each pretrained model's directory and ``source_record`` (empty without any)."""
    root.mkdir(parents=True, exist_ok=True)
    record = {m: {"path": str(Path(p).resolve()), "files": source_record(p)} for m, p in sorted(paths.items())}
    (root / SOURCES).write_text(json.dumps({"models": record}, indent=1))
    return root / SOURCES


def check_sources(root: Path, paths: dict[str, str]) -> None:
    """Refuse, naming the model's key, a resume whose ``models.<name>.path`` directories are not the ones
    the run started from (another model, or the same directory with other files); a moved but identical
    directory is accepted. A run folder without ``sources.json`` started from the built-in warm-start."""
    file = root / SOURCES
    recorded = json.loads(file.read_text())["models"] if file.is_file() else {}
    for model in sorted(set(recorded) | set(paths)):
        where = f"models.{model}.path"
        if model not in paths:
            raise SpecError(where, f"the run started from {recorded[model]['path']} ({file}); give it again to resume")
        if model not in recorded:
            raise SpecError(where, f"the run started without a pretrained {model} ({file}); resume the job as it "
                                   "started, or start a new run folder")
        now, then = source_record(paths[model]), recorded[model]["files"]
        if now != then:
            changed = sorted(k for k in set(now) | set(then) if now.get(k) != then.get(k))
            raise SpecError(where, f"{paths[model]} is not the directory the run started from "
                                   f"({recorded[model]['path']}): {', '.join(changed)} differ; resume with the "
                                   "same initial weights (the reference reloads from there)")
