"""Token-budget micro-batches and packing (``parallel.packing``): every row once, the budget kept, the
replicas' tokens balanced, and the padded frame recovered from the packed one."""

import pytest
import torch

from nereus.runtime.model.decoder import packed_positions
from nereus.runtime.parallel.packing import PackedRows, row_lengths
from nereus.spec.packing import replica_shares, token_budget_groups

LONG_TAIL = [900, 40, 35, 60, 1200, 30, 25, 80, 45, 50, 3000, 20]


def test_token_budget_groups_keep_the_budget_and_every_row_once():
    groups = token_budget_groups(LONG_TAIL, 1500)
    assert sorted(i for g in groups for i in g) == list(range(len(LONG_TAIL)))
    assert all(sum(LONG_TAIL[i] for i in g) <= 1500 for g in groups if len(g) > 1)
    assert [10] in groups  # longer than the budget: alone
    assert len(groups) == 3  # 3000 alone; 1200 and 900 each with short rows (as few as first-fit needs)
    assert groups == token_budget_groups(LONG_TAIL, 1500)  # every rank computes the same plan
    assert token_budget_groups([5, 5, 5, 5], 10) == [[0, 2], [1, 3]]  # longest first, the emptiest first


def test_replica_shares_balance_tokens_longest_first():
    shares = replica_shares(LONG_TAIL, 2)
    assert sorted(i for s in shares for i in s) == list(range(len(LONG_TAIL)))
    loads = [sum(LONG_TAIL[i] for i in s) for s in shares]
    assert abs(loads[0] - loads[1]) <= max(LONG_TAIL)
    assert all(s == sorted(s) for s in shares)
    with pytest.raises(ValueError, match="dp=4"):
        replica_shares([3, 4], 4)


def test_pack_and_unpack_round_trip():
    lengths = (4, 1, 3)
    padded = torch.arange(3 * 5).view(3, 5)
    pack = PackedRows(torch.tensor([2, 0, 1]), lengths)
    packed = pack.pack(padded)
    assert packed.tolist() == [[0, 1, 2, 3, 5, 10, 11, 12]]
    assert pack.next_tokens(packed).tolist() == [[1, 2, 3, 0, 0, 11, 12, 0]]
    assert packed_positions(lengths).tolist() == [[0, 1, 2, 3, 0, 0, 1, 2]]
    back = pack.unpack(packed.float(), 5, next_token=False)
    assert back.tolist() == [[0, 1, 2, 3, 0], [5, 0, 0, 0, 0], [10, 11, 12, 0, 0]]
    nxt = pack.unpack(packed.float(), 4, next_token=True)  # a sequence's last position predicts nothing
    assert nxt.tolist() == [[0, 1, 2, 0], [0, 0, 0, 0], [10, 11, 0, 0]]


def test_row_lengths_default_to_the_width_and_are_checked():
    assert row_lengths(None, 3, 7) == [7, 7, 7]
    assert row_lengths(torch.tensor([2, 7]), 2, 7) == [2, 7]
    with pytest.raises(ValueError):
        row_lengths(torch.tensor([8]), 1, 7)
