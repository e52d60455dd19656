"""Mixture-of-Experts architectures parsed from HuggingFace configs as written (``spec.moe``)."""

import math

import pytest

from nereus.spec.errors import SpecError
from nereus.spec.fields import Fields
from nereus.spec.layout import Layout
from nereus.spec.model import PRESETS, ModelArch, arch_from_hf, read_arch
from nereus.spec.moe import MoESpec, mixtral_name
from nereus.spec.sharding import model_tensors, tp_box

# Qwen/Qwen3-30B-A3B config.json (the keys the parser reads)
QWEN3_30B_A3B = {
    "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "router_aux_loss_coef": 0.001, "vocab_size": 151936, "tie_word_embeddings": False,
    "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "sliding_window": None,
    "use_sliding_window": False,
}
# mistralai/Mixtral-8x7B-v0.1 config.json
MIXTRAL_8X7B = {
    "model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
    "router_aux_loss_coef": 0.02, "vocab_size": 32000, "max_position_embeddings": 32768, "rope_theta": 1e6,
    "rms_norm_eps": 1e-5, "sliding_window": None, "router_jitter_noise": 0.0,
}


def test_published_configs_parse_to_the_presets_and_their_parameter_counts():
    assert arch_from_hf(QWEN3_30B_A3B, "m") == PRESETS["qwen3-30b-a3b"]
    assert arch_from_hf(MIXTRAL_8X7B, "m") == PRESETS["mixtral-8x7b"]
    a3b = PRESETS["qwen3-30b-a3b"]  # the names say it: 30.5B in all, 3.3B active (Qwen3 technical report)
    assert round(a3b.params() / 1e9, 1) == 30.5 and 3.3e9 <= a3b.active_params() < 3.4e9
    assert round(PRESETS["qwen3-235b-a22b"].active_params() / 1e9) == 22
    mix = PRESETS["mixtral-8x7b"]  # 46.7B total, 12.9B active (Jiang et al. 2024)
    assert round(mix.params() / 1e9, 1) == 46.7 and round(mix.active_params() / 1e9, 1) == 12.9
    assert PRESETS["qwen3-8b"].active_params() == PRESETS["qwen3-8b"].params()


def test_qwen2_moe_shared_expert_and_dense_layers():
    cfg = {**QWEN3_30B_A3B, "model_type": "qwen2_moe", "shared_expert_intermediate_size": 512,
           "decoder_sparse_step": 2, "mlp_only_layers": [1], "num_hidden_layers": 4, "head_dim": None,
           "hidden_size": 256, "num_attention_heads": 4, "norm_topk_prob": False}
    arch = arch_from_hf(cfg, "m")
    assert arch.qkv_bias and not arch.qk_norm
    assert arch.moe == MoESpec(128, 8, 768, False, 512, (0, 1, 2), 0.001)  # only layer 3 is sparse
    assert arch.sparse_layers() == 1 and arch.moe.sparse(3) and not arch.moe.sparse(1)
    assert arch.moe.shared_params(256) == 3 * 256 * 512 + 256


@pytest.mark.parametrize(("change", "key", "text"), [
    ({"num_experts_per_tok": 200}, "num_experts_per_tok", "exceeds the 128 experts"),
    ({"mlp_only_layers": [48]}, "mlp_only_layers", "outside the 48 layers"),
])
def test_bad_moe_keys_are_named(change, key, text):
    with pytest.raises(SpecError, match=text) as err:
        arch_from_hf({**QWEN3_30B_A3B, **change}, "model")
    assert key in str(err.value)


def test_qwen3_moe_expert_count_as_transformers_5_writes_it():
    written = {k: v for k, v in QWEN3_30B_A3B.items() if k != "num_experts"} | {"num_local_experts": 128}
    assert arch_from_hf(written, "m") == PRESETS["qwen3-30b-a3b"]
    with pytest.raises(SpecError, match=r"m\.num_local_experts: 64 disagrees with num_experts 128"):
        arch_from_hf({**QWEN3_30B_A3B, "num_local_experts": 64}, "m")


def test_mixtral_names_are_mapped_for_the_moe_tensors_only():
    assert mixtral_name("model.layers.3.mlp.gate.weight") == "model.layers.3.block_sparse_moe.gate.weight"
    assert mixtral_name("model.layers.0.mlp.experts.12.gate_proj.weight") == (
        "model.layers.0.block_sparse_moe.experts.12.w1.weight")
    assert mixtral_name("model.layers.0.mlp.experts.1.up_proj.weight").endswith("experts.1.w3.weight")
    assert mixtral_name("model.layers.0.mlp.experts.1.down_proj.weight").endswith("experts.1.w2.weight")
    assert mixtral_name("model.layers.0.self_attn.q_proj.weight") == "model.layers.0.self_attn.q_proj.weight"


def test_mixtral_jitter_is_refused_and_a_job_file_moe_entry_reads():
    with pytest.raises(SpecError, match="router_jitter_noise"):
        arch_from_hf({**MIXTRAL_8X7B, "router_jitter_noise": 0.1}, "m")
    arch = read_arch(Fields({"layers": 2, "hidden": 64, "ffn_hidden": 128, "heads": 4, "vocab": 100,
                             "moe": {"experts": 4, "top_k": 2, "expert_ffn_hidden": 32}}, "model"), None)
    assert arch.moe == MoESpec(4, 2, 32) and ModelArch(**{**arch.to_dict(), "moe": MoESpec(4, 2, 32)}) == arch
    with pytest.raises(SpecError, match=r"model\.moe\.top_k"):
        read_arch(Fields({"layers": 2, "hidden": 64, "ffn_hidden": 128, "heads": 4, "vocab": 100,
                          "moe": {"experts": 4, "top_k": 5, "expert_ffn_hidden": 32}}, "model"), None)


def test_layout_strings_carry_ep_and_it_is_checked_against_the_model():
    layout = Layout.parse("tp=1,dp=4,ep=2")
    assert layout.ep == 2 and layout.dims.ep == 2 and "EP2" in layout.short()
    assert layout.dims.problem(PRESETS["mixtral-8x7b"]) is None
    assert "dense model, no experts" in str(layout.dims.problem(PRESETS["qwen3-8b"]))


def test_sharding_lists_every_moe_tensor_with_the_dense_mlps_tp_split():
    arch = ModelArch(3, 64, 96, 4, 2, 100, qkv_bias=True,
                     moe=MoESpec(4, 2, 40, shared_expert_ffn_hidden=24, dense_layers=(1,)))
    tensors = {t.name: t for t in model_tensors(arch)}
    assert sum(math.prod(t.shape) for t in tensors.values()) == arch.params()
    router = tensors["model.layers.0.mlp.gate.weight"]
    shared_gate = tensors["model.layers.0.mlp.shared_expert_gate.weight"]
    assert router.shape == (4, 64) and router.tp_dim is None and shared_gate.tp_dim is None
    up = tensors["model.layers.2.mlp.experts.3.up_proj.weight"]
    down = tensors["model.layers.2.mlp.experts.3.down_proj.weight"]
    assert (up.shape, up.tp_dim, up.expert) == ((40, 64), 0, 3) and (down.shape, down.tp_dim) == ((64, 40), 1)
    assert tensors["model.layers.0.mlp.shared_expert.gate_proj.weight"].expert is None
    assert "model.layers.1.mlp.gate_proj.weight" in tensors and "model.layers.1.mlp.gate.weight" not in tensors
    assert tp_box(up, arch, 2, 1) == ((20, 40), (0, 64)) and tp_box(router, arch, 2, 1) == ((0, 4), (0, 64))
