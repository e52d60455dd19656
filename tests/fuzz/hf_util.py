"""A tiny HF model directory written in milliseconds for the bad-input tests: ``config.json`` (a 2-layer
Llama), ``model.safetensors`` written byte by byte (header JSON + zero data, as the format specifies, so a
test can damage any field), a word-level ``tokenizer.json`` built with the ``tokenizers`` package and a
``tokenizer_config.json`` with a chat template; plus a verl-format JSONL data file and a GRPO job on them."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from nereus.spec.model import ModelArch
from nereus.spec.sharding import model_tensors

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 2, "hidden_size": 32,
          "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 64,
          "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
          "tie_word_embeddings": False, "torch_dtype": "float32", "max_position_embeddings": 256,
          "hidden_act": "silu"}
ARCH = ModelArch(layers=2, hidden=32, ffn_hidden=64, heads=4, kv_heads=2, vocab=64)
WORDS = ["<pad>", "<s>", "</s>", "<unk>", *(str(d) for d in range(10)), "rev", "=", "what", "is"]
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}={% endif %}"
TOKENIZER_CONFIG = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                    "unk_token": "<unk>", "pad_token": "<pad>", "chat_template": CHAT_TEMPLATE,
                    "model_max_length": 256}
ITEM = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I32": 4, "I64": 8, "U8": 1, "BOOL": 1}


def tensors(arch: ModelArch = ARCH) -> dict[str, tuple[str, list[int]]]:
    """name → (dtype, shape) of every weight ``arch`` has, as a causal LM."""
    return {t.name: ("F32", list(t.shape)) for t in model_tensors(arch)}


def safetensors_bytes(entries: dict[str, tuple[str, list[int]]], header_patch: dict | None = None,
                      raw_header: bytes | None = None) -> bytes:
    """A safetensors file of zero data for ``entries``; ``header_patch`` replaces header entries after the
    offsets are laid out (to damage one); ``raw_header`` replaces the header bytes altogether."""
    header: dict = {"__metadata__": {"format": "pt"}}
    at = 0
    for name, (dtype, shape) in entries.items():
        size = ITEM.get(dtype, 4)
        for d in shape:
            size *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + size]}
        at += size
    header.update(header_patch or {})
    text = raw_header if raw_header is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + bytes(at)


def tokenizer_json() -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok.to_str()


def model_files(config: dict | None = None, weights: bytes | None = None) -> dict[str, object]:
    """The files of the tiny model directory (name → text or bytes), for a test to damage one."""
    return {"config.json": json.dumps(config or CONFIG), "model.safetensors": weights or safetensors_bytes(tensors()),
            "tokenizer.json": tokenizer_json(), "tokenizer_config.json": json.dumps(TOKENIZER_CONFIG)}


def data_rows(count: int = 12) -> str:
    rows = [{"data_source": "nereus/reverse", "prompt": [{"role": "user", "content": f"rev {i % 10} {(i + 3) % 10}"}],
             "reward_model": {"style": "rule", "ground_truth": f"{(i + 3) % 10} {i % 10}"}} for i in range(count)]
    return "".join(json.dumps(r) + "\n" for r in rows)


def hf_job_doc(model: str, data: str, out: str) -> dict:
    """GRPO on the tiny model (actor and reference from one directory), fixed layouts on 4 workers."""
    return {
        "name": "hf-trust",
        "models": {"actor": {"path": model}, "reference": {"path": model}},
        "algorithm": {"name": "grpo", "samples_per_prompt": 2, "mini_batches": 1},
        "workload": {"prompts_per_step": 2, "prompt_length": 32, "response_length": {"mean": 3, "max": 4}},
        "cluster": {"gpu": {"name": "cpu-local", "peak_tflops": 0.05, "hbm_tb_per_s": 0.01, "memory_gb": 4,
                            "intra_node_gb_per_s": 1, "inter_node_gb_per_s": 1}, "nodes": 1, "gpus_per_node": 4},
        "options": {"recompute": "none", "sequence_parallel": False},
        "run": {"steps": 1, "workers": 4, "data": {"train": data}, "rule_reward": "exact_match",
                "checkpoint": {"dir": out, "every": 1},
                "layouts": {"actor/generation": {"layout": "dp=2", "ranks": [0, 1]},
                            "actor/inference": {"layout": "dp=2,micro_batch_size=2", "ranks": [2, 3]},
                            "reference/inference": {"layout": "tp=2,micro_batch_size=4", "ranks": [0, 1]},
                            "actor/training": {"layout": "tp=2,dp=2,micro_batch_size=1", "ranks": [0, 1, 2, 3]}}},
    }


def write_files(folder: Path, files: dict[str, object]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        path = folder / name
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(str(content))
