"""Every class of bad input that must be refused before anything runs (docs/reliability.md, "Trust: inputs
checked before anything runs"), each as a named regression test: HF directories (config, tokenizer,
safetensors, Parquet), user reward code, error messages of bounded work, session and run records, resume
history, layouts and sampling that cannot run, hygiene, and YAML 1.2 numbers. The CLI runs in this process;
where a test must prove that nothing started, ``RLJob`` set-up past the checks and ``ray.init`` are
tripwires."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT
from tests.fuzz.cli_util import JOB_8B, assert_refused, run_cli, run_record, tiny_job_doc, write_yaml
from tests.fuzz.hf_util import (
    CONFIG,
    data_rows,
    hf_job_doc,
    model_files,
    safetensors_bytes,
    tensors,
    write_files,
)

pytest.importorskip("transformers")


class ReachedTheRuntime(Exception):
    """Set-up got past every check to where workers start."""


def _tripwire(*args: object, **kwargs: object) -> None:
    raise ReachedTheRuntime("a refused job reached the runtime")


@pytest.fixture
def no_runtime(monkeypatch):
    """`nereus run` stops where it would start workers, and Ray itself cannot start."""
    import ray

    from nereus.run.job import RLJob

    monkeypatch.setattr(RLJob, "_fresh", _tripwire)
    monkeypatch.setattr(RLJob, "_start", _tripwire)
    monkeypatch.setattr(ray, "init", _tripwire)


def _hf_job(tmp_path: Path, **files: object) -> Path:
    """A GRPO job on the tiny HF directory of ``tests.fuzz.hf_util``, with ``files`` replacing its files."""
    model = tmp_path / "model"
    write_files(model, {**model_files(), **files})
    (tmp_path / "train.jsonl").write_text(data_rows())
    return write_yaml(tmp_path / "job.yaml", hf_job_doc(str(model), str(tmp_path / "train.jsonl"),
                                                       str(tmp_path / "out")))


def _refused_run(job: Path, *needles: str, preamble: bool = False) -> None:
    assert_refused(run_cli("run", job), *needles, preamble=preamble)


# ----- HF config.json: types and ranges ------------------------------------------------------------------
@pytest.mark.parametrize(("patch", "needle"), [
    ({"rope_theta": None}, "rope_theta: is null"),
    ({"eos_token_id": []}, "eos_token_id: is an empty list"),
    ({"id2label": 5}, "id2label: expected a mapping"),
    ({"id2label": {"x": "LABEL_0"}}, "label ids are the strings"),
    ({"architectures": "LlamaForCausalLM"}, "architectures: expected a list"),
    ({"architectures": [7]}, "architectures[0]: expected a string"),
    ({"rms_norm_eps": None}, "rms_norm_eps: is null"),
    ({"torch_dtype": "int8"}, "torch_dtype: 'int8' is not a floating-point dtype"),
    ({"pad_token_id": 640}, "pad_token_id: token id 640 is outside the vocabulary"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
                       "original_max_position_embeddings": 8192}}, "high_freq_factor: 1.0 must exceed"),
])
def test_hf_config_values_that_crashed_later_are_refused_by_key(tmp_path, no_runtime, patch, needle):
    job = _hf_job(tmp_path, **{"config.json": json.dumps({**CONFIG, **patch})})
    _refused_run(job, "models.actor.path", needle)
    assert_refused(run_cli("plan", job), needle)  # the same reader for every command


# ----- tokenizer files -------------------------------------------------------------------------------------
def test_a_structurally_wrong_tokenizer_json_is_refused_naming_the_file(tmp_path, no_runtime):
    broken = json.loads(model_files()["tokenizer.json"])
    broken["model"] = {"type": "WordLevel", "vocab": 5}
    job = _hf_job(tmp_path, **{"tokenizer.json": json.dumps(broken)})
    _refused_run(job, "models.actor.path", "tokenizer.json does not load as a tokenizer")


def test_a_fifo_or_a_folder_as_a_tokenizer_file_is_refused_without_hanging(tmp_path, no_runtime):
    job = _hf_job(tmp_path)
    (tmp_path / "model" / "tokenizer.json").unlink()
    os.mkfifo(tmp_path / "model" / "tokenizer.json")
    _refused_run(job, "tokenizer.json", "is not a regular file")
    (tmp_path / "model" / "tokenizer.json").unlink()
    (tmp_path / "model" / "tokenizer.json").mkdir()
    _refused_run(job, "tokenizer.json", "is a directory")


def test_a_chat_template_that_does_not_render_is_refused_up_front(tmp_path, no_runtime):
    job = _hf_job(tmp_path, **{"tokenizer_config.json": json.dumps({**json.loads(model_files()
                                                                                ["tokenizer_config.json"]),
                                                                     "chat_template": "{{ messages[0].x.y() }}"})})
    _refused_run(job, "models.actor.path", "the chat template of", "fails on these messages")


# ----- safetensors headers against the config ---------------------------------------------------------------
def test_an_embedding_one_column_wider_than_the_config_is_refused_by_name(tmp_path, no_runtime):
    """It used to load its first 32 columns and train, exit 0."""
    wide = tensors()
    wide["model.embed_tokens.weight"] = ("F32", [64, 33])
    job = _hf_job(tmp_path, **{"model.safetensors": safetensors_bytes(wide)})
    _refused_run(job, "tensor model.embed_tokens.weight has shape [64, 33]", "needs [64, 32]")


@pytest.mark.parametrize(("damage", "needle"), [
    (lambda b: b[: len(b) - 100], "the file is truncated"),
    (lambda b: b[:4], "too short for a safetensors file"),
    (lambda b: (10**12).to_bytes(8, "little") + b[8:], "its header claims"),
    (lambda b: b + b"\0" * 8, "bytes no tensor holds"),
])
def test_a_damaged_safetensors_file_is_refused_before_ray_starts(tmp_path, no_runtime, damage, needle):
    job = _hf_job(tmp_path, **{"model.safetensors": damage(safetensors_bytes(tensors()))})
    _refused_run(job, "model.safetensors", needle)


@pytest.mark.parametrize(("patch", "needle"), [
    ({"model.layers.0.mlp.up_proj.weight": {"dtype": "F32", "shape": [64, 32], "data_offsets": [0, 8]}},
     "holds 8 bytes but F32 of shape [64, 32] needs 8,192"),
    ({"model.layers.2.mlp.up_proj.weight": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}},
     "is not a weight of the 2-layer model"),
    ({"model.norm.weight": {"dtype": "I32", "shape": [32], "data_offsets": [0, 128]}}, "overlaps"),
    ({"lm_head.weight": {"dtype": "F32", "shape": [64, 32], "data_offsets": [0, 8192], "extra": 1}},
     "extra: unknown key"),
])
def test_every_tensor_of_the_header_is_checked(tmp_path, no_runtime, patch, needle):
    job = _hf_job(tmp_path, **{"model.safetensors": safetensors_bytes(tensors(), header_patch=patch)})
    _refused_run(job, needle)


def test_a_missing_tensor_and_a_pickle_checkpoint_are_refused(tmp_path, no_runtime):
    fewer = tensors()
    del fewer["model.layers.1.self_attn.v_proj.weight"]
    job = _hf_job(tmp_path, **{"model.safetensors": safetensors_bytes(fewer)})
    _refused_run(job, "tensor model.layers.1.self_attn.v_proj.weight is missing")
    (tmp_path / "model" / "model.safetensors").unlink()
    (tmp_path / "model" / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")
    _refused_run(job, "has no model.safetensors", "pytorch_model.bin is a pickle file")


def test_a_sharded_index_naming_a_file_outside_the_folder_is_refused(tmp_path, no_runtime):
    job = _hf_job(tmp_path)
    index = {"weight_map": {name: "../../elsewhere.safetensors" for name in tensors()}}
    (tmp_path / "model" / "model.safetensors.index.json").write_text(json.dumps(index))
    _refused_run(job, "model.safetensors.index.json", "not a file of this directory")


@pytest.mark.slow
def test_shapes_that_disagree_with_the_config_are_refused_before_ray_starts(tmp_path):
    """A real `nereus run` process: one error line, exit 2, and no Ray ever started (no session folder under
    its working directory, no ray_session.json in its output folder)."""
    wide = tensors()
    wide["model.layers.0.mlp.down_proj.weight"] = ("F32", [32, 65])
    job = _hf_job(tmp_path, **{"model.safetensors": safetensors_bytes(wide)})
    done = subprocess.run([sys.executable, "-m", "nereus", "run", str(job)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1 and "tensor model.layers.0.mlp.down_proj.weight has shape [32, 65]" in \
        done.stderr
    assert not (tmp_path / ".tmp").exists() and not (tmp_path / "out" / "ray_session.json").exists()


# ----- Parquet schema ---------------------------------------------------------------------------------------
def test_a_parquet_file_without_verl_columns_is_refused_by_column(tmp_path, no_runtime):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    job = yaml.safe_load(_hf_job(tmp_path).read_text())
    pq.write_table(pa.table({"prompt": [1, 2], "reward_model": [{"ground_truth": "1"}] * 2}), tmp_path / "t.parquet")
    job["run"]["data"]["train"] = str(tmp_path / "t.parquet")
    _refused_run(write_yaml(tmp_path / "job.yaml", job), "t.parquet: field 'prompt': column has type int64")
    pq.write_table(pa.table({"prompt": ["hi"]}), tmp_path / "t.parquet")
    _refused_run(tmp_path / "job.yaml", "field 'reward_model': column is missing")


# ----- user reward code -------------------------------------------------------------------------------------
def _reward_job(tmp_path: Path, source: str | None, target: str = "reward.py:compute_score", **run: object) -> Path:
    doc = tiny_job_doc(str(tmp_path / "out"))
    doc["run"].update(reward_function=target, **run)
    if source is not None:
        (tmp_path / "reward.py").write_text(source)
    return write_yaml(tmp_path / "job.yaml", doc)


MARKER = ("import pathlib\npathlib.Path(__file__).with_name('imported').write_text('ran')\n"
          "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")


@pytest.fixture
def child_in_process(monkeypatch):
    """The user-code check's child (``run.user_check``) runs its same function in this process: one real
    child per test below at most, the suite stays fast."""
    from nereus.run import user_check

    monkeypatch.setattr(user_check, "_ask_child", lambda request, where, timeout: user_check._check_in_child(request))


@pytest.mark.parametrize("source", [
    "x = 1\n",  # the attribute is missing
    "compute_score = 3\n",  # not callable
    "def compute_score(a, b):\n    return 0\n",  # the wrong signature
    "compute_score = max\n",  # a builtin
    "import sys\nsys.exit(3)\n" + MARKER,  # exits at import
])
def test_bad_reward_code_is_refused_in_a_child_before_the_header(tmp_path, no_runtime, source):
    """A real child process imports the file: one error line naming the key, no header, the driver alive."""
    _refused_run(_reward_job(tmp_path, source), "run.reward_function")  # no preamble: the header never printed


def test_good_reward_code_passes_the_child_and_the_run_goes_on(tmp_path, no_runtime):
    r = run_cli("run", _reward_job(tmp_path, MARKER))
    assert r.code == 70 and "ReachedTheRuntime" in r.err and r.err.startswith("nereus run: ")  # the header, then on
    assert (tmp_path / "imported").read_text() == "ran"


def test_a_bad_algorithm_module_is_refused_in_the_same_child_before_the_header(tmp_path, no_runtime):
    (tmp_path / "algos.py").write_text("from nereus.rl.core import register_policy_loss\n"
                                       "@register_policy_loss('two_args')\ndef f(logp, adv):\n    return 0, {}\n")
    job = _reward_job(tmp_path, MARKER, algorithm_modules=["algos.py"])
    _refused_run(job, "run.algorithm_modules[0]", "two_args", "must accept")
    assert not (tmp_path / "imported").exists()  # the modules are checked first; the reward was not reached


def test_a_reward_file_is_not_executed_when_its_job_is_refused(tmp_path, no_runtime, child_in_process):
    """The file writes a marker when imported; each refusal below comes before the job is accepted."""
    job = _reward_job(tmp_path, MARKER)
    doc = yaml.safe_load(job.read_text())
    doc["run"]["top_p"] = 0  # refused when the job loads
    assert_refused(run_cli("run", write_yaml(tmp_path / "bad.yaml", doc)), "run.top_p")
    doc["run"]["top_p"] = 1.0
    doc["run"]["data"] = {"train": str(tmp_path / "missing.jsonl")}  # refused in set-up
    assert_refused(run_cli("run", write_yaml(tmp_path / "bad.yaml", doc)), "missing.jsonl")
    assert not (tmp_path / "imported").exists()
    (tmp_path / "out").mkdir(exist_ok=True)  # a resume with no checkpoint: refused after the user-code check
    assert_refused(run_cli("run", job, "--resume"), "no complete checkpoint", preamble=True)
    r = run_cli("run", job)  # accepted: imported once, then the tripwire where workers would start
    assert (tmp_path / "imported").read_text() == "ran" and r.code == 70 and "ReachedTheRuntime" in r.err


@pytest.mark.parametrize(("source", "needle"), [
    ("import sys\nsys.exit(0)\n" + MARKER, "called sys.exit(0)"),
    ("raise RuntimeError('no GPU here')\n" + MARKER, "raised RuntimeError: no GPU here"),
    ("import no_such_module_xyz\n" + MARKER, "No module named 'no_such_module_xyz'"),
    ("x = 1\n", "has no function 'compute_score'"),
    ("def compute_score(a, b):\n    return 0\n", "must accept (data_source, solution_str, ground_truth"),
    ("def compute_score(*, data_source, solution_str, ground_truth, extra_info=None):\n    return 0\n",
     "by position and by name"),
    ("async def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0\n",
     "async function"),
    ("compute_score = max\n", "not a Python function"),
    ("class compute_score:\n    pass\n", "not a Python function"),
    ("compute_score = 3\n", "has no function 'compute_score' (it is 3)"),
])
def test_a_reward_module_that_misbehaves_at_import_is_one_line_naming_it(tmp_path, no_runtime, child_in_process,
                                                                         source, needle):
    job = _reward_job(tmp_path, source)
    _refused_run(job, "run.reward_function", needle)  # before the header


def test_a_syntax_error_is_refused_when_the_job_loads_without_running_the_file(tmp_path, no_runtime):
    job = _reward_job(tmp_path, MARKER + "def broken(:\n")
    assert_refused(run_cli("plan", job), "run.reward_function", "reward.py:5: syntax error")
    _refused_run(job, "syntax error")
    assert not (tmp_path / "imported").exists()


def test_a_builtin_is_refused_as_a_reward(tmp_path, no_runtime, child_in_process):
    _refused_run(_reward_job(tmp_path, None, "builtins:max"), "builtins:max", "not a Python function")


def test_a_reward_import_that_never_ends_is_refused(tmp_path, no_runtime, child_in_process, monkeypatch):
    import nereus.rl.rewards as rewards

    monkeypatch.setattr(rewards, "IMPORT_TIMEOUT_S", 0.5)
    t0 = time.monotonic()
    _refused_run(_reward_job(tmp_path, "while True:\n    pass\n" + MARKER), "took more than")
    assert time.monotonic() - t0 < 60


def test_a_relative_reward_file_resolves_against_the_job_file(tmp_path, no_runtime, child_in_process, monkeypatch):
    sub = tmp_path / "jobs"
    sub.mkdir()
    (sub / "reward.py").write_text(MARKER)
    doc = tiny_job_doc(str(tmp_path / "out"))
    doc["run"]["reward_function"] = "reward.py:compute_score"
    job = write_yaml(sub / "job.yaml", doc)
    monkeypatch.chdir(tmp_path)  # not where the file is: the job file's folder is
    r = run_cli("run", job)
    assert r.code == 70 and "ReachedTheRuntime" in r.err and (sub / "imported").exists()


# ----- error messages of bounded work and size ---------------------------------------------------------------
ALIAS_BOMB = ("a: &a [x, x, x, x, x, x, x, x, x]\n" +
              "".join(f"{c}: &{c} [{', '.join(['*' + p] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi", strict=True)))


def test_an_alias_bomb_in_a_job_file_is_refused_without_rendering_it(tmp_path):
    doc = yaml.safe_dump(tiny_job_doc(str(tmp_path / "out")))
    t0 = time.monotonic()
    assert_refused(run_cli("plan", write_text(tmp_path / "job.yaml", ALIAS_BOMB + doc)), "alias bomb")
    assert_refused(run_cli("run", tmp_path / "job.yaml"), "alias bomb")
    small = ALIAS_BOMB.splitlines()[:3]  # 729 values: under the cap, so the value itself reaches a key
    bomb_at_key = "\n".join(small) + "\n" + doc.replace("steps: 2", "steps: *c")
    r = run_cli("plan", write_text(tmp_path / "job.yaml", bomb_at_key))
    assert_refused(r, "run.steps: expected an integer")
    assert len(r.err) < 400 and time.monotonic() - t0 < 30


def test_an_alias_bomb_in_an_override_is_refused(tmp_path, no_runtime):
    job = write_yaml(tmp_path / "job.yaml", tiny_job_doc(str(tmp_path / "out")))
    bomb = "[" + ", ".join(["&a [x, x, x, x, x, x, x, x, x]"] + ["*a"] * 8) + "]"
    assert_refused(run_cli("run", job, f"run.steps={bomb}"), "run.steps: expected an integer")
    text = "&r [" + ", ".join(["*r"]) + "]"
    assert_refused(run_cli("run", job, f"run.steps={text}"), "refers to the value that holds it")


def test_messages_are_bounded_whatever_the_input(tmp_path):
    from nereus.spec.errors import SpecError, brief

    shared: list = [1] * 9
    for _ in range(30):  # 9^30 values when expanded
        shared = [shared] * 9
    assert len(brief(shared)) <= 60 and len(brief(10**10000)) < 60 and len(brief("x" * 10**7)) <= 60
    err = SpecError("k" * 10**6, "m" * 10**7)
    assert len(str(err)) < 2500
    doc = tiny_job_doc(str(tmp_path / "out"))
    doc["run"]["z" * 100_000] = 1  # an unknown key as long as a pasted blob
    r = run_cli("plan", write_yaml(tmp_path / "job.yaml", doc))
    assert_refused(r, "unknown key")
    assert len(r.err) < 3000


def write_text(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# ----- session and run records --------------------------------------------------------------------------------
def _run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    (run / "init").mkdir(parents=True)
    return run


def test_a_fifo_as_ray_session_json_does_not_hang_scale_or_cleanup(tmp_path):
    run = _run_dir(tmp_path)
    os.mkfifo(run / "ray_session.json")
    for argv in (["scale", "2", "--dir", run], ["cleanup", "--dir", run]):
        assert_refused(run_cli(*argv), "ray_session.json", "is not a regular file")
    done = subprocess.run([sys.executable, "-m", "nereus", "cleanup", "--dir", str(run)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)  # a real process: a hang would time out
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr


@pytest.mark.parametrize("record", [
    {"owner": "1-2", "driver_pid": 1, "num_cpus": float("inf"), "pids": []},
    {"owner": "1-2", "driver_pid": 10**30, "num_cpus": 4, "pids": []},
    {"owner": "1-2", "driver_pid": 1, "num_cpus": 4, "pids": [2**70]},
    {"owner": ["nested"], "driver_pid": 1, "num_cpus": 4},
    {"owner": "not-a-tag", "driver_pid": 1, "num_cpus": 4},
])
def test_extreme_or_wrong_session_records_are_refused_by_key(tmp_path, record):
    run = _run_dir(tmp_path)
    (run / "ray_session.json").write_text(json.dumps(record))
    for argv in (["scale", "2", "--dir", run], ["cleanup", "--dir", run]):
        assert_refused(run_cli(*argv), "--dir", "ray_session.json")
    (run / "ray_session.json").write_text('{"a": ' * 5000 + "1" + "}" * 5000)
    assert_refused(run_cli("scale", "2", "--dir", run), "nested too deeply")


def test_a_directory_where_scale_json_goes_is_refused_and_leaves_no_temporary(tmp_path):
    run = _run_dir(tmp_path)
    (run / "scale.json").mkdir()
    assert_refused(run_cli("scale", "2", "--dir", run), "scale.json exists and is not a regular file")
    assert sorted(p.name for p in run.iterdir()) == ["init", "scale.json"]


def test_a_scale_request_the_run_cannot_read_is_ignored_once(tmp_path):
    from nereus.run.records import read_scale_request

    path = tmp_path / "scale.json"
    os.mkfifo(path)
    workers, why = read_scale_request(path)
    assert workers is None and "is not a regular file" in why and path.exists()  # not ours to remove
    path.unlink()
    for text in ("1e309", '{"workers": 1e400}', '{"workers": 65}', '{"workers": 2, "x": 1}', "[" * 5000):
        path.write_text(text)
        workers, why = read_scale_request(path)
        assert workers is None and why and not path.exists()
    path.write_text('{"workers": 3}')
    assert read_scale_request(path) == (3, None) and not path.exists()


def test_report_on_malformed_decisions_is_refused_and_writes_nothing(tmp_path):
    record = run_record()
    record["generation_decisions"] = [{"action": "generation", "step": 1, "model_stage": "actor/generation",
                                       "iteration": 2, "live": 3, "decision": {"kind": "move_sequences",
                                                                               "moves": 5, "bytes": "many"}}]
    (tmp_path / "r.json").write_text(json.dumps(record))
    assert_refused(run_cli("report", tmp_path / "r.json", "--out", tmp_path / "rep"),
                   "generation_decisions[0].decision.bytes")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]


def test_a_report_that_fails_midway_leaves_no_half_written_folder(tmp_path, monkeypatch):
    import nereus.sim.report as report

    def full_disk(runs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(report, "timeline", full_disk)  # after the plots and the table are written
    (tmp_path / "r.json").write_text(json.dumps(run_record()))
    assert_refused(run_cli("report", tmp_path / "r.json", "--out", tmp_path / "rep"), "No space left on device")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]  # no rep/, no temporary folder


# ----- resume never discards history -------------------------------------------------------------------------
def _resumable(tmp_path: Path, metrics: bytes | str | None) -> Path:
    """A run folder whose step_1 and init/ verify, and ``metrics.jsonl`` as given (the checks stop before
    any weight is read)."""
    from nereus.run.manifest import write_manifest

    out = tmp_path / "out"
    (out / "step_1").mkdir(parents=True)
    (out / "step_1" / "state.json").write_text(json.dumps({"step": 1, "placements": {}}))
    write_manifest(out / "step_1")
    (out / "init").mkdir()
    (out / "init" / "note.txt").write_text("x")
    write_manifest(out / "init")
    (out / "latest").write_text("1")
    if isinstance(metrics, bytes):
        (out / "metrics.jsonl").write_bytes(metrics)
    elif metrics is not None:
        (out / "metrics.jsonl").write_text(metrics)
    return write_yaml(tmp_path / "job.yaml", tiny_job_doc(str(out)))


def test_resume_refuses_a_garbage_metrics_file_and_leaves_it_as_it_was(tmp_path, no_runtime):
    """It used to resume and leave the file empty: the step history was lost."""
    garbage = "not json at all\n\x00\x01 more\n"
    job = _resumable(tmp_path, garbage)
    assert_refused(run_cli("run", job, "--resume"), "metrics.jsonl: line 1 is not a metrics record",
                   "move the file aside", preamble=True)
    assert (tmp_path / "out" / "metrics.jsonl").read_text() == garbage


@pytest.mark.parametrize("kind", ["fifo", "dir", "binary"])
def test_resume_refuses_a_metrics_file_that_is_not_text(tmp_path, no_runtime, kind):
    job = _resumable(tmp_path, b"\xff\xfe\x00" if kind == "binary" else None)
    path = tmp_path / "out" / "metrics.jsonl"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dir":
        path.mkdir()
    assert_refused(run_cli("run", job, "--resume"), "metrics.jsonl", preamble=True)


def test_resume_with_good_metrics_reaches_the_runtime_and_keeps_them(tmp_path, no_runtime):
    lines = '{"step": 1, "a": 1}\n'
    job = _resumable(tmp_path, lines + '{"step": 2, "a": 2}\n')
    r = run_cli("run", job, "--resume")
    assert r.code == 70 and "ReachedTheRuntime" in r.err  # every check passed
    assert (tmp_path / "out" / "metrics.jsonl").read_text() == lines + '{"step": 2, "a": 2}\n'  # untouched yet


# ----- layouts and sampling that cannot run: one check for estimate, plan and run --------------------------------
def test_estimate_refuses_a_pp_that_does_not_split_the_layers(tmp_path):
    job = {"name": "t24", "models": {"m": {"preset": "qwen2.5-0.5b"}}, "algorithm": {"name": "train"},
           "workload": {"global_batch": 64, "sequence_length": 1024},
           "cluster": {"gpu": "H100-SXM-80GB", "nodes": 1, "gpus_per_node": 8}}
    path = write_yaml(tmp_path / "t24.yaml", job)
    assert_refused(run_cli("estimate", path, "--layout", "tp=1,pp=5"), "--layout", "pp=5 does not split the 24 layers")
    assert_refused(run_cli("estimate", path, "--layout", "tp=1,pp=30", "--gpus", "32"), "pp=30 asks for 30")
    assert run_cli("estimate", path, "--layout", "tp=1,pp=4").code == 0


def test_pp_deeper_than_the_layers_is_refused_by_estimate_plan_and_run_alike(tmp_path, no_runtime):
    doc = tiny_job_doc(str(tmp_path / "out"))
    doc["run"]["layouts"]["actor/training"] = {"layout": "tp=1,pp=4,dp=1,micro_batch_size=8", "ranks": [0, 1, 2, 3]}
    job = write_yaml(tmp_path / "job.yaml", doc)
    needle = "run.layouts.actor/training: pp=4 asks for 4 pipeline stages but the model has 2 layers"
    for argv in (["plan", job], ["run", job], ["estimate", job, "--plan", tmp_path / "p.json"]):
        assert_refused(run_cli(*argv), needle)
    plan = json.loads(run_cli("plan", write_yaml(tmp_path / "ok.yaml", tiny_job_doc("o")), "--json").out)
    first = plan["plan"]["placements"][0]
    first["layout"].update(tp=1, pp=4, dp=1)
    first["gpus"] = [0, 1, 2, 3]
    (tmp_path / "p.json").write_text(json.dumps(plan))
    name = first["model_stage"]
    assert_refused(run_cli("estimate", tmp_path / "ok.yaml", "--plan", tmp_path / "p.json"),
                   f"plan.{name}.layout: pp=4 asks for 4 pipeline stages")


@pytest.mark.parametrize(("override", "why"), [
    ("run.top_p=0", "0.0 keeps no token"),
    ("actor_rollout_ref.rollout.top_p=0", "0.0 keeps no token"),
    ("run.temperature=1e-9", "1e-09 overflows the logits"),
])
def test_degenerate_sampling_is_refused_by_plan_and_run(tmp_path, no_runtime, override, why):
    """Refused under the key as typed: the override's on the command line, run.<key> in the job file."""
    job = write_yaml(tmp_path / "job.yaml", tiny_job_doc(str(tmp_path / "out")))
    key, value = override.split("=")
    assert_refused(run_cli("run", job, override), f"{key}: {why}")
    doc = tiny_job_doc(str(tmp_path / "out"))
    doc["run"][key.split(".")[-1]] = float(value)
    assert_refused(run_cli("plan", write_yaml(tmp_path / "job2.yaml", doc)), f"run.{key.split('.')[-1]}: {why}")


# ----- hygiene ----------------------------------------------------------------------------------------------------
def test_internal_error_tracebacks_go_to_one_pruned_cache_folder(tmp_path, monkeypatch):
    import nereus.cli as cli

    monkeypatch.setenv("NEREUS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cli, "TRACEBACKS_KEPT", 3)
    monkeypatch.setattr(cli, "cmd_plan", lambda args: 1 / 0)
    for _ in range(5):
        r = run_cli("plan", JOB_8B)
    folder = tmp_path / "cache" / "tracebacks"
    log = Path(r.err.split("traceback in ")[1].split(";")[0])
    assert r.code == 70 and log.parent == folder and "ZeroDivisionError" in log.read_text()
    assert len(list(folder.iterdir())) == 3 and (folder.stat().st_mode & 0o777) == 0o700


@pytest.mark.slow
def test_the_local_ray_session_folder_is_not_world_writable(ray_runtime):
    import ray

    session = Path(ray._private.worker._global_node.get_session_dir_path())
    for folder in (session.parent, session, session / "logs", session / "sockets"):
        assert folder.stat().st_mode & 0o077 == 0, f"{folder} is {oct(folder.stat().st_mode)}"


# ----- YAML 1.2 numbers ----------------------------------------------------------------------------------------------
def test_yaml12_exponents_are_numbers_in_job_files_and_overrides(tmp_path, no_runtime):
    from nereus.spec.job import load_job

    text = yaml.safe_dump(tiny_job_doc(str(tmp_path / "out")))
    text = re.sub(r"actor_lr: [0-9.e-]+", "actor_lr: 1e-6", text)
    assert "actor_lr: 1e-6" in text
    path = write_text(tmp_path / "job.yaml", text)
    assert load_job(path).run.actor_lr == 1e-6
    assert load_job(path, ["actor_rollout_ref.actor.optim.lr=3e-6", "run.kl_loss_coef=1E-3"]).run.actor_lr == 3e-6
    assert load_job(path, ["run.kl_loss_coef=1E-3"]).run.kl_loss_coef == 1e-3


@pytest.mark.parametrize(("override", "needle"), [
    ("run.steps=010", "has a leading zero: YAML 1.1 reads it as octal"),
    ("run.overlap=yes", "expected true or false, got 'yes' (job files are YAML 1.2"),
    ("run.steps=1_000", "expected an integer, got '1_000' (job files are YAML 1.2"),
    ("run.steps=1:30", "expected an integer, got '1:30'"),
    ("name=2024-01-01", None),  # text in YAML 1.2 (a date in 1.1): accepted as the job's name
])
def test_yaml11_oddities_are_not_accepted_silently(tmp_path, override, needle):
    from nereus.spec.errors import SpecError
    from nereus.spec.job import load_job

    path = write_yaml(tmp_path / "job.yaml", tiny_job_doc(str(tmp_path / "out")))
    if needle is None:
        assert load_job(path, [override]).name == "2024-01-01"
        return
    with pytest.raises(SpecError) as err:
        load_job(path, [override])
    assert needle in str(err.value)
