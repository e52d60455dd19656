"""`nereus simulate` and `nereus report` in plain words: durations in units that fit, the summary under labels,
tail batching's long rounds named by step, speculation explained, identical decisions grouped into one row,
and no measured gain larger than the step it belongs to. Built on synthetic records (no simulation) except
one short simulated run of tail batching."""

from __future__ import annotations

import json
from pathlib import Path

from nereus.cli import main
from nereus.sim.explain import (
    decision_lines,
    duration,
    generation_table,
    markdown_table,
    notes,
    summary_lines,
)
from nereus.sim.report import write_report

ROOT = Path(__file__).resolve().parents[2]


def step(i: int, seconds: float = 100.0, generation: float = 60.0, **extra) -> dict:
    return {"step": i, "step_time_s": seconds, "phases": {"generation": generation, "training": seconds - generation},
            "gpus": 8, "response_mean": 100.0, "response_max": 400.0, "tokens": 1000.0, "transition_s": 0.0,
            "lost_s": 0.0, "strategy": None, **extra}


def speculation(i: int, measured_gain: float, k: int = 4) -> dict:
    return {"action": "generation", "step": i, "model_stage": "actor/generation", "iteration": 0, "live": 0,
            "decision": {"kind": "set_speculation", "look": {"iterations": 0, "live_at_most": 0}, "reason": "nereus",
                         "speculation": {"draft": "suffix", "draft_tokens": k, "live_at_most": 128},
                         "gain_s": 50.0, "cost_s": 0.0},
            "outcome": {"applied": True, "reason": "", "cost_s": 0.0, "gain_s": measured_gain, "figures": {}},
            "overhead_s": 0.0}


def record(steps: list[dict], decisions: list[dict] = ()) -> dict:
    run_s = sum(s["step_time_s"] for s in steps)
    summary = {"policy": "nereus", "steps": len(steps), "mean_step_s": run_s / len(steps), "run_s": run_s,
               "transitions": 0, "transition_s": 0.0, "transition_share": 0.0, "tokens_per_s": 90.0,
               "tokens_per_gpu_s": 11.0, "failures": 0, "lost_s": 0.0, "controller_overhead_s_per_step": 0.004,
               "controller_overhead_share": 0.0001, "wall_s": 0.5}
    return {"policy": "nereus", "job": "j", "trace": "t", "seed": 0, "summary": summary, "steps": steps,
            "decisions": [], "plans": [], "generation_decisions": list(decisions)}


def test_durations_fit_their_size():
    assert [duration(x) for x in (0.0083, 0.35, 12.4, 104.2, 20 * 60 + 20, 4800, 14 * 3600 + 360, 3 * 86400 + 7200)] \
        == ["8.3 ms", "350 ms", "12.4 s", "104 s", "20 min 20 s", "1 h 20 min", "14 h 6 min", "3 d 2 h"]


def test_run_time_and_summary_read_as_words_not_keys():
    run = record([step(i, 4.0) for i in range(20)])  # 80 s of steps: "0.02 h" before
    table = markdown_table([run])
    assert "| 80 s |" in table and "(h)" not in table and "0.02" not in table
    lines = "\n".join(summary_lines(run["summary"]))
    assert "mean step time" in lines and "4 s" in lines and "controller time per step" in lines
    assert not any(key in lines for key in ("mean_step_s", "run_s", "tokens_per_s", "controller_overhead"))


def test_identical_decisions_are_one_row_with_their_steps():
    steps = [step(i) for i in range(60)]
    decisions = [speculation(i, 30.0) for i in range(3, 53)] + [speculation(53, 30.0, k=6)]
    run = record(steps, decisions)
    table = generation_table([run])
    rows = [line for line in table.splitlines() if line.startswith("| nereus |")]
    assert len(rows) == 2 and "| 3–52 |" in rows[0] and "set_speculation ×50" in rows[0]
    assert "| 53 |" in rows[1] and "×" not in rows[1].split("|")[4]
    text = "\n".join(decision_lines(run))
    assert "set_speculation ×50" in text and "3–52" in text and text.count("set_speculation") == 2


def test_a_measured_gain_never_exceeds_its_step():
    run = record([step(0, 100.0), step(1, 100.0)], [speculation(0, 150.0), speculation(1, 150.0)])
    table = generation_table([run])
    row = next(line for line in table.splitlines() if line.startswith("| nereus |"))
    assert float(row.rstrip(" |").split("|")[-1]) <= 100.0  # 150 s gained on a 100 s step before
    assert "2 measured gains larger than their own step" in table
    assert all("150" not in line for line in decision_lines(run)[:1])


def test_long_rounds_are_named_by_step_and_speculation_is_explained():
    steps = [step(i, 200.0 if i % 5 == 4 else 100.0) for i in range(25)]
    for s in steps:
        long = s["step"] % 5 == 4
        s["tail"] = {"long_round": float(long), "launched_groups": 64.0 if long else 80.0, "kept_groups": 64.0,
                     "deferred_groups": 0.0 if long else 16.0 * (s["step"] % 5 + 1)}
    run = record(steps, [speculation(i, 90.0) for i in range(25)])
    text = "\n".join(notes(run))
    assert "- step 19: long round (regenerates 64 deferred prompts), 3 min 20 s" in text
    assert "20 short rounds" in text and "5 long rounds" in text and "periodic slow steps" in text
    assert "## Speculative decoding" in text and "drafts copied from earlier responses" in text
    assert "on in 25 of 25 steps" in text and "over the 5 steps not stopped early" in text


def test_simulated_tail_batching_labels_the_slow_steps(tmp_path, capsys):
    out = tmp_path / "rp.json"
    assert main(["simulate", str(ROOT / "traces" / "long_tail_dapo.yaml"), "--job",
                 str(ROOT / "examples" / "grpo_7b_h100.yaml"), "--policy", "rollpacker-like", "--steps", "9",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "mean step time" in printed and "mean_step_s" not in printed and "long round (regenerates" in printed
    steps = json.loads(out.read_text())["steps"]
    long = [s["step_time_s"] for s in steps if s.get("tail", {}).get("long_round")]
    short = [s["step_time_s"] for s in steps if "tail" in s and not s["tail"]["long_round"]]
    assert long and short and min(long) > 1.5 * max(short)  # the labelled steps are the slow ones
    rounds = [s["tail"] for s in steps if "tail" in s]  # 128 prompts a step, over-launched 1.5-fold
    assert {(r["launched_groups"], r["kept_groups"]) for r in rounds} == {(192.0, 128.0), (128.0, 128.0)}
    text = write_report([str(out)], tmp_path / "rep")["markdown"].read_text()
    assert "## Tail batching" in text and "long round (regenerates 128 deferred prompts)" in text


def test_different_moves_stay_apart_and_keep_their_step_and_iteration():
    def move(i: int, seq: int) -> dict:
        return {"action": "generation", "step": i, "model_stage": "actor/generation", "iteration": 4, "live": 6,
                "decision": {"kind": "move_sequences", "look": {"iterations": 0, "live_at_most": 0}, "reason": "gain",
                             "moves": [{"seq": [seq, 0, 12, 30, 42, 8, 50.0], "dst": 1, "refill": False}],
                             "gain_s": 0.5, "cost_s": 0.1, "bytes": 1024},
                "outcome": {"applied": True, "reason": "", "cost_s": 0.05, "gain_s": 0.2, "figures": {}},
                "overhead_s": 0.0}
    table = generation_table([record([step(0), step(1)], [move(0, 1), move(1, 2)])])
    assert "| nereus | 0 | 4 | move_sequences |" in table and "| nereus | 1 | 4 | move_sequences |" in table
    assert "replica 0 → 1: 1 sequences" in table
