"""The runtime's stage modules hold the contract's tensors with the contract's TP boxes, in checkpoint order
for Llama-style models (``ShardedModel.optimizer_params`` orders by ``sharding.rank_order`` explicitly, so
ZeRO ranges match for every model; tests/runtime/transitions/test_live_transition.py checks the optimizer state
itself). Skipped without torch (planning installs do not need it)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from nereus.runtime.model.decoder import ModelConfig  # noqa: E402
from nereus.runtime.parallel.pp import build_stage  # noqa: E402
from nereus.runtime.parallel.tp import apply_tp  # noqa: E402
from nereus.spec import Layout  # noqa: E402
from nereus.spec.model import ModelArch  # noqa: E402
from nereus.spec.sharding import box_volume, rank_order  # noqa: E402

LLAMA_LIKE = ModelArch(layers=3, hidden=16, ffn_hidden=40, heads=4, kv_heads=2, vocab=29)


@pytest.mark.parametrize("value_head", [False, True])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 3), (4, 1)])
def test_runtime_parameter_order_is_the_contract_flat_order(tp, pp, value_head):
    cfg = ModelConfig(LLAMA_LIKE, value_head=value_head)
    lay = Layout(tp=tp, pp=pp)
    for stage in range(pp):
        for t in range(tp):
            model = apply_tp(build_stage(cfg, pp, stage), None, tp, t)
            params = [(n, p.numel()) for n, p in model.named_parameters()]
            contract = [(n, box_volume(b)) for n, b in rank_order(LLAMA_LIKE, lay.dims, stage, t, value_head)]
            assert params == contract
