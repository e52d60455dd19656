"""ReMax's greedy baseline in the step: each drawn prompt answered once greedily, scored, and given to its
rows' advantages (the generation and the scoring are stand-ins here; the real pass runs in `nereus run`)."""

from __future__ import annotations

from dataclasses import replace

import torch

from nereus.rl.data import Prompt
from nereus.run.greedy_baseline import with_greedy_baseline
from nereus.run.inference import Inferred
from nereus.run.rollout import pack, repeat_prompts
from nereus.run.training import advantages
from tests.run.jobs import tiny_job


class _Generation:
    """Greedy "responses": the prompt's first id, once; two replicas."""

    def __init__(self) -> None:
        self.asked: list[tuple[int, list[Prompt]]] = []

    def replicas(self) -> int:
        return 2

    def greedy(self, step: int, prompts: list[Prompt]):
        self.asked.append((step, prompts))
        return pack([list(p.ids) for p in prompts], [[p.ids[0]] for p in prompts], None, eos=0)


class _Inference:
    """Scores a greedy response by its one token."""

    def has(self, model: str) -> bool:
        return False

    def scores(self, roll, rows: list[Prompt]) -> torch.Tensor:
        return torch.tensor([float(t) for t in roll.tokens[torch.arange(len(rows)), roll.last]])


def test_remax_answers_each_drawn_prompt_once_and_subtracts_its_score(tmp_path):
    job = tiny_job("grpo", str(tmp_path))
    job = replace(job, algorithm=replace(job.algorithm, adv_estimator="remax", samples_per_prompt=2))
    drawn = [Prompt((3, 1), "x", "s", 0), Prompt((5, 1), "y", "s", 1), Prompt((3, 1), "x", "s", 0)]
    rows = repeat_prompts(drawn, 2)
    roll = pack([list(p.ids) for p in rows], [[9, 9]] * 6, None, eos=7)
    inf = Inferred(score=torch.tensor([4.0, 2.0, 6.0, 5.0, 3.0, 3.0]), old_logp=torch.zeros(6, 2))
    gen = _Generation()
    out = with_greedy_baseline(job, 7, rows, inf, gen, _Inference())
    # three draws, padded with the first to split over two replicas; step 7's weights
    assert gen.asked == [(7, drawn + drawn[:1])]
    torch.testing.assert_close(out.baseline_score, torch.tensor([3.0, 3.0, 5.0, 5.0, 3.0, 3.0]))
    adv = advantages(job, roll, rows, out)["adv"]
    # reward-to-go (the score from every token) minus the greedy response's score
    torch.testing.assert_close(adv[:, 0], torch.tensor([1.0, -1.0, 1.0, 0.0, 0.0, 0.0]))
    # any other estimator: no greedy pass
    grpo = replace(job, algorithm=replace(job.algorithm, adv_estimator="grpo"))
    assert with_greedy_baseline(grpo, 7, rows, inf, gen, _Inference()) is inf and len(gen.asked) == 1
