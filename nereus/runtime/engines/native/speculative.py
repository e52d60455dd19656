"""Speculative decoding with n-gram drafts for the continuous-batching engine (``decode_engine``).

Drafts cost no model: the last ``n`` tokens of a sequence (``prompt_lookup_max`` down to
``prompt_lookup_min``) are looked up in text it has at hand, and the tokens that followed the latest match
are proposed — prompt-lookup decoding (Saxena 2023, https://github.com/apoorvumang/prompt-lookup-decoding),
vLLM's ``speculative_config={"method": "ngram", ...}``. The text searched is the sequence's own prompt and
response, then the responses of the other sequences with the same prompt in the engine (a GRPO group's
earlier or concurrent answers: suffix-style drafts from sibling responses, as in SuffixDecoding, Oliaro et
al. 2024, https://arxiv.org/abs/2411.04975).

One forward verifies ``k`` drafts: the last sampled token and the ``k`` drafts go in as one chunk, and the
logits at its ``k + 1`` positions give the target distribution p_i before each draft and after the last.
The rule (Leviathan et al. 2023, https://arxiv.org/abs/2211.17192, algorithm 1; Chen et al. 2023,
https://arxiv.org/abs/2302.01318, algorithm 2) with a point-mass draft q = δ(d_i): accept d_i with
probability min(1, p_i(d_i)/q(d_i)) = p_i(d_i); at the first rejection draw from the residual
norm(max(0, p_i − q)) — p_i with d_i removed — and stop; when all ``k`` are accepted draw one more token
from p_{k+1}. Every emitted token then has exactly the target distribution:
P(d_i) = p_i(d_i) and P(x ≠ d_i) = (1 − p_i(d_i)) · p_i(x) / (1 − p_i(d_i)) = p_i(x). Under greedy decoding
the rule is "accept while the draft is the argmax, then emit the argmax", so the tokens equal plain
decoding's. Sampled tokens equal plain decoding's in distribution, not draw for draw (other uniforms).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from nereus.runtime.engines.sampling import SamplingParams, target_probs
from nereus.runtime.model.decoder import logprobs_from_logits
from nereus.spec.levers import Speculation


def propose(context: Seq[int], sources: Seq[Seq[int]], spec: Speculation, limit: int) -> list[int]:
    """Up to ``min(limit, draft_tokens)`` draft tokens to follow ``context``: for the longest
    n-gram suffix of ``context`` (``prompt_lookup_max`` .. ``prompt_lookup_min``) found in the context
    itself (before its end) or in one of ``sources``, the tokens after its latest occurrence."""
    return propose_text(as_text(context), [as_text(s) for s in sources], spec, limit)


def as_text(tokens: Seq[int]) -> str:
    """Token ids as a string of code points (one per token), so that n-gram lookups run as ``str.rfind``."""
    return "".join(map(chr, tokens))


def propose_text(context: str, sources: Seq[str], spec: Speculation, limit: int) -> list[int]:
    """``propose`` on token strings (``as_text``): the latest occurrence that ends before a text's last
    token, so at least one token follows it."""
    k = min(limit, spec.draft_tokens)
    if k < 1:
        return []
    for n in range(min(spec.prompt_lookup_max, len(context) - 1), spec.prompt_lookup_min - 1, -1):
        suffix = context[-n:]
        for text in (context, *sources):
            found = text.rfind(suffix, 0, len(text) - 1)
            if found >= 0:
                return [ord(c) for c in text[found + n: found + n + k]]
    return []


def verify(logits: torch.Tensor, drafts: list[int], params: SamplingParams,
           gen: torch.Generator | None) -> tuple[list[int], list[float]]:
    """Emitted tokens (1 .. k + 1) and their log-probs under the unscaled model from the full-vocabulary
    ``logits`` [k + 1, V] at the chunk's positions (the module docstring's rule)."""
    out: list[int] = []
    for i, draft in enumerate(drafts):
        row = logits[i: i + 1]
        if params.temperature <= 0:
            best = int(row.argmax(dim=-1))
            out.append(best)
            if best != draft:
                break
            continue
        p = target_probs(row, params)[0].double()
        p = p / p.sum()
        u = float(torch.rand(1, generator=gen, dtype=torch.float64, device=row.device))
        if u < float(p[draft]):
            out.append(draft)
            continue
        residual = p.clone()
        residual[draft] = 0.0
        out.append(int(torch.multinomial(residual, 1, generator=gen)))
        break
    else:  # every draft accepted: one more token from the distribution after the last
        row = logits[len(drafts): len(drafts) + 1]
        if params.temperature <= 0:
            out.append(int(row.argmax(dim=-1)))
        else:
            out.append(int(torch.multinomial(target_probs(row, params)[0], 1, generator=gen)))
    toks = torch.tensor(out, device=logits.device)
    logps = logprobs_from_logits(logits[: len(out)], toks).double().tolist()
    return out, logps


def verify_rows(logits: torch.Tensor, drafts: torch.Tensor, params: SamplingParams,
                gen: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``verify`` for a batch of rows at once: ``logits`` [B, k + 1, V] (full vocabulary) at each row's
    chunk positions, ``drafts`` [B, k]. Returns the tokens each row emits [B, k + 1] (its accepted drafts,
    then the residual draw at its first rejection or the draw after its last draft; positions past that
    hold the drafts and are not emitted), how many it emits [B] (1 .. k + 1), and every position's
    log-prob under the unscaled model [B, k + 1]. The same rule as ``verify`` row by row, drawing its
    uniforms for the whole batch at once."""
    b, k = drafts.shape
    if params.temperature <= 0:
        best = logits.argmax(dim=-1)  # [B, k + 1]
        hit = best[:, :k] == drafts
        accepted = hit.long().cumprod(dim=1).sum(dim=1)
        out = torch.cat([drafts, best[:, k:]], dim=1)
        out[torch.arange(b), accepted] = best[torch.arange(b), accepted]
    else:
        p = target_probs(logits.reshape(b * (k + 1), -1), params).double().reshape(b, k + 1, -1)
        p = p / p.sum(dim=-1, keepdim=True)
        u = torch.rand(b, k, generator=gen, dtype=torch.float64, device=logits.device)
        hit = u < p[:, :k].gather(-1, drafts[..., None])[..., 0]
        accepted = hit.long().cumprod(dim=1).sum(dim=1)
        rows = torch.arange(b)
        last = p[rows, accepted].clone()  # the distribution the row's next token comes from
        rejected = accepted < k
        last[rows[rejected], drafts[rows[rejected], accepted[rejected]]] = 0.0  # the residual max(0, p - δ(d))
        out = torch.cat([drafts, drafts[:, :1]], dim=1).clone()
        out[rows, accepted] = torch.multinomial(last, 1, generator=gen)[:, 0]
    logps = logprobs_from_logits(logits, out.to(logits.device)).double()
    return out, accepted + 1, logps
