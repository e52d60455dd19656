"""benchmarks/e2e_validation.py on rows it has never seen: published rows of the packaged data set with their
fields varied over every enum value of the schema (nereus/cost/e2e_runs.md), values it does not know, other
frameworks, GPU kinds and sync modes, MoE models, layouts that do not divide, sizes that do not fit, odd and
empty cells, and files with a BOM, CRLF line ends, blanks around column names, extra and missing columns.

Every row must be either modelled, with finite predictions, or skipped with a one-line reason, and the final
JSON line must print with its documented keys, for both sources. No figure is asserted."""

from __future__ import annotations

import csv
import io
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import e2e_validation  # noqa: E402

from tests.helpers import published_rows as packaged_rows  # noqa: E402

KEYS = {"rows", "skipped", "cells", "mean_abs_pct", "overall_mean_abs_pct", "overall_max_abs_pct"}
# A batch the simulator runs in milliseconds: the sim source draws every sequence of every step.
SMALL = {"prompts_per_step": "32", "samples_per_prompt": "2", "max_prompt_len": "256", "max_response_len": "512",
         "mean_prompt_len": "", "mean_response_len": ""}
# Rows of the packaged data set the variants start from: sync colocated Megatron, one-step-off and fully-async
# disaggregated FSDP, MoE (with and without shared experts and dense first layers), OpenRLHF and DeepSpeed-Chat
# PPO with a critic, a weight-sync-only row.
BASES = ("verl_oso_3", "verl_oso_2", "verl_fa_2", "verl_fa30_2", "verl_dsv3_1", "openrlhf_7B", "dschat_7B",
         "verl_wsync_1")
# Each schema column with every enum value it lists, values it does not, and odd cells.
VALUES = {
    "framework": ["verl", "OpenRLHF", "DeepSpeed-Chat", "NeMo-RL", "slime", "AReaL", "OpenRLHF ", "ROLL", ""],
    "gpu": ["H100-80G", "H800-80G", "H20-96G", "A100-80G", "A100-40G", "A800-80G", "H200-141G", "B200-180G",
            "GB200", "other", "", "h100", "L40S", "MI300X", "-"],
    "rollout_engine": ["vllm", "sglang", "other", "", "lmdeploy", "VLLM", "trtllm"],
    "train_backend": ["fsdp", "fsdp2", "megatron", "deepspeed", "other", "", "xla"],
    "sync_mode": ["sync", "one_step_off", "fully_async", "partial_rollout", "", "async"],
    "placement": ["colocated", "disaggregated", "", "hybrid"],
    "offload": ["none", "param", "optimizer", "param+optimizer", "", "yes"],
    "dynamic_bsz": ["yes", "no", "", "maybe"],
    "enforce_eager": ["yes", "no", "", "true"],
    "checkpoint_engine": ["yes", "no", "", "1"],
    "algorithm": ["ppo", "grpo", "dapo", "reinforce_pp", "rloo", "other", "", "gspo"],
    "critic": ["yes", "no", "", "x"],
    "reference": ["yes", "no", "", "x"],
    "arch": ["dense", "moe", "", "hybrid"],
    "staleness": ["0", "0.1", "1", "2", "-1", "x", "nan", ""],
    "gpus_per_node": ["", "0", "1", "3", "16", "8.5"],
    "gpus_total": ["", "0", "1", "2", "3", "12", "1000", "-8", "abc", "1e400", "inf"],
    "gen_gpus": ["", "0", "1", "3", "100"],
    "train_gpus": ["", "0", "3", "100"],
    "rollout_tp": ["", "0", "1", "3", "7", "64", "1.5"],
    "rollout_ep": ["", "3", "8", "64"],
    "train_tp": ["", "3", "16"],
    "train_pp": ["", "3", "7", "100"],
    "train_cp": ["", "3", "64"],
    "train_ep": ["", "3", "1000"],
    "prompts_per_step": ["", "0", "1", "3", "31"],
    "samples_per_prompt": ["", "0", "1", "3"],
    "max_prompt_len": ["", "0", "1"],
    "max_response_len": ["", "0", "1", "1000000"],
    "mean_prompt_len": ["0", "1e9"],
    "mean_response_len": ["0", "0.4", "1e9"],
    "n_layers": ["", "0", "1", "1000"],
    "hidden": ["", "7", "64", "65536"],
    "n_heads": ["", "1", "7", "1000"],
    "n_kv_heads": ["", "1", "3", "7", "1000"],
    "head_dim": ["", "7", "256"],
    "ffn_hidden": ["", "1", "100000"],
    "vocab": ["", "1", "10000000"],
    "params_b": ["", "0", "0.001", "1e6"],
    "n_experts": ["", "1", "3", "1000"],
    "experts_per_token": ["", "1", "8", "100"],
    "moe_ffn_hidden": ["", "1", "7", "100000"],
    "shared_experts": ["", "1", "2", "0.5", "x"],
    "t_gen_s": ["", "0", "1e-9", "1e12"],
    "t_values_s": ["5"],
    "t_update_critic_s": ["5"],
    "t_weight_sync_s": ["", "0", "3"],
    "t_step_s": ["", "0"],
    "tok_per_s_per_gpu": ["0", "1000"],
}
# Several fields at once: what a run of a framework the project has never seen could publish.
SCENARIOS = {
    "nemo_sync": ("verl_oso_3", {"framework": "NeMo-RL", "gpu": "H100-80G", "rollout_engine": "vllm",
                                 "train_backend": "megatron", "sync_mode": "sync"}),
    "slime_one_step_off": ("verl_oso_2", {"framework": "slime", "gpu": "H800-80G", "rollout_engine": "sglang",
                                          "train_backend": "megatron", "sync_mode": "one_step_off"}),
    "areal_fully_async": ("verl_fa_2", {"framework": "AReaL", "gpu": "H200-141G", "rollout_engine": "sglang",
                                        "sync_mode": "fully_async", "staleness": "4"}),
    "roll_moe_b200": ("verl_fa30_2", {"framework": "ROLL", "gpu": "B200-180G", "rollout_engine": "sglang",
                                      "sync_mode": "one_step_off", "staleness": ""}),
    "moe_shared_dense_gb200": ("verl_dsv3_1", {"gpu": "GB200", "gpus_per_node": "4", "gpus_total": "96"}),
    "no_gpus_per_node": ("verl_oso_2", {"gpus_per_node": ""}),
    "no_gpus_per_node_12": ("verl_oso_2", {"gpus_per_node": "", "gpus_total": "12", "gen_gpus": "4",
                                           "train_gpus": "8"}),
    "pools_under_total": ("verl_oso_2", {"gen_gpus": "2", "train_gpus": "6"}),
    "pools_over_total": ("verl_oso_2", {"gen_gpus": "8", "train_gpus": "12"}),
    "colocated_pools_differ": ("verl_oso_3", {"gen_gpus": "4", "train_gpus": "12"}),
    # verl's MoE script of 235B runs TP8; on 14 rollout GPUs the largest TP below it that divides them and the
    # 28 heads is 7, which splits the 4 KV heads unevenly: TP 2 is the largest that splits both
    "derived_tp_kv_heads": ("verl_fa30_2", {"rollout_tp": "", "params_b": "235", "hidden": "3584", "n_heads": "28",
                                            "n_kv_heads": "4", "gpus_total": "30", "gpus_per_node": "2",
                                            "gen_gpus": "14", "train_gpus": "16"}),
    "huge_dense": ("verl_oso_3", {"n_layers": "400", "hidden": "32768", "n_heads": "256", "n_kv_heads": "8",
                                  "head_dim": "128", "ffn_hidden": "131072", "gpus_total": "8",
                                  "gpus_per_node": "8", "train_tp": "8", "train_pp": "1", "rollout_tp": "8"}),
    "tiny_dense": ("verl_oso_3", {"n_layers": "1", "hidden": "64", "n_heads": "1", "n_kv_heads": "1",
                                  "head_dim": "64", "ffn_hidden": "128", "vocab": "100", "params_b": "0.0001",
                                  "train_tp": "1", "train_pp": "1", "rollout_tp": "1"}),
    "critic_stages_only": ("openrlhf_7B", {"t_step_s": "", "t_values_s": "30", "t_update_critic_s": "60"}),
    "critic_stages_no_critic": ("verl_oso_3", {"t_gen_s": "", "t_old_logprob_s": "", "t_update_actor_s": "",
                                               "t_step_s": "", "t_values_s": "30", "t_update_critic_s": "60"}),
    "step_only": ("verl_oso_3", {"t_gen_s": "", "t_old_logprob_s": "", "t_update_actor_s": ""}),
    "throughput_only": ("verl_fa_2", {"t_gen_s": "", "t_update_actor_s": "", "t_step_s": "", "tok_per_s_per_gpu":
                                      "900"}),
    "nothing_published": ("verl_oso_3", {"t_gen_s": "", "t_old_logprob_s": "", "t_update_actor_s": "",
                                         "t_step_s": ""}),
    "all_zero": ("verl_oso_3", {"t_gen_s": "0", "t_old_logprob_s": "0", "t_update_actor_s": "0", "t_step_s": "0"}),
    "wsync_256": ("verl_wsync_1", {"gpus_total": "256", "gen_gpus": "128", "train_gpus": "128"}),
    "moe_dense_no_params": ("verl_dsv3_1", {"params_b": ""}),
    "moe_tp_beyond_expert": ("verl_fa30_2", {"moe_ffn_hidden": "2", "rollout_tp": "4"}),
    "mini_batch_under_dp": ("verl_fa_7", {"samples_per_prompt": "1"}),
    "blank_padded": ("verl_oso_3", {"gpu": " H100-80G ", "gpus_total": " 16 ", "sync_mode": " sync "}),
    "comma_number": ("verl_oso_3", {"prompts_per_step": "1,024"}),  # thousands separator: 1024
    "decimal_comma": ("verl_oso_3", {"prompts_per_step": "1,5"}),
    "no_run_id": ("verl_oso_3", {"run_id": ""}),
}



def variants(small: bool) -> list[dict]:
    """Every base row with each column varied over ``VALUES``, then the ``SCENARIOS``; ``small``: at a
    batch the simulator runs quickly, each column varied on one base row in turn (the simulator prices the
    job and plan that the cost model's variants already built, at some ten milliseconds a row)."""
    rows, out = packaged_rows(), []
    for base in BASES:
        for j, (column, values) in enumerate(VALUES.items()):
            if small and BASES[j % len(BASES)] != base:
                continue
            for i, value in enumerate(values):
                out.append({**rows[base], **(SMALL if small else {}), column: value,
                            "run_id": f"{base}.{column}.{i}"})
    for name, (base, fields) in SCENARIOS.items():
        out.append({**rows[base], **(SMALL if small and "prompts_per_step" not in fields else {}),
                    "run_id": name, **fields})
    return out


def write(path: Path, rows: list[dict], newline: str = "\n", bom: bool = False) -> Path:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(rows[0]), lineterminator=newline)
    writer.writeheader()
    writer.writerows(rows)
    path.write_bytes((("\ufeff" if bom else "") + out.getvalue()).encode())
    return path


def summary(capsys: pytest.CaptureFixture, *args: str) -> dict:
    assert e2e_validation.main(list(args)) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(out) == KEYS
    for value in (*out["mean_abs_pct"].values(), out["overall_mean_abs_pct"], out["overall_max_abs_pct"]):
        assert value is None or math.isfinite(value)
    return out


def check_every_row(rows: list[dict], source: str) -> tuple[list, list[dict], int]:
    """Each row modelled with finite cells or skipped with a one-line reason, never both, never neither."""
    cells, skipped, modelled, _ = e2e_validation.validate(rows, source)
    ids = [row["run_id"] or f"(row {i + 1})" for i, row in enumerate(rows)]
    with_cells = {run_id for run_id, *_ in cells}
    why = {s["run_id"]: s["why"] for s in skipped}
    assert modelled + len(skipped) == len(rows)
    assert len(with_cells) == modelled and not with_cells & set(why)
    assert set(ids) == with_cells | set(why)
    assert all(reason.strip() and "\n" not in reason for reason in why.values())
    assert all(math.isfinite(guess) and math.isfinite(published) for _, _, published, guess in cells)
    return cells, skipped, modelled


def test_every_variant_is_modelled_or_skipped_by_the_cost_model() -> None:
    rows = variants(small=False)
    _, skipped, modelled = check_every_row(rows, "cost")
    why = {s["run_id"]: s["why"] for s in skipped}
    # rows a rule covers are modelled, not skipped: other frameworks and GPU kinds, MoE with dense first layers
    for run_id in ("nemo_sync", "slime_one_step_off", "areal_fully_async", "roll_moe_b200", "wsync_256",
                   "moe_shared_dense_gb200", "no_gpus_per_node", "critic_stages_only", "step_only",
                   "throughput_only", "derived_tp_kv_heads", "tiny_dense", "blank_padded",
                   "comma_number",
                   "mini_batch_under_dp"):  # a mini-batch takes every training rank a sequence at the least
        assert run_id not in why, why[run_id]
    assert "gpu" in why["verl_oso_3.gpu.9"] and "gpu" in why["verl_oso_3.gpu.13"]  # other, MI300X
    assert "verl_oso_3.gpu.4" not in why  # A100-40G: the catalogue's 40 GB A100
    assert "not modelled" in why["verl_oso_3.rollout_engine.4"]  # lmdeploy
    assert "gpus_per_node" in why["no_gpus_per_node_12"]
    assert "no published" in why["nothing_published"] and "predicted" in why["all_zero"]
    assert "predicted" in why["critic_stages_no_critic"]
    assert "FFN width" in why["moe_tp_beyond_expert"]
    assert "not a number" in why["decimal_comma"]
    assert "does not fit" in why["huge_dense"]
    assert modelled > len(rows) // 2


def test_every_variant_is_modelled_or_skipped_by_the_simulator() -> None:
    _, skipped, _ = check_every_row(variants(small=True), "sim")
    assert "does not fit" in {s["run_id"]: s["why"] for s in skipped}["huge_dense"]  # the truth has no memory


@pytest.mark.parametrize("source", ["cost", "sim"])
def test_odd_file_prints_its_table_baselines_and_json(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                      source: str) -> None:
    """BOM, CRLF, blanks around column names, an extra column, optional columns left out, a short line."""
    rows = packaged_rows()
    picked = [{**rows[base], **SMALL} for base in ("verl_oso_3", "verl_oso_2", "verl_fa30_2", "verl_wsync_1")]
    picked += [{**rows["verl_oso_3"], **SMALL, "run_id": "step_0", "t_step_s": "0"},
               {**rows["verl_oso_2"], **SMALL, "run_id": "kv_7", "n_kv_heads": "7"}]
    for row in picked:
        row.pop("enforce_eager"), row.pop("checkpoint_engine")
        row["unknown column"] = "?"
    path = write(tmp_path / "runs.csv", picked, newline="\r\n", bom=True)
    header, *lines = path.read_bytes().decode("utf-8-sig").split("\r\n")
    spaced = ", ".join(f" {name} " for name in header.split(","))
    path.write_bytes(("\ufeff" + "\r\n".join([spaced, *lines, "verl_short,https://example.org"])).encode())
    out = summary(capsys, "--rows", str(path), "--source", source)  # the table and the baselines too
    assert out["rows"] == 5 and out["cells"] > 0
    assert {s["run_id"] for s in out["skipped"]} == {"kv_7", "verl_short"}


def test_column_names_in_capitals_are_the_schemas(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rows = packaged_rows()
    plain = write(tmp_path / "plain.csv", [{**rows["verl_oso_3"], **SMALL}])
    header, rest = plain.read_text().split("\n", 1)
    capitals = tmp_path / "capitals.csv"
    capitals.write_text(header.upper().replace("RUN_ID", "Run_Id") + "\n" + rest)
    out = summary(capsys, "--rows", str(capitals), "--json")
    assert out["rows"] == 1 and out == summary(capsys, "--rows", str(plain), "--json")


def test_empty_and_header_only_files(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    for text in ("", "run_id,gpu\n"):
        path = tmp_path / "runs.csv"
        path.write_text(text)
        out = summary(capsys, "--rows", str(path), "--json")
        assert out["rows"] == 0 and out["cells"] == 0 and out["overall_mean_abs_pct"] is None


def test_bytes_that_are_not_utf8_skip_their_row(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rows = packaged_rows()
    path = write(tmp_path / "runs.csv", [{**rows["verl_oso_3"], **SMALL, "gpus_total": "16"}])
    path.write_bytes(path.read_bytes().replace(b",16,", b",1\xe96,", 1))
    out = summary(capsys, "--rows", str(path), "--json")
    assert out["rows"] == 0 and "not a number" in out["skipped"][0]["why"]


ENUMS = ("framework", "algorithm", "critic", "reference", "arch", "gpu", "placement", "rollout_engine",
         "enforce_eager", "checkpoint_engine", "train_backend", "offload", "dynamic_bsz", "sync_mode")


def test_an_enum_cell_in_capitals_or_with_blanks_is_read_as_written_plainly() -> None:
    """'FULLY_ASYNC' was priced as a synchronous step (the mode compared as written)."""
    rows = packaged_rows()
    pairs = [(base, column) for base in BASES for column in ENUMS]
    plain = [{**rows[base], "run_id": f"{base}.{column}"} for base, column in pairs]
    loud = [{**row, column: f" {row[column].upper()} "} for row, (_, column) in zip(plain, pairs, strict=True)]
    assert e2e_validation.validate(loud, "cost") == e2e_validation.validate(plain, "cost")


def test_a_file_the_csv_module_cannot_read_is_a_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "runs.csv"
    path.write_text("run_id,notes\nx," + "a" * 200_000 + "\n")  # a cell over csv.field_size_limit()
    assert e2e_validation.main(["--rows", str(path), "--json"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("--rows:") and "cannot be read as CSV" in err and "\n" not in err
