"""The supervised warm-start: the target-accuracy stop (at a multiple of CHECK_EVERY steps, once greedy
decoding solves the share of training prompts), the greedy accuracy it reads against single-prompt
decoding, and ``init/sources.json``, which lets a job read wholly from HF directories resume."""

from __future__ import annotations

import json
import shutil

import pytest

from nereus.rl.data import EOS, CharTokenizer, load_prompts, write_rows
from nereus.rl.task import reverse_rows
from nereus.run import warmstart
from nereus.runtime.engines.native.fixed_batch import SamplingParams, reference_generate
from nereus.runtime.model.decoder import ModelConfig, build_model
from nereus.spec.errors import SpecError
from nereus.spec.model import ModelArch

TOK = CharTokenizer()
ARCH = ModelArch(layers=1, hidden=32, ffn_hidden=64, heads=4, kv_heads=2, vocab=64)


def _prompts(tmp_path, n: int = 40):
    return load_prompts(write_rows(tmp_path / "rows.jsonl", reverse_rows(n, seed=0, max_digits=2)), TOK, 16)


def test_greedy_accuracy_is_single_prompt_greedy_decoding(tmp_path):
    prompts = _prompts(tmp_path)
    model = build_model(ModelConfig(ARCH), seed=3).eval()
    params = SamplingParams(max_new_tokens=3, eos_token_id=EOS)
    want = 0
    for p in prompts:
        out = reference_generate(model, list(p.ids), params)
        want += out[-1:] == [EOS] and TOK.decode(out[:-1]) == p.ground_truth
    assert warmstart.greedy_accuracy(model, prompts, TOK, 3) == want / len(prompts)
    warmstart.sft(model, prompts, TOK, 30, 20, 3e-2, 0, max_new=3)  # a model that solves some of them
    model.eval()
    want = 0
    for p in prompts:
        out = reference_generate(model, list(p.ids), params)
        want += out[-1:] == [EOS] and TOK.decode(out[:-1]) == p.ground_truth
    assert 0 < want < len(prompts) and warmstart.greedy_accuracy(model, prompts, TOK, 3) == want / len(prompts)


def test_target_accuracy_stops_the_warm_start(tmp_path, monkeypatch):
    prompts = _prompts(tmp_path)
    seen = []

    def accuracy(model, probe, tok, max_new):  # the n-th look reports n/10
        seen.append(len(probe))
        return len(seen) / 10

    monkeypatch.setattr(warmstart, "greedy_accuracy", accuracy)
    model = build_model(ModelConfig(ARCH), seed=0)
    _, steps = warmstart.sft(model, prompts, TOK, 200, 8, 1e-3, 0, target_accuracy=0.3, max_new=3)
    assert steps == 3 * warmstart.CHECK_EVERY and seen == [len(prompts)] * 3  # the third look reaches 0.3
    seen.clear()
    _, steps = warmstart.sft(model, prompts, TOK, 25, 8, 1e-3, 0, max_new=3)
    assert steps == 25 and not seen  # no target: every step, no look


def test_sources_record_refuses_a_changed_directory(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    (model / "model.safetensors").write_bytes(b"x" * 10)
    init = tmp_path / "init"
    warmstart.write_sources(init, {"actor": str(model), "reference": str(model)})
    warmstart.check_sources(init, {"actor": str(model), "reference": str(model)})
    moved = shutil.copytree(model, tmp_path / "moved")  # the same files elsewhere: accepted
    warmstart.check_sources(init, {"actor": str(moved), "reference": str(model)})
    (moved / "model.safetensors").write_bytes(b"x" * 11)
    with pytest.raises(SpecError, match=r"models\.actor\.path: .* is not the directory the run started from .*"
                                        r"model\.safetensors differ"):
        warmstart.check_sources(init, {"actor": str(moved), "reference": str(model)})
    with pytest.raises(SpecError, match=r"models\.reference\.path: the run started from .*; give it again"):
        warmstart.check_sources(init, {"actor": str(model)})
    warmstart.write_sources(init, {})  # a built-in job's record lists no model
    with pytest.raises(SpecError, match=r"models\.actor\.path: the run started without a pretrained actor"):
        warmstart.check_sources(init, {"actor": str(model)})
