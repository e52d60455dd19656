"""MoE rows of the published-runs schema as jobs and plans (``nereus.sim.published_runs``): the experts,
shared experts and dense layers from the row's columns, the EP degree on the training layouts."""

from __future__ import annotations

import pytest

from nereus.sim.published_arch import moe_arch_dict
from nereus.sim.published_runs import RowSkipped, published_run
from nereus.spec.model import PRESETS
from tests.helpers import published_rows as rows


def test_qwen3_30b_a3b_row_is_the_preset_and_trains_at_the_rows_ep() -> None:
    run = published_run(rows()["verl_fa30_2"])
    arch, preset = run.job.models["actor"], PRESETS["qwen3-30b-a3b"]
    assert arch.moe is not None and arch.sparse_layers() == arch.layers  # ffn_hidden empty: every layer sparse
    assert arch.active_params() == pytest.approx(preset.active_params(), rel=1e-3)  # q/k norms aside
    assert arch.params() / 1e9 == pytest.approx(30.5, rel=0.01)  # the row's params_b
    layouts = {str(p.model_stage): p.layout for p in run.plan.placements}
    assert layouts["actor/training"].ep == 8 and layouts["actor/generation"].ep == 1  # rollout_ep empty


def test_dense_layers_come_from_params_b() -> None:
    row = rows()["verl_dsv3_1"]  # DeepSeek-V3: the first 3 of 61 layers dense, one shared expert
    attention = {"layers": 61, "hidden": 7168, "heads": 128, "kv_heads": 128, "vocab": 129280}
    arch = moe_arch_dict(row, attention)
    assert arch["moe"]["dense_layers"] == [0, 1, 2]
    assert arch["moe"]["shared_expert_ffn_hidden"] == 2048 and arch["ffn_hidden"] == 18432
    with pytest.raises(RowSkipped, match="params_b"):
        moe_arch_dict({**row, "params_b": ""}, attention)


def test_uneven_pipeline_and_dense_ep_rules() -> None:
    uneven = published_run(rows()["verl_dsv3_1"])  # PP12 over 61 layers: priced at its fullest stage (6 layers)
    assert uneven.plan.placement("actor/training").layout.pp == 12
    dense = published_run({**rows()["verl_oso_3"], "train_ep": "8"})
    assert all(p.layout.ep == 1 for p in dense.plan.placements)  # no experts: ep stays 1
