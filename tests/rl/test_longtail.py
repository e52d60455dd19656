"""The long-tail ``repeat`` task: ground-truth response lengths spread about 10x between median and
maximum in both splits, held-out prompts never appear in training, rows load as verl-format files with the
built-in tokenizer, and the rule-based rewards score the answer."""

from __future__ import annotations

import statistics

import pytest

from nereus.rl.data import CharTokenizer, load_prompts
from nereus.rl.longtail import (
    MAX_REPEAT,
    TASK_SOURCE,
    held_out,
    length_spread,
    repeat_rows,
    response_lengths,
    task_rows,
    write_task,
)
from nereus.rl.task import digit_match, exact_match


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_response_lengths_spread_about_tenfold(seed):
    train, val = task_rows(512, 256, seed)
    for rows in (train, val):
        lengths = response_lengths(rows)
        assert statistics.median(lengths) <= 4 and max(lengths) == MAX_REPEAT + 1
        assert 8 <= length_spread(rows) <= 13
    counts = [r["extra_info"]["repeat"] for r in train]
    # P(k >= n) = 2/(n+1): a third of the counts are 1, about one in 18 reaches the cap
    assert 0.28 < counts.count(1) / len(counts) < 0.39
    assert 0.03 < counts.count(MAX_REPEAT) / len(counts) < 0.09


def test_held_out_prompts_never_train_and_rows_are_reproducible():
    train, val = task_rows(2000, 300, 4)
    prompts = {split: {r["prompt"][0]["content"] for r in rows} for split, rows in (("train", train), ("val", val))}
    assert not prompts["train"] & prompts["val"]
    assert all(held_out(int(r["reward_model"]["ground_truth"][0]), r["extra_info"]["repeat"]) for r in val)
    assert repeat_rows(50, 4) == train[:50]
    with pytest.raises(ValueError, match="split"):
        repeat_rows(1, 0, split="test")


def test_rows_load_as_verl_files_and_the_rule_scores_them(tmp_path):
    train_path, val_path = write_task(tmp_path, *task_rows(40, 10, 0))
    tok = CharTokenizer()
    prompts = load_prompts(train_path, tok, max_prompt_length=12) + load_prompts(val_path, tok, 12)
    assert len(prompts) == 50 and {p.data_source for p in prompts} == {TASK_SOURCE}
    for p in prompts:
        text = tok.decode(list(p.ids))
        digit, k = text[len("rep:"):-1].split("x")
        assert p.ground_truth == digit * int(k)
    answer = "7" * 12
    assert exact_match(answer, answer, finished=True) == 1.0
    assert exact_match(answer, answer, finished=False) == 0.0  # cut at the length limit
    assert exact_match(answer[:-1], answer, finished=True) == 0.0
    assert digit_match(answer[:-1], answer, finished=True) == pytest.approx(11 / 12)
