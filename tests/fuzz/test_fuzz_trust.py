"""Fuzzing the inputs checked before anything runs (docs/reliability.md, "Trust: inputs checked before
anything runs"): 850 seeded bad inputs on the surfaces the first suite (``test_fuzz_cli``) does not reach:
HF model directories (``config.json``, tokenizer files, safetensors headers and indexes), user reward
files and modules, Ray session records and scale requests, damaged run records (report decisions,
``metrics.jsonl`` on resume), alias bombs, layouts and sampling that cannot run, and cluster addresses.
Each must exit 2 (or 1 for a cluster failure) with one error line and no traceback, and none may hang: a
case that runs past ``CASE_DEADLINE_S`` dumps every thread's stack and ends the test process.

Every mutation is bad by construction, per field: a value of another type, NaN, an infinity, past 64 bits,
out of range, null where nothing means null, a list that must not be empty; a tensor whose name, shape,
dtype or byte range disagrees with the config or the file; a file that is a directory, FIFO, binary,
truncated, nested too deep or with a duplicate key. The CLI runs in this process, with tripwires where
workers would start and on ``ray.init``; a few cases run as real processes at the end.
"""

from __future__ import annotations

import copy
import faulthandler
import json
import os
import random
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent import futures
from pathlib import Path

import pytest
import yaml

from nereus.spec.hf_files import JSON_TOKENIZER_FILES
from tests.conftest import ROOT
from tests.fuzz.cli_util import refusal_problem, run_cli, run_record, tiny_job_doc
from tests.fuzz.hf_util import (
    CONFIG,
    TOKENIZER_CONFIG,
    data_rows,
    hf_job_doc,
    safetensors_bytes,
    tensors,
    tokenizer_json,
)
from tests.fuzz.test_fuzz_cli import DIR, FIFO, Case, _materialise, file_defect

pytest.importorskip("transformers")

SEED = 28
CASE_DEADLINE_S = 120  # far above any case (the slowest loads a tokenizer): past it, a case hangs
NAN, INF = float("nan"), float("inf")
GENERIC_BAD = [NAN, INF, -INF, 10**30, -(10**30), 2**64, "abc", {"k": 1}, True, [None]]


def _job_files(d: str = "{d}") -> dict[str, object]:
    """The tiny HF model directory, its data file and a GRPO job on them."""
    doc = hf_job_doc(f"{d}/model", f"{d}/train.jsonl", f"{d}/out")
    return {"model/config.json": json.dumps(CONFIG), "model/model.safetensors": safetensors_bytes(tensors()),
            "model/tokenizer.json": TOKENIZER, "model/tokenizer_config.json": json.dumps(TOKENIZER_CONFIG),
            "train.jsonl": data_rows(), "job.yaml": yaml.safe_dump(doc)}


TOKENIZER = tokenizer_json()
RUN_HF = ["run", "{d}/job.yaml"]


# ----- HF config.json -------------------------------------------------------------------------------------
# key -> values that are bad for it whatever the others are (lists are valid token ids, so not for those)
REQUIRED_INTS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
CONFIG_BAD: dict[str, list[object]] = {
    **{k: [*GENERIC_BAD, None, 0, -1, 1.5, [2]] for k in REQUIRED_INTS},
    "num_key_value_heads": [*GENERIC_BAD, 0, 3, -2, 1.5],
    "rms_norm_eps": [*GENERIC_BAD, None, 0, -1e-5, 2.0],
    "rope_theta": [*GENERIC_BAD, None, 0, 0.5, 1e13],
    "max_position_embeddings": [*GENERIC_BAD, 0, -5, 2**23],
    "bos_token_id": [NAN, INF, "abc", {"k": 1}, True, [], [64], [-1], 64, -1, 10**30, ["x"]],
    "eos_token_id": [NAN, "abc", {"k": 1}, False, [], [2, 64], [[2]], 64, -3, 2**64],
    "pad_token_id": [NAN, "abc", {"k": 1}, True, [], 640, -1, [1.5]],
    "architectures": ["LlamaForCausalLM", 5, [3], [""], [], {"a": 1}, [None]],
    "id2label": [5, "x", [1], {"x": "a"}, {"0": 5}, {"-1": "a"}, {"²": "a"}],
    "label2id": [5, "x", [1], {"a": "0"}, {"a": True}, {"a": NAN}],
    "num_labels": [*GENERIC_BAD, 0, -1, 2**17],
    "torch_dtype": [5, "int8", "float8", "", ["float32"], True],
    "dtype": [5, "int4", "uint8", {"a": 1}],
    "tie_word_embeddings": [5, "yes", [True], 1.0],
    "hidden_act": ["gelu", 5, None, ["silu"], "relu"],
    "model_type": ["gpt2", 5, ["llama"], "bert"],
    "head_dim": [*GENERIC_BAD, 16, 4],
    "attention_bias": [True, "x", 5],
    "mlp_bias": [True, [1]],
    "rope_scaling": [5, "linear", [1], {"rope_type": "yarn", "factor": 2.0}, {"type": "dynamic"},
                     {"rope_type": "llama3", "factor": 0.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
                     {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
                     {"rope_type": "llama3", "factor": 8.0}, {"rope_theta": None}, {"partial_rotary_factor": 0.5}],
    "rope_parameters": [7, {"rope_theta": NAN}, {"rope_type": "longrope"}],
    "partial_rotary_factor": [0.5, "x", NAN],
}


def hf_config_cases(rng: random.Random) -> list[Case]:
    """``config.json`` of an HF directory with one (sometimes two) bad keys, or the file itself broken; read
    by ``nereus run`` (the pre-flight) or ``nereus plan`` (the job's reader)."""
    cases = []
    for i in range(150):
        files = _job_files()
        argv = RUN_HF if rng.random() < 0.6 else ["plan", "{d}/job.yaml"]
        if rng.random() < 0.85:
            config = copy.deepcopy(CONFIG)
            keys = rng.sample(sorted(CONFIG_BAD), rng.choice([1, 1, 1, 2]))
            for key in keys:
                config[key] = copy.deepcopy(rng.choice(CONFIG_BAD[key]))
            what = ",".join(f"{k}={config[k]!r}"[:40] for k in keys)
            files["model/config.json"] = json.dumps(config)
        else:
            what, files["model/config.json"] = file_defect(rng, json.dumps(CONFIG), "json")
        cases.append(Case(f"hf_config#{i} {argv[0]} {what}", argv, files))
    return cases


# ----- safetensors ----------------------------------------------------------------------------------------
def _header_mutation(rng: random.Random) -> tuple[str, bytes]:
    """A safetensors file of the tiny model with one header entry made wrong."""
    entries = tensors()
    name = rng.choice(sorted(entries))
    dtype, shape = entries[name]
    size = 4
    for d in shape:
        size *= d
    kind = rng.choice(["shape+1", "shape-dim", "shape+dim", "transpose", "dtype", "dtype-size", "offsets",
                       "meta-type", "missing", "unknown-tensor", "extra-layer", "entry-key", "entry-type"])
    patch: dict = {}
    if kind == "shape+1":
        bigger = list(shape)
        bigger[rng.randrange(len(bigger))] += 1
        entries[name] = (dtype, bigger)
    elif kind == "shape-dim" and len(shape) > 1:
        entries[name] = (dtype, [shape[0] * shape[1]])
    elif kind == "shape+dim":
        entries[name] = (dtype, [*shape, 1] if rng.random() < 0.5 else [1, *shape])
    elif kind == "transpose" and len(shape) == 2 and shape[0] != shape[1]:
        entries[name] = (dtype, shape[::-1])
    elif kind == "dtype":
        entries[name] = (rng.choice(["I32", "U8", "BOOL", "I64"]), shape)
    elif kind in ("dtype-size", "offsets", "meta-type", "entry-key", "entry-type"):
        bad: object
        if kind == "dtype-size":
            bad = {"dtype": rng.choice(["F16", "BF16", "F64"]), "shape": shape, "data_offsets": [0, size]}
        elif kind == "offsets":
            bad = {"dtype": dtype, "shape": shape, "data_offsets": rng.choice(
                [[size, 0], [0, size - 4], [0, size + 4], [0], [0, size, 8], [-4, size - 4], [0.0, float(size)],
                 ["0", str(size)], [0, 2**70], [0, None]])}
        elif kind == "meta-type":
            bad = {"dtype": rng.choice([5, None, "F99", "f32", ["F32"]]), "shape": shape, "data_offsets": [0, size]}
        elif kind == "entry-key":
            bad = {"dtype": dtype, "shape": shape, "data_offsets": [0, size], rng.choice(["x", "offsets"]): 1}
        else:
            bad = rng.choice([5, "x", [1, 2], None, {"shape": shape}])
        patch[name] = bad
    elif kind == "missing":
        del entries[name]
    elif kind == "unknown-tensor":
        entries[rng.choice(["model.extra.weight", "score.weight", "lm_head.bias", "transformer.wte.weight"])] = \
            ("F32", [4, 32])
    else:  # a layer the 2-layer config does not have, or a bias Llama has not
        entries[rng.choice(["model.layers.2.input_layernorm.weight", "model.layers.0.self_attn.q_proj.bias"])] = \
            ("F32", [32])
    if kind in ("shape-dim", "transpose") and entries[name] == (dtype, shape):
        entries[name] = (dtype, [shape[0] + 1, *shape[1:]])
    return f"{kind}:{name}", safetensors_bytes(entries, header_patch=patch)


def _file_mutation(rng: random.Random) -> tuple[str, object]:
    good = safetensors_bytes(tensors())
    length = int.from_bytes(good[:8], "little")
    kind = rng.choice(["truncate", "append", "length-big", "length-small", "length-zero", "not-json", "not-utf8",
                       "list", "duplicate", "deep", "empty", "dir", "fifo", "huge-meta", "meta-not-str"])
    header = json.loads(good[8:8 + length])
    if kind == "truncate":
        return kind, good[: rng.randrange(1, len(good) - 1)]
    if kind == "append":
        return kind, good + bytes(rng.randrange(1, 64))
    if kind == "length-big":
        return kind, (length + rng.randrange(1, 10**6)).to_bytes(8, "little") + good[8:]
    if kind == "length-small":
        return kind, (length - rng.randrange(1, min(length, 200))).to_bytes(8, "little") + good[8:]
    if kind == "length-zero":
        return kind, bytes(8) + good[8:]
    if kind in ("not-json", "not-utf8", "list", "duplicate", "deep"):
        raw = {"not-json": b"{not json" + b" " * 10, "not-utf8": b'{"\xff\xfe": 1}', "list": b"[1, 2, 3]",
               "duplicate": good[8:8 + length - 1] + b', "__metadata__": {}}',
               "deep": b'{"__metadata__": ' + b"[" * 3000 + b"]" * 3000 + b"}"}[kind]
        return kind, len(raw).to_bytes(8, "little") + raw + good[8 + length:]
    if kind == "empty":
        return kind, b""
    if kind == "dir":
        return kind, DIR
    if kind == "fifo":
        return kind, FIFO
    header["__metadata__"] = {"format": 5} if kind == "meta-not-str" else {"x": [1] * 10}
    raw = json.dumps(header).encode()
    return kind, len(raw).to_bytes(8, "little") + raw + good[8 + length:]


def _index_mutation(rng: random.Random) -> tuple[str, dict[str, object]]:
    """A sharded checkpoint (two shard files and an index) with one inconsistency."""
    names = sorted(tensors())
    half = {n: tensors()[n] for n in names[: len(names) // 2]}
    rest = {n: tensors()[n] for n in names[len(names) // 2:]}
    weight_map = {**{n: "model-00001-of-00002.safetensors" for n in half},
                  **{n: "model-00002-of-00002.safetensors" for n in rest}}
    shards = {"model/model-00001-of-00002.safetensors": safetensors_bytes(half),
              "model/model-00002-of-00002.safetensors": safetensors_bytes(rest)}
    kind = rng.choice(["outside", "absolute", "missing-file", "wrong-file", "unlisted", "map-type", "entry-type",
                       "not-json", "dir-shard"])
    name = rng.choice(names)
    if kind == "outside":
        weight_map[name] = "../model.safetensors"
    elif kind == "absolute":
        weight_map[name] = "/etc/passwd"
    elif kind == "missing-file":
        weight_map[name] = "model-00003-of-00002.safetensors"
    elif kind == "wrong-file":
        weight_map[name] = ("model-00002-of-00002.safetensors" if weight_map[name].startswith("model-00001")
                            else "model-00001-of-00002.safetensors")
    elif kind == "unlisted":
        del weight_map[name]
    elif kind == "dir-shard":
        shards["model/model-00002-of-00002.safetensors"] = DIR
    index: object = {"metadata": {}, "weight_map": weight_map}
    if kind == "map-type":
        index = {"weight_map": rng.choice([[1], "x", 5])}
    elif kind == "entry-type":
        weight_map[name] = rng.choice([5, None, ["a"]])
    files: dict[str, object] = {"model/model.safetensors.index.json": "{not json" if kind == "not-json" else
                                json.dumps(index), **shards}
    return kind, files


def safetensors_cases(rng: random.Random) -> list[Case]:
    cases = []
    for i in range(170):
        files = _job_files()
        roll = rng.random()
        if roll < 0.55:
            what, files["model/model.safetensors"] = _header_mutation(rng)
        elif roll < 0.85:
            what, files["model/model.safetensors"] = _file_mutation(rng)
        else:
            what, shard_files = _index_mutation(rng)
            del files["model/model.safetensors"]
            files.update(shard_files)
        cases.append(Case(f"safetensors#{i} {what}", RUN_HF, files))
    return cases


# ----- tokenizer files ------------------------------------------------------------------------------------
def _tokenizer_json_defect(rng: random.Random) -> tuple[str, object]:
    doc = json.loads(TOKENIZER)
    kind = rng.choice(["model-type", "vocab-type", "no-model", "list", "empty-object", "model-null", "file"])
    if kind == "model-type":
        doc["model"]["type"] = rng.choice(["Nope", 5, None])
    elif kind == "vocab-type":
        doc["model"]["vocab"] = rng.choice([5, "x", [1, 2]])
    elif kind == "no-model":
        del doc["model"]
    elif kind == "model-null":
        doc["model"] = None
    elif kind == "list":
        return kind, "[1, 2]"
    elif kind == "empty-object":
        return kind, "{}"
    else:
        return file_defect(rng, TOKENIZER, "json")
    return kind, json.dumps(doc)


def tokenizer_cases(rng: random.Random) -> list[Case]:
    templates = [5, [], {"x": 1}, "{% for %}", "{{ messages[0].nope.nope() }}", "{% if %}",
                 "{{ raise_exception('no') }}"]
    cases = []
    for i in range(80):
        files = _job_files()
        kind = rng.choice(["tokenizer.json", "tokenizer.json", "tokenizer_config.json", "template", "no-template",
                           "side-file", "no-tokenizer"])
        if kind == "tokenizer.json":
            what, files["model/tokenizer.json"] = _tokenizer_json_defect(rng)
        elif kind == "tokenizer_config.json":
            what, files["model/tokenizer_config.json"] = file_defect(rng, json.dumps(TOKENIZER_CONFIG), "json")
            if what.startswith("empty-or-scalar") or what == "duplicate":  # `{}` and duplicates read as config
                files["model/tokenizer_config.json"] = rng.choice(["[1, 2]", "42", '"text"', "null"])
        elif kind == "template":
            template = rng.choice(templates)
            what = f"chat_template={template!r}"[:50]
            files["model/tokenizer_config.json"] = json.dumps({**TOKENIZER_CONFIG, "chat_template": template})
        elif kind == "no-template":
            what = "no chat_template"
            files["model/tokenizer_config.json"] = json.dumps({k: v for k, v in TOKENIZER_CONFIG.items()
                                                               if k != "chat_template"})
        elif kind == "side-file":
            name = rng.choice(["special_tokens_map.json", "generation_config.json", "added_tokens.json",
                               "chat_template.json", "vocab.json", "merges.txt", "chat_template.jinja"])
            defect = rng.choice(["dir", "fifo"] + (["list"] if name in JSON_TOKENIZER_FILES else []))
            what = f"{name}:{defect}"
            files[f"model/{name}"] = {"dir": DIR, "fifo": FIFO}.get(defect, "[1, 2]")
        else:
            what = "no tokenizer files"
            del files["model/tokenizer.json"]
            del files["model/tokenizer_config.json"]
        cases.append(Case(f"tokenizer#{i} {kind} {what}", RUN_HF, files))
    return cases


# ----- user reward code -----------------------------------------------------------------------------------
GOOD_FN = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n"
REWARD_SOURCES = [
    "def compute_score(:\n", "compute_score = \n", GOOD_FN + "\x00\n", "raise ValueError('at import')\n" + GOOD_FN,
    "import sys\nsys.exit(0)\n" + GOOD_FN, "import sys\nsys.exit(3)\n" + GOOD_FN, "import sys\nsys.exit('bye')\n",
    "raise SystemExit\n" + GOOD_FN, "import no_such_module_for_nereus\n" + GOOD_FN, "1 / 0\n" + GOOD_FN,
    "def f():\n    f()\nf()\n" + GOOD_FN, "x = " + "(" * 300 + "1" + ")" * 300 + "\n" + GOOD_FN,
    "x = 1\n", "def other(data_source, solution_str, ground_truth, extra_info=None):\n    return 0\n",
    "def compute_score():\n    return 0\n", "def compute_score(a, b):\n    return 0\n",
    "def compute_score(data_source, solution_str, ground_truth, extra_info, more):\n    return 0\n",
    "def compute_score(*, data_source, solution_str, ground_truth, extra_info=None):\n    return 0\n",
    "def compute_score(a, b, c, extra_info=None):\n    return 0\n",
    "async def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0\n",
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    yield 0\n",
    "compute_score = max\n", "from math import sqrt as compute_score\n", "compute_score = 3\n",
    "compute_score = None\n", "class compute_score:\n    pass\n",
    "class C:\n    def __call__(self, data_source, solution_str, ground_truth, extra_info=None):\n        return 0\n"
    "compute_score = C()\n", "compute_score = lambda a: 0\n", "import os\ncompute_score = os.getcwd\n",
    "if True:\n    def compute_score(a):\n        return 0\n", "try:\n    import nope_xyz\nexcept ImportError:\n"
    "    raise RuntimeError('optional dependency missing')\n" + GOOD_FN,
]
REWARD_TARGETS = ["builtins:max", "math:sqrt", "os:getcwd", "json:loads", "nereus.rl.task:TASK_SOURCE",
                  "no_such_pkg_for_nereus.mod:f", "no_colon", ":f", "reward.py:", "reward.py:1x", "a b:c",
                  "reward.py:compute score", "missing.py:compute_score", "{d}:compute_score",
                  "{d}/adir.py:compute_score", "{d}/fifo.py:compute_score", "{d}/binary.py:compute_score",
                  "nereus.rl.rewards:RewardRouter", "nereus.rl.rewards:normalize_answer"]


def reward_cases(rng: random.Random) -> list[Case]:
    """``run.reward_function``: a file that misbehaves when imported or defines no usable function, or a
    target that is no Python function with verl's signature."""
    cases = []
    for i in range(110):
        doc = tiny_job_doc("{d}/out")
        files: dict[str, object] = {"adir.py": DIR, "fifo.py": FIFO, "binary.py": b"\xff\xfe\x00def x",
                                    "sub/placeholder": ""}
        if rng.random() < 0.7:
            source = rng.choice(REWARD_SOURCES)
            files["sub/reward.py"] = source
            doc["run"]["reward_function"] = "reward.py:compute_score"  # relative: resolves against the job file
            what = source.splitlines()[0][:40] if source.strip() else "empty"
        else:
            what = rng.choice(REWARD_TARGETS)
            doc["run"]["reward_function"] = what
        files["sub/job.yaml"] = yaml.safe_dump(doc)
        cases.append(Case(f"reward#{i} {what!r}", ["run", "{d}/sub/job.yaml"], files, preamble=True))
    return cases


# ----- session records and scale requests -----------------------------------------------------------------
SESSION = {"owner": "4194000-123", "driver_pid": 4194000, "session_dir": "/nowhere", "gcs_address": "127.0.0.1:1",
           "num_cpus": 4, "auth": "token", "pids": [4194001, 4194002]}
SESSION_BAD = {"owner": [5, ["x"], "x", "12", "12-", "-5", "a-b", "1-2-3", "１-2"],
               "driver_pid": [*GENERIC_BAD, 0, -1, 2**22 + 1, 1.5],
               "num_cpus": [*GENERIC_BAD, -1, 1.5, 10**6],
               "pids": [5, "x", [NAN], [10**30], [True], ["1"], {"a": 1}, [[1]]]}
NEEDS = {"scale": "num_cpus", "cleanup": "owner"}  # the key each command cannot do without


def session_cases(rng: random.Random) -> list[Case]:
    """``nereus scale N --dir`` and ``nereus cleanup --dir`` on a run folder whose ``ray_session.json`` (or
    ``scale.json``) is broken."""
    cases = []
    for i in range(110):
        argv = rng.choice([["scale", str(rng.choice([1, 2, 3])), "--dir", "{d}/run"], ["cleanup", "--dir", "{d}/run"]])
        files: dict[str, object] = {"run/init/x": ""}
        roll = rng.random()
        if roll < 0.6:
            record = copy.deepcopy(SESSION)
            key = rng.choice(sorted(SESSION_BAD))
            record[key] = copy.deepcopy(rng.choice(SESSION_BAD[key]))
            if rng.random() < 0.15:  # the key the command needs, missing or null
                key = NEEDS[argv[0]]
                record[key] = None
                if rng.random() < 0.5:
                    del record[key]
            what = f"{key}={record.get(key)!r}"[:50]
            files["run/ray_session.json"] = json.dumps(record)
        elif roll < 0.9:
            what, files["run/ray_session.json"] = file_defect(rng, json.dumps(SESSION), "json")
            if what in ("duplicate",) and argv[0] == "scale":
                files["run/ray_session.json"] = json.dumps(SESSION)[:-1] + ', "owner": "1-2"}'
        else:
            argv = ["scale", "2", "--dir", "{d}/run"]
            what = "scale.json " + rng.choice(["dir", "fifo"])
            files["run/scale.json"] = DIR if what.endswith("dir") else FIFO
        cases.append(Case(f"session#{i} {argv[0]} {what}", argv, files))
    return cases


# ----- damaged run records: report decisions, metrics.jsonl on resume ---------------------------------------
DECISION = {"action": "generation", "step": 3, "model_stage": "actor/generation", "iteration": 4, "live": 6,
            "decision": {"kind": "move_sequences", "look": {"iterations": 0, "live_at_most": 0}, "reason": "gain",
                         "moves": [{"seq": [1, 0, 12, 30, 42, 8, 50.0], "dst": 1, "refill": False}],
                         "gain_s": 0.5, "cost_s": 0.1, "bytes": 1024},
            "outcome": {"applied": True, "reason": "", "cost_s": 0.05, "gain_s": 0.2, "figures": {}},
            "overhead_s": 0.0}
# Bad values by their path in the entry: each replaces the good one, one per case.
DECISION_BAD = {("step",): [*GENERIC_BAD, -1], ("iteration",): [NAN, "x", -2], ("live",): ["a", 1.5, -1],
                ("model_stage",): [5, None, ["a"]], ("overhead_s",): [NAN, INF, -1.0, "x"],
                ("decision",): [5, "x", [1], None], ("decision", "kind"): [5, "teleport", None, ["x"]],
                ("decision", "gain_s"): [NAN, INF, "x", 1e13], ("decision", "cost_s"): ["x", INF],
                ("decision", "bytes"): ["many", NAN, -1, 1.5], ("decision", "look"): [5, "x"],
                ("decision", "look", "iterations"): [-1, "x", NAN], ("decision", "moves"): [5, "x", {"a": 1}, [5]],
                ("decision", "moves", 0, "seq"): [5, "x", [1], [NAN] * 7, ["a"] * 7, [-1] * 7, [1] * 20],
                ("decision", "moves", 0, "dst"): ["a", 1.5, -1, None], ("decision", "moves", 0, "refill"): ["no", 2],
                ("outcome",): [5, None, []], ("outcome", "applied"): ["yes", 5, [True], None],
                ("outcome", "cost_s"): [NAN, "slow"], ("outcome", "gain_s"): [NAN, INF, "x", 1e13],
                ("outcome", "figures"): [5, "x", {"a": "b"}, {"a": NAN}]}


def _set_path(entry: dict, path: tuple, value: object) -> None:
    for key in path[:-1]:
        entry = entry[key]
    entry[path[-1]] = value


def record_cases(rng: random.Random) -> list[Case]:
    """``nereus report`` on a run record whose decisions inside the step are malformed
    (``generation_decisions`` of a real run)."""
    cases = []
    paths = sorted(DECISION_BAD, key=str)
    for i in range(60):
        record = run_record()
        decision = copy.deepcopy(DECISION)
        path = rng.choice(paths)
        _set_path(decision, path, copy.deepcopy(rng.choice(DECISION_BAD[path])))
        record["generation_decisions"] = [copy.deepcopy(DECISION)] * rng.randrange(3) + [decision]
        key = ".".join(map(str, path))
        if rng.random() < 0.15:
            record["generation_decisions"] = rng.choice([5, "x", {"a": 1}, [5], [None], [[DECISION]]])
            key = "generation_decisions"
        cases.append(Case(f"record#{i} {key}", ["report", "{d}/run.json", "--out", "{d}/report"],
                          {"run.json": json.dumps(record)}))
    return cases


GOOD_LINES = ['{"step": 1, "actor/pg_loss": 0.1}', '{"step": 2, "actor/pg_loss": 0.2}',
              '{"step": 3, "actor/pg_loss": 0.3}']
BAD_LINES = ["not json", "[1, 2]", "42", '"text"', "null", '{"no_step": 1}', '{"step": "1"}', '{"step": -1}',
             '{"step": true}', '{"step": 1.5}', '{"step": null}', "{" * 3000 + "}" * 3000, '{"step": 1',
             '{"step": ' + "9" * 5000 + "}", "\x00\x01\x02", '{"step": 1}{"step": 2}']


def metrics_cases(rng: random.Random) -> list[Case]:
    """``nereus run --resume`` from a checkpoint that verifies, with a damaged ``metrics.jsonl``: refused,
    the file left as it was (never cut)."""
    cases = []
    for i in range(70):
        roll = rng.random()
        if roll < 0.75:
            lines = list(GOOD_LINES)
            lines.insert(rng.randrange(len(lines) + 1), rng.choice(BAD_LINES))
            content: object = "\n".join(lines) + "\n"  # ends in a newline: no line was torn by a kill
            what = "line"
        else:
            what = rng.choice(["dir", "fifo", "binary", "nul"])
            content = {"dir": DIR, "fifo": FIFO, "binary": b"\xff\xfe" + b"\x00" * 20,
                       "nul": "\n".join(GOOD_LINES) + "\n\x00\n"}[what]
        files = {"job.yaml": yaml.safe_dump(tiny_job_doc("{d}/out")), "out/metrics.jsonl": content,
                 "out/latest": "1", "out/step_1/state.json": json.dumps({"step": 1, "placements": {}}),
                 "out/init/note.txt": "x"}  # _prepare writes both folders' manifests: they verify
        cases.append(Case(f"metrics#{i} {what}", ["run", "{d}/job.yaml", "--resume"], files, preamble=True))
    return cases


# ----- alias bombs, layouts and sampling that cannot run, cluster addresses ------------------------------
def alias_cases(rng: random.Random) -> list[Case]:
    cases = []
    doc = yaml.safe_dump(tiny_job_doc("{d}/out"))
    for i in range(30):
        width, depth = rng.choice([(9, 9), (10, 7), (30, 5), (4, 16)])
        lines = [f"a0: &a0 [{', '.join(['x'] * width)}]"]
        lines += [f"a{k}: &a{k} [{', '.join([f'*a{k - 1}'] * width)}]" for k in range(1, depth)]
        bomb = "\n".join(lines) + "\n"
        where = rng.choice(["top", "override", "recursive", "deep"])
        if where == "top":
            cases.append(Case(f"alias#{i} top {width}^{depth}", [rng.choice(["plan", "run"]), "{d}/job.yaml"],
                              {"job.yaml": bomb + doc}))
        elif where == "override":
            value = f"&v0 [{', '.join(['x'] * width)}]"
            for k in range(1, depth):
                value = f"&v{k} [{value}, {', '.join([f'*v{k - 1}'] * (width - 1))}]"
            cases.append(Case(f"alias#{i} override {width}^{depth}", ["run", "{d}/job.yaml", f"run.steps=[{value}]"],
                              {"job.yaml": doc}))
        elif where == "recursive":
            cases.append(Case(f"alias#{i} recursive", ["plan", "{d}/job.yaml"],
                              {"job.yaml": "r: &r [1, *r]\n" + doc if rng.random() < 0.5 else
                               "r: &r {k: *r}\n" + doc}))
        else:
            chain = "".join(f"d{k}: &d{k} [*d{k - 1}]\n" for k in range(1, 80))
            cases.append(Case(f"alias#{i} deep chain", ["plan", "{d}/job.yaml"], {"job.yaml": "d0: &d0 [1]\n" +
                                                                                   chain + doc}))
    return cases


def plan_cases(rng: random.Random) -> list[Case]:
    """Layouts that cannot run the 2-layer, 4-head tiny model, and degenerate sampling, via the job file or
    overrides, refused alike by ``plan``, ``estimate`` and ``run``."""
    layouts = [("tp=1,pp=3,dp=1", 3), ("tp=1,pp=4,dp=1", 4), ("tp=3,pp=1,dp=1", 3),
               ("tp=1,pp=2,dp=1,interleave=2", 2), ("tp=1,pp=1,dp=1,interleave=2", 1)]
    sampling = ["run.top_p=0", "run.top_p=0.0", "run.top_p=-0.0", "run.temperature=1e-9", "run.temperature=1e-30",
                "actor_rollout_ref.rollout.top_p=0", "actor_rollout_ref.rollout.temperature=1e-7"]
    cases = []
    for i in range(50):
        doc = tiny_job_doc("{d}/out")
        command = rng.choice(["plan", "run", "estimate"])
        argv = [command, "{d}/job.yaml"] + (["--plan", str(ROOT / "examples" / "plans" / "ppo_8b_h100_64.json")]
                                            if command == "estimate" else [])
        if rng.random() < 0.5:
            text, world = rng.choice(layouts)
            stage = rng.choice(["actor/training", "reference/inference", "actor/inference"])
            doc["run"]["layouts"][stage] = {"layout": text + ("" if "generation" in stage else ",micro_batch_size=8"),
                                            "ranks": list(range(world))}
            what = f"{stage}={text}"
        else:
            what = rng.choice(sampling)
            if command == "run":
                argv.append(what)
            else:
                key, value = what.split("=")
                doc["run"][key.split(".")[-1]] = float(value)
        cases.append(Case(f"plan#{i} {command} {what}", argv, {"job.yaml": yaml.safe_dump(doc)}))
    return cases


ADDRESSES = ["ray://10.0.0.1:10001", "ray://{http}", "0.0.0.0:6379", "[::]:6379", "host:99999", "garbage",
             ":6379", "10.0.0.1:", "127.0.0.1:1", "localhost:1", "[::1]:1", "{http}", "{grpc}", "{silent}"]


def address_cases(rng: random.Random) -> list[Case]:
    """``nereus run --address``: what is not a Ray cluster this driver can join, refused within seconds."""
    doc = yaml.safe_dump(tiny_job_doc("{d}/out"))
    return [Case(f"address#{i} {a}", ["run", "{d}/job.yaml", "--address", a], {"job.yaml": doc})
            for i, a in enumerate(rng.sample(ADDRESSES, len(ADDRESSES)) + ["{http}", "{grpc}"] * 3)]


def all_cases() -> dict[str, list[Case]]:
    kinds: dict[str, Callable[[random.Random], list[Case]]] = {
        "hf_config": hf_config_cases, "safetensors": safetensors_cases, "tokenizer": tokenizer_cases,
        "reward": reward_cases, "session": session_cases, "record": record_cases, "metrics": metrics_cases,
        "alias": alias_cases, "plan": plan_cases, "address": address_cases}
    return {k: make(random.Random(f"{SEED}:{k}")) for k, make in kinds.items()}


CASES = all_cases()


# ----- running them ---------------------------------------------------------------------------------------
class ReachedTheRuntime(Exception):
    """A bad input got past every check to the point of starting work."""


def _tripwire(*args: object, **kwargs: object) -> None:
    raise ReachedTheRuntime("a fuzz case reached the runtime")


@pytest.fixture
def no_runtime(monkeypatch):
    import ray

    from nereus.run import user_check
    from nereus.run.job import RLJob

    monkeypatch.setattr(RLJob, "_fresh", _tripwire)
    monkeypatch.setattr(RLJob, "_start", _tripwire)
    monkeypatch.setattr(ray, "init", _tripwire)
    # the user-code check's child runs its same function here (real children: test_bad_input_in_a_real_process)
    monkeypatch.setattr(user_check, "_ask_child", lambda request, where, timeout: user_check._check_in_child(request))


@pytest.fixture(scope="module")
def listeners():
    """Three listeners that are not Ray, on this host's addresses: one answers HTTP, one is a gRPC server
    with no Ray service, one accepts and never answers."""
    import grpc

    http = socket.create_server(("0.0.0.0", 0))
    silent = socket.create_server(("0.0.0.0", 0))

    def answer() -> None:
        while True:
            try:
                conn, _ = http.accept()
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
                conn.close()
            except OSError:
                return

    threading.Thread(target=answer, daemon=True).start()
    server = grpc.server(futures.ThreadPoolExecutor(2))
    port = server.add_insecure_port("0.0.0.0:0")
    server.start()
    yield {"{http}": f"127.0.0.1:{http.getsockname()[1]}", "{grpc}": f"127.0.0.1:{port}",
           "{silent}": f"127.0.0.1:{silent.getsockname()[1]}"}
    server.stop(0)
    http.close()
    silent.close()


def _prepare(case: Case, folder: Path, addresses: dict[str, str]) -> list[str]:
    argv = _materialise(case, folder)
    if case.name.startswith("metrics#"):  # a checkpoint that verifies, so the resume reaches metrics.jsonl
        from nereus.run.manifest import write_manifest

        write_manifest(folder / "out" / "step_1")
        write_manifest(folder / "out" / "init")
    for key, value in addresses.items():
        argv = [a.replace(key, value) for a in argv]
    return argv


def _problem(kind: str, r, case: Case, folder: Path) -> str | None:
    if r.code == 1 and kind == "address":  # the cluster, not the input, may fail a probe too
        return refusal_problem(type(r)(2, r.out, r.err), preamble=case.preamble)
    problem = refusal_problem(r, preamble=case.preamble)
    if problem is None and kind == "metrics" and not (folder / "out" / "metrics.jsonl").exists():
        return "metrics.jsonl is gone"
    return problem


# kinds whose cases take more than a few seconds together (a tokenizer load, a data set, a 5 s probe each)
SLOW_KINDS = ("hf_config", "safetensors", "tokenizer", "reward", "metrics", "address")


@pytest.mark.parametrize("kind", [pytest.param(k, marks=pytest.mark.slow) if k in SLOW_KINDS else k for k in CASES])
def test_bad_input_is_refused_in_one_line(kind, tmp_path, no_runtime, listeners):
    problems = []
    for i, case in enumerate(CASES[kind]):
        folder = tmp_path / f"c{i}"
        argv = _prepare(case, folder, listeners)
        faulthandler.dump_traceback_later(CASE_DEADLINE_S, exit=True)  # a hang ends the run, naming the stack
        try:
            r = run_cli(*argv)
        finally:
            faulthandler.cancel_dump_traceback_later()
        problem = _problem(kind, r, case, folder)
        if problem:
            problems.append(f"{case.name}: nereus {' '.join(argv)[:300]}\n    {problem}")
    assert not problems, f"{len(problems)} of {len(CASES[kind])} {kind} cases:\n" + "\n".join(problems[:15])


def test_there_are_over_five_hundred_new_cases_over_every_class():
    assert sum(len(c) for c in CASES.values()) >= 500
    assert {"hf_config", "safetensors", "tokenizer", "reward", "session", "record", "metrics"} <= set(CASES)
    assert all(len(c) >= 20 for c in CASES.values())


@pytest.mark.slow
@pytest.mark.parametrize("name", ["safetensors#0", "reward#sys.exit", "session#fifo", "alias#bomb",
                                  "address#http"])
def test_bad_input_in_a_real_process(tmp_path, listeners, name):
    """A few cases as real `python -m nereus` processes: nothing of Ray is started, one line, exit 2."""
    chosen = {"safetensors#0": lambda: next(c for c in CASES["safetensors"] if "truncate" in c.name),
              "reward#sys.exit": lambda: next(c for c in CASES["reward"] if "sys.exit" in
                                              str(c.files.get("sub/reward.py"))),
              "session#fifo": lambda: Case("fifo", ["cleanup", "--dir", "{d}/run"], {"run/ray_session.json": FIFO}),
              "alias#bomb": lambda: next(c for c in CASES["alias"] if " top " in c.name),
              "address#http": lambda: Case("http", ["run", "{d}/job.yaml", "--address", "{http}"],
                                           {"job.yaml": yaml.safe_dump(tiny_job_doc("{d}/out"))})}[name]()
    folder = tmp_path / "c"
    argv = _prepare(chosen, folder, listeners)
    done = subprocess.run([sys.executable, "-m", "nereus", *argv], cwd=folder, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    lines = done.stderr.splitlines()
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert lines and lines[-1].startswith("nereus: error: ") and sum("error:" in ln for ln in lines) == 1
    assert not (folder / ".tmp").exists()  # no Ray session was ever created


@pytest.mark.slow
def test_the_unmutated_inputs_are_accepted(tmp_path, no_runtime):
    """Each kind's inputs before their one defect pass every check: the HF job, a good reward function and
    a verified resume reach the point where workers start; a valid session record lets `scale` write its
    request; a run record with valid mid-step decisions renders."""
    reward = tiny_job_doc("{d}/out")
    reward["run"]["reward_function"] = "reward.py:compute_score"
    good = {
        "hf": Case("hf", RUN_HF, _job_files()),
        "reward": Case("reward", ["run", "{d}/sub/job.yaml"], {"sub/job.yaml": yaml.safe_dump(reward),
                                                              "sub/reward.py": GOOD_FN}),
        "metrics": Case("metrics#good", ["run", "{d}/job.yaml", "--resume"],
                        {"job.yaml": yaml.safe_dump(tiny_job_doc("{d}/out")),
                         "out/metrics.jsonl": "\n".join(GOOD_LINES) + "\n", "out/latest": "1",
                         "out/step_1/state.json": json.dumps({"step": 1, "placements": {}}), "out/init/note.txt": "x"}),
    }
    for name, case in good.items():
        r = run_cli(*_prepare(case, tmp_path / name, {}))
        assert r.code == 70 and "ReachedTheRuntime" in r.err, (name, r.err[-1000:])
    argv = _prepare(Case("s", ["scale", "3", "--dir", "{d}/run"], {"run/init/x": "",
                                                                   "run/ray_session.json": json.dumps(SESSION)}),
                    tmp_path / "session", {})
    assert run_cli(*argv).code == 0 and json.loads((tmp_path / "session" / "run" / "scale.json").read_text()) == \
        {"workers": 3}
    record = run_record()
    record["generation_decisions"] = [DECISION]
    argv = _prepare(Case("r", ["report", "{d}/run.json", "--out", "{d}/report"], {"run.json": json.dumps(record)}),
                    tmp_path / "record", {})
    assert run_cli(*argv).code == 0 and (tmp_path / "record" / "report" / "report.md").exists()
