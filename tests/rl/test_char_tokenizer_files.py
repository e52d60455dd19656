"""The built-in character tokenizer written as HF tokenizer files (``rl.char_tokenizer_files``): loaded back by
transformers (and by Nereus's own HF tokenizer, so the folder can be a later job's model path), it encodes,
decodes and renders prompts exactly as the run's tokenizer; checkpoints without a source directory carry it."""

from __future__ import annotations

import json
import os

import pytest

from nereus.rl.data import BOS, EOS, PAD, CharTokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
TEXTS = ["what is 3 + 4?", "12*7=84", "a.b,c<d>:e-f", " spaces  kept ", "9"]


def written(folder, tok: CharTokenizer):
    for name, data in tok.tokenizer_files().items():
        (folder / name).write_bytes(data)
    return folder


def test_saved_char_tokenizer_reproduces_the_runs_encoding(tmp_path):
    transformers = pytest.importorskip("transformers")
    from nereus.rl.tokenizer import HFTokenizer

    run = CharTokenizer()
    folder = written(tmp_path, run)
    hf = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id, len(hf)) == (PAD, BOS, EOS, run.vocab_size)
    for text in TEXTS:
        ids = run.encode(text)
        assert hf(text, add_special_tokens=False)["input_ids"] == ids, text
        assert hf.decode([BOS, *ids, EOS, PAD], skip_special_tokens=True) == text
    loaded = HFTokenizer(folder)  # what a later job with models.actor.path at the checkpoint reads
    messages = [{"role": "system", "content": "be brief."}, {"role": "user", "content": "what is 3+4?"}]
    assert loaded.prompt_ids(messages) == run.prompt_ids(messages)
    assert [loaded.encode(t) for t in TEXTS] == [run.encode(t) for t in TEXTS]
    assert (loaded.eos_token_id, loaded.pad_token_id, loaded.stop_token_ids) == (EOS, PAD, (EOS,))
    with pytest.raises(Exception, match="UNK"):  # outside the alphabet: refused, as CharTokenizer.encode does
        hf("What", add_special_tokens=False)
    with pytest.raises(KeyError):
        run.encode("What")


def test_specials_cannot_be_spelt_by_the_alphabet():
    with pytest.raises(ValueError, match="bracket"):
        CharTokenizer("ab[]").tokenizer_files()
    config = json.loads(CharTokenizer().tokenizer_files()["tokenizer_config.json"])
    assert config["clean_up_tokenization_spaces"] is False  # " ." decodes as " ."


def test_a_checkpoint_without_a_source_carries_the_tokenizer_and_a_source_wins(tmp_path):
    from nereus.runtime.model.decoder import ModelConfig, build_model
    from nereus.runtime.model.hf import save_checkpoint
    from nereus.spec.model import ModelArch

    cfg = ModelConfig(ModelArch(layers=1, hidden=32, ffn_hidden=64, heads=4, kv_heads=2, vocab=64), eos_token_id=EOS)
    state = build_model(cfg).state_dict()
    files = CharTokenizer().tokenizer_files()
    save_checkpoint(tmp_path / "a", cfg, state, tokenizer=files)
    assert all((tmp_path / "a" / name).read_bytes() == data for name, data in files.items())
    source = tmp_path / "src"
    save_checkpoint(source, cfg, state)
    (source / "tokenizer.json").write_text("{}")  # the source model's own tokenizer
    save_checkpoint(tmp_path / "b", cfg, state, source=source, tokenizer=files)
    assert (tmp_path / "b" / "tokenizer.json").read_text() == "{}"
    assert (tmp_path / "b" / "tokenizer_config.json").read_bytes() == files["tokenizer_config.json"]
