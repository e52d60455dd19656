"""HuggingFace Llama/Qwen2/Qwen3 and Qwen3-MoE/Qwen2-MoE/Mixtral checkpoints: ``config.json`` ↔ ``ModelConfig``
and safetensors ↔ tensors.

Tensor names are the checkpoint's own, so loading a rank's shard reads only the global boxes that
``nereus.spec.sharding.rank_tensors`` assigns it (``safe_open(...).get_slice``), never the whole model:
a rank holding some experts reads only theirs. Experts are stored one tensor per expert and projection, as
the hub's checkpoints and transformers 5's ``save_pretrained`` write them (transformers fuses them in
memory only); Mixtral's ``block_sparse_moe.*`` / ``w1``,``w3``,``w2`` names are mapped to Qwen's here only
(``spec.moe.mixtral_name``).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from nereus.runtime.model.decoder import ModelConfig
from nereus.spec.model import ModelArch, arch_from_hf
from nereus.spec.moe import mixtral_name
from nereus.spec.sharding import Box

INDEX = "model.safetensors.index.json"
# Local names that read another tensor: a tied checkpoint has no ``lm_head.weight``, and the last
# pipeline stage's copy of a tied embedding (``tied_head``) is the embedding.
ALIASES: Mapping[str, str] = MappingProxyType({"lm_head.weight": "model.embed_tokens.weight",
                                               "tied_head": "model.embed_tokens.weight"})
SINGLE = "model.safetensors"
# Tokenizer files (``PreTrainedTokenizerFast.save_pretrained`` and older spellings) and the generation
# config, copied from the model a checkpoint started from so that ``AutoTokenizer`` loads the checkpoint too.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json",
                   "generation_config.json")
# keys of a source config.json that describe another head or dtype than the tensors written
_HEAD_KEYS = ("id2label", "label2id", "num_labels", "problem_type", "dtype", "torch_dtype", "architectures")


def config_from_hf(data: dict, where: str = "config.json") -> ModelConfig:
    """Map a Llama/Qwen2/Qwen3/Mistral ``config.json`` dict (transformers 4.x or 5.x spelling) to ``ModelConfig``:
    the architecture by the spec's parser (``arch_from_hf``, whose errors name the key), plus what only
    the runtime needs (RoPE, norm epsilon, value head, special tokens)."""
    arch = arch_from_hf(data, where)
    rope = dict(data.get("rope_parameters") or data.get("rope_scaling") or {})
    theta = rope.pop("rope_theta", data.get("rope_theta", 10000.0))
    rope.setdefault("rope_type", rope.pop("type", "default"))  # ``type``: the older spelling
    if rope.get("rope_type", "default") == "default":
        rope = {}
    eos = data.get("eos_token_id")
    return ModelConfig(arch=arch, rope_theta=float(theta), rms_eps=float(data.get("rms_norm_eps", 1e-6)),
                       rope_scaling=rope, value_head=_labels(data) == 1 and _is_scorer(data),
                       bos_token_id=data.get("bos_token_id"),
                       eos_token_id=tuple(eos) if isinstance(eos, list) else eos)


def _labels(data: dict) -> int | None:
    """``num_labels``, or the size of ``id2label`` (transformers 5 writes only the mapping)."""
    return data.get("num_labels", len(data.get("id2label") or {}) or None)


def _is_scorer(data: dict) -> bool:
    return any(a.endswith("ForSequenceClassification") or a.endswith("ForTokenClassification")
               for a in data.get("architectures") or [])


# transformers' class-name prefix of each model type ``config_to_hf`` writes; Qwen3 with QKV biases has
# no class (``arch_from_hf`` never reads one: Qwen3's ``attention_bias`` is refused)
_HF_CLASSES = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "qwen3_moe": "Qwen3Moe", "qwen2_moe": "Qwen2Moe",
               "mixtral": "Mixtral"}


def hf_model_type(arch: ModelArch) -> str:
    """The ``model_type`` ``config_to_hf`` writes: the one family with the architecture's features (Qwen3's
    q/k norms, Qwen2's QKV bias, experts)."""
    if arch.moe is not None:
        return "qwen3_moe" if arch.qk_norm else "qwen2_moe" if arch.qkv_bias else "mixtral"
    return "qwen3" if arch.qk_norm else "qwen2" if arch.qkv_bias else "llama"


def _moe_keys(arch: ModelArch, kind: str) -> dict:
    """The MoE keys of ``config.json`` as family ``kind`` spells them (``spec.moe.moe_from_hf`` reads them)."""
    moe = arch.moe
    common = {"num_experts_per_tok": moe.top_k, "router_aux_loss_coef": moe.aux_loss_coef,
              "output_router_logits": False}
    if kind == "mixtral":  # every layer sparse, experts as wide as intermediate_size, always renormalised
        return {**common, "num_local_experts": moe.experts, "intermediate_size": moe.expert_ffn_hidden,
                "router_jitter_noise": 0.0, "sliding_window": None}
    out = {**common, "num_experts": moe.experts, "moe_intermediate_size": moe.expert_ffn_hidden,
           "norm_topk_prob": moe.norm_topk_prob, "decoder_sparse_step": 1, "mlp_only_layers": list(moe.dense_layers)}
    if kind == "qwen2_moe":
        out |= {"shared_expert_intermediate_size": moe.shared_expert_ffn_hidden, "qkv_bias": True}
    return out


def config_to_hf(cfg: ModelConfig) -> dict:
    """A ``config.json`` that transformers loads as LlamaForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM /
    Qwen3MoeForCausalLM / Qwen2MoeForCausalLM / MixtralForCausalLM (or a scorer): the type follows from the
    features only it has (``hf_model_type``)."""
    a = cfg.arch
    kind = hf_model_type(a)
    head = "ForSequenceClassification" if cfg.value_head else "ForCausalLM"
    rope = {"rope_type": "default", **cfg.rope_scaling, "rope_theta": cfg.rope_theta}
    out = {
        "architectures": [_HF_CLASSES[kind] + head], "model_type": kind,
        "num_hidden_layers": a.layers, "hidden_size": a.hidden, "intermediate_size": a.ffn_hidden,
        "num_attention_heads": a.heads, "num_key_value_heads": a.kv_heads, "head_dim": a.head_dim,
        "vocab_size": a.vocab,
        "tie_word_embeddings": a.tied_embeddings, "rms_norm_eps": cfg.rms_eps, "rope_theta": cfg.rope_theta,
        "rope_parameters": rope, "hidden_act": "silu", "torch_dtype": "float32", "dtype": "float32",
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_id) if isinstance(cfg.eos_token_id, tuple) else cfg.eos_token_id,
    }
    if a.moe is not None:
        out |= _moe_keys(a, kind)
    if cfg.value_head:
        out["num_labels"] = 1
    return out


def read_config(path: str | Path) -> ModelConfig:
    file = Path(path) / "config.json"
    return config_from_hf(json.loads(file.read_text()), str(file))


def _files(path: Path) -> dict[str, Path]:
    """Tensor name → the safetensors file holding it."""
    if (path / INDEX).exists():
        index = json.loads((path / INDEX).read_text())["weight_map"]
        return {name: path / file for name, file in index.items()}
    with safe_open(path / SINGLE, framework="pt") as f:
        return dict.fromkeys(f.keys(), path / SINGLE)


def load_boxes(path: str | Path, boxes: dict[str, Box], dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Read exactly ``boxes`` (name → global box) from a checkpoint directory (names in ``ALIASES`` read
    their source when the checkpoint lacks them)."""
    path = Path(path)
    where = _files(path)
    out: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    sources = {name: _source(name, where, path) for name in boxes}
    for name, source in sources.items():
        by_file.setdefault(where[source], []).append(name)
    for file, names in by_file.items():
        with safe_open(file, framework="pt") as f:
            for name in names:
                sl = f.get_slice(sources[name])
                index = tuple(slice(lo, hi) for lo, hi in boxes[name])
                out[name] = sl[index].to(dtype).contiguous()
    return out


def _source(name: str, where: Mapping[str, Path], path: Path) -> str:
    """The checkpoint tensor holding contract tensor ``name``: itself, its Mixtral spelling, or an alias."""
    for source in (name, mixtral_name(name), ALIASES.get(name)):
        if source in where:
            return source
    raise KeyError(f"{name} is not in the checkpoint at {path}")


def slice_boxes(full: dict[str, torch.Tensor], boxes: dict[str, Box]) -> dict[str, torch.Tensor]:
    """``boxes`` cut from whole tensors ``full`` (a reference model's state dict), ``ALIASES`` applied."""
    out = {}
    for name, box in boxes.items():
        source = full[name] if name in full else full[ALIASES[name]]
        out[name] = source.detach()[tuple(slice(lo, hi) for lo, hi in box)].clone()
    return out


def save_checkpoint(path: str | Path, cfg: ModelConfig, tensors: dict[str, torch.Tensor],
                    source: str | Path | None = None, tokenizer: Mapping[str, bytes] | None = None) -> None:
    """Write a full checkpoint (``config.json`` + ``model.safetensors``) from whole tensors. With
    ``source`` (the HF model directory the model started from) the config keeps the source's other keys
    (``max_position_embeddings``, ``pad_token_id``...) and its tokenizer files are copied alongside.
    ``tokenizer`` (name → contents: the job's tokenizer files, ``rl.tokenizer.Tokenizer.tokenizer_files``)
    is written where the source gave no file of that name, so every checkpoint loads with ``AutoTokenizer``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = config_to_hf(cfg)
    if source is not None:
        base = json.loads((Path(source) / "config.json").read_text())
        config = {**{k: v for k, v in base.items() if k not in _HEAD_KEYS}, **config}
        for name in TOKENIZER_FILES:
            if (Path(source) / name).is_file():
                shutil.copyfile(Path(source) / name, path / name)
    for name, data in (tokenizer or {}).items():
        if not (path / name).exists():
            (path / name).write_bytes(data)
    if cfg.value_head:
        config["id2label"] = {"0": "LABEL_0"}
        config["label2id"] = {"LABEL_0": 0}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    data = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    if cfg.arch.tied_embeddings:
        data.pop("lm_head.weight", None)
    if config["model_type"] == "mixtral":
        data = {mixtral_name(k): v for k, v in data.items()}
    save_file(data, str(path / SINGLE), metadata={"format": "pt"})
