"""``run.packing``: packed sequences in token-budget micro-batches for inference and training (the runtime's
``parallel.packing``), as verl's ``use_remove_padding``, ``use_dynamic_bsz`` and ``*_max_token_len_per_gpu``.

Packing changes time and memory, not results: rows are cut to their real length and laid end to end, so no
compute runs on padding, and a micro-batch holds at most a budget of tokens instead of a number of rows.
The budget of each model-stage is written into its layout (``Layout.max_token_len``), the one field the
runtime reads. With ``dynamic_bsz`` the budgets are verl's keys (verl's defaults when unset); without it,
a packed micro-batch holds at most the tokens of the padded one it replaces (micro-batch size × the
longest sequence), so memory stays within what the layout was planned for.

The micro-batch plan itself is here too, torch-free, so that the runtime (``runtime.parallel.packing``) runs
and the cost model (``cost.stage_tokens``) prices the same micro-batches: ``replica_shares`` deals a batch's
rows to the DP replicas by tokens, ``token_budget_groups`` groups a replica's rows under the budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from nereus.spec.fields import MAX_TOKENS, Fields

# verl's defaults (verl/trainer/config: the actor's ppo_max_token_len_per_gpu 16384, which the rollout's and
# reference's log_prob_max_token_len_per_gpu follow; the critic's ppo_max_token_len_per_gpu 32768, which its
# forward_max_token_len_per_gpu follows)
ACTOR_DEFAULT, CRITIC_DEFAULT = 16384, 32768
CRITIC_MODELS = ("critic", "reward")


@dataclass(frozen=True)
class PackingSpec:
    """``run.packing``; a budget left None takes the default of ``token_budget``."""

    enable: bool = False  # verl's use_remove_padding
    dynamic_bsz: bool = False  # verl's use_dynamic_bsz: micro-batches by the budgets below
    max_token_len_per_gpu: int | None = None  # actor training (verl's actor ppo_max_token_len_per_gpu)
    log_prob_max_token_len_per_gpu: int | None = None  # actor and reference inference
    critic_max_token_len_per_gpu: int | None = None  # critic training (verl's critic.ppo_max_token_len_per_gpu)
    forward_max_token_len_per_gpu: int | None = None  # critic and reward-model inference

    @property
    def on(self) -> bool:
        """Whether the runtime packs (token-budget micro-batches are always packed)."""
        return self.enable or self.dynamic_bsz


def read_packing(f: Fields) -> PackingSpec:
    """``run.packing``: ``enable``, ``dynamic_bsz`` and the four token budgets (each 1 to ``MAX_TOKENS``)."""
    budgets = {k: f.get(k, int, None, minimum=1, maximum=MAX_TOKENS) for k in (
        "max_token_len_per_gpu", "log_prob_max_token_len_per_gpu", "critic_max_token_len_per_gpu",
        "forward_max_token_len_per_gpu")}
    spec = PackingSpec(enable=f.get("enable", bool, False), dynamic_bsz=f.get("dynamic_bsz", bool, False), **budgets)
    f.finish()
    return spec


def token_budget(spec: PackingSpec, model: str, stage: str, micro_batch_size: int, max_seq: int) -> int:
    """The ``Layout.max_token_len`` of ``model``'s ``stage``: 0 (padded) when not packing or for generation;
    with ``dynamic_bsz`` the stage's budget (an inference budget left unset follows the model's training
    one, which defaults to verl's); else the padded micro-batch's
    tokens, ``micro_batch_size`` × ``max_seq`` (the longest prompt plus response)."""
    if not spec.on or stage not in ("inference", "training"):
        return 0
    if not spec.dynamic_bsz:
        return micro_batch_size * max_seq
    if model in CRITIC_MODELS:  # the forward budget follows the training one, as in verl's critic config
        train = spec.critic_max_token_len_per_gpu or CRITIC_DEFAULT
        return train if stage == "training" else spec.forward_max_token_len_per_gpu or train
    train = spec.max_token_len_per_gpu or ACTOR_DEFAULT  # the rollout's and reference's log-prob budgets follow it
    return train if stage == "training" else spec.log_prob_max_token_len_per_gpu or train


def replica_shares(lengths: Sequence[int], dp: int) -> list[list[int]]:
    """Row indices per data-parallel replica: longest first, each to the replica with the fewest tokens so
    far (the lowest index on a tie), so the replicas' token counts differ by at most one row's length. Each
    replica's rows stay in batch order. Needs at least ``dp`` rows (every replica runs a micro-batch)."""
    if len(lengths) < dp:
        raise ValueError(f"{len(lengths)} sequences cannot give each of dp={dp} replicas one")
    load, out = [0] * dp, [[] for _ in range(dp)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        d = min(range(dp), key=lambda d: (load[d], d))
        load[d] += lengths[i]
        out[d].append(i)
    return [sorted(rows) for rows in out]


def replica_order(lengths: Sequence[int], dp: int) -> list[int]:
    """The batch rows in the order a packed inference's replicas answer them: each replica's share
    (``replica_shares``, in batch order), replicas in DP order. The driver inverts it."""
    return [i for share in replica_shares(lengths, dp) for i in share]


def token_budget_groups(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into micro-batches of at most ``budget`` tokens (a longer row alone):
    as few micro-batches as first-fit decreasing needs, then the rows dealt longest first to the emptiest
    micro-batch they fit in, so the micro-batches are balanced rather than full-then-empty."""
    if budget < 1:
        raise ValueError(f"token budget {budget} must be at least 1")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    return _deal(lengths, order, _first_fit_count(lengths, order, budget), budget)


def _first_fit_count(lengths: Sequence[int], order: list[int], budget: int) -> int:
    bins: list[int] = []
    for i in order:
        n = lengths[i]
        room = next((b for b, used in enumerate(bins) if used + n <= budget), None)
        if room is None:
            bins.append(n)
        else:
            bins[room] += n
    return len(bins)


def _deal(lengths: Sequence[int], order: list[int], count: int, budget: int) -> list[list[int]]:
    load, out = [0] * count, [[] for _ in range(count)]
    for i in order:
        n = lengths[i]
        fits = [b for b in range(len(load)) if load[b] + n <= budget or not out[b]]
        if not fits:  # balancing can strand a row the first-fit count had room for: it opens a micro-batch
            load.append(0)
            out.append([])
            fits = [len(load) - 1]
        b = min(fits, key=lambda b: (load[b], b))
        load[b] += n
        out[b].append(i)
    return [g for g in out if g]
