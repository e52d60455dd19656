"""Parameter counts and per-rank parameters of ``nereus.cost.memory`` against the sharding contract, for
Qwen3's explicit head size and q/k norms."""

from __future__ import annotations

import pytest

from nereus.cost.memory import attention_activation_coeff, layer_params_per_rank
from nereus.spec.model import PRESETS, ModelArch
from nereus.spec.parallel_dims import ParallelDims
from nereus.spec.sharding import box_volume, model_tensors, rank_tensors

TINY_QWEN3 = ModelArch(layers=2, hidden=64, ffn_hidden=96, heads=4, kv_heads=2, vocab=50, head_dim=24, qk_norm=True)


def test_qwen3_presets_match_the_model_cards():
    # Qwen3-0.6B: 0.6B parameters, 0.44B non-embedding; Qwen3-8B: 8.2B, 6.95B non-embedding (model cards)
    small, large = PRESETS["qwen3-0.6b"], PRESETS["qwen3-8b"]
    assert 0.59e9 < small.params() < 0.61e9 and 0.435e9 < small.layers * small.layer_params() < 0.445e9
    assert 8.15e9 < large.params() < 8.25e9 and 6.9e9 < large.layers * large.layer_params() < 7.0e9


@pytest.mark.parametrize("arch", [TINY_QWEN3, PRESETS["qwen3-0.6b"], PRESETS["llama3-8b"]])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_layer_params_per_rank_is_the_contract_boxes(arch, tp):
    """One layer's parameters on a TP rank: the contract's boxes of that layer, q/k norms replicated."""
    boxes = rank_tensors(arch, ParallelDims(tp=tp), 0)
    layer = sum(box_volume(b) for name, b in boxes.items() if name.startswith("model.layers.0."))
    assert layer_params_per_rank(arch, tp) == layer
    assert sum(box_volume(tuple((0, d) for d in t.shape)) for t in model_tensors(arch)) == arch.params()


def test_attention_activations_follow_the_projection_widths():
    # Llama-style (head_dim = hidden / heads) keeps Korthikanti et al.'s 11 + 4·kv/heads; Qwen3's wider
    # projections (heads·head_dim = 96 over hidden 64) and q/k norm inputs store more
    llama = ModelArch(layers=2, hidden=64, ffn_hidden=96, heads=4, kv_heads=2, vocab=50)
    assert attention_activation_coeff(llama) == 11 + 4 * 2 / 4
    q, kv = 96 / 64, 48 / 64
    assert attention_activation_coeff(TINY_QWEN3) == pytest.approx(7 + 4 * q + 4 * kv + 2 * (q + kv))
