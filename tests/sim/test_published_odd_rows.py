"""Rows of the published-runs schema the packaged data set does not have (``nereus.sim.published_runs``,
``published_predict``, ``published_baseline``): a rollout TP derived for heads it must split, a weight-sync
row at hundreds of GPUs, a mini-batch too small for the training ranks, a plan the cost model rejects, a
published step of 0. Each is modelled or skipped with its reason, never a crash."""

from __future__ import annotations

import math
import re

import pytest

from nereus.sim.published_baseline import baseline_of
from nereus.sim.published_predict import predict
from nereus.sim.published_runs import RowSkipped, published_run
from nereus.spec.cluster import gpu_presets
from tests.helpers import published_rows as rows


def test_a_derived_rollout_tp_splits_the_kv_heads_too() -> None:
    """verl's MoE script of 235B runs TP8; on 14 rollout GPUs the largest TP below it dividing them and the 28
    heads is 7, which splits 4 KV heads unevenly (the plan was rejected): TP 2 splits both."""
    row = {**rows()["verl_fa30_2"], "rollout_tp": "", "params_b": "235", "hidden": "3584", "n_heads": "28",
           "n_kv_heads": "4", "gpus_total": "30", "gpus_per_node": "2", "gen_gpus": "14", "train_gpus": "16"}
    run = published_run(row)
    assert run.plan.placement("actor/generation").layout.tp == 2
    assert all(math.isfinite(v) for v in predict(run, "cost").values())


def test_a_weight_sync_row_is_priced_at_hundreds_of_gpus() -> None:
    """Its nominal batch is one update: mini-batches of 32 prompts left 128 training ranks without a sequence."""
    row = {**rows()["verl_wsync_1"], "gpus_total": "256", "gen_gpus": "128", "train_gpus": "128"}
    run = published_run(row)
    assert run.job.algorithm.mini_batches == 1
    assert set(predict(run, "cost")) == {"t_weight_sync_s"}


def test_a_mini_batch_covers_every_training_rank() -> None:
    """verl's default 32 prompts a mini-batch would leave 32 of the 64 training ranks without a sequence at
    one sample a prompt; a run that ran had at least 64 prompts a mini-batch (8 updates of 512)."""
    row = {**rows()["verl_fa_7"], "samples_per_prompt": "1"}
    run = published_run(row)
    assert run.job.algorithm.mini_batches == 512 // 64
    assert all(math.isfinite(v) for v in predict(run, "cost").values())
    assert published_run(rows()["verl_fa_7"]).job.algorithm.mini_batches == 512 // 32  # 16 samples: the default


def test_gpus_per_node_left_empty_is_named_in_the_reason() -> None:
    row = {**rows()["verl_oso_2"], "gpus_per_node": "", "gpus_total": "12", "gen_gpus": "4", "train_gpus": "8"}
    with pytest.raises(RowSkipped, match=r"gpus_per_node 8 \(empty: 8"):
        published_run(row)


@pytest.mark.parametrize(("column", "value"), [("n_layers", "1e30"), ("n_layers", "2000000000"),
                                               ("gpus_total", "1e12"), ("prompts_per_step", "1e30")])
def test_a_count_beyond_any_run_skips_the_row_naming_its_column(column: str, value: str) -> None:
    """A typo's count is not built layer by layer or GPU by GPU (the MoE rows once overflowed, and a layer
    count of 2e9 stalled the validation): the row is skipped with the column's name."""
    for run_id in ("verl_dsv3_1", "verl_oso_3"):
        with pytest.raises(RowSkipped, match=rf"{column}='{value}' is larger than any run's"):
            published_run({**rows()[run_id], column: value})


def test_a_plan_the_cost_model_rejects_skips_the_row_with_its_reason() -> None:
    run = published_run({**rows()["verl_oso_3"], "n_kv_heads": "7"})  # the row's rollout TP 2 splits 7 KV heads
    for source in ("cost", "sim"):
        with pytest.raises(RowSkipped, match="cannot be priced: .*7 KV heads"):
            predict(run, source)


def test_a_published_step_of_zero_has_no_baseline() -> None:
    run = published_run({**rows()["verl_oso_3"], "t_step_s": "0"})
    assert baseline_of(run, "verl") is None
    assert baseline_of(published_run(rows()["verl_oso_3"]), "verl") == "verl-like"


@pytest.mark.parametrize(("gpu", "preset"), [("A100-80G", "A100"), ("h100-80gb", "H100"), ("GB200", "GB200"),
                                             ("H20-96G", "H20"), ("A100-40G", "A100-SXM-40GB"), ("H100-94G", None)])
def test_a_gpu_kind_is_its_familys_preset_only_at_the_presets_memory(gpu: str, preset: str | None) -> None:
    """An A100-40G is the catalogue's 40 GB A100 (1.6 TB/s), not its 80 GB one; a memory the catalogue has
    no preset of (an H100 of 94 GB) is skipped, not priced as another GPU."""
    row = {**rows()["verl_oso_3"], "gpu": gpu}
    if preset is None:
        with pytest.raises(RowSkipped, match=f"gpu='{gpu}': the catalogue's"):
            published_run(row)
    else:
        assert published_run(row).job.cluster.gpu == gpu_presets()[preset]


def test_a_dense_row_whose_head_dim_is_not_hidden_over_heads_is_priced_with_it() -> None:
    """Qwen3-32B: 64 heads of 128 over hidden 5120 (its public config); it was skipped, as MoE rows were not."""
    row = {**rows()["verl_oso_3"], "params_b": "32.8", "n_layers": "64", "hidden": "5120", "n_heads": "64",
           "n_kv_heads": "8", "head_dim": "128", "ffn_hidden": "25600", "vocab": "151936", "rollout_tp": "4"}
    run = published_run(row)
    actor = run.job.models["actor"]
    assert actor.head_dim == 128 and abs(actor.params() / 32.8e9 - 1) < 0.01
    assert all(math.isfinite(v) and v > 0 for v in predict(run, "cost").values())


@pytest.mark.parametrize(("gpu", "preset"), [("H100 SXM", "H100"), ("NVIDIA H100 80GB HBM3", "H100"),
                                             ("A100-SXM4-40GB", "A100-SXM-40GB"), ("H20 96 GB", "H20"),
                                             ("GB200 NVL72", "GB200"), ("H100 PCIe", None), ("H100 NVL", None),
                                             ("H100/A100", None), ("L40S", None), ("8xH100", "H100"),
                                             ("H20 96GB x 8", "H20"), ("4×GB200", "GB200"), ("MI300X", None),
                                             ("H100 x 8 PCIe", None)])
def test_a_gpu_named_as_datasheets_name_it_is_its_preset(gpu: str, preset: str | None) -> None:
    """Vendor, SXM form factor, memory type, the NVL72 rack and a count written with the kind are not another
    product; a PCIe or NVL H100 (other clocks, memory and links), two kinds at once or a kind the catalogue
    does not hold skip the row."""
    row = {**rows()["verl_oso_3"], "gpu": gpu}
    if preset is None:
        with pytest.raises(RowSkipped, match="is not in the GPU catalogue"):
            published_run(row)
    else:
        assert published_run(row).job.cluster.gpu == gpu_presets()[preset]


@pytest.mark.parametrize(("run_id", "column", "written"), [
    ("verl_oso_3", "placement", "colocate"), ("verl_oso_2", "placement", "Separate"),
    ("verl_oso_2", "sync_mode", "1-step-off"), ("verl_oso_2", "sync_mode", "One-Step-Off"),
    ("verl_oso_3", "sync_mode", "on-policy"), ("verl_oso_3", "train_backend", "Megatron-Core"),
    ("verl_oso_3", "algorithm", "GSPO"), ("verl_oso_1", "offload", "param + optimizer"),
    ("verl_oso_3", "placement", "co-located"), ("verl_oso_2", "placement", "decoupled"),
    ("verl_oso_1", "train_backend", "DTensor"), ("verl_oso_2", "placement", "standalone"),
    ("verl_oso_2", "sync_mode", "one_step_off_policy"), ("verl_fa_6", "sync_mode", "fully-async-policy"),
    ("dschat_7B", "train_backend", "DeepSpeed ZeRO-3"), ("verl_oso_3", "algorithm", "Dr. GRPO"),
    ("verl_oso_1", "offload", "optimizer + params"), ("verl_oso_4", "offload", "no"),
    ("openrlhf_7B", "critic", "TRUE"), ("verl_oso_3", "reference", "false")])
def test_a_cell_spelled_otherwise_is_read_as_the_schemas_word(run_id: str, column: str, written: str) -> None:
    """Case, blanks, hyphens and a few other names of a value (verl's "colocate", "on-policy", Megatron-Core,
    NeMo RL's DTensor backend as FSDP2, GSPO's and Dr. GRPO's GRPO stages, true/false for yes/no, an offload's
    parts in either order) price the row as the schema's own word does."""
    row = rows()[run_id]
    assert predict(published_run({**row, column: written}), "cost") == predict(published_run(row), "cost")


@pytest.mark.parametrize(("column", "written", "word"), [
    ("train_backend", "torch FSDP", "fsdp"), ("train_backend", "FSDP1", "fsdp"),
    ("train_backend", "ZeRO-3", "deepspeed"),
    ("algorithm", "REINFORCE++-baseline", "reinforce_pp"), ("algorithm", "Dr-GRPO", "grpo"),
    ("offload", "params", "param"), ("offload", "param, optimizer", "param+optimizer"),
    ("offload", "Parameters & Optimizer States", "param+optimizer"), ("offload", "params and optim", "param+optimizer"),
    ("offload", "optimizer/param", "param+optimizer"), ("offload", "weights", "param"), ("offload", "off", "none")])
def test_another_name_of_a_value_prices_the_row_as_the_schemas_word(column: str, written: str, word: str) -> None:
    row = rows()["verl_oso_1"]
    assert (predict(published_run({**row, column: written}), "cost")
            == predict(published_run({**row, column: word}), "cost"))


@pytest.mark.parametrize(("column", "written"), [("sync_mode", "Fully Async X"), ("offload", "param + grad"),
                                                 ("placement", "Hybrid"), ("dynamic_bsz", "maybe")])
def test_an_unknown_word_skips_the_row_naming_the_cell_as_written(column: str, written: str) -> None:
    with pytest.raises(RowSkipped, match=re.escape(f"{column}={written!r} is not modelled")):
        published_run({**rows()["verl_oso_3"], column: written})


@pytest.mark.parametrize(("run_id", "column", "written", "word"), [
    ("verl_oso_1", "dynamic_bsz", "false", "no"), ("verl_oso_1", "dynamic_bsz", "TRUE", "yes"),
    ("verl_fa_3", "enforce_eager", "true", "yes"), ("verl_fa_6", "partial_rollout", "False", "no"),
    ("verl_fa_6", "checkpoint_engine", "TRUE", "yes")])
def test_true_and_false_in_a_yes_no_column_are_yes_and_no(run_id: str, column: str, written: str, word: str) -> None:
    """true/false read as yes/no in every yes/no column, dynamic batching's and the optional settings' too:
    a ``dynamic_bsz`` of 'false' is no, not the framework's default."""
    row = rows()[run_id]
    assert (predict(published_run({**row, column: written}), "cost")
            == predict(published_run({**row, column: word}), "cost"))


@pytest.mark.parametrize(("column", "written"), [
    ("t_step_s", "N/A"), ("t_gen_s", "-"), ("t_update_actor_s", "\u2014"), ("mean_response_len", "n/a"),
    ("rollout_tp", "?"), ("offload", "unknown"), ("dynamic_bsz", "TBD")])
def test_a_cell_that_says_not_stated_is_an_empty_cell(column: str, written: str) -> None:
    """"N/A", "-" and the like are how tables leave a value out: the row keeps its other cells and prices as
    with the cell empty, instead of being skipped as a number or word it cannot read."""
    row = rows()["verl_oso_3"]
    run = published_run({**row, column: written})
    assert column not in run.published
    assert predict(run, "cost") == predict(published_run({**row, column: ""}), "cost")


def test_a_required_cell_that_says_not_stated_skips_naming_it_as_written() -> None:
    with pytest.raises(RowSkipped, match=re.escape("gpu='N/A' is not in the GPU catalogue")):
        published_run({**rows()["verl_oso_3"], "gpu": "N/A"})
    with pytest.raises(RowSkipped, match=re.escape("n_layers is empty (the architecture)")):
        published_run({**rows()["verl_oso_3"], "n_layers": "-"})


@pytest.mark.parametrize(("run_id", "written"), [("verl_oso_1", "yes"), ("verl_fa30_1", "True"), ("verl_oso_3", "on")])
def test_offload_on_without_its_kind_is_read_as_the_schema_writes_it_empty(run_id: str, written: str) -> None:
    """e2e_runs.md leaves ``offload`` empty when a source says offload is on without saying what: a row that
    writes "yes" instead takes the empty cell's rules (its recipe's offload, room for its rollout)."""
    row = rows()[run_id]
    assert (predict(published_run({**row, "offload": written}), "cost")
            == predict(published_run({**row, "offload": ""}), "cost"))


@pytest.mark.parametrize(("run_id", "written", "word"), [
    ("verl_oso_3", "verl v0.5", "verl"), ("verl_oso_3", "VERL", "verl"), ("verl_fa30_1", "verl 0.4.1", "verl"),
    ("verl_oso_1", "verl (v0.5)", "verl"), ("openrlhf_7B", "OpenRLHF v0.3.1", "OpenRLHF"),
    ("dschat_7B", "deepspeed chat", "DeepSpeed-Chat")])
def test_a_framework_followed_by_its_version_is_that_framework(run_id: str, written: str, word: str) -> None:
    """A listed framework's name in any case or spacing, or followed by a version, prices the row as its
    name does: verl's rules by version (eager decoding before August 2025), its MoE recipes and its
    baselines, and OpenRLHF's and DeepSpeed-Chat's own defaults."""
    row = rows()[run_id]
    run = published_run({**row, "framework": written})
    assert predict(run, "cost") == predict(published_run({**row, "framework": word}), "cost")
    assert baseline_of(run, written) == baseline_of(run, word)


@pytest.mark.parametrize(("written", "engine"), [
    ("vLLM", "vllm"), ("vLLM 0.8.5", "vllm"), ("vllm (V1)", "vllm"), ("SGLang", "sglang"),
    ("SGLang v0.4.6.post1", "sglang"), ("TensorRT-LLM", "trtllm"), ("trt_llm", "trtllm"), ("TRT-LLM", "trtllm"),
    ("vllm-v0", "vllm")])
def test_a_rollout_engine_as_published_tables_name_it_is_its_engine(written: str, engine: str) -> None:
    """An engine's key or one of its aliases (``spec.engines``) in any case, with hyphens, blanks or
    underscores, or followed by its version, prices the row as the engine's key does."""
    row = rows()["verl_oso_4"]
    assert published_run({**row, "rollout_engine": written}).job.options.rollout_engine == engine
    assert (predict(published_run({**row, "rollout_engine": written}), "cost")
            == predict(published_run({**row, "rollout_engine": engine}), "cost"))


@pytest.mark.parametrize("written", ["HF generate", "lmdeploy", "0.8.5"])
def test_an_engine_nereus_does_not_declare_skips_the_row_naming_it(written: str) -> None:
    with pytest.raises(RowSkipped, match=re.escape(f"rollout_engine={written!r}")):
        published_run({**rows()["verl_oso_4"], "rollout_engine": written})


@pytest.mark.parametrize(("column", "written", "plain"), [
    ("t_step_s", "365.28 s", "365.28"), ("t_gen_s", "150.72 seconds", "150.72"), ("gpus_total", "64 GPUs", "64"),
    ("gpus_per_node", "8 gpus", "8"), ("max_response_len", "28672 tokens", "28672"),
    ("max_response_len", "28K", "28672"), ("max_prompt_len", "2k", "2048"),
    ("mean_response_len", "1,200 tokens", "1200"), ("max_response_len", "28K tokens", "28672"),
    ("gpu_memory_utilization", "70%", "0.7")])
def test_a_number_with_its_columns_unit_or_a_caps_k_is_read_as_the_number(column: str, written: str,
                                                                         plain: str) -> None:
    """A unit that is the column's own is read past, and a length cap's K is 1,024 (RL configs' caps are
    multiples of it: verl's "28K tokens" is 28,672)."""
    row = rows()["verl_fa_3"]
    assert (predict(published_run({**row, column: written}), "cost")
            == predict(published_run({**row, column: plain}), "cost"))


@pytest.mark.parametrize(("run_id", "column", "written"), [
    ("verl_fa_6", "rollout_tp", "TP4"), ("verl_fa30_2", "train_tp", "tp=2"), ("verl_fa30_2", "train_ep", "EP 8"),
    ("verl_fa30_2", "train_pp", "PP:1")])
def test_a_degree_after_its_own_name_is_the_degree(run_id: str, column: str, written: str) -> None:
    """"TP4" in ``rollout_tp`` is 4, as tables and launch flags write a degree."""
    row = rows()[run_id]
    assert (predict(published_run({**row, column: written}), "cost") == predict(published_run(row), "cost"))


@pytest.mark.parametrize(("column", "written"), [("rollout_tp", "PP4"), ("train_ep", "TP8"), ("gpus_total", "TP4")])
def test_a_degree_under_another_name_skips_the_row(column: str, written: str) -> None:
    with pytest.raises(RowSkipped, match=re.escape(f"{column}={written!r} is not a number")):
        published_run({**rows()["verl_fa30_2"], column: written})


def test_a_staleness_in_percent_is_its_share() -> None:
    row = rows()["verl_fa_6"]
    assert published_run({**row, "staleness": "50%"}).staleness == 0.5 == float(row["staleness"])


@pytest.mark.parametrize(("column", "written"), [("mean_response_len", "1.2k"), ("max_response_len", "2.5K"),
                                                 ("prompts_per_step", "512 s"), ("t_step_s", "365 ms"),
                                                 ("t_gen_s", "5%")])
def test_another_unit_or_a_k_outside_a_cap_skips_the_row(column: str, written: str) -> None:
    with pytest.raises(RowSkipped, match=re.escape(f"{column}={written!r} is not a number")):
        published_run({**rows()["verl_fa_3"], column: written})


@pytest.mark.parametrize(("column", "written", "cap"), [("mean_response_len", "40000", "max_response_len"),
                                                      ("mean_prompt_len", "3000", "max_prompt_len")])
def test_a_mean_longer_than_its_cap_skips_the_row_naming_both(column: str, written: str, cap: str) -> None:
    row = rows()["verl_fa_3"]
    with pytest.raises(RowSkipped, match=re.escape(f"{column} {written} exceeds {cap} {row[cap]}")):
        published_run({**row, column: written})


@pytest.mark.parametrize(("run_id", "placement"), [("verl_oso_4", "disaggregated"), ("verl_fa_7", "disaggregated"),
                                                   ("verl_fa_3", "colocated"), ("verl_oso_1", "colocated"),
                                                   ("openrlhf_70B", "disaggregated"), ("dschat_13B", "colocated")])
def test_an_empty_placement_is_read_from_the_pools_the_row_states(run_id: str, placement: str) -> None:
    """A rollout pool and a trainer pool each smaller than the run (verl_oso_4's 4 + 12 of 16 GPUs) are
    separate GPUs: the row is priced as disaggregated, not every model on every GPU; so is a row of a
    framework that puts each model on GPUs of its own (OpenRLHF, no pools stated); otherwise colocated."""
    row = rows()[run_id]
    run = published_run({**row, "placement": ""})
    assert run.plan.strategy == placement == row["placement"]
    assert predict(run, "cost") == predict(published_run(row), "cost")


@pytest.mark.parametrize("run_id", ["openrlhf_7B", "dschat_13B"])
def test_ppo_with_an_empty_critic_runs_its_critic(run_id: str) -> None:
    """PPO's advantages come from a value model (GAE): an empty ``critic`` on a PPO row is yes, not a
    critic-free GRPO step."""
    row = rows()[run_id]
    run = published_run({**row, "critic": ""})
    assert "critic" in run.job.models
    assert predict(run, "cost") == predict(published_run(row), "cost")
    assert "critic" not in published_run({**row, "critic": "", "algorithm": "grpo"}).job.models


def test_an_empty_arch_with_routed_experts_is_moe() -> None:
    """The experts a row states make it an MoE model: an empty ``arch`` had read as dense and skipped the row
    for its empty dense ``ffn_hidden``."""
    row = rows()["verl_fa30_2"]
    run = published_run({**row, "arch": ""})
    assert run.job.models["actor"].moe is not None
    assert predict(run, "cost") == predict(published_run(row), "cost")
    assert published_run({**rows()["verl_oso_2"], "arch": ""}).job.models["actor"].moe is None


@pytest.mark.parametrize("run_id", ["openrlhf_13B", "verl_fa30_1", "verl_dsv3_1"])
def test_an_empty_params_b_is_the_architectures_count(run_id: str) -> None:
    """The rules that go by a model's size (OpenRLHF's rollout TP by script, verl's MoE recipe of the
    nearest size) read the architecture's own count where ``params_b`` is empty: the row is priced as with
    its published size, not without those rules."""
    row = rows()[run_id]
    if row["ffn_hidden"] and row["arch"] == "moe":  # dense layers counted from params_b: it must be stated
        with pytest.raises(RowSkipped, match="params_b is empty"):
            published_run({**row, "params_b": ""})
        return
    assert predict(published_run({**row, "params_b": ""}), "cost") == predict(published_run(row), "cost")


def test_params_b_with_its_unit_is_the_number() -> None:
    row = rows()["verl_fa30_1"]
    assert predict(published_run({**row, "params_b": f"{row['params_b']}B"}), "cost") == \
        predict(published_run(row), "cost")


def test_a_prompt_cap_left_empty_beside_its_mean_is_the_mean_over_the_stated_fraction() -> None:
    """The prior that reads an unstated mean prompt as 1/8 of its cap, read the other way: verl_oso_2 with a
    mean prompt of 256 and no cap is priced as with its 2,048 cap; a response's cap is still required (it
    sets the rollout's tail)."""
    row = {**rows()["verl_oso_2"], "mean_prompt_len": "256", "mean_response_len": "2000"}
    assert row["max_prompt_len"] == "2048"
    assert predict(published_run({**row, "max_prompt_len": ""}), "cost") == predict(published_run(row), "cost")
    with pytest.raises(RowSkipped, match=r"^max_response_len is empty \(the longest response sets the rollout"):
        published_run({**row, "max_response_len": ""})
    with pytest.raises(RowSkipped, match=r"^max_prompt_len is empty \(a mean of 0 gives no cap\)$"):
        published_run({**row, "max_prompt_len": "", "mean_prompt_len": "0"})
