"""benchmarks/verl_moe_mfu.py: verl's Megatron MoE training efficiency is what its three published Qwen3-30B-A3B
MFU rows give (the constant in ``published_frameworks`` is the script's fit, rounded), and the DeepSeek-V3 row
held out from the fit is priced near its published MFU with it and far from it at the prior."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import verl_moe_mfu  # noqa: E402

from nereus.sim.published_frameworks import (  # noqa: E402
    VERL_MEGATRON_MOE_TRAINING_EFFICIENCY,
    framework_of,
    training_efficiency,
)
from nereus.sim.published_runs import job_of  # noqa: E402
from tests.helpers import published_rows  # noqa: E402


def test_the_constant_is_the_fit_and_the_held_out_row_is_priced_with_it(capsys: pytest.CaptureFixture) -> None:
    assert verl_moe_mfu.main(["--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["fitted_efficiency"] == pytest.approx(VERL_MEGATRON_MOE_TRAINING_EFFICIENCY, abs=0.005)
    assert out["qwen3_pooled"] == pytest.approx(3 / (1 / 0.40 + 1 / 0.37 + 1 / 0.31), rel=0.02)
    assert out["dsv3_mfu"] == pytest.approx(out["dsv3_published"], rel=0.15)
    assert out["dsv3_mfu_prior"] > 1.4 * out["dsv3_published"]


def test_only_verls_megatron_moe_training_takes_it() -> None:
    rows = published_rows()
    for run_id, expected in [("verl_fa30_2", VERL_MEGATRON_MOE_TRAINING_EFFICIENCY), ("verl_dsv3_1",
                              VERL_MEGATRON_MOE_TRAINING_EFFICIENCY), ("verl_oso_3", 0.0), ("verl_fa_6", 0.0)]:
        row = rows[run_id]
        assert training_efficiency(row, job_of(row, {})) == expected, run_id  # dense Megatron, FSDP: the prior
    fsdp_moe = {**rows["verl_fa30_2"], "train_backend": "fsdp2"}
    assert training_efficiency(fsdp_moe, job_of(fsdp_moe, {})) == 0.0
    nemo = published_rows("e2e_runs_nemo_rl.csv")["nemorl_q30_32"]
    assert training_efficiency(nemo, job_of(nemo, {})) == framework_of(nemo).training_efficiency == 0.0
