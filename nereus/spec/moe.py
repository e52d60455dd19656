"""Mixture-of-Experts part of a decoder architecture: the fields the cost model, the planner and the runtime
all read, parsed once from a HuggingFace config as written.

Three checkpoint families share one routing scheme (Shazeer et al. 2017; Fedus et al. 2021): a linear router
scores every expert per token, softmax over all experts, the ``top_k`` best are kept, optionally renormalised
to sum to 1 (``norm_topk_prob``; Mixtral always does), and the token's output is the weighted sum of its
experts' SwiGLU MLPs. Qwen2-MoE adds a shared expert every token passes through, scaled by a sigmoid gate.
Some layers may stay dense (``mlp_only_layers``, ``decoder_sparse_step``), with the dense ``ffn_hidden``.

=================  =============================  =======================  ==============================
family             experts / top-k keys           expert width key         extras
=================  =============================  =======================  ==============================
``qwen3_moe``      num_experts, num_experts_per_tok  moe_intermediate_size  q/k norms, norm_topk_prob
``qwen2_moe``      num_experts, num_experts_per_tok  moe_intermediate_size  QKV bias, shared expert + gate
``mixtral``        num_local_experts, num_experts_per_tok  intermediate_size  renormalised top-k
=================  =============================  =======================  ==============================
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from nereus.spec.errors import SpecError
from nereus.spec.fields import MAX_LAYERS, Fields

MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral")
MAX_EXPERTS = 2**12  # DeepSeek-V3 has 256 routed experts, Qwen3-235B 128; past this a config is garbage


@dataclass(frozen=True)
class MoESpec:
    """Routed experts of every sparse layer (``dense_layers`` keep the dense MLP of ``ModelArch.ffn_hidden``)."""

    experts: int
    top_k: int
    expert_ffn_hidden: int
    norm_topk_prob: bool = True
    shared_expert_ffn_hidden: int = 0  # Qwen2-MoE: one shared SwiGLU expert behind a sigmoid gate
    dense_layers: tuple[int, ...] = ()
    aux_loss_coef: float = 0.0  # load-balancing loss weight (Fedus et al. 2021, eq. 4), router_aux_loss_coef

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.experts:
            raise ValueError(f"MoESpec.top_k: {self.top_k}; give 1 <= top_k <= experts ({self.experts})")

    def sparse(self, layer: int) -> bool:
        """Whether ``layer`` routes its tokens to experts (else it has the dense MLP)."""
        return layer not in self.dense_layers

    def expert_params(self, hidden: int) -> int:
        """Parameters of one routed expert (gate, up, down of ``expert_ffn_hidden``)."""
        return 3 * hidden * self.expert_ffn_hidden

    def shared_params(self, hidden: int) -> int:
        """The shared expert and its one-output gate (Qwen2-MoE), or 0."""
        return 3 * hidden * self.shared_expert_ffn_hidden + hidden if self.shared_expert_ffn_hidden else 0

    def router_params(self, hidden: int) -> int:
        return self.experts * hidden

    def mlp_params(self, hidden: int) -> int:
        """All MLP parameters of one sparse layer: every expert, the shared one, the router."""
        return self.experts * self.expert_params(hidden) + self.shared_params(hidden) + self.router_params(hidden)

    def active_mlp_params(self, hidden: int) -> int:
        """The MLP parameters one token's forward pass touches in a sparse layer: ``top_k`` experts, the
        shared one, the router (what "A3B" counts in Qwen3-30B-A3B)."""
        return self.top_k * self.expert_params(hidden) + self.shared_params(hidden) + self.router_params(hidden)

    def to_dict(self) -> dict:
        out: dict = {"experts": self.experts, "top_k": self.top_k, "expert_ffn_hidden": self.expert_ffn_hidden,
                     "norm_topk_prob": self.norm_topk_prob}
        if self.shared_expert_ffn_hidden:
            out["shared_expert_ffn_hidden"] = self.shared_expert_ffn_hidden
        if self.dense_layers:
            out["dense_layers"] = list(self.dense_layers)
        if self.aux_loss_coef:
            out["aux_loss_coef"] = self.aux_loss_coef
        return out


def moe_from_hf(f: Fields, kind: str, layers: int, max_ffn: int) -> MoESpec | None:
    """The MoE part of a checked HuggingFace ``config.json`` of model type ``kind`` (None for dense types
    and for an MoE type configured with no experts). Keys as the checkpoint writes them; transformers'
    defaults where one is left out."""
    if kind not in MOE_MODEL_TYPES:
        return None
    if kind == "mixtral":
        experts = f.get("num_local_experts", int, 8, minimum=1, maximum=MAX_EXPERTS)
        width = f.get("intermediate_size", int, minimum=1, maximum=max_ffn)
        norm, shared, dense = True, 0, ()
        jitter = f.get("router_jitter_noise", float, 0.0, minimum=0.0)
        if jitter:
            raise SpecError(f.key_path("router_jitter_noise"), f"{jitter} adds random noise to routing in "
                                                               "training; set it to 0")
    else:
        experts = _qwen_experts(f)
        if not experts:
            return None
        width = f.get("moe_intermediate_size", int, minimum=1, maximum=max_ffn)
        norm = f.get("norm_topk_prob", bool, False)
        shared = (f.get("shared_expert_intermediate_size", int, minimum=1, maximum=max_ffn)
                  if kind == "qwen2_moe" else 0)
        dense = _dense_layers(f, layers)
    top_k = f.get("num_experts_per_tok", int, 2, minimum=1, maximum=MAX_EXPERTS)
    if top_k > experts:
        raise SpecError(f.key_path("num_experts_per_tok"), f"{top_k} exceeds the {experts} experts; give the "
                                                           "checkpoint's own value")
    coef = f.get("router_aux_loss_coef", float, 0.001 if kind != "mixtral" else 0.02, minimum=0.0, maximum=1e3)
    return MoESpec(experts, top_k, width, norm, shared, dense, coef)


def _qwen_experts(f: Fields) -> int:
    """Qwen's expert count: ``num_experts`` as the hub's configs write it, or ``num_local_experts``, the name
    transformers 5 writes for Qwen3-MoE (its config maps one to the other)."""
    if not f.has("num_experts") and f.has("num_local_experts"):
        return f.get("num_local_experts", int, minimum=0, maximum=MAX_EXPERTS)
    experts = f.get("num_experts", int, minimum=0, maximum=MAX_EXPERTS)
    other = f.get("num_local_experts", int, None, minimum=0, maximum=MAX_EXPERTS)
    if other is not None and other != experts:
        raise SpecError(f.key_path("num_local_experts"), f"{other} disagrees with num_experts {experts}; give one "
                                                         "expert count")
    return experts


def _dense_layers(f: Fields, layers: int) -> tuple[int, ...]:
    """Qwen's dense layers: those in ``mlp_only_layers`` and those off ``decoder_sparse_step`` (a layer i is
    sparse when i is not listed and (i + 1) is a multiple of the step, as transformers builds them)."""
    step = f.get("decoder_sparse_step", int, 1, minimum=1, maximum=MAX_LAYERS)
    only = set(f.get_list("mlp_only_layers", int)) if f.data.get("mlp_only_layers") is not None else set()
    bad = sorted(i for i in only if not 0 <= i < layers)
    if bad:
        raise SpecError(f.key_path("mlp_only_layers"), f"layer {bad[0]} is outside the {layers} layers")
    return tuple(i for i in range(layers) if i in only or (i + 1) % step)


def read_moe(f: Fields) -> MoESpec:
    """An ``moe:`` mapping of a job file's model entry (the fields of ``MoESpec``)."""
    experts = f.get("experts", int, minimum=1, maximum=MAX_EXPERTS)
    spec = MoESpec(
        experts=experts,
        top_k=f.get("top_k", int, minimum=1, maximum=experts),
        expert_ffn_hidden=f.get("expert_ffn_hidden", int, minimum=1, maximum=2**20),
        norm_topk_prob=f.get("norm_topk_prob", bool, True),
        shared_expert_ffn_hidden=f.get("shared_expert_ffn_hidden", int, 0, minimum=0, maximum=2**20),
        dense_layers=tuple(f.get_list("dense_layers", int)) if f.has("dense_layers") else (),
        aux_loss_coef=f.get("aux_loss_coef", float, 0.0, minimum=0.0, maximum=1e3),
    )
    f.finish()
    return spec


# Mixtral's checkpoint names of the MoE tensors (transformers' MixtralForCausalLM on disk and on the hub): the
# router and experts under ``block_sparse_moe``, the expert's gate/up/down as w1/w3/w2. In memory and in the
# sharding contract every family uses Qwen's names (``mlp.gate``, ``mlp.experts.{i}.gate_proj`` ...).
_MIXTRAL_MLP = re.compile(r"\.mlp\.(gate\.weight|experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight)$")
_MIXTRAL_PROJ = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def mixtral_name(name: str) -> str:
    """The Mixtral checkpoint name of a contract tensor name (other names unchanged)."""
    m = _MIXTRAL_MLP.search(name)
    if m is None:
        return name
    head = name[:m.start()] + ".block_sparse_moe."
    if m.group(2) is None:
        return head + "gate.weight"
    return f"{head}experts.{m.group(2)}.{_MIXTRAL_PROJ[m.group(3)]}.weight"
