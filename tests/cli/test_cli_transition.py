"""`nereus transition`: text, JSON, the Perfetto timeline, the graph file, and one-line errors."""

from __future__ import annotations

import json

import pytest

from nereus.cli import main
from nereus.elastic.plan import FORMAT, TransitionPlan
from tests.conftest import EXAMPLES

JOB = str(EXAMPLES / "ppo_8b_h100.yaml")
P64, P128 = str(EXAMPLES / "plans" / "ppo_8b_h100_64.json"), str(EXAMPLES / "plans" / "ppo_8b_h100_128.json")


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_text_report_names_times_bytes_memory_and_baselines(capsys):
    code, out, _ = run(capsys, "transition", JOB, "--from", P64, "--to", P128)
    assert code == 0
    for text in ("Transition for 'ppo-llama3-8b' on 128 x H100", "actor/training", "->", "predicted",
                 "bandwidth bound", "owner-change lower bound", "peak memory", "checkpoint", "gather_scatter",
                 "broadcast", "operations:"):
        assert text in out


def test_json_timeline_and_graph_files(capsys, tmp_path):
    trace, graph_file = tmp_path / "t.json", tmp_path / "g.json"
    code, out, _ = run(capsys, "transition", JOB, "--from", P64, "--to", P128, "--json", "--timeline", str(trace),
                       "--graph", str(graph_file), "--storage-gb-per-s", "4")
    assert code == 0
    data = json.loads(out)
    assert data["bytes_sent"] == data["lower_bound_bytes"] > 0
    assert data["bandwidth_bound_s"] <= data["predicted_s"] <= 1.2 * data["bandwidth_bound_s"]
    assert data["peak_bytes_max"] <= data["capacity_bytes"] and len(data["peak_bytes_per_device"]) == 128
    assert data["baseline_ratios"]["checkpoint"] >= 10 and data["storage_bytes_per_s_per_node"] == 4e9
    events = json.loads(trace.read_text())["traceEvents"]
    names = {(e["pid"], e["args"]["name"]) for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert (0, "GPU 0 (node 0)") in names and (127, "GPU 127 (node 15)") in names
    tracks = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"NVLink out", "NVLink in", "InfiniBand out", "InfiniBand in", "buffers"} <= tracks
    spans = [e for e in events if e["ph"] == "X"]
    assert spans and all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    assert any(e["name"].startswith("to GPU") for e in spans) and any(e["name"].startswith("from GPU") for e in spans)
    assert any(e["ph"] == "i" and e["name"] == "commit" for e in events)
    assert any(e["ph"] == "C" for e in events)  # memory counters
    graph = json.loads(graph_file.read_text())
    assert graph["format"] == FORMAT and graph["steps"][graph["commit"]]["kind"] == "commit"
    send = next(s for s in graph["steps"] if s["kind"] == "send")
    assert {"src", "dst", "bytes", "deps", "parts", "chunks", "staging", "from_host"} <= set(send)
    assert {"kind", "group", "piece", "dest"} == set(send["parts"][0]["pieces"][0])
    plan = TransitionPlan.from_json(graph)  # what an executor reads back: the same plan
    assert plan.to_json() == graph and plan.bytes_sent == data["bytes_sent"]


@pytest.mark.parametrize("argv,pattern", [
    (["--from", "missing.json", "--to", P128], "--from missing.json: plan file not found"),
    (["--from", P64, "--to", str(EXAMPLES / "ppo_8b_h100.yaml")], "--to "),
    (["--from", P64, "--to", P128, "--chunk-mb", "0"], "--chunk-mb: must be > 0"),
    (["--from", P64, "--to", P128, "--storage-gb-per-s", "-1"], "--storage-gb-per-s: must be > 0"),
])
def test_bad_input_is_a_one_line_error(capsys, argv, pattern):
    code, _, err = run(capsys, "transition", JOB, *argv)
    assert code == 2 and "Traceback" not in err
    assert err.startswith("nereus: error: ") and pattern in err and err.count("\n") == 1


def test_plan_of_another_job_is_refused_by_field(capsys, tmp_path):
    plan = json.loads(open(P64).read())
    plan["placements"] = [p for p in plan["placements"] if p["model_stage"] != "critic/training"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(plan))
    code, _, err = run(capsys, "transition", JOB, "--from", P64, "--to", str(bad))
    assert code == 2 and "--to plan.placements: missing model-stages ['critic/training']" in err


def test_plan_layout_the_model_cannot_take_is_refused_by_field(capsys, tmp_path):
    plan = json.loads(open(P64).read())
    plan["placements"][0]["layout"]["tp"] = 3
    plan["placements"][0]["gpus"] = plan["placements"][0]["gpus"][: 3 * plan["placements"][0]["layout"]["pp"]
                                                                   * plan["placements"][0]["layout"]["dp"]]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(plan))
    code, _, err = run(capsys, "transition", JOB, "--from", str(bad), "--to", P128)
    assert code == 2 and "from.placements[0].layout.tp: 3 does not divide the 32 attention heads" in err
