"""Prompt files in verl's format (JSONL and Parquet), errors that name file, row and field, the built-in
task and its rule-based rewards, and the job spec's `run:` section."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from nereus.rl.data import CharTokenizer, DataError, load_prompts, write_rows
from nereus.rl.task import digit_match, exact_match, reverse_rows, split_rows
from nereus.spec.errors import SpecError
from nereus.spec.job import job_from_dict
from tests.run.jobs import tiny_job

TOK = CharTokenizer()


def _row(content="rev:12=", truth="21") -> dict:
    return {"data_source": "t", "prompt": [{"role": "user", "content": content}],
            "reward_model": {"style": "rule", "ground_truth": truth}}


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_round_trip(tmp_path, suffix):
    rows = reverse_rows(20, seed=1, max_digits=4)
    prompts = load_prompts(write_rows(tmp_path / f"p{suffix}", rows), TOK, 16)
    assert len(prompts) == 20
    p = prompts[3]
    assert TOK.decode(list(p.ids)) == rows[3]["prompt"][0]["content"]
    assert p.ids[0] == TOK.bos_token_id
    assert p.ground_truth == rows[3]["reward_model"]["ground_truth"]
    assert p.data_source == "nereus/reverse" and p.index == 3


def test_task_rows_are_distinct_and_exclusion_holds():
    val = reverse_rows(30, seed=2, max_digits=3)
    held = {r["reward_model"]["ground_truth"][::-1] for r in val}
    train = reverse_rows(100, seed=3, max_digits=3, exclude=held)
    digits = [r["prompt"][0]["content"][4:-1] for r in train]
    assert len(set(digits)) == 100 and not held & set(digits)
    assert all(r["reward_model"]["ground_truth"] == d[::-1] for r, d in zip(train, digits, strict=True))


def test_held_out_split_leaves_training_every_length():
    """The built-in task's held-out prompts are a random part of one pool: both sets hold short and long
    strings alike (drawn first, the held-out set took all ten one-digit strings from training)."""
    for seed in range(5):
        pool = reverse_rows(4200, seed=seed, max_digits=6)
        train, val = split_rows(pool, 200, seed)
        assert len(train) == 4000 and len(val) == 200
        key = [r["reward_model"]["ground_truth"] for r in pool]
        assert sorted(key) == sorted(r["reward_model"]["ground_truth"] for r in train + val)  # a partition
        lengths = Counter(len(r["reward_model"]["ground_truth"]) for r in train)
        assert all(lengths[n] >= 5 for n in range(1, 7)), lengths
        short = sum(len(r["reward_model"]["ground_truth"]) <= 2 for r in val)
        assert short <= 20  # ~2.6% of the pool is one or two digits long; drawn first they were a fifth


def test_rewards():
    assert exact_match("321", "321", True) == 1.0
    assert exact_match("321", "321", False) == 0.0  # cut off before EOS
    assert exact_match("32", "321", True) == 0.0
    assert digit_match("3x1", "321", True) == pytest.approx(2 / 3)
    assert digit_match("3214", "321", True) == pytest.approx(3 / 4)  # an extra character costs


@pytest.mark.parametrize(("line", "field", "text"), [
    ("{not json", None, "not valid JSON"),
    (json.dumps({"reward_model": {"ground_truth": "1"}}), "prompt", "missing"),
    (json.dumps(_row() | {"reward_model": {"style": "rule"}}), "reward_model.ground_truth", "expected a string"),
    (json.dumps(_row(content="rev:" + "1" * 30 + "=")), "prompt", "exceed the maximum prompt length 16"),
    (json.dumps(_row(content="REV")), "prompt", "not in the tokenizer's alphabet"),
    (json.dumps(_row() | {"prompt": []}), "prompt", "non-empty list"),
    (json.dumps(_row() | {"data_source": 3}), "data_source", "expected a string"),
])
def test_bad_rows_name_file_row_and_field(tmp_path, line, field, text):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(_row()) + "\n" + line + "\n")
    with pytest.raises(DataError) as err:
        load_prompts(path, TOK, 16)
    msg = str(err.value)
    assert msg.startswith(f"{path}: row 1") and text in msg
    if field:
        assert f"field '{field}'" in msg


def test_bad_parquet_and_missing_file(tmp_path):
    broken = tmp_path / "x.parquet"
    broken.write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match="x.parquet: not a readable Parquet file"):
        load_prompts(broken, TOK, 16)
    with pytest.raises(DataError, match="file not found"):
        load_prompts(tmp_path / "none.jsonl", TOK, 16)
    bad = write_rows(tmp_path / "y.parquet", [_row(), _row(truth=None)])
    with pytest.raises(DataError, match=r"y.parquet: row 1: field 'reward_model.ground_truth'"):
        load_prompts(bad, TOK, 16)


def test_run_section(tmp_path):
    job = tiny_job("ppo", str(tmp_path))
    run = job.run
    assert run.steps == 3 and run.layouts["actor/training"].pp == 2 and run.ranks["critic/training"] == (3, 2, 1, 0)
    assert [run.max_response_length(s, 4) for s in range(4)] == [3, 3, 4, 4]
    assert job.algorithm.name == "ppo" and job.workload.response.max == 4


def _spec(run: dict) -> dict:
    return {"models": {"actor": {"preset": "llama3-8b"}, "critic": {"preset": "llama3-8b"}},
            "algorithm": {"name": "ppo"},
            "workload": {"prompts_per_step": 4, "prompt_length": 8, "response_length": {"mean": 3, "max": 4}},
            "cluster": {"gpu": "H100", "nodes": 1, "gpus_per_node": 4}, "run": run}


def test_learning_rate_warm_up_is_verls_constant_schedule():
    """verl's get_constant_schedule_with_warmup: lr × step / warm-up steps while warming up (the first
    step at 0), then lr; lr_warmup_steps wins over lr_warmup_steps_ratio unless it is <= 0."""
    run = job_from_dict(_spec({"steps": 40, "lr_warmup_steps": 4})).run
    assert [run.lr_at(1.0, s) for s in range(6)] == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    ratio = job_from_dict(_spec({"steps": 40, "lr_warmup_steps": -1, "lr_warmup_steps_ratio": 0.1})).run
    assert ratio.warmup_steps == 4 and ratio.lr_at(2.0, 2) == 1.0
    assert job_from_dict(_spec({"steps": 40})).run.lr_at(3e-4, 0) == 3e-4  # no warm-up by default
    weights = job_from_dict(_spec({"weight_decay": 0.01})).run
    assert weights.weight_decay == 0.01


def test_steps_from_epochs_and_several_data_files():
    from nereus.spec.run import resolve_steps

    run = job_from_dict(_spec({"total_epochs": 3, "data": {"train": ["a.jsonl", "b.parquet"], "val": "c.jsonl",
                                                          "filter_overlong_prompts": True}})).run
    assert (run.data.train, run.data.val, run.data.filter_overlong_prompts) == (("a.jsonl", "b.parquet"),
                                                                              ("c.jsonl",), True)
    assert run.steps == 0 and resolve_steps(run, 41, 4).steps == 30  # 10 whole steps per epoch
    given = job_from_dict(_spec({"total_epochs": 3, "steps": 7})).run  # verl: total_training_steps wins
    assert resolve_steps(given, 41, 4).steps == 7
    with pytest.raises(SpecError, match=r"run\.total_epochs: 3 training rows make no whole step of 4"):
        resolve_steps(run, 3, 4)
    with pytest.raises(SpecError, match=r"run\.data\.train: an empty list"):
        job_from_dict(_spec({"data": {"train": []}}))


def test_overlong_prompts_are_dropped_only_when_asked(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": c}], "reward_model": {"ground_truth": "1"}}
            for c in ("12", "1234567890123", "3")]
    path = write_rows(tmp_path / "rows.jsonl", rows)
    with pytest.raises(DataError, match=r"row 1: field 'prompt': .* exceed the maximum prompt length 8"):
        load_prompts(path, TOK, 8)
    notes = []
    kept = load_prompts(path, TOK, 8, drop_overlong=True, notes=notes)
    assert [p.ground_truth for p in kept] == ["1", "1"] and [p.index for p in kept] == [0, 2]
    assert notes == [f"{path}: 1 rows dropped, their prompts exceed 8 tokens (run.data.filter_overlong_prompts)"]


@pytest.mark.parametrize(("patch", "path"), [
    ({"stepz": 3}, "run.stepz"),
    ({"layouts": {"critic/generation": "tp=1"}}, "run.layouts.critic/generation"),
    ({"layouts": {"actor/training": {"layout": "tp=2", "ranks": [0]}}}, "run.layouts.actor/training.ranks"),
    ({"curriculum": [{"step": 1, "max_response_length": 2}]}, "run.curriculum[0].step"),
    ({"curriculum": [{"step": 0, "max_response_length": 9}]}, "run.curriculum[0].max_response_length"),
    ({"kl_loss_type": "k9"}, "run.kl_loss_type"),
])
def test_run_section_errors_name_the_key(tmp_path, patch, path):
    spec = {"models": {"actor": {"preset": "llama3-8b"}, "critic": {"preset": "llama3-8b"}},
            "algorithm": {"name": "ppo"},
            "workload": {"prompts_per_step": 4, "prompt_length": 8, "response_length": {"mean": 3, "max": 4}},
            "cluster": {"gpu": "H100", "nodes": 1, "gpus_per_node": 4}, "run": patch}
    with pytest.raises(SpecError) as err:
        job_from_dict(spec)
    assert err.value.path == path


@pytest.fixture(scope="module")
def hf_tokenizer_dir(tmp_path_factory):
    """A byte-level BPE tokenizer trained with ``tokenizers`` and saved with a ChatML chat template."""
    pytest.importorskip("transformers")
    import importlib.util

    from tests.conftest import EXAMPLES

    spec = importlib.util.spec_from_file_location("make_tiny_hf", EXAMPLES / "make_tiny_hf.py")
    maker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(maker)
    folder = tmp_path_factory.mktemp("tok")
    maker.make_tokenizer(["Natalia sold clips to 48 of her friends. #### 72", "system user assistant"], folder)
    return folder


def test_make_tiny_hf_help_prints_and_creates_nothing(tmp_path):
    import subprocess
    import sys

    from tests.conftest import EXAMPLES

    script = EXAMPLES / "make_tiny_hf.py"
    done = subprocess.run([sys.executable, str(script), "--help"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0 and "usage: make_tiny_hf.py" in done.stdout and "--rows" in done.stdout
    bad = subprocess.run([sys.executable, str(script), str(tmp_path / "x"), "--rows", "0"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60, check=False)
    assert bad.returncode == 2 and "--rows and --val" in bad.stderr
    assert list(tmp_path.iterdir()) == []  # neither runs/tiny_hf nor the named folder


def test_verl_rows_render_through_the_chat_template(tmp_path, hf_tokenizer_dir):
    from nereus.rl.tokenizer import HFTokenizer, Tokenizer

    tok = HFTokenizer(hf_tokenizer_dir)
    assert isinstance(tok, Tokenizer) and isinstance(TOK, Tokenizer)  # both meet the interface
    row = {"data_source": "openai/gsm8k", "ability": "math",
           "prompt": [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": "Natalia sold 48 clips. How many?"}],
           "reward_model": {"style": "rule", "ground_truth": "72"}, "extra_info": {"split": "test", "index": 7}}
    [p] = load_prompts(write_rows(tmp_path / "gsm8k.parquet", [row]), tok, 64)
    text = tok.hf.decode(list(p.ids))  # specials kept: the roles are the template's, not glued contents
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nNatalia sold 48 clips. How "
                    "many?<|im_end|>\n<|im_start|>assistant\n")
    assert p.extra_info == {"split": "test", "index": 7} and p.data_source == "openai/gsm8k"
    assert tok.decode(tok.encode("#### 72") + [tok.eos_token_id]) == "#### 72"
    assert tok.pad_token_id != tok.eos_token_id and tok.vocab_size == len(tok.hf)
    with pytest.raises(DataError, match=r"row 0: field 'prompt': \d+ tokens exceed the maximum prompt length 8"):
        load_prompts(tmp_path / "gsm8k.parquet", tok, 8)


def test_hf_tokenizer_refusals(tmp_path, hf_tokenizer_dir):
    import shutil

    from nereus.rl.tokenizer import HFTokenizer

    with pytest.raises(SpecError, match=r"models\.actor\.path: no loadable tokenizer in"):
        HFTokenizer(tmp_path)
    shutil.copytree(hf_tokenizer_dir, tmp_path / "plain")
    (tmp_path / "plain" / "chat_template.jinja").unlink()
    with pytest.raises(SpecError, match=r"models\.actor\.path: .* has no chat_template"):
        HFTokenizer(tmp_path / "plain")


def test_model_path_errors_name_the_key(tmp_path):
    spec = {"models": {"actor": {"path": str(tmp_path / "nowhere")}}, "algorithm": {"name": "grpo"},
            "workload": {"prompts_per_step": 4, "prompt_length": 8, "response_length": {"mean": 3, "max": 4}},
            "cluster": {"gpu": "H100", "nodes": 1, "gpus_per_node": 4}}
    with pytest.raises(SpecError, match=r"models\.actor\.path: .*nowhere' is not a directory; give an HF model"):
        job_from_dict(spec)
    spec["models"]["actor"] = {"path": str(tmp_path)}
    with pytest.raises(SpecError, match=r"models\.actor\.path: file .*config\.json' not found"):
        job_from_dict(spec)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2,
                                                      "intermediate_size": 128, "num_attention_heads": 6,
                                                      "vocab_size": 100}))
    with pytest.raises(SpecError, match=r"models\.actor\.path<.*>\.num_attention_heads: hidden \(64\) must be divis"):
        job_from_dict(spec)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3_moe", "mixtral", "qwen2_moe"])
def test_make_tiny_hf_model_has_a_head_size_vllms_cpu_build_runs(tmp_path, arch):
    """The tiny model's head size is one vLLM's CPU attention takes, so a job generating with vLLM accepts
    it on the CPU build (checked against the engine's declared head sizes, not a number copied here); the
    MoE ones have 4 experts, 2 per token."""
    pytest.importorskip("transformers")
    import importlib.util

    from nereus.runtime.model.hf import read_config
    from nereus.spec.engines import engine_traits
    from nereus.spec.rollout import RolloutEngine, check_rollout_engine
    from tests.conftest import EXAMPLES

    spec = importlib.util.spec_from_file_location("make_tiny_hf", EXAMPLES / "make_tiny_hf.py")
    maker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(maker)
    maker.make_model(tmp_path, vocab=64, eos=2, pad=0, arch=arch)
    arch, moe = read_config(tmp_path).arch, arch != "qwen2"
    assert (arch.moe is not None) == moe and (not moe or (arch.moe.experts, arch.moe.top_k) == (4, 2))
    traits = engine_traits("vllm")
    assert arch.head_dim in traits.cpu_head_sizes and arch.layers == 2 and arch.hidden <= 64
    check_rollout_engine(RolloutEngine(engine="vllm"), {"actor": arch.head_dim}, {}, traits.cpu_distribution)
