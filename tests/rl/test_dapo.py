"""DAPO's sampling side (nereus.rl.dapo): overlong shaping (arXiv:2503.14476 eq. 13), the group filter and
the rule that generates further batches, against plain references."""

import pytest
import torch

from nereus.rl.dapo import (
    FilterTally,
    GenerationBatchesExhausted,
    filter_metric,
    kept_groups,
    needs_another_batch,
    overlong_penalty,
    trained_rows,
)


def eq13(length: int, max_len: int, buffer: int, factor: float) -> float:
    """DAPO eq. 13 written out case by case."""
    if length <= max_len - buffer:
        return 0.0
    if length <= max_len:
        return ((max_len - buffer) - length) / buffer * factor
    return -factor


def test_overlong_penalty_matches_eq13_case_by_case():
    lengths = torch.arange(0, 25)
    got = overlong_penalty(lengths, 20, 6, 0.5)
    want = torch.tensor([eq13(n, 20, 6, 0.5) for n in range(25)])
    torch.testing.assert_close(got, want)
    assert got[14] == 0 and got[20] == pytest.approx(-0.5) and got[24] == pytest.approx(-0.5)


def test_overlong_penalty_is_verls_min_form_inside_the_limit():
    # verl's DAPO reward manager: min(-(|y| - (L_max - L_cache)) / L_cache * factor, 0), for |y| <= L_max
    lengths = torch.randint(1, 4097, (200,), generator=torch.Generator().manual_seed(0))
    verl = torch.clamp(-(lengths.double() - (4096 - 1024)) / 1024 * 1.0, max=0).float()
    torch.testing.assert_close(overlong_penalty(lengths, 4096, 1024, 1.0), verl)


def test_overlong_penalty_refuses_an_empty_buffer():
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(torch.tensor([3]), 10, 0, 1.0)


def test_filter_metric_acc_is_the_rule_reward_right_or_wrong():
    rule = torch.tensor([1.0, 0.0, -1.0, 0.5])
    score = rule - 0.25
    assert filter_metric("acc", score, rule).tolist() == [1.0, 0.0, 0.0, 1.0]
    for name in ("score", "seq_reward", "seq_final_reward"):
        assert filter_metric(name, score, rule).tolist() == score.tolist()
    with pytest.raises(ValueError, match="rule reward"):
        filter_metric("acc", score, None)


def test_kept_groups_drops_groups_whose_values_are_all_equal():
    values = torch.tensor([1, 1, 1, 1,  0, 0, 0, 0,  1, 0, 1, 1,  0.5, 0.5, 0.5, 0.25], dtype=torch.float32)
    keep = kept_groups(values, 4)
    # the reference: numpy-style population std > 0 per group
    want = values.reshape(-1, 4).double().std(dim=1, unbiased=False) > 0
    assert keep.tolist() == want.tolist() == [False, False, True, True]


def test_kept_groups_keeps_singletons_and_refuses_partial_groups():
    assert kept_groups(torch.tensor([1.0, 1.0, 0.0]), 1).tolist() == [True, True, True]
    with pytest.raises(ValueError, match="whole groups"):
        kept_groups(torch.zeros(5), 2)


def test_tally_and_the_rule_for_another_batch():
    t = FilterTally().add(torch.tensor([True, False, False, True]))
    assert (t.batches, t.generated, t.kept, t.keep_rate) == (1, 4, 2, 0.5)
    assert needs_another_batch(t, needed=4, limit=None)
    assert needs_another_batch(t, needed=4, limit=2)
    t2 = t.add(torch.tensor([True, True, True, False]))
    assert not needs_another_batch(t2, needed=4, limit=2)  # 5 kept >= 4: full, the surplus is trimmed
    m = t2.metrics()
    assert m["train/num_gen_batches"] == 2 and m["train/filter_groups_keep_rate"] == pytest.approx(5 / 8)


def test_another_batch_past_the_limit_raises_naming_the_key():
    t = FilterTally().add(torch.tensor([False, False])).add(torch.tensor([True, False]))
    with pytest.raises(GenerationBatchesExhausted, match="run.filter_groups.max_num_gen_batches"):
        needs_another_batch(t, needed=2, limit=2)
    assert needs_another_batch(t, needed=2, limit=None)  # 0 in the spec: no limit


def test_trained_rows_are_the_first_kept_groups_in_generation_order():
    keeps = [torch.tensor([False, True, True]), torch.tensor([True, False, True])]
    rows = trained_rows(keeps, group_size=2, needed=3)
    assert rows == [(0, 2), (0, 3), (0, 4), (0, 5), (1, 0), (1, 1)]
    assert trained_rows(keeps, 2, 10) == rows + [(1, 4), (1, 5)]
