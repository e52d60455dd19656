"""The fixed batch's tail levers (``runtime.engines.native.fixed_decode``): speculative decoding in one batched
forward whose rows accept different numbers of drafts — greedy tokens equal plain decoding's under every
kind of layout, sampled tokens keep the model's distribution (chi-square against exact probabilities,
fixed seeds) — and the stop rule of
tail batching and partial rollout (the first whole groups kept, the rest deferred or carried, resumed
rows continuing where they stopped), each against the plain fixed batch."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch
import torch.distributed as dist

from nereus.runtime.cluster.launch import run_world
from nereus.runtime.engines.answers import Carried
from nereus.runtime.engines.native.fixed_decode import FixedDecode
from nereus.runtime.engines.sampling import SamplingParams
from nereus.spec.levers import Speculation
from nereus.spec.rollout import UNBOUNDED_LIVE
from tests.runtime.decode_helpers import layout, prompts, shard
from tests.runtime.engines.native.test_speculative import N_SAMPLED, _exact_pairs, chi2, chi2_limit

pytestmark = [pytest.mark.slow, pytest.mark.rayless]  # no Ray: may run beside the Ray tests
SPEC = Speculation("ngram", 3, UNBOUNDED_LIVE, prompt_lookup_max=3)


def repetitive() -> list[list[int]]:
    """Prompts whose text repeats (the drafts' source), two rows of the first: a sibling."""
    base = prompts()
    return [p * 3 for p in base] + [base[0] * 3, base[1] * 3]


def decode(sm, ps: list[list[int]], sp: SamplingParams, drafter=None) -> FixedDecode:
    return FixedDecode(sm, ps, sp, drafter).run()


@dataclass
class FlawedOracle:
    """Drafts the plain answer's next tokens, each wrong (its token + 1) where a seeded coin says so: rows
    accept different numbers of drafts, and their caches grow apart."""

    answers: list[list[int]]
    wrong: float = 0.3
    calls: int = 0

    def __call__(self, prompts, rows, finished, k):
        g = torch.Generator().manual_seed(self.calls)
        self.calls += 1
        out = []
        for answer, row in zip(self.answers, rows, strict=True):
            d = (answer[len(row):] + [0] * k)[:k]
            out.append([t + 1 if float(torch.rand(1, generator=g)) < self.wrong else t for t in d])
        return out


def _greedy(rank: int, world: int) -> None:
    sp = SamplingParams(max_new_tokens=14, eos_token_id=None)
    for lay in (layout(), layout(tp=2), layout(pp=2), layout(dp=2), layout(tp=2, pp=2)):
        if lay.world > world:
            continue
        groups, sm = shard(lay)
        if sm is not None:
            plain = decode(sm, repetitive(), sp)
            fast = decode(sm, repetitive(), replace(sp, speculation=SPEC))
            assert fast.rows == plain.rows, lay.short()
            assert fast.accepted_tokens > 0 and fast.speculative_iterations > 0, lay.short()
            assert fast.iterations < plain.iterations, lay.short()  # accepted drafts save forwards
            if groups.last_stage:  # k + 1 positions per forward: log-probs equal to rounding
                for a, b in zip(fast.row_logps, plain.row_logps, strict=True):
                    assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-6, rtol=0), lay.short()
            oracle = FlawedOracle(plain.rows)
            cut = decode(sm, repetitive(), replace(sp, speculation=SPEC), oracle)
            assert cut.rows == plain.rows and 0 < cut.accepted_tokens < cut.draft_tokens, lay.short()
            off = decode(sm, repetitive(), replace(sp, speculation=replace(SPEC, live_at_most=1)))
            assert off.speculative_iterations == 0 and off.rows == plain.rows  # switched by the live batch
        dist.barrier()
        groups.destroy()


def test_greedy_speculation_equals_plain_decoding_under_every_kind_of_layout():
    run_world(_greedy, 4, timeout_s=180)


def _sampled(rank: int, world: int) -> None:
    _, sm = shard(layout())
    prompt = prompts()[1] * 2
    sp = SamplingParams(max_new_tokens=3, temperature=0.15, top_p=0.95,
                        speculation=replace(SPEC, draft_tokens=2))
    exact = _exact_pairs(sp, prompt)
    counts: dict = {}
    accepted = 0
    rows = 40  # a GRPO-like group per call: the siblings' answers are drafts too
    for call in range(N_SAMPLED // rows):
        run = decode(sm, [prompt] * rows, replace(sp, seed=call))
        accepted += run.accepted_tokens
        for toks in run.rows:
            counts[tuple(toks[:2])] = counts.get(tuple(toks[:2]), 0) + 1
    assert accepted > N_SAMPLED // 4  # the rule was exercised, not just plain sampling
    assert set(counts) <= set(exact)
    stat, df = chi2(counts, exact, N_SAMPLED)
    assert stat < chi2_limit(df), (stat, df)


def test_sampled_speculation_keeps_the_models_distribution():
    """1,200 rows of one prompt in batches of 40: the first two tokens' joint distribution passes a
    chi-square test against the model's exact probabilities."""
    run_world(_sampled, 1, timeout_s=300)


def _groups(rank: int, world: int) -> None:
    _, sm = shard(layout())
    ps = [p for p in prompts(4) for _ in range(2)]  # 4 groups of 2 rows
    sp = SamplingParams(max_new_tokens=8, temperature=1.0, seed=4, eos_token_id=5)
    plain = decode(sm, ps, sp)
    by_len = sorted(range(4), key=lambda g: (max(len(plain.rows[2 * g]), len(plain.rows[2 * g + 1])), g))
    kept = decode(sm, ps, replace(sp, keep_groups=2, group_size=2)).answers()
    assert {i // 2 for i, a in enumerate(kept) if a is not None} == set(by_len[:2])
    for i, a in enumerate(kept):  # kept rows answer as the plain batch: the same draws up to the stop
        assert a is None or a == (plain.rows[i], plain.row_logps[i])
    carried = decode(sm, ps, replace(sp, keep_groups=2, group_size=2, carry_partial=True)).answers()
    for i, a in enumerate(carried):
        if isinstance(a, Carried):  # a prefix of what the row would have generated
            assert a.tokens == plain.rows[i][: len(a.tokens)] and a.done == (a.tokens == plain.rows[i])
    # a must-keep group is kept whatever its finish order: the slowest group, resumed rows
    must = decode(sm, ps, replace(sp, keep_groups=1, group_size=2, must_groups=1)).answers()
    assert must[0] is not None and must[1] is not None and all(a is None for a in must[2:])


def test_round_keeps_the_first_whole_groups_and_defers_or_carries_the_rest():
    run_world(_groups, 1, timeout_s=120)


def _resumed(rank: int, world: int) -> None:
    _, sm = shard(layout())
    ps = prompts(4)
    sp = SamplingParams(max_new_tokens=10, eos_token_id=None)
    plain = decode(sm, ps, sp).rows
    cut = [3, 0, 10, 6]  # tokens a previous step generated per row; row 2 had finished
    resumed = replace(sp, resumed=tuple(cut), resumed_done=frozenset({2}))
    got = decode(sm, [p + plain[i][:c] for i, (p, c) in enumerate(zip(ps, cut, strict=True))], resumed).rows
    assert got[2] == []  # a finished row generates nothing
    for i in (0, 1, 3):  # the others continue exactly where they stopped, up to the shared limit
        assert plain[i][: cut[i]] + got[i] == plain[i], i
    spec = decode(sm, [p + plain[i][:c] for i, (p, c) in enumerate(zip(ps, cut, strict=True))],
                  replace(resumed, speculation=SPEC)).rows
    assert spec == got  # per-row limits bound the drafts


def test_resumed_rows_continue_where_they_stopped():
    run_world(_resumed, 1, timeout_s=120)
