"""From prompts and generated responses to the tensors every later stage reads.

Sequences are packed prompt-first and right-padded: ``[prompt, response, pad...]``. A causal model never
attends from a real token to the padding after it and positions start at 0, so the training pass sees
exactly what generation saw (which left-pads prompts and masks the padding instead). ``index[b, j]`` is
the position in the [B, T−1] log-prob frame whose next token is response token j, ``mask[b, j]`` 1 for
the response's real tokens (EOS included, padding not).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from nereus.rl.core import agg_weights
from nereus.rl.data import PAD
from nereus.runtime.model.routes import routes_frame
from nereus.runtime.parallel.batch import TrainBatch


@dataclass
class Rollout:
    tokens: torch.Tensor  # [B, T] long
    index: torch.Tensor  # [B, R] long
    mask: torch.Tensor  # [B, R] float
    gen_logp: torch.Tensor  # [B, R] log-probs recorded while generating
    prompt_len: torch.Tensor  # [B]
    response_len: torch.Tensor  # [B]
    finished: torch.Tensor  # [B] bool: ended with EOS
    # [B, T, sparse layers, k] int16: the experts generation routed each position to (router replay,
    # ``runtime.model.routes``); None: not recorded (a dense model, replay off, an engine that does not record)
    routes: torch.Tensor | None = None

    @property
    def lengths(self) -> torch.Tensor:
        """Each sequence's real tokens, prompt plus response (``tokens`` is padded past them)."""
        return self.prompt_len + self.response_len

    @property
    def last(self) -> torch.Tensor:
        """Position of each sequence's last token in [B, T] (the reward model's score position)."""
        return self.prompt_len + self.response_len - 1

    def response_frame(self, per_position: torch.Tensor) -> torch.Tensor:
        """[B, R] of a per-position tensor ([B, T−1] log-probs or [B, T] values) at ``index``."""
        return per_position.gather(1, self.index) * self.mask


def pack(prompts: list[list[int]], responses: list[list[int]], logps: list[list[float]] | None,
         eos: int | tuple[int, ...], fixed: tuple[int, int] | None = None,
         routes: list[torch.Tensor] | None = None) -> Rollout:
    """Pack prompt/response pairs (``logps`` per response token, or None) into a ``Rollout``; a response
    ending with ``eos`` (an id, or any of several) is finished. ``fixed``:
    (prompt length, response length) bounds to pad to instead of the longest present
    (``run.rollout.pad_to_max``: rows packed before the others finish have the same width). ``routes``: each
    row's experts per position fed (router replay), laid in the frame of the packed tokens."""
    b = len(prompts)
    if fixed is not None:
        width, total = max(1, fixed[1]), fixed[0] + max(1, fixed[1])
    else:
        width = max(1, max(len(r) for r in responses))
        total = max(len(p) + max(1, len(r)) for p, r in zip(prompts, responses, strict=True))
    tokens = torch.full((b, total), PAD, dtype=torch.long)
    index = torch.zeros(b, width, dtype=torch.long)
    mask = torch.zeros(b, width)
    gen_logp = torch.zeros(b, width)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        seq = list(p) + list(r)
        tokens[i, : len(seq)] = torch.tensor(seq)
        n = len(r)
        index[i] = (torch.arange(width) + len(p) - 1).clamp(max=total - 2)
        mask[i, :n] = 1.0
        if logps is not None and n:
            gen_logp[i, :n] = torch.tensor(logps[i][:n])
    plen = torch.tensor([len(p) for p in prompts])
    rlen = torch.tensor([len(r) for r in responses])
    stops = {eos} if isinstance(eos, int) else set(eos)
    finished = torch.tensor([bool(r) and r[-1] in stops for r in responses])
    frame = None if routes is None else routes_frame(routes, total)
    return Rollout(tokens, index, mask, gen_logp, plen, rlen, finished, frame)


def repeat_prompts(prompts: list, n: int) -> list:
    """Each drawn prompt ``n`` times in a row: the step's rows, whose GRPO groups are ``draw_uids``."""
    return [p for p in prompts for _ in range(n)]


def draw_uids(rows: int, n: int) -> torch.Tensor:
    """The uid of each row of ``repeat_prompts``: the index of the draw it answers. The responses to one
    draw form one GRPO group, and a prompt drawn twice in a step is two groups (verl gives every drawn
    prompt a fresh uid before repeating it rollout.n times, verl/trainer/ppo/ray_trainer.py)."""
    return torch.arange(rows) // n


def mini_batches(batch: TrainBatch, count: int, gen: torch.Generator, loss_agg_mode: str = "token-mean",
                 horizon: int | None = None, pg_agg_mode: str | None = None) -> list[TrainBatch]:
    """``count`` shuffled mini-batches of equal size, each with the ``weight`` per token that makes the
    losses the ``loss_agg_mode`` aggregate over the mini-batch (``rl.core.agg_weights``; ``horizon``: the
    maximum response length of seq-mean-token-sum-norm), see ``rl.losses.actor_loss``; with ``pg_agg_mode``
    (a policy loss that fixes its own aggregation, ``PolicyLoss.aggregation``) also ``pg_weight``."""
    n = len(batch)
    order = torch.randperm(n, generator=gen)
    size = n // count
    out = []
    for k in range(count):
        mb = batch.select(order[k * size: (k + 1) * size])
        pg = None if pg_agg_mode in (None, loss_agg_mode) else agg_weights(mb.mask, pg_agg_mode, horizon)
        out.append(replace(mb, weight=agg_weights(mb.mask, loss_agg_mode, horizon), pg_weight=pg))
    return out
