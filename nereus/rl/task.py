"""The built-in verifiable task and rule-based rewards.

``reverse``: the prompt is ``rev:`` and a string of 1–``max_digits`` digits followed by ``=``; the answer is
the digits reversed, then EOS. The answer length grows with the prompt, so a maximum response length
below ``max_digits + 1`` truncates the longest answers (scored 0) — the response-length curriculum raises
the limit in stages, and the responses of the step grow with it. Rewards are verifiable by rule (exact
match), as in math/code RL; ``nereus.rl.rewards`` routes rows of ``TASK_SOURCE`` to ``exact_match`` and
names both rules for ``run.rule_reward``.
"""

from __future__ import annotations

import random

TASK_SOURCE = "nereus/reverse"


def reverse_rows(count: int, seed: int, max_digits: int, exclude: set[str] | None = None) -> list[dict]:
    """``count`` distinct prompts in verl's row format; prompts in ``exclude`` are skipped (held-out sets)."""
    rng = random.Random(seed)
    seen = set(exclude or ())
    rows = []
    while len(rows) < count:
        n = rng.randint(1, max_digits)
        digits = "".join(rng.choice("0123456789") for _ in range(n))
        if digits in seen:
            continue
        seen.add(digits)
        rows.append({"data_source": TASK_SOURCE,
                     "prompt": [{"role": "user", "content": f"rev:{digits}="}],
                     "ability": "string",
                     "reward_model": {"style": "rule", "ground_truth": digits[::-1]},
                     "extra_info": {"index": len(rows)}})
    return rows


def split_rows(rows: list[dict], held_out: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(training, held-out) rows: ``held_out`` of ``rows`` drawn at random, so both follow one distribution.
    Drawing the held-out prompts first instead (and the training ones without them) hands the held-out set
    most of the few short strings (all ten of one digit), which training then never sees."""
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    held = set(order[:held_out])
    return [r for i, r in enumerate(rows) if i not in held], [rows[i] for i in sorted(held)]


def exact_match(response: str, ground_truth: str, finished: bool) -> float:
    """1 when the decoded response equals the ground truth and ended with EOS (a truncated answer fails)."""
    return 1.0 if finished and response == ground_truth else 0.0


def digit_match(response: str, ground_truth: str, finished: bool) -> float:
    """Partial credit: the fraction of answer positions right, over the longer of the two strings (so extra
    or missing characters cost), 0 for a truncated response. Exact answers score 1. A denser signal than
    exact match for a small policy; accuracy is still measured by exact match."""
    if not finished:
        return 0.0
    right = sum(a == b for a, b in zip(response, ground_truth, strict=False))
    return right / max(len(response), len(ground_truth), 1)

