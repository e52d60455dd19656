"""GRPO's groups by how many siblings solved the prompt (``run.report.solve_shares``)."""

from __future__ import annotations

import pytest
import torch

from nereus.run.report import solve_shares


def test_groups_are_consecutive_rows_and_shares_add_up():
    scores = torch.tensor([1, 1, 1, 1,  # every sibling solved
                           0, 0, 0, 0,  # none did
                           1, 0, 1, 0,  # some did: the only group with a learning signal
                           0, 0, 0, 1], dtype=torch.float)
    m = solve_shares(scores, 4)
    assert m == pytest.approx({"batch/solve_all": 0.25, "batch/solve_none": 0.25, "batch/solve_partial": 0.5})


def test_partial_scores_count_as_neither_solved_nor_unsolved():
    m = solve_shares(torch.tensor([0.5, 0.5, 1.0, 1.0]), 2)
    assert m["batch/solve_all"] == 0.5 and m["batch/solve_none"] == 0.0 and m["batch/solve_partial"] == 0.5


def test_no_whole_group_gives_nothing():
    assert solve_shares(torch.tensor([1.0]), 8) == {}
