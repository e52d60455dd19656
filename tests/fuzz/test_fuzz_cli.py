"""Fuzzing the command line: over a thousand generated bad inputs across every subcommand
and file kind — job, trace, profile, plan, run record, HuggingFace config, checkpoint folder (``latest``,
``MANIFEST.json``, step folders) and flag values — each must be refused with exit code 2 and one stderr line
without a traceback (docs/reliability.md, "One-line errors").

Cases come from a seeded generator, so a failure names a case that reproduces. Every mutation is bad by
construction: a number the reader takes becomes NaN, an infinity, an integer past 64 bits or a value of
another type; an unknown key goes into a mapping that is read key by key; a file becomes a directory, a
FIFO, binary, empty, truncated, nested too deep, or gains a duplicate key. The CLI runs in this process
(``nereus.cli.main``); a few cases run as real processes at the end. Nothing here may reach the workers:
``RLJob`` set-up and ``nereus profile`` measuring are replaced by a tripwire, so a bad input that slipped
through fails its case instead of starting Ray.
"""

from __future__ import annotations

import copy
import json
import os
import random
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT
from tests.fuzz.cli_util import (
    JOB_8B,
    JOB_TRAIN,
    PLAN_64,
    PLAN_128,
    PROFILE,
    TRACE,
    refusal_problem,
    run_cli,
    run_record,
    tiny_job_doc,
)

SEED = 19
BAD_NUMBERS: list[object] = [float("nan"), float("inf"), float("-inf"), 10**30, -(10**30), 2**64, "abc", [1],
                             {"k": 1}, True]
HF_CONFIG = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
             "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 64, "rms_norm_eps": 1e-5,
             "rope_theta": 10000.0, "bos_token_id": 1, "eos_token_id": [2, 3]}


@dataclass
class Case:
    """One generated input: files to create in a fresh folder and the argv (``{d}`` is that folder)."""

    name: str
    argv: list[str]
    files: dict[str, object] = field(default_factory=dict)  # name -> str | bytes | DIR | FIFO | a builder
    preamble: bool = False  # `nereus run` reports its set-up before a checkpoint is refused


DIR, FIFO = object(), object()


# ----- mutations ----------------------------------------------------------------------------------------
def _paths(node: object, prefix: tuple = ()) -> list[tuple[tuple, object]]:
    out = [(prefix, node)]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, (*prefix, i))
    return out


def _set(doc: object, path: tuple, value: object) -> object:
    if not path:
        return value
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = value
    return doc


def _numeric(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def mutate(rng: random.Random, doc: dict, readable: Callable[[tuple], bool], unknown_keys: bool,
           ) -> tuple[str, object]:
    """A copy of ``doc`` made invalid in one place; ``readable(path)`` says whether the reader takes the value
    at ``path`` (run records carry keys the report never reads)."""
    doc = copy.deepcopy(doc)
    nodes = [(p, v) for p, v in _paths(doc) if readable(p)]
    numbers = [(p, v) for p, v in nodes if _numeric(v)]
    mappings = [(p, v) for p, v in nodes if isinstance(v, dict)]
    kind = rng.choice(["number"] * 3 + ["unknown"] * unknown_keys + ["not-a-mapping"])
    if kind == "number" and numbers:
        path, _ = rng.choice(numbers)
        value = rng.choice(BAD_NUMBERS)
        return f"{'.'.join(map(str, path))}={value!r}"[:80], _set(doc, path, copy.deepcopy(value))
    path, node = rng.choice(mappings)
    if kind == "unknown":
        node[f"zz_fuzz_{rng.randrange(1000)}"] = rng.choice([1, "x", [1], {"a": 1}])
        return f"{'.'.join(map(str, path))}+unknown", doc
    return f"{'.'.join(map(str, path))}=scalar", _set(doc, path, rng.choice([5, "text", [1, 2]]))


def file_defect(rng: random.Random, text: str, fmt: str) -> tuple[str, object]:
    """The file itself broken (the same for every file kind)."""
    kind = rng.choice(["dir", "fifo", "binary", "nul", "empty-or-scalar", "truncated", "deep", "duplicate",
                       "syntax"])
    if kind == "dir":
        return kind, DIR
    if kind == "fifo":
        return kind, FIFO
    if kind == "binary":
        return kind, b"\xff" + bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))
    if kind == "nul":
        at = rng.randrange(len(text))
        return kind, text[:at] + "\x00" + text[at:]
    if kind == "empty-or-scalar":
        return kind, rng.choice(["", "42\n", "- a\n- b\n", "null\n", '"text"\n'] if fmt == "yaml" else
                                ["", "42", "[1, 2]", "null", '"text"'])
    if kind == "truncated":
        return kind, text[: rng.randrange(1, max(2, len(text) // 3))]
    if kind == "deep":
        n = rng.choice([100, 1_000, 20_000])
        return f"{kind}{n}", ("a: " if fmt == "yaml" else '{"a": ') + "[" * n + "]" * n + ("" if fmt == "yaml" else "}")
    if kind == "duplicate":
        if fmt == "json":
            return kind, text.rstrip()[:-1].rstrip() + ', "' + json.loads(text).__iter__().__next__() + '": 1}'
        key = rng.choice([k for k in yaml.safe_load(text) if isinstance(k, str)])
        return kind, text + f"\n{key}: 1\n"
    return kind, text + rng.choice(["\n: : [\n", "\n\tx: 1\n", "\nkey: [1, 2\n"] if fmt == "yaml" else
                                   [",", "}", "{"])


def dump(doc: object, fmt: str) -> str:
    return yaml.safe_dump(doc, sort_keys=False) if fmt == "yaml" else json.dumps(doc)


def doc_cases(rng: random.Random, count: int, label: str, doc: dict, fmt: str, argv: Callable[[str], list[str]],
              name: str, readable: Callable[[tuple], bool] = lambda p: True, unknown_keys: bool = True,
              extra: dict | None = None, preamble: bool = False) -> list[Case]:
    """``count`` cases of one file kind: value mutations (two in three) and file defects."""
    cases = []
    for i in range(count):
        if rng.random() < 2 / 3:
            what, bad = mutate(rng, doc, readable, unknown_keys)
            content: object = dump(bad, fmt)
        else:
            what, content = file_defect(rng, dump(doc, fmt), fmt)
        cases.append(Case(f"{label}#{i} {what}", argv(f"{{d}}/{name}"), {name: content, **(extra or {})},
                          preamble))
    return cases


# ----- the file kinds -----------------------------------------------------------------------------------
def job_cases(rng: random.Random) -> list[Case]:
    tiny = tiny_job_doc("{d}/out")
    big, train = yaml.safe_load(JOB_8B.read_text()), yaml.safe_load(JOB_TRAIN.read_text())
    trace = str(TRACE)
    uses = [
        ("plan", tiny, lambda j: ["plan", j]),
        ("plan-8b", big, lambda j: ["plan", j, "--gpus", "64"]),
        ("estimate", big, lambda j: ["estimate", j, "--plan", str(PLAN_64)]),
        ("estimate-train", train, lambda j: ["estimate", j, "--layout", "tp=8,pp=64"]),
        ("simulate", tiny, lambda j: ["simulate", trace, "--job", j, "--steps", "1"]),
        ("transition", big, lambda j: ["transition", j, "--from", str(PLAN_64), "--to", str(PLAN_128)]),
        ("run", tiny, lambda j: ["run", j, "--out", "{d}/out"]),
    ]
    cases = []
    for label, doc, argv in uses:
        cases += doc_cases(rng, 60, f"job/{label}", doc, "yaml", argv, "job.yaml")
    return cases


def trace_cases(rng: random.Random) -> list[Case]:
    doc = yaml.safe_load(TRACE.read_text())
    job = tiny_job_doc("{d}/out")
    extra = {"job.yaml": yaml.safe_dump(job)}
    out = []
    for fmt in ("yaml", "json"):
        out += doc_cases(rng, 80, f"trace/{fmt}", doc, fmt, lambda t: ["simulate", t, "--job", "{d}/job.yaml",
                                                                      "--steps", "1"], f"trace.{fmt}", extra=extra)
    return out


def profile_cases(rng: random.Random) -> list[Case]:
    doc = yaml.safe_load(PROFILE.read_text())
    job = yaml.safe_load(JOB_8B.read_text())
    job["cluster"] = {"profile": "profile.yaml"}
    return doc_cases(rng, 90, "profile", doc, "yaml", lambda p: ["plan", "{d}/job.yaml"], "profile.yaml",
                     extra={"job.yaml": yaml.safe_dump(job)})


def plan_cases(rng: random.Random) -> list[Case]:
    doc = json.loads(PLAN_64.read_text())
    uses = [("estimate", lambda p: ["estimate", str(JOB_8B), "--plan", p]),
            ("from", lambda p: ["transition", str(JOB_8B), "--from", p, "--to", str(PLAN_128)]),
            ("to", lambda p: ["transition", str(JOB_8B), "--from", str(PLAN_64), "--to", p])]
    cases = []
    for label, argv in uses:
        cases += doc_cases(rng, 50, f"plan/{label}", doc, "json", argv, "plan.json")
    return cases


def record_cases(rng: random.Random) -> list[Case]:
    """Run records: only what the report reads is mutated (``sim.report.load_run``)."""
    from nereus.sim.report import STEP_KEYS, SUMMARY_KEYS

    summary_keys = {*SUMMARY_KEYS, "steps", "transitions"}
    step_keys = {*STEP_KEYS, "step", "gpus", "lost_s", "strategy", "phases"}

    def readable(path: tuple) -> bool:
        if len(path) <= 1:
            return not path or path[0] in ("policy", "summary", "steps")
        if path[0] == "summary":
            return path[1] in summary_keys
        return path[0] == "steps" and (len(path) == 2 or path[2] in step_keys)

    good = run_record()
    return doc_cases(rng, 130, "record", good, "json", lambda r: ["report", r, "--out", "{d}/report"],
                     "run.json", readable=readable, unknown_keys=False)


def hf_config_cases(rng: random.Random) -> list[Case]:
    job = tiny_job_doc("{d}/out")
    job["models"]["actor"] = {"hf_config": "config.json"}
    return doc_cases(rng, 70, "hf_config", HF_CONFIG, "json", lambda c: ["plan", "{d}/job.yaml"], "config.json",
                     unknown_keys=False, extra={"job.yaml": yaml.safe_dump(job)})


def layout_cases(rng: random.Random) -> list[Case]:
    bad = ["tp=nan", "tp=0", "tp=-1", f"tp={10**30}", "tp=8,pp=²", "pq=1", "tp", "tp=8,pp=64,dp=100000",
           "tp=8,pp=1e3", "tp=8,pp=64,micro_batch_size=0", "tp=8,pp=64,recompute=maybe", "=", ",,,=1",
           "tp=8,pp=64,fsdp=2", "tp=3,pp=5", "tp=8,pp=64,interleave=100000"]
    return [Case(f"layout#{i} {text}", ["estimate", str(JOB_TRAIN), "--layout", text]) for i, text in
            enumerate(bad)]


def override_cases(rng: random.Random) -> list[Case]:
    """`nereus run JOB key.path=value`: a number of the job made bad on the command line."""
    doc = tiny_job_doc("{d}/out")
    paths = [p for p, v in _paths(doc) if _numeric(v) and all(isinstance(k, str) for k in p)]
    values = [".nan", ".inf", "-.inf", str(10**30), "9" * 5000, "[" * 3000, "abc", "[1]", "{k: 1}", "true",
              "[1, 2", "{a: 1, a: 2}"]
    files = {"job.yaml": yaml.safe_dump(doc)}
    cases = []
    for i in range(60):
        text = f"{'.'.join(rng.choice(paths))}={rng.choice(values)}"
        cases.append(Case(f"override#{i} {text[:60]}", ["run", "{d}/job.yaml", text, "--out", "{d}/out"], files))
    return cases


def data_cases(rng: random.Random) -> list[Case]:
    """`run.data.train`: a prompt file (verl's row format) that is broken."""
    doc = tiny_job_doc("{d}/out")
    doc["run"]["data"] = {"train": "{d}/train.jsonl"}
    good = json.dumps({"data_source": "nereus/reverse", "prompt": [{"role": "user", "content": "rev:12="}],
                       "reward_model": {"style": "rule", "ground_truth": "21"}})
    contents = [DIR, FIFO, b"\xff\xfe" + good.encode(), "[" * 20_000 + "]" * 20_000 + "\n", "not json\n", "[1, 2]\n",
                good + "\n" + "{" + "\n", '{"a": ' + "9" * 5000 + "}\n", good + "\n" + good[:-5] + "\n", "",
                json.dumps({"prompt": 3}) + "\n", json.dumps({"prompt": [{"role": "user"}]}) + "\n"]
    cases = []
    for i in range(40):
        content = rng.choice(contents)
        cases.append(Case(f"data#{i} {contents.index(content)}", ["run", "{d}/job.yaml", "--out", "{d}/out"],
                          {"job.yaml": yaml.safe_dump(doc), "train.jsonl": content}))
    return cases


def checkpoint_cases(rng: random.Random) -> list[Case]:
    """`nereus run --resume` on broken checkpoint folders: ``latest``, step folders, manifests, ``init/``.
    No folder verifies (each has a defect), so no case can resume."""
    latest_values = ["", "garbage", "-3", "1e9", str(10**30), "\x00\x01", "2\n3", " 1 ", "01", "step_1", "NaN"]

    def manifest(rng: random.Random) -> object:
        return rng.choice(["not json", "[]", '{"files": 3}', '{"files": {"state.json": {}}}', '{"a": 1}', "",
                           b"\xff\xfe", DIR, '{"files": {"../../etc/passwd": {"bytes": 1, "sha256": "0"}}}',
                           "[" * 5000 + "]" * 5000, json.dumps({"files": {"state.json": {"bytes": -1}}})])

    cases = []
    for i in range(120):
        files: dict[str, object] = {"job.yaml": yaml.safe_dump(tiny_job_doc("{d}/out"))}
        shape = rng.choice(["latest", "step", "init", "latest-dir", "out-file"])
        if shape == "out-file":
            files["out"] = "not a folder"
        elif shape == "latest-dir":
            files["out/latest"] = DIR
        else:
            files["out/latest"] = rng.choice(latest_values) if shape == "latest" else str(rng.choice([1, 2]))
            for step in rng.sample([1, 2], rng.randrange(0, 3)):
                files[f"out/step_{step}/state.json"] = rng.choice(['{"step": 1}', "{", b"\xff", "[]"])
                if rng.random() < 0.8:
                    files[f"out/step_{step}/MANIFEST.json"] = manifest(rng)
            if shape == "init" or rng.random() < 0.5:
                files["out/init/MANIFEST.json"] = manifest(rng)
        cases.append(Case(f"checkpoint#{i} {shape}", ["run", "{d}/job.yaml", "--resume", "--out", "{d}/out"],
                          files, preamble=True))
    return cases


def flag_cases(rng: random.Random) -> list[Case]:
    """Bad flag values and outputs for every subcommand."""
    tiny = {"job.yaml": yaml.safe_dump(tiny_job_doc("{d}/out"))}
    j8, p64, p128, tr = str(JOB_8B), str(PLAN_64), str(PLAN_128), str(TRACE)
    outs = ["{d}/missing/x.json", "{d}/file/x.json", "{d}", "/dev/full"]
    pools: list[tuple[str, list[str], list[str], dict]] = [
        ("plan --gpus", ["plan", j8, "--gpus"], ["0", "-1", str(10**12), "100001", "nan", "abc", "", "1e3"], {}),
        ("plan --out", ["plan", "{d}/job.yaml", "--out"], outs, tiny),
        ("estimate --gpus", ["estimate", j8, "--plan", p64, "--gpus"], ["0", "-8", str(10**15), "x"], {}),
        ("simulate --steps", ["simulate", tr, "--job", "{d}/job.yaml", "--steps"],
         ["0", "-5", str(10**12), "100001", "x", "1.5"], tiny),
        ("simulate --seed", ["simulate", tr, "--job", "{d}/job.yaml", "--steps", "1", "--seed"],
         ["-1", str(2**32), str(10**30), "nan"], tiny),
        ("simulate --policy", ["simulate", tr, "--job", "{d}/job.yaml", "--policy"], ["bogus", "", "NEREUS"], tiny),
        ("simulate --out", ["simulate", tr, "--job", "{d}/job.yaml", "--steps", "1", "--out"], outs[:3], tiny),
        ("transition --chunk-mb", ["transition", j8, "--from", p64, "--to", p128, "--chunk-mb"],
         ["nan", "inf", "-inf", "0", "-1", "1e-9", "1e12", "x"], {}),
        ("transition --storage", ["transition", j8, "--from", p64, "--to", p128, "--storage-gb-per-s"],
         ["nan", "inf", "0", "-2", "1e9"], {}),
        ("transition --timeline", ["transition", j8, "--from", p64, "--to", p128, "--timeline"], outs, {}),
        ("transition --graph", ["transition", j8, "--from", p64, "--to", p128, "--graph"], outs, {}),
        ("profile --workers", ["profile", "--workers"], ["0", "1", "-3", "1000", "x"], {}),
        ("profile --memory-gb", ["profile", "--memory-gb"], ["nan", "inf", "0", "-1", "1e9"], {}),
        ("profile --out", ["profile", "--out"], outs[:3], {}),
        ("run --workers", ["run", "{d}/job.yaml", "--out", "{d}/o", "--workers"], ["0", "-1", "65", "1000"], tiny),
        ("run --out", ["run", "{d}/job.yaml", "--resume", "--out"], ["{d}/typo", "{d}/file"], tiny),
        ("run --out new", ["run", "{d}/job.yaml", "--out"], ["{d}/file", "{d}/file/sub", "/proc/nereus-fuzz"], tiny),
        ("report --out", ["report", "{d}/run.json", "--out"], ["{d}/file", "{d}/file/sub"],
         {"run.json": json.dumps(run_record())}),
        ("scale", ["scale"], ["0", "-1", "65", "1000", "x"], {}),
        ("scale --dir", ["scale", "2", "--dir"], ["{d}", "{d}/file", "{d}/missing"], {}),
        ("usage", [], ["plan", "frobnicate", "estimate", "simulate", "transition", "report"], {}),
    ]
    cases: list[Case] = []
    for label, argv, values, files in pools:
        for v in values:
            case_argv = [*argv, v] if argv else [v]
            cases.append(Case(f"flag/{label} {v!r}", case_argv, {"file": "x", **files}))
    # `nereus cleanup --dir RUN` with a broken ray_session.json (never a mapping: a record names processes to kill)
    for session in [DIR, b"\xff\xfe", "", "not json", "[1, 2]", "42", "[" * 5000 + "]" * 5000, '"text"']:
        cases.append(Case(f"flag/cleanup --dir {session if isinstance(session, str) else 'dir/binary'}"[:60],
                          ["cleanup", "--dir", "{d}"], {"ray_session.json": session}))
    cases.append(Case("flag/cleanup --dir missing", ["cleanup", "--dir", "{d}/missing"]))
    return cases


def all_cases() -> dict[str, list[Case]]:
    rng = random.Random(SEED)
    kinds = {"job": job_cases, "trace": trace_cases, "profile": profile_cases, "plan": plan_cases,
             "record": record_cases, "hf_config": hf_config_cases, "layout": layout_cases,
             "checkpoint": checkpoint_cases, "override": override_cases, "data": data_cases,
             "flags": flag_cases}
    return {k: make(random.Random(f"{SEED}:{k}:{rng.random()}")) for k, make in kinds.items()}


CASES = all_cases()


# ----- running them -------------------------------------------------------------------------------------
class ReachedTheRuntime(Exception):
    """A bad input got past every check to the point of starting work."""


def _tripwire(*args: object, **kwargs: object) -> None:
    raise ReachedTheRuntime("a fuzz case reached the runtime")


@pytest.fixture
def no_runtime(monkeypatch):
    """`nereus run` and `nereus profile` stop where they would start workers or measure."""
    from nereus.run.job import RLJob
    from nereus.runtime.cluster import profile

    monkeypatch.setattr(RLJob, "_fresh", _tripwire)
    monkeypatch.setattr(RLJob, "_start", _tripwire)
    monkeypatch.setattr(profile, "measure", _tripwire)


def _materialise(case: Case, folder: Path) -> list[str]:
    folder.mkdir(parents=True)
    for name, content in case.files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if content is DIR:
            path.mkdir()
        elif content is FIFO:
            os.mkfifo(path)
        elif isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(str(content).replace("{d}", str(folder)))
    return [a.replace("{d}", str(folder)) for a in case.argv]


def _run_all(kind: str, tmp_path: Path) -> None:
    problems = []
    for i, case in enumerate(CASES[kind]):
        argv = _materialise(case, tmp_path / f"c{i}")
        problem = refusal_problem(run_cli(*argv), preamble=case.preamble)
        if problem:
            problems.append(f"{case.name}: nereus {' '.join(argv)}\n    {problem}")
    assert not problems, f"{len(problems)} of {len(CASES[kind])} {kind} cases:\n" + "\n".join(problems[:15])


@pytest.mark.parametrize("kind", list(CASES))
def test_bad_input_is_refused_in_one_line(kind, tmp_path, no_runtime):
    _run_all(kind, tmp_path)


def test_there_are_over_a_thousand_cases_over_every_subcommand():
    cases = [c for kind in CASES.values() for c in kind]
    assert len(cases) >= 1000
    commands = {c.argv[0] for c in cases if c.argv}
    assert {"plan", "estimate", "simulate", "report", "transition", "profile", "run", "scale", "cleanup"} <= commands


@pytest.mark.parametrize("argv,files", [
    (["plan", "{d}"], {}),
    (["simulate", "{d}/t.yaml", "--job", str(JOB_8B)], {"t.yaml": b"\xff\x00binary"}),
    (["plan", str(JOB_8B), "--gpus", str(10**12)], {}),
    (["transition", str(JOB_8B), "--from", str(PLAN_64), "--to", str(PLAN_128), "--chunk-mb", "nan"], {}),
    (["report", "{d}/r.json"], {"r.json": '{"policy": "x", "steps": [], "summary": {}}'}),
])
def test_bad_input_in_a_real_process(tmp_path, argv, files):
    argv = _materialise(Case("subprocess", argv, files), tmp_path / "c")
    done = subprocess.run([sys.executable, "-m", "nereus", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("nereus: error: ")
