"""Every traceback, hang and silently accepted input met in review of the CLI, as a named regression test.
Each is refused with exit code 2 and one stderr line naming the file, flag or key (docs/reliability.md,
"One-line errors"); the hangs are refused before any work starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from nereus.spec.fields import MAX_GPUS, MAX_STEPS
from tests.fuzz.cli_util import (
    JOB_8B,
    JOB_TRAIN,
    PLAN_64,
    PLAN_128,
    PROFILE,
    TRACE,
    assert_refused,
    run_cli,
    run_record,
    tiny_job_doc,
    write_json,
    write_yaml,
)

BINARY = bytes(range(256)) * 4  # not UTF-8 from byte 128 on


@pytest.fixture
def job(tmp_path):
    return write_yaml(tmp_path / "job.yaml", tiny_job_doc(tmp_path / "out"))


def _job_with(tmp_path, edit) -> str:
    doc = tiny_job_doc(tmp_path / "out")
    edit(doc)
    return str(write_yaml(tmp_path / "edited.yaml", doc))


# ----- tracebacks: a directory or a binary file where a file is expected --------------------------------
def _file_argv(kind: str, path: str, job: str) -> list[str]:
    return {"job": ["plan", path],
            "plan": ["estimate", str(JOB_8B), "--plan", path],
            "trace": ["simulate", path, "--job", job],
            "run file": ["report", path, "--out", os.path.dirname(path) + "/report"],
            "transition plan": ["transition", str(JOB_8B), "--from", path, "--to", str(PLAN_128)]}[kind]


@pytest.mark.parametrize("kind", ["job", "plan", "trace", "run file", "transition plan"])
def test_directory_given_as_a_file_is_refused(tmp_path, job, kind):
    folder = tmp_path / "a-folder"
    folder.mkdir()
    assert_refused(run_cli(*_file_argv(kind, str(folder), str(job))), str(folder), "is a directory")


@pytest.mark.parametrize("kind", ["job", "plan", "trace", "run file", "transition plan"])
def test_binary_file_given_as_a_file_is_refused(tmp_path, job, kind):
    blob = tmp_path / "blob.bin"
    blob.write_bytes(BINARY)
    assert_refused(run_cli(*_file_argv(kind, str(blob), str(job))), str(blob), "not UTF-8")


@pytest.mark.parametrize("content", ["dir", "binary"])
def test_profile_that_is_a_directory_or_binary_is_refused(tmp_path, content):
    target = tmp_path / "profile.yaml"
    target.mkdir() if content == "dir" else target.write_bytes(BINARY)
    doc = yaml.safe_load(JOB_8B.read_text())
    doc["cluster"] = {"profile": str(target), "nodes": 1, "gpus_per_node": 4}
    assert_refused(run_cli("plan", write_yaml(tmp_path / "job.yaml", doc)), "cluster.profile", str(target))


def test_run_file_given_as_a_directory_to_run(tmp_path):
    assert_refused(run_cli("run", tmp_path), str(tmp_path), "is a directory")


def test_hf_config_that_is_a_directory_is_refused(tmp_path, job):
    (tmp_path / "config.json").mkdir()
    path = _job_with(tmp_path, lambda d: d["models"].update(actor={"hf_config": str(tmp_path / "config.json")}))
    assert_refused(run_cli("plan", path), "models.actor.hf_config", "is a directory")


# ----- tracebacks: unwritable outputs, disk full -----------------------------------------------------------
@pytest.mark.parametrize("where", ["missing-folder", "parent-is-a-file", "is-a-directory"])
def test_plan_out_to_an_unwritable_path_is_refused(tmp_path, job, where):
    (tmp_path / "file").write_text("x")
    out = {"missing-folder": tmp_path / "nope" / "plan.json", "parent-is-a-file": tmp_path / "file" / "plan.json",
           "is-a-directory": tmp_path}[where]
    assert_refused(run_cli("plan", job, "--out", out), "--out")


def test_plan_out_on_a_full_disk_is_refused():
    # /dev/full answers every write with ENOSPC: the disk-full case without filling a disk
    assert_refused(run_cli("plan", JOB_8B, "--out", "/dev/full"), "--out", "No space left on device")


def test_simulate_out_on_a_full_disk_is_refused(job):
    # the progress lines come first: a full disk shows only when the record is written
    assert_refused(run_cli("simulate", TRACE, "--job", job, "--steps", "1", "--out", "/dev/full"),
                   "--out", "No space left on device", preamble=True)


def test_report_out_that_is_a_file_is_refused(tmp_path):
    record = write_json(tmp_path / "run.json", run_record())
    assert_refused(run_cli("report", record, "--out", record), "--out", "is a file")


@pytest.mark.parametrize("flag", ["--timeline", "--graph"])
def test_transition_outputs_on_a_full_disk_are_refused(flag):
    r = run_cli("transition", JOB_8B, "--from", PLAN_64, "--to", PLAN_128, flag, "/dev/full", "--json")
    assert_refused(r, flag, "No space left on device")


# ----- tracebacks: numbers -------------------------------------------------------------------------------
def test_gpus_ten_to_the_twelve_is_refused_before_allocating():
    assert_refused(run_cli("plan", JOB_8B, "--gpus", str(10**12)), "--gpus", f"{MAX_GPUS:,}")


def test_nodes_ten_to_the_thirty_is_refused(tmp_path):
    doc = yaml.safe_load(JOB_8B.read_text())
    doc["cluster"]["nodes"] = 10**30
    assert_refused(run_cli("plan", write_yaml(tmp_path / "j.yaml", doc)), "cluster.nodes")


def test_nodes_times_gpus_per_node_beyond_the_cap_is_refused(tmp_path):
    doc = yaml.safe_load(JOB_8B.read_text())
    doc["cluster"].update(nodes=MAX_GPUS, gpus_per_node=8)
    assert_refused(run_cli("plan", write_yaml(tmp_path / "j.yaml", doc)), "cluster.nodes", "at most")


@pytest.mark.parametrize("key", ["mean", "max"])
@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf"])
def test_non_finite_response_length_is_refused(tmp_path, key, value):
    text = (tmp_path / "j.yaml")
    doc = tiny_job_doc()
    doc["workload"]["response_length"][key] = "@@"
    text.write_text(yaml.safe_dump(doc).replace("'@@'", value))
    assert_refused(run_cli("plan", text), f"workload.response_length.{key}")


def test_non_finite_trace_lengths_are_refused(tmp_path, job):
    doc = yaml.safe_load(TRACE.read_text())
    doc["response_length"]["points"][0]["mean"] = float("nan")
    trace = write_json(tmp_path / "t.json", doc)  # JSON's NaN literal
    assert "NaN" in trace.read_text()
    assert_refused(run_cli("simulate", trace, "--job", job), "response_length.points[0].mean", "finite")


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e-9", "1e12"])
def test_chunk_mb_that_is_not_a_sane_finite_size_is_refused(value):
    assert_refused(run_cli("transition", JOB_8B, "--from", PLAN_64, "--to", PLAN_128, "--chunk-mb", value),
                   "--chunk-mb")


@pytest.mark.parametrize("value", ["nan", "inf", "0"])
def test_storage_bandwidth_that_is_not_finite_and_positive_is_refused(value):
    argv = ["transition", JOB_8B, "--from", PLAN_64, "--to", PLAN_128, "--storage-gb-per-s", value]
    assert_refused(run_cli(*argv), "--storage-gb-per-s")


@pytest.mark.parametrize("seed", ["-1", str(2**32)])
def test_simulate_seed_outside_numpys_range_is_refused(job, seed):
    assert_refused(run_cli("simulate", TRACE, "--job", job, "--seed", seed), "--seed")


def test_yaml_nested_twenty_thousand_deep_is_refused(tmp_path):
    deep = tmp_path / "deep.yaml"
    deep.write_text("a: " + "[" * 20_000 + "]" * 20_000 + "\n")
    assert_refused(run_cli("plan", deep), str(deep), "nested deeper than")
    block = tmp_path / "block.yaml"  # block style: one indentation level per line
    block.write_text("".join(" " * i + f"k{i}:\n" for i in range(2_000)))  # past the recursion limit
    assert_refused(run_cli("plan", block), str(block), "nested deeper than")


def test_json_nested_twenty_thousand_deep_is_refused(tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 20_000 + "]" * 20_000)
    assert_refused(run_cli("estimate", JOB_8B, "--plan", deep), str(deep), "nested")


def test_run_file_missing_keys_is_refused_by_key(tmp_path):
    record = run_record()
    del record["steps"][1]["phases"]
    path = write_json(tmp_path / "run.json", record)
    assert_refused(run_cli("report", path, "--out", tmp_path / "rep"), str(path), "steps[1].phases")
    assert not (tmp_path / "rep").exists()  # checked before anything is written
    assert_refused(run_cli("report", write_json(tmp_path / "other.json", {"policy": "x"}), "--out",
                           tmp_path / "rep"), "not a run record")


def test_simulate_with_a_training_only_job_is_refused():
    assert_refused(run_cli("simulate", TRACE, "--job", JOB_TRAIN), "--job", "training-only")


def test_stdout_closed_by_head_is_a_quiet_exit_in_process():
    class ClosedPipe:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            raise BrokenPipeError(32, "Broken pipe")

    r = run_cli("plan", JOB_8B, "--json", stdout=ClosedPipe())
    assert r.code == 141 and r.err == ""


def test_stdout_closed_by_head_is_a_quiet_exit_in_a_real_process():
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the child writes: its first write raises EPIPE
    try:
        done = subprocess.run([sys.executable, "-m", "nereus", "plan", str(JOB_8B), "--json"], stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
    assert done.returncode == 141 and done.stderr == "", done.stderr


@pytest.mark.parametrize("latest", ["", "garbage", "-3", "1e9", "\x00\x01", "99"])
def test_malformed_latest_is_refused(tmp_path, job, latest):
    out = tmp_path / "out"
    out.mkdir()
    (out / "latest").write_text(latest)
    assert_refused(run_cli("run", job, "--resume", "--out", out), "--resume", preamble=True)


@pytest.mark.parametrize("manifest", ["not json", "[]", '{"files": 3}', '{"files": {"x": {}}}', '{"a": 1}'])
def test_malformed_manifest_is_refused(tmp_path, job, manifest):
    out = tmp_path / "out"
    step = out / "step_1"
    step.mkdir(parents=True)
    (step / "state.json").write_text('{"step": 1}')
    (step / "MANIFEST.json").write_text(manifest)
    (out / "latest").write_text("1")
    assert_refused(run_cli("run", job, "--resume", "--out", out), "--resume", preamble=True)


# ----- hangs: refused up front ---------------------------------------------------------------------------
def test_a_billion_layers_is_refused_before_planning(tmp_path):
    path = _job_with(tmp_path, lambda d: d["models"]["actor"].update(layers=10**9))
    assert_refused(run_cli("plan", path), "models.actor.layers", "<= 1000")


def test_simulate_ten_to_the_twelve_steps_is_refused(job):
    assert_refused(run_cli("simulate", TRACE, "--job", job, "--steps", str(10**12)), "--steps", str(MAX_STEPS))


def test_train_size_ten_to_the_twelve_is_refused(tmp_path):
    path = _job_with(tmp_path, lambda d: d["run"]["data"].update(train_size=10**12))
    assert_refused(run_cli("run", path), "run.data.train_size")


def test_train_size_beyond_the_tasks_distinct_prompts_is_refused(tmp_path):
    # 3 digits give 1,110 distinct prompts: 900 never finishes drawing distinct ones
    path = _job_with(tmp_path, lambda d: d["run"]["data"].update(train_size=900, max_digits=3))
    assert_refused(run_cli("run", path), "run.data.train_size", "max_digits")


# ----- accepted silently before ---------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["plan", "estimate"])
def test_gpus_zero_is_refused_not_ignored(command):
    assert_refused(run_cli(command, JOB_8B, "--plan", PLAN_64, "--gpus", "0")
                   if command == "estimate" else run_cli(command, JOB_8B, "--gpus", "0"), "--gpus", ">= 1")


@pytest.mark.parametrize("workers", ["0", "-1", "1000"])
def test_run_workers_zero_negative_or_a_thousand_is_refused(tmp_path, job, workers):
    assert_refused(run_cli("run", job, "--workers", workers, "--out", tmp_path / "o"), "--workers")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("workers", ["0", "1000"])
def test_profile_workers_zero_or_a_thousand_is_refused(workers):
    assert_refused(run_cli("profile", "--workers", workers), "--workers")


@pytest.mark.parametrize("steps", ["0", "-5"])
def test_simulate_steps_zero_or_negative_is_refused(job, steps):
    assert_refused(run_cli("simulate", TRACE, "--job", job, "--steps", steps), "--steps", ">= 1")


@pytest.mark.parametrize("key", ["actor_lr", "temperature", "gamma", "top_p", "grad_clip"])
@pytest.mark.parametrize("value", [".nan", ".inf"])
def test_non_finite_run_numbers_are_refused(tmp_path, key, value):
    doc = tiny_job_doc()
    doc["run"][key] = "@@"
    path = tmp_path / "j.yaml"
    path.write_text(yaml.safe_dump(doc).replace("'@@'", value))
    assert_refused(run_cli("plan", path), f"run.{key}", "finite")


@pytest.mark.parametrize("kind", ["job", "trace", "profile"])
def test_duplicate_yaml_keys_are_refused(tmp_path, kind):
    if kind == "job":
        path = tmp_path / "j.yaml"
        path.write_text(JOB_8B.read_text() + "\nname: again\nname: twice\n")
        argv = ["plan", path]
    elif kind == "trace":
        path = tmp_path / "t.yaml"
        path.write_text(TRACE.read_text() + "\nsteps: 10\n")
        argv = ["simulate", path, "--job", JOB_8B]
    else:
        path = tmp_path / "p.yaml"
        path.write_text(PROFILE.read_text() + "\nnodes: 1\nnodes: 2\n")
        doc = yaml.safe_load(JOB_8B.read_text())
        doc["cluster"] = {"profile": str(path)}
        argv = ["plan", write_yaml(tmp_path / "j.yaml", doc)]
    assert_refused(run_cli(*argv), str(path), "duplicate key")


def test_duplicate_json_keys_are_refused(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text('{"num_gpus": 64, "num_gpus": 128, "placements": []}')
    assert_refused(run_cli("estimate", JOB_8B, "--plan", path), str(path), "duplicate key")


def test_hf_config_whose_heads_do_not_divide_hidden_is_refused(tmp_path):
    config = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 100, "num_attention_heads": 3,
              "head_dim": 33, "intermediate_size": 256, "vocab_size": 64}
    write_json(tmp_path / "config.json", config)
    path = _job_with(tmp_path, lambda d: d["models"].update(actor={"hf_config": str(tmp_path / "config.json")}))
    assert_refused(run_cli("plan", path), "num_attention_heads", "divisible")


def test_hf_config_sizes_are_bounded_like_inline_ones(tmp_path):
    config = {"model_type": "llama", "num_hidden_layers": 10**9, "hidden_size": 64, "num_attention_heads": 4,
              "intermediate_size": 128, "vocab_size": 64}
    write_json(tmp_path / "config.json", config)
    path = _job_with(tmp_path, lambda d: d["models"].update(actor={"hf_config": str(tmp_path / "config.json")}))
    assert_refused(run_cli("plan", path), "num_hidden_layers", "<= 1000")


def test_resume_from_a_mistyped_out_folder_creates_nothing(tmp_path, job):
    typo = tmp_path / "ouut"
    assert_refused(run_cli("run", job, "--resume", "--out", typo), "--out", "does not exist")
    assert not typo.exists()


@pytest.mark.parametrize("workers", ["0", "1000"])
def test_scale_to_zero_or_a_thousand_workers_is_refused(tmp_path, workers):
    assert_refused(run_cli("scale", workers, "--dir", tmp_path), "workers")
    assert not (tmp_path / "scale.json").exists()


def test_scale_into_a_folder_that_is_not_a_run_is_refused(tmp_path):
    assert_refused(run_cli("scale", "2", "--dir", tmp_path), str(tmp_path))
    assert not (tmp_path / "scale.json").exists()


# ----- the last resort is for bugs only ------------------------------------------------------------------
def test_an_internal_error_is_one_line_naming_the_traceback_log(monkeypatch):
    import nereus.cli as cli

    def broken(args):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(cli, "cmd_plan", broken)
    r = run_cli("plan", JOB_8B)
    log = r.err.split("traceback in ")[1].split(";")[0]
    try:
        assert r.code == 70 and r.err.count("\n") == 1 and "internal error (ZeroDivisionError: a bug)" in r.err
        assert "Traceback" in open(log).read() and "ZeroDivisionError" in open(log).read()
    finally:
        os.unlink(log)


def test_usage_errors_are_one_line(capsys):
    assert_refused(run_cli("plan"), "the following arguments are required: job")
    assert_refused(run_cli("simulate", TRACE, "--job", JOB_8B, "--steps", "many"), "--steps", "invalid int")
    assert_refused(run_cli("frobnicate"), "invalid choice")
    assert run_cli("--help").code == 0


def test_a_valid_job_still_plans(tmp_path):
    r = run_cli("plan", JOB_8B, "--json", "--out", tmp_path / "plan.json")
    assert r.code == 0 and json.loads(r.out)["feasible"]
    assert json.loads((tmp_path / "plan.json").read_text())["step_time_s"] > 0


# ----- found by the fuzz suite (tests/fuzz/test_fuzz_cli.py) ----------------------------------------------
@pytest.mark.parametrize("override", ["run.steps=" + "9" * 5000, "run.steps=" + "[" * 3000, "run.actor_lr=.nan"])
def test_run_override_values_are_read_like_the_file(tmp_path, job, override):
    assert_refused(run_cli("run", job, override, "--out", tmp_path / "o"), override.split("=")[0])


@pytest.mark.parametrize("content", [b"\xff\xfe binary", b"[" * 20_000 + b"]" * 20_000, "fifo"])
def test_a_broken_prompt_file_is_refused_by_name(tmp_path, content):
    train = tmp_path / "train.jsonl"
    os.mkfifo(train) if content == "fifo" else train.write_bytes(content)
    path = _job_with(tmp_path, lambda d: d["run"].update(data={"train": str(train)}))
    assert_refused(run_cli("run", path, "--out", tmp_path / "o"), "run.data", str(train))


def test_a_trace_whose_failures_leave_no_gpu_is_refused_before_simulating(tmp_path):
    doc = yaml.safe_load(TRACE.read_text())
    doc["failures"] = [{"step": 3, "gpus": 8}, {"step": 5, "gpus": 8}]  # the trace starts on 16 GPUs
    trace = write_yaml(tmp_path / "t.yaml", doc)
    assert_refused(run_cli("simulate", trace, "--job", JOB_8B, "--steps", "10"), str(trace),
                   "at step 5 the trace leaves no GPU")
    assert run_cli("simulate", trace, "--job", JOB_8B, "--steps", "4").code != 2  # the loss comes later


def test_a_run_record_with_absurd_seconds_is_refused(tmp_path):
    record = run_record()
    record["steps"][0]["step_time_s"] = 1e308  # finite, but the plots' axis arithmetic overflows
    path = write_json(tmp_path / "run.json", record)
    assert_refused(run_cli("report", path, "--out", tmp_path / "rep"), "steps[0].step_time_s", "<=")


@pytest.mark.parametrize("out", ["file/sub", "/proc/nereus-test", "/sys/nereus-test"])
def test_run_into_an_unwritable_out_folder_is_refused(tmp_path, job, out):
    (tmp_path / "file").write_text("x")
    target = out if out.startswith("/") else str(tmp_path / out)
    assert_refused(run_cli("run", job, "--out", target), "--out", "cannot write into")


def test_a_disk_that_fills_during_a_command_is_one_line_naming_the_file(monkeypatch):
    import nereus.cli as cli

    def fills(args):  # what a checkpoint write meets when the disk fills mid-run
        raise OSError(28, "No space left on device", "/runs/job/step_40/model.safetensors")

    monkeypatch.setattr(cli, "cmd_plan", fills)
    assert_refused(run_cli("plan", JOB_8B), "/runs/job/step_40/model.safetensors", "No space left on device")


def test_a_metric_line_torn_by_a_killed_driver_does_not_block_resume(tmp_path):
    """A driver killed while writing a metric line leaves it torn: the resume goes on, but only after
    keeping the whole file aside (the history is never cut silently; docs/reliability.md)."""
    import io

    from nereus.run.metrics import MetricsDamaged, prepare_resume, resume_lines

    text = '{"step": 1, "a": 1}\n{"step": 2, "a": 2}\n{"step": 3, "a"'  # killed while writing step 3
    assert resume_lines(text, 2) == (['{"step": 1, "a": 1}', '{"step": 2, "a": 2}'], '{"step": 3, "a"')
    path = tmp_path / "metrics.jsonl"
    path.write_text(text)
    warn = io.StringIO()
    assert prepare_resume(path, 2, warn) == ['{"step": 1, "a": 1}', '{"step": 2, "a": 2}']
    assert (tmp_path / "metrics.before-resume-1.jsonl").read_text() == text  # kept, byte for byte
    assert "metrics.before-resume-1.jsonl" in warn.getvalue() and warn.getvalue().count("\n") == 1
    with pytest.raises(MetricsDamaged, match="line 1 is not a metrics record"):
        resume_lines('[1]\n{"no_step": 1}\n' + "[" * 5000 + "\n", 9)


def test_a_wait_past_its_deadline_is_one_line_and_exit_1(monkeypatch, capsys):
    """A worker wait past its deadline (runtime.hosts.waits.WaitTimeout) is the cluster failing, not bad input
    and not a bug: one stderr line naming the wait, exit 1, no traceback file."""
    import nereus.cli as cli
    from nereus.spec.errors import RuntimeFailure

    def stuck(args):
        raise RuntimeFailure("train_step: 1 of 4 workers did not answer within 660 s")

    monkeypatch.setattr(cli, "cmd_plan", stuck)
    assert cli.main(["plan", str(JOB_8B)]) == 1
    err = capsys.readouterr().err
    assert err == "nereus: error: train_step: 1 of 4 workers did not answer within 660 s\n"


def test_wait_timeout_is_a_runtime_failure():
    pytest.importorskip("ray")
    from nereus.runtime.hosts.waits import WaitTimeout
    from nereus.spec.errors import RuntimeFailure

    assert issubclass(WaitTimeout, RuntimeFailure)
