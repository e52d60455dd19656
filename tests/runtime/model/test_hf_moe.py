"""MoE checkpoints against transformers: Qwen3MoeForCausalLM, Qwen2MoeForCausalLM and MixtralForCausalLM load
with equal logits and load-balancing loss, save back as the same class, and a rank reads only its experts."""

import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from nereus.runtime.model.hf import load_boxes, read_config, save_checkpoint  # noqa: E402
from nereus.runtime.model.moe import RoutingRecord  # noqa: E402
from nereus.spec.errors import SpecError  # noqa: E402
from nereus.spec.hf_files import check_model_dir  # noqa: E402
from nereus.spec.sharding import model_tensors  # noqa: E402
from tests.runtime.model.test_hf import _load_ours  # noqa: E402

COMMON = dict(hidden_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              vocab_size=97, max_position_embeddings=128, num_experts_per_tok=2)
CLASSES = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "mixtral": "MixtralForCausalLM"}


def _hf_config(kind: str):
    if kind == "qwen3_moe":  # layer 1 dense, the rest sparse, top-k renormalised
        return transformers.Qwen3MoeConfig(**COMMON, intermediate_size=40, moe_intermediate_size=24, num_experts=4,
                                           norm_topk_prob=True, mlp_only_layers=[1], router_aux_loss_coef=0.01)
    if kind == "qwen2_moe":  # every second layer sparse, top-k not renormalised, a shared expert
        return transformers.Qwen2MoeConfig(**COMMON, intermediate_size=40, moe_intermediate_size=24, num_experts=4,
                                           shared_expert_intermediate_size=32, decoder_sparse_step=2)
    return transformers.MixtralConfig(**COMMON, intermediate_size=24, num_local_experts=4)


def _hf_model(kind: str):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_hf_config(kind))
    with torch.no_grad():  # perturb norms and biases (HF: 1 and 0); sharpen the routers so no top-k is a near tie
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn_like(p))
    return model.eval()


def _tokens() -> torch.Tensor:
    return torch.randint(0, COMMON["vocab_size"], (3, 19), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("kind", list(CLASSES))
def test_logits_and_aux_loss_match_transformers(tmp_path, kind):
    hf = _hf_model(kind)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    check_model_dir(tmp_path, "model")  # the pre-flight reads the hub's per-expert names
    ours = _load_ours(tmp_path)
    moe = ours.cfg.arch.moe
    assert moe.experts == 4 and moe.top_k == 2 and moe.shared_expert_ffn_hidden == (32 if kind == "qwen2_moe" else 0)
    assert moe.dense_layers == {"qwen3_moe": (1,), "qwen2_moe": (0, 2), "mixtral": ()}[kind]
    record = RoutingRecord(aux=True)
    with torch.no_grad():
        want = hf(_tokens(), output_router_logits=True)
        got = ours(_tokens(), routing=record)
    torch.testing.assert_close(got, want.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(record.aux_loss(), want.aux_loss, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", list(CLASSES))
def test_saved_checkpoint_loads_in_transformers_as_the_same_class(tmp_path, kind):
    _hf_model(kind).save_pretrained(tmp_path / "hf", safe_serialization=True)
    ours = _load_ours(tmp_path / "hf")
    save_checkpoint(tmp_path / "ours", ours.cfg, ours.state_dict())
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert config["architectures"] == [CLASSES[kind]] and config["model_type"] == kind
    check_model_dir(tmp_path / "ours", "model")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert type(back).__name__ == CLASSES[kind]
    with torch.no_grad():
        torch.testing.assert_close(back(_tokens()).logits, ours(_tokens()), rtol=1e-5, atol=1e-5)
    assert read_config(tmp_path / "ours") == ours.cfg


def test_a_rank_reads_only_the_experts_it_holds(tmp_path):
    hf = _hf_model("mixtral")
    hf.save_pretrained(tmp_path, safe_serialization=True)
    arch = read_config(tmp_path).arch
    mine = {t.name: tuple((0, n) for n in t.shape) for t in model_tensors(arch) if t.expert in (2, 3)}
    got = load_boxes(tmp_path, mine)
    assert set(got) == set(mine) and len(got) == 3 * 2 * 3  # 3 layers × 2 experts × gate/up/down
    fused = hf.model.layers[0].mlp.experts  # transformers 5: gate and up stacked per expert in memory
    gate, up = fused.gate_up_proj[3].chunk(2, dim=0)
    torch.testing.assert_close(got["model.layers.0.mlp.experts.3.gate_proj.weight"], gate.detach())
    torch.testing.assert_close(got["model.layers.0.mlp.experts.3.up_proj.weight"], up.detach())
    torch.testing.assert_close(got["model.layers.0.mlp.experts.3.down_proj.weight"], fused.down_proj[3].detach())


def test_a_missing_expert_tensor_is_refused_by_name(tmp_path):
    _hf_model("qwen3_moe").save_pretrained(tmp_path, safe_serialization=True)
    ours = _load_ours(tmp_path)
    tensors = {k: v for k, v in ours.state_dict().items() if k != "model.layers.2.mlp.experts.1.up_proj.weight"}
    save_checkpoint(tmp_path / "broken", ours.cfg, tensors)
    with pytest.raises(SpecError, match=r"experts\.1\.up_proj"):
        check_model_dir(tmp_path / "broken", "model")
