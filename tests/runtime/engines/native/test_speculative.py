"""Speculative decoding with n-gram drafts in the continuous-batching engine: drafts from the sequence's
own text and its siblings' responses; greedy tokens equal plain decoding's; sampled tokens keep the
target distribution (the rejection rule alone on fixed logits, and the whole engine on a tiny model,
both against exact probabilities with fixed seeds: deterministic, no timing); switched by live batch."""

from __future__ import annotations

import math

import pytest
import torch

from nereus.runtime.cluster.launch import run_world
from nereus.runtime.engines.native.decode_engine import DecodeEngine
from nereus.runtime.engines.native.speculative import propose, verify, verify_rows
from nereus.runtime.engines.sampling import SamplingParams, target_probs
from nereus.runtime.model.decoder import build_model
from nereus.spec.levers import Speculation
from nereus.spec.rollout import UNBOUNDED_LIVE
from tests.runtime.decode_helpers import CFG, alone, answers, assert_same, layout, prompts, shard

pytestmark = pytest.mark.rayless  # processes but no Ray: may run beside the Ray tests


def chi2_limit(df: int, z: float = 3.719) -> float:
    """The chi-square quantile at normal score ``z`` (3.719: 1 − 1e-4) by Wilson & Hilferty (1931)."""
    h = 2 / (9 * df)
    return df * (1 - h + z * math.sqrt(h)) ** 3


def chi2(counts: dict, probs: dict, n: int) -> tuple[float, int]:
    """Pearson's statistic over cells expected ≥ 5 times, the rest pooled into one cell; (stat, df)."""
    big = [c for c, p in probs.items() if p * n >= 5]
    stat = sum((counts.get(c, 0) - probs[c] * n) ** 2 / (probs[c] * n) for c in big)
    rest_p = 1 - sum(probs[c] for c in big)
    rest_n = n - sum(counts.get(c, 0) for c in big)
    if rest_p * n >= 1:
        stat += (rest_n - rest_p * n) ** 2 / (rest_p * n)
    return stat, len(big) - (rest_p * n < 1)


def test_propose_takes_the_longest_suffix_match_latest_first():
    spec = Speculation("ngram", 3, UNBOUNDED_LIVE, prompt_lookup_max=3, prompt_lookup_min=1)
    assert propose([1, 2, 3, 9, 1, 2, 3, 4, 1, 2, 3], [], spec, 8) == [4, 1, 2]  # latest match of [1, 2, 3]
    assert propose([5, 6, 7], [[0, 6, 7, 8, 9]], spec, 8) == [8, 9]  # found in a sibling's response
    assert propose([5, 6, 7], [[0, 6, 7, 8, 9]], spec, 1) == [8]  # the length limit
    assert propose([5, 6, 7], [[1, 2]], spec, 8) == []  # nothing matches
    two = Speculation("ngram", 4, UNBOUNDED_LIVE, prompt_lookup_min=2)
    assert propose([4, 4], [], two, 8) == []  # a 2-gram needs 3 tokens
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        Speculation("ngram", 4, UNBOUNDED_LIVE, prompt_lookup_min=4, prompt_lookup_max=3)


def test_greedy_verification_accepts_while_the_draft_is_the_argmax():
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 0.0, 4.0], [3.0, 0.0, 0.0]])
    greedy = SamplingParams(temperature=0.0)
    assert verify(logits, [1, 2], greedy, None)[0] == [1, 2, 0]  # both accepted, one more
    assert verify(logits, [1, 0], greedy, None)[0] == [1, 2]  # second rejected: the argmax instead
    toks, lps = verify(logits, [2, 2], greedy, None)
    assert toks == [1] and lps == pytest.approx([float(torch.log_softmax(logits[0], -1)[1])])


@pytest.mark.slow
@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_rejection_rule_keeps_the_target_distribution(top_p):
    """10,000 draws on fixed logits, drafts 0 then 1: the first token has p_1's distribution, the second
    (given the first draft was accepted) p_2's; a rule that kept every draft would be far off."""
    logits = torch.tensor([[1.0, 0.2, 2.0, -1.0, 0.5], [0.3, 1.5, -0.5, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    params = SamplingParams(temperature=0.8, top_p=top_p)
    p = [target_probs(logits[i: i + 1], params)[0].double() for i in range(2)]
    p = [q / q.sum() for q in p]
    gen = torch.Generator().manual_seed(3)
    n, first, second = 10_000, {}, {}
    for _ in range(n):
        toks, _ = verify(logits, [0, 1], params, gen)
        first[toks[0]] = first.get(toks[0], 0) + 1
        if toks[0] == 0:
            second[toks[1]] = second.get(toks[1], 0) + 1
    for counts, q in ((first, p[0]), (second, p[1])):
        probs = {t: float(q[t]) for t in range(5) if q[t] > 0}
        assert set(counts) <= set(probs)  # nothing outside top-p
        stat, df = chi2(counts, probs, sum(counts.values()))
        assert stat < chi2_limit(df), (counts, probs)
    assert first[0] / n == pytest.approx(float(p[0][0]), abs=0.03)
    assert first[0] / n < 0.5  # keeping every draft would emit token 0 every time


def test_batched_greedy_verification_equals_the_row_by_row_rule():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(50, 4, 6, generator=g)
    drafts = torch.randint(0, 6, (50, 3), generator=g)
    drafts[::2] = logits[::2, :3].argmax(-1)  # half the rows draft the argmax: accepted through
    drafts[::4, 1] = (drafts[::4, 1] + 1) % 6  # a quarter of them rejected at the second draft
    greedy = SamplingParams(temperature=0.0)
    out, counts, logps = verify_rows(logits, drafts, greedy, None)
    for i in range(50):
        toks, lps = verify(logits[i], drafts[i].tolist(), greedy, None)
        assert out[i, : counts[i]].tolist() == toks and logps[i, : counts[i]].tolist() == pytest.approx(lps)
    assert set(counts.tolist()) == {1, 2, 4}


@pytest.mark.slow
@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_batched_rejection_rule_keeps_the_target_distribution(top_p):
    """10,000 rows verified at once on the same fixed logits, drafts 0 then 1: as the row-by-row rule."""
    logits = torch.tensor([[1.0, 0.2, 2.0, -1.0, 0.5], [0.3, 1.5, -0.5, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    params = SamplingParams(temperature=0.8, top_p=top_p)
    p = [target_probs(logits[i: i + 1], params)[0].double() for i in range(2)]
    p = [q / q.sum() for q in p]
    n = 10_000
    out, counts, _ = verify_rows(logits.expand(n, 3, 5), torch.tensor([[0, 1]]).expand(n, 2), params,
                                 torch.Generator().manual_seed(3))
    first = dict(zip(*torch.unique(out[:, 0], return_counts=True), strict=True))
    second = dict(zip(*torch.unique(out[counts > 1][out[counts > 1][:, 0] == 0][:, 1], return_counts=True),
                      strict=True))
    for counted, q in ((first, p[0]), (second, p[1])):
        counted = {int(t): int(c) for t, c in counted.items()}
        probs = {t: float(q[t]) for t in range(5) if q[t] > 0}
        assert set(counted) <= set(probs)
        stat, df = chi2(counted, probs, sum(counted.values()))
        assert stat < chi2_limit(df), (counted, probs)
    assert int((out[:, 0] == 0).sum()) / n < 0.5  # keeping every draft would emit token 0 every time


def _greedy(rank: int, world: int) -> None:
    _, sm = shard(layout())
    base = prompts()
    ps = [p * 3 for p in base] + [base[0] * 3]  # repeated text: the prompt holds the drafts; one sibling
    sp = SamplingParams(max_new_tokens=12, eos_token_id=None)
    want = alone(sm, ps, sp)
    engine = DecodeEngine(sm, sp, slots=4)
    engine.speculation = Speculation("ngram", 3, UNBOUNDED_LIVE, prompt_lookup_max=3)
    for i, p in enumerate(ps):
        engine.submit(i, p)
    engine.run()
    assert_same(answers(engine), want, exact=False)  # k + 1 positions per forward: log-probs to rounding
    assert engine.accepted_tokens > 0 and engine.draft_tokens >= engine.accepted_tokens
    plain = DecodeEngine(sm, sp, slots=4)
    for i, p in enumerate(ps):
        plain.submit(i, p)
    plain.run()
    assert engine.iterations < plain.iterations  # accepted drafts save iterations
    # switched by live batch: above live_at_most nothing is drafted
    off = DecodeEngine(sm, sp, slots=4)
    off.speculation = Speculation("ngram", 4, len(ps) - 1)
    for i, p in enumerate(ps):
        off.submit(i, p)
    for _ in range(2):
        off.step()
    assert off.draft_tokens == 0 and len(off.unfinished()) == len(ps)


def test_greedy_speculation_equals_plain_decoding_and_saves_iterations():
    run_world(_greedy, 1, timeout_s=120)


N_SAMPLED = 1200


def _exact_pairs(sp: SamplingParams, prompt: list[int]) -> dict[tuple[int, int], float]:
    """P(t1, t2) of the tiny model under ``sp``'s temperature and top-p, by enumeration (float64)."""
    model = build_model(CFG, seed=1).double().eval()
    out = {}
    with torch.no_grad():
        p1 = target_probs(model(torch.tensor([prompt]))[0, -1:], sp)[0]
        p1 = p1 / p1.sum()
        for t1 in torch.nonzero(p1)[:, 0].tolist():
            p2 = target_probs(model(torch.tensor([prompt + [t1]]))[0, -1:], sp)[0]
            p2 = p2 / p2.sum()
            for t2 in torch.nonzero(p2)[:, 0].tolist():
                out[(t1, t2)] = float(p1[t1] * p2[t2])
    return out


def _sampled(rank: int, world: int) -> None:
    _, sm = shard(layout())
    prompt = prompts()[1] * 2
    sp = SamplingParams(max_new_tokens=3, temperature=0.15, top_p=0.95, seed=21)
    exact = _exact_pairs(sp, prompt)
    engine = DecodeEngine(sm, sp, slots=16)  # a group of siblings at a time: their answers are the drafts
    engine.speculation = Speculation("ngram", 2, UNBOUNDED_LIVE, prompt_lookup_max=2)
    for i in range(N_SAMPLED):
        engine.submit(i, prompt)
    engine.run()
    counts: dict = {}
    for s in engine.finished.values():
        counts[tuple(s.tokens[:2])] = counts.get(tuple(s.tokens[:2]), 0) + 1
    assert engine.accepted_tokens > N_SAMPLED // 4  # the rule was exercised, not just plain sampling
    assert set(counts) <= set(exact)
    stat, df = chi2(counts, exact, N_SAMPLED)
    assert stat < chi2_limit(df), (stat, df)
    top = max(exact, key=exact.get)
    assert counts[top] / N_SAMPLED == pytest.approx(exact[top], abs=0.05)


@pytest.mark.slow
def test_sampled_speculation_keeps_the_models_distribution():
    """1,200 sequences of one prompt (GRPO-like siblings) through the speculating engine: the first two
    tokens' joint distribution passes a chi-square test against the model's exact probabilities."""
    run_world(_sampled, 1, timeout_s=300)
