import json

import pytest
import yaml

from nereus.spec import Layout, ModelStage, Placement, Plan, SpecError, job_from_dict, load_job
from nereus.spec.cluster import gpu_presets
from nereus.spec.model import PRESETS, arch_from_hf


def base_spec() -> dict:
    return yaml.safe_load((__import__("tests.conftest").conftest.EXAMPLES / "ppo_8b_h100.yaml").read_text())


@pytest.mark.parametrize("name", ["ppo_8b_h100", "grpo_7b_h100", "ppo_tiny_cpu", "train_gpt_1t_a100",
                                  "ppo_70b_a100_one_node", "grpo_longtail_levers"])
def test_examples_load(examples, name):
    job = load_job(examples / f"{name}.yaml")
    assert job.model_stages()
    assert job.cluster.num_gpus >= 1


def test_ppo_and_grpo_model_stages(examples):
    ppo = [str(ms) for ms in load_job(examples / "ppo_8b_h100.yaml").model_stages()]
    assert ppo == ["actor/generation", "actor/inference", "reference/inference", "critic/inference",
                   "reward/inference", "actor/training", "critic/training"]
    grpo = [str(ms) for ms in load_job(examples / "grpo_7b_h100.yaml").model_stages()]
    assert grpo == ["actor/generation", "actor/inference", "reference/inference", "actor/training"]
    train = [str(ms) for ms in load_job(examples / "train_gpt_1t_a100.yaml").model_stages()]
    assert train == ["gpt/training"]


def test_misspelled_key_names_path_and_suggestion():
    spec = base_spec()
    spec["workload"]["prompt_lenght"] = spec["workload"].pop("prompt_length")
    with pytest.raises(SpecError) as err:
        job_from_dict(spec)
    assert err.value.path in ("workload.prompt_length", "workload.prompt_lenght")
    spec = base_spec()
    spec["options"]["recomptue"] = "full"
    with pytest.raises(SpecError, match=r"options\.recomptue: unknown key; did you mean 'recompute'"):
        job_from_dict(spec)


@pytest.mark.parametrize("path,value,pattern", [
    (("cluster", "nodes"), 0, r"cluster\.nodes: 0 is out of range"),
    (("options", "recompute"), "some", r"options\.recompute: 'some' is not allowed; choose one of"),
    (("algorithm", "name"), "dpo", r"algorithm\.name: 'dpo' is not allowed"),
    (("workload", "response_length"), {"mean": 9000, "max": 100}, r"workload\.response_length\.mean: .*exceeds max"),
    (("cluster", "gpu"), "V100", r"cluster\.gpu: 'V100' is not allowed"),
    (("models", "actor"), {"preset": "llama-9b"}, r"models\.actor\.preset"),
    (("models", "critic"), {"layers": 2, "hidden": 64, "ffn_hidden": 128, "heads": 3, "vocab": 10},
     r"models\.critic\.heads: hidden \(64\) must be divisible"),
    (("algorithm", "mini_batches"), 3, r"algorithm\.mini_batches: 3 does not divide"),
    (("options", "micro_batch_size"), "big", r"options\.micro_batch_size: 'big' is not allowed"),
    (("workload", "prompts_per_step"), "many", r"workload\.prompts_per_step: expected an integer"),
])
def test_bad_values_name_the_key(path, value, pattern):
    spec = base_spec()
    spec[path[0]][path[1]] = value
    with pytest.raises(SpecError, match=pattern):
        job_from_dict(spec)


def test_algorithm_model_checks():
    spec = base_spec()
    spec["algorithm"]["models"] = ["actor", "reference"]
    with pytest.raises(SpecError, match=r"algorithm\.models: ppo needs a 'critic'"):
        job_from_dict(spec)
    spec["algorithm"]["models"] = ["actor", "judge"]
    with pytest.raises(SpecError, match=r"algorithm\.models\[1\]: 'judge' is not defined"):
        job_from_dict(spec)


def test_missing_section_and_bad_yaml(tmp_path):
    spec = base_spec()
    del spec["cluster"]
    with pytest.raises(SpecError, match="cluster: required section is missing"):
        job_from_dict(spec)
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: [unclosed\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_job(bad)
    with pytest.raises(SpecError, match="job file not found"):
        load_job(tmp_path / "missing.yaml")


def test_hf_config_maps_onto_arch(tmp_path):
    cfg = {"model_type": "qwen2", "num_hidden_layers": 28, "hidden_size": 3584, "intermediate_size": 18944,
           "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = base_spec()
    spec["models"]["actor"] = {"hf_config": str(tmp_path / "config.json")}
    job = job_from_dict(spec)
    assert job.models["actor"] == PRESETS["qwen2.5-7b"]
    # Qwen2.5-7B has 7.6B parameters (model card).
    assert 7.5e9 < job.models["actor"].params() < 7.7e9


LLAMA_CFG = {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 14336,
             "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "head_dim": 128,
             "attention_bias": False, "mlp_bias": False, "num_labels": None, "rope_theta": 500000.0}


@pytest.mark.parametrize(("patch", "pattern"), [
    ({"model_type": "gpt2"}, r"cfg\.model_type: 'gpt2' is not supported"),
    ({"head_dim": 127}, r"cfg\.head_dim: 127 is odd: RoPE rotates pairs"),
    ({"attention_bias": True}, r"cfg\.attention_bias: biases other than Qwen2's QKV bias"),
    ({"mlp_bias": True}, r"cfg\.mlp_bias: biases other"),
    ({"num_key_value_heads": 5}, r"cfg\.num_key_value_heads: heads \(32\) must be divisible by kv_heads \(5\)"),
    ({"hidden_size": 4100, "head_dim": None}, r"cfg\.num_attention_heads: hidden \(4100\) must be divisible"),
    ({"vocab_size": "big"}, r"cfg\.vocab_size: expected"),
    ({"num_hidden_layers": None}, r"cfg\.num_hidden_layers: required key is missing"),
])
def test_hf_config_refuses_what_the_arch_cannot_describe(patch, pattern):
    assert arch_from_hf(LLAMA_CFG, "cfg") == PRESETS["llama3-8b"]
    with pytest.raises(SpecError, match=pattern):
        arch_from_hf({**LLAMA_CFG, **patch}, "cfg")


# Qwen3-8B's config.json (hub), the keys the parser reads: head_dim given, q/k norms implied by the type
QWEN3_8B_CFG = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 36,
                "hidden_size": 4096, "intermediate_size": 12288, "num_attention_heads": 32, "num_key_value_heads": 8,
                "head_dim": 128, "vocab_size": 151936, "attention_bias": False, "tie_word_embeddings": False,
                "use_sliding_window": False, "sliding_window": None, "max_window_layers": 36,
                "max_position_embeddings": 40960, "rope_theta": 1000000, "rms_norm_eps": 1e-06}


def _with_actor(model: dict) -> dict:
    spec = base_spec()
    spec["models"]["actor"] = model
    return spec


def test_qwen3_config_reads_head_dim_and_qk_norm_and_round_trips_inline():
    arch = arch_from_hf(QWEN3_8B_CFG, "cfg")
    assert arch == PRESETS["qwen3-8b"] and arch.qk_norm and not arch.qkv_bias and arch.head_dim == 128
    small = PRESETS["qwen3-0.6b"]  # 16 heads of 128 over hidden 1,024: projections twice as wide as hidden
    assert small.heads * small.head_dim == 2 * small.hidden
    for a in (arch, small):
        assert job_from_dict(_with_actor(a.to_dict())).models["actor"] == a
    with pytest.raises(SpecError, match=r"models\.actor\.qk_norm: with qkv_bias: true is no transformers model"):
        job_from_dict(_with_actor({**small.to_dict(), "qkv_bias": True}))


QWEN2_CFG = {**LLAMA_CFG, "model_type": "qwen2", "use_sliding_window": False, "sliding_window": 4096,
             "max_window_layers": 28, "max_position_embeddings": 32768}
MISTRAL_CFG = {**LLAMA_CFG, "model_type": "mistral", "sliding_window": None, "max_position_embeddings": 32768}
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}


@pytest.mark.parametrize(("cfg", "patch", "pattern"), [
    (LLAMA_CFG, {"hidden_act": "gelu"}, r"cfg\.hidden_act: 'gelu' is not supported: .*SiLU.*hidden_act: silu"),
    (LLAMA_CFG, {"hidden_activation": "gelu_pytorch_tanh"}, r"cfg\.hidden_activation: 'gelu_pytorch_tanh'"),
    (QWEN2_CFG, {"use_sliding_window": True},
     r"cfg\.use_sliding_window: sliding-window attention \(4096 tokens on 4 of 32 layers\) is not implemented"
     r".*set use_sliding_window: false"),
    (QWEN2_CFG, {"use_sliding_window": True, "layer_types": ["full_attention", "sliding_attention"] * 16},
     r"cfg\.use_sliding_window: .*16 of 32 layers"),
    (MISTRAL_CFG, {"sliding_window": 4096},
     r"cfg\.sliding_window: sliding-window attention \(4096 tokens, below max_position_embeddings 32768\)"
     r".*sliding_window: null"),
    (LLAMA_CFG, {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     r"cfg\.rope_scaling\.rope_type: RoPE scaling 'yarn' is not implemented \(the runtime has default and llama3\)"),
    (LLAMA_CFG, {"rope_scaling": {"type": "linear", "factor": 2.0}}, r"cfg\.rope_scaling\.type: .*'linear'"),
    (LLAMA_CFG, {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4}}, r"cfg\.rope_parameters\.rope_type"),
    (LLAMA_CFG, {"rope_scaling": {**LLAMA3_ROPE, "factor": None}},
     r"cfg\.rope_scaling\.factor: required key is missing"),
    (LLAMA_CFG, {"partial_rotary_factor": 0.5}, r"cfg\.partial_rotary_factor: 0\.5 is not supported"),
    (LLAMA_CFG, {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.25}},
     r"cfg\.rope_parameters\.partial_rotary_factor: 0\.25"),
])
def test_hf_config_refuses_what_would_compute_other_logits(cfg, patch, pattern):
    # each of these loads into the same tensors but would silently diverge from transformers' logits
    arch_from_hf(cfg, "cfg")
    with pytest.raises(SpecError, match=pattern):
        arch_from_hf({**cfg, **patch}, "cfg")


def test_mistral_config_without_sliding_window_gets_transformers_default():
    # MistralConfig's default sliding_window is 4096: leaving the key out is not null
    cfg = {k: v for k, v in MISTRAL_CFG.items() if k != "sliding_window"}
    with pytest.raises(SpecError, match=r"cfg\.sliding_window: sliding-window attention \(4096 tokens"):
        arch_from_hf(cfg, "cfg")


@pytest.mark.parametrize(("cfg", "patch"), [
    (LLAMA_CFG, {"hidden_act": "silu", "rope_scaling": LLAMA3_ROPE}),
    (LLAMA_CFG, {"hidden_act": "swish", "rope_parameters": {**LLAMA3_ROPE, "rope_theta": 5e5}}),
    (LLAMA_CFG, {"rope_scaling": {"type": "default"}, "sliding_window": 4096}),  # Llama ignores sliding_window
    (QWEN2_CFG, {}),  # Qwen2 configs carry sliding_window with use_sliding_window: false
    (QWEN2_CFG, {"use_sliding_window": True, "max_window_layers": 32}),  # no layer is windowed
    (QWEN2_CFG, {"use_sliding_window": True, "sliding_window": 32768}),  # as wide as every position
    (QWEN2_CFG, {"use_sliding_window": True, "sliding_window": None}),
    (MISTRAL_CFG, {}),
    (MISTRAL_CFG, {"sliding_window": 32768}),
])
def test_hf_config_accepts_what_matches_transformers(cfg, patch):
    assert arch_from_hf({**cfg, **patch}, "cfg").layers == 32


def test_preset_parameter_counts_match_published_sizes():
    assert 8.0e9 < PRESETS["llama3-8b"].params() < 8.1e9  # 8.03B (Meta model card)
    assert 70.4e9 < PRESETS["llama3-70b"].params() < 70.8e9  # 70.6B
    assert 0.49e9 < PRESETS["qwen2.5-0.5b"].params() < 0.5e9  # 0.49B


# Datasheet figures, dense BF16 (NVIDIA A100 / H100 / H200 SXM datasheets; the spec sheets' "BF16" for
# H100/H200 is the 2:4-sparse 1,979 TFLOP/s, half of it dense), NVLink as the per-GPU bidirectional total,
# one NIC per GPU: ConnectX-6 HDR 200 Gb/s (A100 systems), ConnectX-7 NDR 400 Gb/s (H100/H200 systems).
DATASHEETS = {  # name: (TFLOP/s, HBM TB/s, HBM GB, NVLink GB/s bidirectional, NIC Gb/s)
    "A100-SXM-40GB": (312, 1.555, 40, 600, 200),  # the 80GB part with 40 GB of HBM2 (A100 datasheet)
    "A100-SXM-80GB": (312, 2.039, 80, 600, 200),
    "H100-SXM-80GB": (989.4, 3.35, 80, 900, 400),
    "H200-SXM-141GB": (989.4, 4.8, 141, 900, 400),
    "H20-96GB": (148, 4.0, 96, 900, 400),
    "H800-SXM-80GB": (989.4, 3.35, 80, 400, 400),  # H100 SXM5 with NVLink at 400 GB/s (H800 datasheet)
    "A800-SXM-80GB": (312, 2.039, 80, 400, 200),  # A100 SXM4 80GB with NVLink at 400 GB/s (A800 datasheet)
    "B200-SXM-180GB": (2250, 8.0, 180, 1800, 400),  # DGX/HGX B200 datasheets, per GPU, dense
    "GB200-NVL72-186GB": (2500, 8.0, 186, 1800, 400),  # GB200 NVL72 datasheet, per GPU, dense
}


FAMILY_PRESET = {"A100": "A100-SXM-80GB"}  # families with more than one memory size


def test_hardware_presets_match_datasheets():
    presets = gpu_presets()
    for name, (tflops, hbm, mem, nvlink, nic) in DATASHEETS.items():
        g = presets[name]
        assert g.peak_flops == tflops * 1e12
        assert g.hbm_bytes_per_s == hbm * 1e12
        assert g.memory_bytes == mem * 1e9
        assert g.intra_node_bytes_per_s == nvlink * 1e9 / 2  # one direction
        assert g.inter_node_bytes_per_s == nic * 1e9 / 8  # bits to bytes
        family = name.split("-")[0]
        assert presets[f"{family}-{mem}GB"] is g
        assert presets[family] is presets[FAMILY_PRESET.get(family, name)]  # a bare family: its largest memory
    # every row of the packaged table is one of these (a new row needs its datasheet here too)
    assert {g.name for g in presets.values()} == set(DATASHEETS)


def test_plan_round_trip_and_validation():
    layout = Layout(tp=2, pp=2, dp=2, micro_batch_size=2, interleave=2, recompute="full")
    plan = Plan((Placement(ModelStage("actor", "training"), layout, tuple(range(8))),), 8)
    again = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again == plan
    assert layout.dims.coords(layout.dims.rank(1, 1, 0)) == (1, 1, 0)
    bad = plan.to_dict()
    bad["placements"][0]["gpus"] = [0, 1, 2]
    with pytest.raises(SpecError, match=r"plan\.placements\[0\]\.gpus: has 3 GPUs but the layout needs"):
        Plan.from_dict(bad)
    bad = plan.to_dict()
    bad["placements"][0]["layout"]["tpp"] = 2
    with pytest.raises(SpecError, match=r"plan\.placements\[0\]\.layout\.tpp: unknown key; did you mean 'tp'"):
        Plan.from_dict(bad)


def test_layout_parse():
    assert Layout.parse("tp=4,pp=2,dp=8,recompute=full") == Layout(tp=4, pp=2, dp=8, recompute="full")
    with pytest.raises(SpecError, match=r"--layout: 'tp' is not KEY=VALUE"):
        Layout.parse("tp")
    with pytest.raises(SpecError, match=r"--layout\.tp: 0 is out of range"):
        Layout.parse("tp=0")


def test_strict_yaml_refuses_duplicates_but_keeps_merge_keys():
    from nereus.spec.files import load_yaml

    merged = load_yaml("base: &b {a: 1, b: 2}\nchild:\n  <<: *b\n  b: 3\n", "x.yaml")
    assert merged["child"] == {"a": 1, "b": 3}  # `<<: *base` then an override is not a duplicate
    with pytest.raises(SpecError, match=r"x\.yaml: not valid YAML: duplicate key 'b'.* at line 2"):
        load_yaml("a: {b: 1,\n  b: 2}\n", "x.yaml")
    with pytest.raises(SpecError, match="nested deeper than 64 levels"):
        load_yaml("[" * 65 + "]" * 65, "x.yaml")
    assert load_yaml("[" * 63 + "]" * 63, "x.yaml") is not None


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), 2**64, -(2**70)])
def test_fields_refuse_non_finite_and_oversized_numbers(value):
    from nereus.spec.fields import Fields

    with pytest.raises(SpecError, match=r"^a\.x: "):
        Fields({"x": value}, "a").get("x", float, minimum=0)
    with pytest.raises(SpecError, match=r"^a\.x\[1\]: "):
        Fields({"x": [1.0, value]}, "a").get_list("x", float)
