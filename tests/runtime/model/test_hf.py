"""Our decoder against transformers' LlamaForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM: load, logits, save
round trip."""

import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from nereus.runtime.model.decoder import CausalLM  # noqa: E402
from nereus.runtime.model.hf import config_from_hf, load_boxes, read_config, save_checkpoint  # noqa: E402
from nereus.spec.errors import SpecError  # noqa: E402
from nereus.spec.model import arch_from_hf  # noqa: E402
from nereus.spec.parallel_dims import ParallelDims  # noqa: E402
from nereus.spec.sharding import rank_tensors  # noqa: E402

COMMON = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=3, num_attention_heads=8,
              num_key_value_heads=2, vocab_size=211, max_position_embeddings=128)
# Qwen3 gives head_dim explicitly: 8 heads of 24 over hidden 64 (not hidden / heads = 8)
QWEN3_HEAD_DIM = 24


def _hf_model(kind: str, tied: bool, **extra):
    torch.manual_seed(0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**COMMON, tie_word_embeddings=tied, rope_theta=500000.0, **extra)
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "qwen3":
        cfg = transformers.Qwen3Config(**COMMON, head_dim=QWEN3_HEAD_DIM, tie_word_embeddings=tied, **extra)
        model = transformers.Qwen3ForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2Config(**COMMON, tie_word_embeddings=tied, **extra)
        model = transformers.Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # HF initialises norms to 1 and biases to 0; perturb them so both are checked
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def _load_ours(path) -> CausalLM:
    cfg = read_config(path)
    ours = CausalLM(cfg)
    ours.load_state_dict(load_boxes(path, rank_tensors(cfg.arch, ParallelDims(), 0)), strict=True)
    return ours.eval()


@pytest.mark.parametrize("kind,tied", [("llama", False), ("llama", True), ("qwen2", False), ("qwen2", True),
                                       ("qwen3", False), ("qwen3", True)])
def test_logits_match_transformers(tmp_path, kind, tied):
    hf = _hf_model(kind, tied)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    ours = _load_ours(tmp_path)
    a = ours.cfg.arch
    assert a.qkv_bias == (kind == "qwen2") and a.qk_norm == (kind == "qwen3") and a.tied_embeddings == tied
    assert a.head_dim == (QWEN3_HEAD_DIM if kind == "qwen3" else COMMON["hidden_size"] // COMMON["num_attention_heads"])
    tokens = torch.randint(0, COMMON["vocab_size"], (3, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(tokens).logits
        got = ours(tokens)
    err = (want - got).abs().max().item()
    assert err <= 1e-4, err


def test_llama3_rope_scaling_matches(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
    hf = _hf_model("llama", False, rope_scaling=scaling)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    ours = _load_ours(tmp_path)
    assert ours.cfg.rope_scaling["rope_type"] == "llama3"
    tokens = torch.randint(0, COMMON["vocab_size"], (2, 60), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (hf(tokens).logits - ours(tokens)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_save_round_trip_loads_in_transformers(tmp_path, kind):
    hf = _hf_model(kind, True)
    hf.save_pretrained(tmp_path / "a", safe_serialization=True)
    ours = _load_ours(tmp_path / "a")
    save_checkpoint(tmp_path / "b", ours.cfg, ours.state_dict())
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "b").eval()
    assert type(back) is type(hf)  # Qwen3ForCausalLM, with the hub's q_norm / k_norm tensor names
    tokens = torch.randint(0, COMMON["vocab_size"], (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (back(tokens).logits - hf(tokens).logits).abs().max().item() <= 1e-5


def test_qwen3_weights_are_checked_against_the_config(tmp_path):
    """The pre-flight (``spec.hf_files``) knows Qwen3's q/k norms and explicit head size: a Qwen3 directory
    passes; Qwen2 weights (QKV biases, no q/k norms) under a Qwen3 config are refused; a wrong head_dim
    names the shapes."""
    from nereus.spec.hf_files import check_model_dir

    _hf_model("qwen3", False).save_pretrained(tmp_path / "q3", safe_serialization=True)
    check_model_dir(tmp_path / "q3", "models.actor.path")
    _hf_model("qwen2", False).save_pretrained(tmp_path / "q2", safe_serialization=True)
    data = json.loads((tmp_path / "q2" / "config.json").read_text())
    (tmp_path / "q2" / "config.json").write_text(json.dumps({**data, "model_type": "qwen3"}))
    with pytest.raises(SpecError, match=r"models\.actor\.path: .*tensor 'model\.layers\.\d\.self_attn\."
                                        r"[qkv]_proj\.bias' is not a weight"):
        check_model_dir(tmp_path / "q2", "models.actor.path")
    data = json.loads((tmp_path / "q3" / "config.json").read_text())
    (tmp_path / "q3" / "config.json").write_text(json.dumps({**data, "head_dim": 16}))
    with pytest.raises(SpecError, match=r"has shape \[\d+(, 64)?\] .*8 heads of 16, 2 KV heads\) needs"):
        check_model_dir(tmp_path / "q3", "models.actor.path")


def test_partial_boxes_read_only_the_slice(tmp_path):
    hf = _hf_model("llama", False)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    cfg = read_config(tmp_path)
    boxes = rank_tensors(cfg.arch, ParallelDims(tp=2, pp=3), ParallelDims(tp=2, pp=3).rank(2, 0, 1))
    got = load_boxes(tmp_path, boxes)
    full = dict(hf.state_dict())
    assert set(got) == {"model.norm.weight", "lm_head.weight"} | {
        n for n in full if n.startswith("model.layers.2.")}
    for name, box in boxes.items():
        want = full[name][tuple(slice(lo, hi) for lo, hi in box)]
        assert torch.equal(got[name], want), name


def test_checkpoint_config_is_validated_by_the_spec_parser(tmp_path):
    # the runtime reads a checkpoint's architecture through nereus.spec.model.arch_from_hf: the same
    # refusals, naming the file and the key
    hf = _hf_model("llama", False)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    data = json.loads((tmp_path / "config.json").read_text())
    assert config_from_hf(data).arch == arch_from_hf(data, "x")
    (tmp_path / "config.json").write_text(json.dumps({**data, "mlp_bias": True}))
    with pytest.raises(SpecError, match=r"config\.json>?\.mlp_bias: biases other than Qwen2's QKV bias"):
        read_config(tmp_path)


@pytest.mark.parametrize("make,pattern", [
    (lambda: transformers.LlamaConfig(**COMMON, hidden_act="gelu"), r"config\.json\.hidden_act: 'gelu'"),
    (lambda: transformers.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=16, max_window_layers=1),
     r"config\.json\.use_sliding_window: sliding-window attention \(16 tokens on 2 of 3 layers\)"),
    (lambda: transformers.MistralConfig(**COMMON, sliding_window=16), r"config\.json\.sliding_window: .*16 tokens"),
    (lambda: transformers.Qwen3Config(**COMMON, use_sliding_window=True, sliding_window=16, max_window_layers=1),
     r"config\.json\.use_sliding_window: sliding-window attention \(16 tokens on 2 of 3 layers\)"),
    (lambda: transformers.Qwen3Config(**COMMON, attention_bias=True), r"config\.json\.attention_bias: biases"),
    (lambda: transformers.LlamaConfig(**COMMON, rope_scaling={"rope_type": "linear", "factor": 2.0}),
     r"config\.json\.rope_parameters\.rope_type: RoPE scaling 'linear' is not implemented"),
    (lambda: transformers.LlamaConfig(**COMMON, attention_bias=True), r"config\.json\.attention_bias: biases"),
])
def test_transformers_configs_that_would_diverge_are_refused(make, pattern):
    # each loads into tensors our decoder has, but transformers would compute other logits from them
    with pytest.raises(SpecError, match=pattern):
        config_from_hf(make().to_dict())


def test_transformers_configs_that_match_are_accepted():
    for cfg in (transformers.Qwen2Config(**COMMON), transformers.MistralConfig(**COMMON, sliding_window=None),
                transformers.Qwen3Config(**COMMON, use_sliding_window=True, sliding_window=128),
                transformers.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=128)):
        assert config_from_hf(cfg.to_dict()).arch.layers == COMMON["num_hidden_layers"]


def test_older_rope_type_spelling_is_read():
    scaling = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
    data = {**transformers.LlamaConfig(**COMMON).to_dict(), "rope_parameters": None, "rope_scaling": scaling}
    assert config_from_hf(data).rope_scaling["rope_type"] == "llama3"


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_packed_sequences_match_transformers(tmp_path, kind):
    """Sequences packed end to end (positions restarting, attention within each) give, position for
    position, transformers' logits of each sequence run alone and of the right-padded batch; gradients of
    a loss over the real tokens are the padded batch's."""
    hf = _hf_model(kind, tied=kind == "qwen2")
    hf.save_pretrained(tmp_path, safe_serialization=True)
    ours = _load_ours(tmp_path)
    lengths = (9, 3, 14, 1, 6)
    g = torch.Generator().manual_seed(4)
    seqs = [torch.randint(0, COMMON["vocab_size"], (n,), generator=g) for n in lengths]
    padded = torch.zeros(len(seqs), max(lengths), dtype=torch.long)
    keep = torch.zeros(len(seqs), max(lengths), dtype=torch.bool)
    for i, s in enumerate(seqs):
        padded[i, : len(s)], keep[i, : len(s)] = s, True
    packed = ours(torch.cat(seqs)[None], seq_lens=lengths)[0]
    with torch.no_grad():
        alone = torch.cat([hf(s[None]).logits[0] for s in seqs])
        batched = hf(padded, attention_mask=keep.long()).logits[keep]
    assert (packed.detach() - alone).abs().max().item() <= 1e-4
    assert (packed.detach() - batched).abs().max().item() <= 1e-4
    packed.logsumexp(-1).sum().backward()
    got = {n: p.grad.clone() for n, p in ours.named_parameters()}
    ours.zero_grad()
    ours(padded)[keep].logsumexp(-1).sum().backward()
    for n, p in ours.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
