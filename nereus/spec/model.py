"""Decoder architecture of one model: the fields the cost model and the runtime both read."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from nereus.spec.errors import SpecError, brief
from nereus.spec.fields import MAX_LAYERS, MAX_TOKENS, Fields, check_number
from nereus.spec.files import read_json_file
from nereus.spec.moe import MOE_MODEL_TYPES, MoESpec, moe_from_hf, read_moe

# Upper bounds of an architecture's sizes, checked on load so that the cost model's products stay far from
# overflow and the planner's per-layer search finishes (docs/reliability.md). Published models are well
# inside: hidden 25,600 (GPT 1T), ffn_hidden 73,728 (Megatron 1T), vocab 256,000 (Gemma).
MAX_HIDDEN = 2**17
MAX_FFN_HIDDEN = 2**20
MAX_VOCAB = 2**24


def kv_token_bytes(layers: int, kv_heads: int, head_dim: int, elem_bytes: int) -> int:
    """KV cache of one token position over ``layers`` and ``kv_heads``: 2 (K and V) · layers · kv_heads ·
    head_dim · bytes per element (design: memory). Every KV size in the package is this times positions:
    the cost model's per-rank caches, a migration's pieces (``elastic.kvplan.KVShape``), a move's bytes."""
    return 2 * layers * kv_heads * head_dim * elem_bytes


@dataclass(frozen=True)
class ModelArch:
    """A Llama/Qwen2/Qwen3-style decoder (or a GPT-style one with a GeLU MLP, for published training data).

    ``head_dim`` is hidden / heads unless given (Qwen3 gives it: 0.6B has 16 heads of 128 over hidden
    1,024); ``qk_norm`` is Qwen3's per-head RMSNorm of queries and keys before RoPE (one weight of
    ``head_dim`` each, shared by all heads). ``moe`` makes it a Mixture-of-Experts decoder (``spec.moe``):
    its sparse layers route tokens to experts instead of the dense MLP of ``ffn_hidden``."""

    layers: int
    hidden: int
    ffn_hidden: int
    heads: int
    kv_heads: int
    vocab: int
    tied_embeddings: bool = False
    mlp: str = "swiglu"  # swiglu: gate, up, down matrices; gelu: up, down (GPT-2/3, Megatron)
    qkv_bias: bool = False
    head_dim: int = 0  # 0: hidden // heads (resolved on construction)
    qk_norm: bool = False
    moe: MoESpec | None = None

    def __post_init__(self) -> None:
        if not self.head_dim and self.heads > 0:
            object.__setattr__(self, "head_dim", self.hidden // self.heads)

    def replicated_layer_params(self) -> int:
        """Parameters of one layer that tensor parallelism replicates: the two norms, Qwen3's q/k norms."""
        return 2 * self.hidden + (2 * self.head_dim if self.qk_norm else 0)

    def layer_params(self) -> int:
        """Parameters of one decoder layer: attention, MLP, two norms (biases of GPT-style MLPs too); of an
        MoE decoder, the mean over its layers (all experts of the sparse ones: what memory holds)."""
        return self._layer_param_sums[0] // self.layers

    def active_layer_params(self) -> int:
        """The parameters one token's forward pass touches in a layer, on average over the layers: all of
        them in a dense decoder; ``top_k`` experts, the shared one and the router in a sparse layer (what
        the FLOPs of a token count, 2 per active parameter)."""
        return self._layer_param_sums[1] // self.layers

    @cached_property
    def _layer_param_sums(self) -> tuple[int, int]:
        """(all, active) parameters of the layers together."""
        hd = self.head_dim
        attn = self.hidden * (self.heads + 2 * self.kv_heads) * hd + self.heads * hd * self.hidden
        if self.qkv_bias:
            attn += (self.heads + 2 * self.kv_heads) * hd
        mats = 3 if self.mlp == "swiglu" else 2
        mlp = mats * self.hidden * self.ffn_hidden
        if self.mlp == "gelu":
            mlp += self.ffn_hidden + self.hidden + 3 * self.hidden  # biases of MLP and attention
        rest = self.layers * (attn + self.replicated_layer_params())
        if self.moe is None:
            return rest + self.layers * mlp, rest + self.layers * mlp
        dense = len(self.moe.dense_layers)
        sparse = self.layers - dense
        return (rest + dense * mlp + sparse * self.moe.mlp_params(self.hidden),
                rest + dense * mlp + sparse * self.moe.active_mlp_params(self.hidden))

    def sparse_layers(self) -> int:
        """Layers whose MLP routes to experts (0 for a dense decoder)."""
        return 0 if self.moe is None else self.layers - len(self.moe.dense_layers)

    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    def params(self, value_head: bool = False) -> int:
        """Total parameters; a value head (critic, reward) replaces the LM head by a hidden→1 projection."""
        head = self.hidden if value_head else (0 if self.tied_embeddings else self.vocab * self.hidden)
        return self._layer_param_sums[0] + self.embedding_params() + head + self.hidden

    def active_params(self) -> int:
        """Parameters one token's forward pass touches (all of them for a dense decoder; ``A3B`` of an MoE)."""
        return self.params() - (self._layer_param_sums[0] - self._layer_param_sums[1])

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """KV cache per token over the whole model (``kv_token_bytes``)."""
        return kv_token_bytes(self.layers, self.kv_heads, self.head_dim, dtype_bytes)

    def to_dict(self) -> dict:
        return {
            "layers": self.layers, "hidden": self.hidden, "ffn_hidden": self.ffn_hidden,
            "heads": self.heads, "kv_heads": self.kv_heads, "vocab": self.vocab,
            "tied_embeddings": self.tied_embeddings, "mlp": self.mlp, "qkv_bias": self.qkv_bias,
            **({"head_dim": self.head_dim} if self.head_dim != self.hidden // self.heads else {}),
            **({"qk_norm": True} if self.qk_norm else {}),
            **({"moe": self.moe.to_dict()} if self.moe is not None else {}),
        }


# Published architectures (each from the model's HuggingFace config.json).
PRESETS: dict[str, ModelArch] = {
    "llama3-8b": ModelArch(32, 4096, 14336, 32, 8, 128256),
    "llama3-70b": ModelArch(80, 8192, 28672, 64, 8, 128256),
    "llama2-70b": ModelArch(80, 8192, 28672, 64, 8, 32000),
    "qwen2.5-7b": ModelArch(28, 3584, 18944, 28, 4, 152064, qkv_bias=True),
    "qwen2.5-0.5b": ModelArch(24, 896, 4864, 14, 2, 151936, tied_embeddings=True, qkv_bias=True),
    "qwen2.5-32b": ModelArch(64, 5120, 27648, 40, 8, 152064, qkv_bias=True),
    "qwen3-0.6b": ModelArch(28, 1024, 3072, 16, 8, 151936, tied_embeddings=True, head_dim=128, qk_norm=True),
    "qwen3-8b": ModelArch(36, 4096, 12288, 32, 8, 151936, head_dim=128, qk_norm=True),
    # Mixture-of-Experts (``spec.moe``): 128 experts, 8 routed per token, renormalised top-k
    "qwen3-30b-a3b": ModelArch(48, 2048, 6144, 32, 4, 151936, head_dim=128, qk_norm=True,
                               moe=MoESpec(128, 8, 768, True, aux_loss_coef=0.001)),
    "qwen3-235b-a22b": ModelArch(94, 4096, 12288, 64, 4, 151936, head_dim=128, qk_norm=True,
                                 moe=MoESpec(128, 8, 1536, True, aux_loss_coef=0.001)),
    "mixtral-8x7b": ModelArch(32, 4096, 14336, 32, 8, 32000, moe=MoESpec(8, 2, 14336, True, aux_loss_coef=0.02)),
}


HF_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", *MOE_MODEL_TYPES)
# the dense family each MoE type's attention and norms follow (Qwen2's QKV bias, Qwen3's q/k norms)
_ATTENTION_FAMILY = {"qwen3_moe": "qwen3", "qwen2_moe": "qwen2", "mixtral": "mixtral"}


def hf_value_head(cfg: dict) -> bool:
    """Whether a checked ``config.json`` describes a scorer (a reward model's value head, ``score.weight``):
    a ``*ForSequenceClassification`` or ``*ForTokenClassification`` class with one label (``num_labels``, or
    the size of ``id2label``: transformers 5 writes only the mapping)."""
    labels = cfg.get("num_labels", len(cfg.get("id2label") or {}) or None)  # as runtime.model.hf reads it
    heads = cfg.get("architectures") or []
    return labels == 1 and any(a.endswith(("ForSequenceClassification", "ForTokenClassification")) for a in heads)


def arch_from_hf(cfg: object, where: str) -> ModelArch:
    """The architecture of a parsed HuggingFace Llama/Qwen2/Qwen3/Mistral ``config.json`` (transformers 4.x
    or 5.x spelling). The one parser of these files: ``nereus.runtime.model.hf`` reads a checkpoint's config
    through it. The type implies Qwen2's QKV bias and Qwen3's q/k norms; ``head_dim`` is read as written
    (null or absent: hidden / heads). It refuses what ``ModelArch`` cannot describe, naming the key:
    another model type, attention or MLP biases, and head counts that do not divide; and what would load
    but compute other logits than transformers does (``_check_numerics``)."""
    f = Fields(cfg, where)
    kind = f.get("model_type", str, "llama")
    if kind not in HF_MODEL_TYPES:
        raise SpecError(f.key_path("model_type"), f"{kind!r} is not supported; use a {', '.join(HF_MODEL_TYPES[:-1])} "
                                                  f"or {HF_MODEL_TYPES[-1]} config")
    heads = f.get("num_attention_heads", int, minimum=1, maximum=MAX_HIDDEN)
    hidden = f.get("hidden_size", int, minimum=1, maximum=MAX_HIDDEN)
    head_dim = f.get("head_dim", int, None, minimum=2, maximum=MAX_HIDDEN) or 0
    for key in ("attention_bias", "mlp_bias"):
        if f.get(key, bool, False):
            raise SpecError(f.key_path(key), "biases other than Qwen2's QKV bias are not supported: the "
                                             f"runtime's projections have none; use a config with {key}: false")
    layers = f.get("num_hidden_layers", int, minimum=1, maximum=MAX_LAYERS)
    moe = moe_from_hf(f, kind, layers, MAX_FFN_HIDDEN)
    kind = _ATTENTION_FAMILY.get(kind, kind)
    _check_numerics(f, kind, layers)
    arch = ModelArch(
        layers=layers,
        hidden=hidden,
        ffn_hidden=f.get("intermediate_size", int, minimum=1, maximum=MAX_FFN_HIDDEN),
        heads=heads,
        kv_heads=f.get("num_key_value_heads", int, heads, minimum=1, maximum=MAX_HIDDEN),
        vocab=f.get("vocab_size", int, minimum=1, maximum=MAX_VOCAB),
        tied_embeddings=f.get("tie_word_embeddings", bool, False),
        qkv_bias=kind == "qwen2",
        head_dim=head_dim,
        qk_norm=kind == "qwen3",
        moe=moe,
    )
    _check_heads(arch, f.key_path("num_attention_heads"), f.key_path("num_key_value_heads"))
    if arch.head_dim % 2:
        raise SpecError(f.key_path("head_dim"), f"{arch.head_dim} is odd: RoPE rotates pairs of dimensions; give "
                                                "the checkpoint's own (even) value")
    _check_runtime_keys(f, arch.vocab)
    return arch


def _check_runtime_keys(f: Fields, vocab: int) -> None:
    """What the runtime reads besides the architecture (``nereus.runtime.model.hf.config_from_hf``): the norm
    epsilon, the RoPE base, the special token ids, the head (``architectures``, ``num_labels``,
    ``id2label``) and the dtype, checked here so that a bad value is refused by key on load rather than
    turning into NaN logits, an index error or a TypeError on the workers. A key may be left out or null
    (its default applies), except the norm epsilon and the RoPE base, which have no null meaning."""
    _not_null(f, "rms_norm_eps")  # ``config_from_hf`` reads these two as floats: null has no meaning
    f.get("rms_norm_eps", float, None, minimum=1e-12, maximum=1.0)
    for where in (f, f.sub("rope_parameters"), f.sub("rope_scaling")):
        _not_null(where, "rope_theta")
        where.get("rope_theta", float, None, minimum=1.0, maximum=1e12)
    f.get("max_position_embeddings", int, None, minimum=1, maximum=MAX_TOKENS)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if f.data.get(key) is None:
            continue
        ids = f.get_list(key, int) if isinstance(f.data[key], list) else [f.get(key, int)]
        if not ids:
            raise SpecError(f.key_path(key), "is an empty list; give the token id (or a list of them), or null")
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise SpecError(f.key_path(key), f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1}); "
                                             "give the config that belongs to this model")
    _check_head_keys(f)
    for key in ("torch_dtype", "dtype"):
        dtype = f.get(key, str, None)
        if dtype is not None and dtype not in HF_DTYPES:
            raise SpecError(f.key_path(key), f"{brief(dtype)} is not a floating-point dtype the runtime loads; "
                                             f"give one of {list(HF_DTYPES)}")


# ``torch_dtype`` / ``dtype`` of a config.json: the weights the runtime converts (to fp32 on CPU workers)
HF_DTYPES = ("float32", "float16", "bfloat16", "float64")
# ``num_labels``: a reward model has 1; classification heads have a few; past this a config is garbage
MAX_LABELS = 2**16


def _not_null(f: Fields, key: str) -> None:
    if f.has(key) and f.data[key] is None:
        raise SpecError(f.key_path(key), "is null; give a value or remove the key (its default then applies)")


def _check_head_keys(f: Fields) -> None:
    """The keys that say which head the weights have: ``architectures`` (a list of class names),
    ``num_labels`` and ``id2label`` / ``label2id`` (mappings of label ids and names)."""
    if f.data.get("architectures") is not None:
        names = f.get_list("architectures", str)
        if not names or not all(names):
            raise SpecError(f.key_path("architectures"), "give the model class name, e.g. [LlamaForCausalLM]")
    labels = f.get("num_labels", int, None, minimum=1, maximum=MAX_LABELS)
    id2label = f.get("id2label", dict, None)
    label2id = f.get("label2id", dict, None)
    for key, mapping, value_kind in (("id2label", id2label, str), ("label2id", label2id, int)):
        if mapping is None:
            continue
        if len(mapping) > MAX_LABELS:
            raise SpecError(f.key_path(key), f"has {len(mapping):,} labels (at most {MAX_LABELS:,})")
        for k, v in mapping.items():
            label_id = k if key == "id2label" else v
            if key == "id2label" and not (isinstance(k, str) and k.isascii() and k.isdigit() or type(k) is int):
                raise SpecError(f"{f.key_path(key)}.{brief(k)}", "label ids are the strings \"0\", \"1\", ...")
            if not isinstance(v, value_kind) or isinstance(v, bool):
                wanted = "a label name" if value_kind is str else "a label id"
                raise SpecError(f"{f.key_path(key)}.{brief(k)}", f"expected {wanted}, got {brief(v)}")
            check_number(v, f"{f.key_path(key)}.{brief(k)}")
            if int(label_id) >= MAX_LABELS or int(label_id) < 0:
                raise SpecError(f"{f.key_path(key)}.{brief(k)}", f"label id {brief(label_id)} is out of range")
    if labels is not None and id2label is not None and len(id2label) != labels:
        raise SpecError(f.key_path("num_labels"), f"{labels} disagrees with id2label's {len(id2label)} labels; "
                                                  "give the config that belongs to this model")


# transformers maps both names to SiLU; the runtime's MLP is SwiGLU with SiLU (nereus.runtime.model.decoder)
SILU_NAMES = ("silu", "swish")
# RoPE variants nereus.runtime.model.decoder.rope_inv_freq implements, and the keys llama3 scaling reads
ROPE_TYPES = ("default", "llama3")
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# transformers' defaults where a config leaves a key out: (sliding_window, max_position_embeddings)
_WINDOW_DEFAULTS = {"qwen2": (4096, 32768), "qwen3": (4096, 32768), "mistral": (4096, 4096 * 32),
                    "mixtral": (None, 4096 * 32)}
# types that window only when ``use_sliding_window`` is set, from ``max_window_layers`` on (or by ``layer_types``)
_WINDOW_SWITCHED = ("qwen2", "qwen3")


def _check_numerics(f: Fields, kind: str, layers: int) -> None:
    """Refuse what ``ModelArch`` and the runtime would load but compute differently from transformers:
    an activation other than SiLU, sliding-window attention, RoPE scaling other than default or llama3,
    and partial rotary embeddings."""
    for key in ("hidden_act", "hidden_activation"):
        act = f.get(key, str, "silu")
        if act not in SILU_NAMES:
            raise SpecError(f.key_path(key), f"{act!r} is not supported: the runtime's MLP is SwiGLU with "
                                             f"SiLU; use a checkpoint whose config has {key}: silu")
    _check_sliding_window(f, kind, layers)
    for key in ("rope_parameters", "rope_scaling"):
        _check_rope(f.sub(key))
    _check_rotary_fraction(f)


def _check_sliding_window(f: Fields, kind: str, layers: int) -> None:
    """Qwen2 and Qwen3 window layers >= ``max_window_layers`` (or those ``layer_types`` names) when
    ``use_sliding_window`` is set; Mistral windows every layer unless ``sliding_window`` is null. The
    runtime attends causally over the whole sequence, which is the same only for a window at least
    ``max_position_embeddings`` wide. Llama ignores the key."""
    if kind not in _WINDOW_DEFAULTS or kind in _WINDOW_SWITCHED and not f.get("use_sliding_window", bool, False):
        return
    default_window, default_positions = _WINDOW_DEFAULTS[kind]
    window = f.get("sliding_window", int, None) if f.has("sliding_window") else default_window
    positions = f.get("max_position_embeddings", int, default_positions)
    if window is None or window >= positions:
        return
    if kind in ("mistral", "mixtral"):
        raise SpecError(f.key_path("sliding_window"), f"sliding-window attention ({window} tokens, below "
                        f"max_position_embeddings {positions}) is not implemented: the runtime attends over "
                        "the whole sequence; use a checkpoint whose config has sliding_window: null "
                        "(Mistral v0.2 and later)")
    if f.has("layer_types"):
        sliding = [i for i, t in enumerate(f.get_list("layer_types", str)) if t == "sliding_attention"]
    else:
        sliding = list(range(f.get("max_window_layers", int, 28), layers))
    if sliding:
        raise SpecError(f.key_path("use_sliding_window"), f"sliding-window attention ({window} tokens on "
                        f"{len(sliding)} of {layers} layers) is not implemented: the runtime attends over "
                        "the whole sequence; set use_sliding_window: false (the same logits for sequences "
                        f"of at most {window} tokens)")


def _check_rope(rope: Fields) -> None:
    """One RoPE mapping (``rope_parameters`` or ``rope_scaling``; ``type`` is the older spelling of
    ``rope_type``): a variant the runtime implements, with the keys it reads."""
    key = "rope_type" if rope.has("rope_type") or not rope.has("type") else "type"
    variant = rope.get(key, str, "default")
    if variant not in ROPE_TYPES:
        raise SpecError(rope.key_path(key), f"RoPE scaling {variant!r} is not implemented (the runtime has "
                                            f"{' and '.join(ROPE_TYPES)}); use a checkpoint without it")
    if variant == "llama3":  # rope_inv_freq divides by factor, low_freq_factor and high - low
        factor, low, high, positions = (rope.get(name, float, minimum=0) for name in LLAMA3_ROPE_KEYS)
        for name, value in (("factor", factor), ("low_freq_factor", low), ("original_max_position_embeddings",
                                                                           positions)):
            if value <= 0:
                raise SpecError(rope.key_path(name), f"{value} must be > 0; give the checkpoint's own value")
        if high <= low:
            raise SpecError(rope.key_path("high_freq_factor"), f"{high} must exceed low_freq_factor ({low}); "
                                                               "give the checkpoint's own values")


def _check_rotary_fraction(f: Fields) -> None:
    """``partial_rotary_factor`` at the top level (transformers 4.x) or in a RoPE mapping (5.x)."""
    for where in (f, f.sub("rope_parameters"), f.sub("rope_scaling")):
        fraction = where.get("partial_rotary_factor", float, 1.0)
        if fraction != 1.0:
            raise SpecError(where.key_path("partial_rotary_factor"), f"{fraction} is not supported: the "
                            "runtime rotates every head dimension; use a config with partial_rotary_factor: 1")


def arch_from_hf_config(path: Path, where: str) -> ModelArch:
    """``arch_from_hf`` of a ``config.json`` file; errors name ``where`` and the file."""
    if not Path(path).exists():
        raise SpecError(where, f"file {str(path)!r} not found; give a path to a HuggingFace config.json")
    try:
        cfg = read_json_file(path, "HuggingFace config.json")
    except SpecError as err:
        raise SpecError(where, str(err)) from None
    return arch_from_hf(cfg, f"{where}<{path}>")


def _check_heads(arch: ModelArch, heads_key: str, kv_key: str) -> None:
    if arch.hidden % arch.heads:
        raise SpecError(heads_key, f"hidden ({arch.hidden}) must be divisible by heads ({arch.heads})")
    if arch.heads % arch.kv_heads:
        raise SpecError(kv_key, f"heads ({arch.heads}) must be divisible by kv_heads ({arch.kv_heads})")


def read_arch(f: Fields, base_dir: Path) -> ModelArch:
    """A model entry: ``preset: NAME``, ``hf_config: PATH``, or the architecture fields themselves."""
    if f.has("preset"):
        name = f.get("preset", str, choices=sorted(PRESETS))
        f.finish()
        return PRESETS[name]
    if f.has("hf_config"):
        path = Path(f.get("hf_config", str))
        f.finish()
        return arch_from_hf_config(path if path.is_absolute() else base_dir / path, f.key_path("hf_config"))
    heads = f.get("heads", int, minimum=1, maximum=MAX_HIDDEN)
    arch = ModelArch(
        layers=f.get("layers", int, minimum=1, maximum=MAX_LAYERS),
        hidden=f.get("hidden", int, minimum=1, maximum=MAX_HIDDEN),
        ffn_hidden=f.get("ffn_hidden", int, minimum=1, maximum=MAX_FFN_HIDDEN),
        heads=heads,
        kv_heads=f.get("kv_heads", int, heads, minimum=1, maximum=MAX_HIDDEN),
        vocab=f.get("vocab", int, minimum=1, maximum=MAX_VOCAB),
        tied_embeddings=f.get("tied_embeddings", bool, False),
        mlp=f.get("mlp", str, "swiglu", choices=["swiglu", "gelu"]),
        qkv_bias=f.get("qkv_bias", bool, False),
        head_dim=f.get("head_dim", int, 0, minimum=2, maximum=MAX_HIDDEN),
        qk_norm=f.get("qk_norm", bool, False),
        # a null ``moe`` (e.g. ``dataclasses.asdict`` of a dense arch) is a dense model, as a missing one
        moe=read_moe(f.sub("moe")) if f.sub("moe").data else None,
    )
    f.finish()
    _check_heads(arch, f.key_path("heads"), f.key_path("kv_heads"))
    if arch.qk_norm and arch.qkv_bias:  # saved checkpoints must load in transformers as some class
        raise SpecError(f.key_path("qk_norm"), "with qkv_bias: true is no transformers model (Qwen2 has the "
                                               "biases, Qwen3 the q/k norms); give one of them")
    return arch
