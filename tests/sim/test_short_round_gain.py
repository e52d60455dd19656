"""Speculation's measured gain in a short round of tail batching is against the plain round stopped where
its own groups end, not against a plain generation run to the end: compared unstopped, the gain of the
first short round of this run (GRPO 7B, long_tail_dapo, seed 0) read 61.8 s against a 60.4 s round."""

from __future__ import annotations

import json
from pathlib import Path

from nereus.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_speculation_gain_in_short_rounds_is_measured_on_stopped_rounds(tmp_path):
    out = tmp_path / "n.json"
    assert main(["simulate", str(ROOT / "traces" / "long_tail_dapo.yaml"), "--job",
                 str(ROOT / "examples" / "grpo_7b_h100.yaml"), "--policy", "nereus", "--steps", "9",
                 "--out", str(out)]) == 0
    run = json.loads(out.read_text())
    steps = {s["step"]: s for s in run["steps"]}
    short = [d for d in run["generation_decisions"] if d["decision"]["kind"] == "set_speculation"
             and "tail" in steps[d["step"]] and not steps[d["step"]]["tail"]["long_round"]]
    assert short, "the run has short rounds with speculation"
    for d in short:
        generation = steps[d["step"]]["phases"]["generation"]
        assert 0 < d["outcome"]["gain_s"] < generation, (d["step"], d["outcome"]["gain_s"], generation)
