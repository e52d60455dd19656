"""``vllm.server.engine_layout``: where each checkpoint tensor lands in vLLM's fused parameters (no vLLM
needed; the engine tests check it against a real engine's parameters)."""

from __future__ import annotations

import pytest

from nereus.runtime.engines.vllm.server import engine_layout
from nereus.runtime.model.decoder import ModelConfig, build_model
from nereus.spec.model import ModelArch


@pytest.mark.parametrize("arch", [
    ModelArch(layers=2, hidden=64, ffn_hidden=96, heads=4, kv_heads=2, vocab=50),
    ModelArch(layers=1, hidden=64, ffn_hidden=128, heads=2, kv_heads=1, vocab=40, tied_embeddings=True, qkv_bias=True),
    ModelArch(layers=2, hidden=64, ffn_hidden=96, heads=2, kv_heads=1, vocab=50, head_dim=48, qk_norm=True),
])
def test_every_checkpoint_tensor_has_a_place_and_fused_parameters_are_tiled(arch):
    cfg = ModelConfig(arch)
    state = build_model(cfg, seed=0).state_dict()
    layout = engine_layout(cfg)
    assert set(layout) == set(state)
    rows: dict[str, list[tuple[int, int]]] = {}
    for name, d in layout.items():
        assert d.rows == state[name].shape[0], name
        rows.setdefault(d.param, []).append((d.offset, d.offset + d.rows))
    for param, spans in rows.items():
        spans.sort()
        assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False)), param
    a = arch
    assert rows["model.layers.0.self_attn.qkv_proj.weight"][-1][1] == (a.heads + 2 * a.kv_heads) * a.head_dim
    assert rows["model.layers.0.mlp.gate_up_proj.weight"][-1][1] == 2 * a.ffn_hidden
