"""A built-in verifiable task with a long tail of response lengths: ``repeat``.

The prompt is ``rep:`` a digit ``x`` a count ``k`` and ``=`` (``rep:7x4=``); the answer is the digit
written ``k`` times (``7777``), then EOS. ``k`` is drawn per prompt from a heavy-tailed law,
P(k ≥ n) = 2 / (n + 1) for n ≥ 1 (a discrete Pareto of index 1, ``k = ⌊2/u⌋ − 1`` for u uniform on
(0, 1]), capped at ``max_repeat``: half of the answers have at most 3 digits, while one in 18 reaches the
cap of 36 — about 10× the median response length (answer plus EOS), the spread that leaves most workers
idle while one finishes a long response (the long tail of RL rollouts and the
idle "bubbles" it causes: Gao et al. 2025, "RollPacker", https://arxiv.org/abs/2509.21009, Sec. 1).

Rewards are the rule-based ones of ``rl.task`` (``exact_match``, ``digit_match``) on the decoded response
against ``reward_model.ground_truth``: the answer is checkable by rule. Rows are in verl's format, like
``rl.task.reverse_rows``, so they run as ``run.data.train``/``run.data.val`` files (``write_task``,
``python -m nereus.rl.longtail DIR``) with the built-in character tokenizer; the held-out prompts
(``held_out``) never appear in training.
"""

from __future__ import annotations

import argparse
import random
import statistics
from pathlib import Path

from nereus.rl.data import write_rows

TASK_SOURCE = "nereus/repeat"
MAX_REPEAT = 36


def repeat_count(rng: random.Random, max_repeat: int = MAX_REPEAT) -> int:
    """k with P(k ≥ n) = 2/(n+1), capped at ``max_repeat`` (inverse transform of u uniform on (0, 1])."""
    u = 1.0 - rng.random()
    return min(max_repeat, int(2.0 / u) - 1)


def held_out(digit: int, k: int) -> bool:
    """The held-out tenth of the prompt space: for each count one digit, so both splits keep the length
    law and every held-out prompt pairs a digit and a count the training rows show in other prompts."""
    return (digit + k) % 10 == 0


def repeat_rows(count: int, seed: int, max_repeat: int = MAX_REPEAT, split: str = "train") -> list[dict]:
    """``count`` rows in verl's format from ``split`` ("train": the prompts ``held_out`` leaves, "val": the
    held-out ones). Prompts repeat: the length law, not distinctness, is the point (there are only
    10·``max_repeat`` prompts)."""
    if max_repeat < 1:
        raise ValueError(f"max_repeat must be at least 1, got {max_repeat}")
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    rng = random.Random(seed)
    rows: list[dict] = []
    while len(rows) < count:
        k = repeat_count(rng, max_repeat)
        digit = rng.choice([d for d in range(10) if held_out(d, k) == (split == "val")])
        text = f"rep:{digit}x{k}="
        rows.append({"data_source": TASK_SOURCE,
                     "prompt": [{"role": "user", "content": text}],
                     "ability": "string",
                     "reward_model": {"style": "rule", "ground_truth": str(digit) * k},
                     "extra_info": {"index": len(rows), "repeat": k}})
    return rows


def response_lengths(rows: list[dict]) -> list[int]:
    """Tokens of each ground-truth response under the character tokenizer: the answer plus EOS."""
    return [len(r["reward_model"]["ground_truth"]) + 1 for r in rows]


def length_spread(rows: list[dict]) -> float:
    """Maximum over median response length."""
    lengths = response_lengths(rows)
    return max(lengths) / statistics.median(lengths)


def task_rows(train_size: int = 4000, val_size: int = 200, seed: int = 0,
              max_repeat: int = MAX_REPEAT) -> tuple[list[dict], list[dict]]:
    """Training and held-out rows (disjoint prompt sets, the same length law)."""
    return repeat_rows(train_size, seed, max_repeat), repeat_rows(val_size, seed + 10_000, max_repeat, "val")


def write_task(out: str | Path, train: list[dict], val: list[dict]) -> tuple[Path, Path]:
    """``repeat_train.parquet`` and ``repeat_val.parquet`` in ``out`` (``run.data.train``/``val``)."""
    out = Path(out)
    return write_rows(out / "repeat_train.parquet", train), write_rows(out / "repeat_val.parquet", val)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m nereus.rl.longtail", description=__doc__.split("\n")[0])
    p.add_argument("out", help="directory for repeat_train.parquet and repeat_val.parquet")
    p.add_argument("--train-size", type=int, default=4000)
    p.add_argument("--val-size", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-repeat", type=int, default=MAX_REPEAT)
    a = p.parse_args(argv)
    train, val = task_rows(a.train_size, a.val_size, a.seed, a.max_repeat)
    paths = write_task(a.out, train, val)
    lengths = response_lengths(train)
    print(f"{paths[0]}\n{paths[1]}\ntraining response length: median {statistics.median(lengths):g}, "
          f"max {max(lengths)}, spread {length_spread(train):.1f}x")


if __name__ == "__main__":
    main()
