"""A published-runs row's model architecture (``sim.published_runs``): the ``models`` entry its columns
describe, whether it is a Mixture-of-Experts model, and its size in billions of parameters.

What a row leaves empty here takes a stated rule (``nereus/cost/e2e_runs.md``): ``arch`` is moe where the
row states routed experts (``n_experts``), else dense; ``n_kv_heads`` and ``head_dim`` as Hugging Face
configs default them (``n_heads``, ``hidden`` / ``n_heads``); ``shared_experts`` none; ``params_b`` the
architecture's own count (``ModelArch.params``), which the rules that go by a model's size read (the
nearest recipe or script of that size).
"""

from __future__ import annotations

from pathlib import Path

from nereus.sim.published_cells import RowSkipped, count, enum, layer_count, number
from nereus.spec.errors import SpecError
from nereus.spec.fields import Fields
from nereus.spec.model import ModelArch, read_arch


def is_moe(row: dict) -> bool:
    """The row's ``arch`` is moe; empty: moe where it states routed experts (``n_experts`` above 0)."""
    return enum(row, "arch", ("dense", "moe"), "moe" if number(row, "n_experts") else "dense") == "moe"


def arch_dict(row: dict) -> dict:
    """The ``models`` entry of the row's architecture columns; an MoE row's (``arch`` moe) with its experts."""
    moe = is_moe(row)
    need = "the architecture"
    heads = count(row, "n_heads", need)
    hidden = count(row, "hidden", need)
    head_dim = count(row, "head_dim")  # as written where it differs from hidden / heads (Qwen3-4B, -32B)
    out = {"layers": layer_count(row), "hidden": hidden, "heads": heads,
           "kv_heads": count(row, "n_kv_heads") or heads, "vocab": count(row, "vocab", need),
           **({"head_dim": head_dim} if head_dim is not None else {})}
    if not moe:
        return {**out, "ffn_hidden": count(row, "ffn_hidden", need)}
    return moe_arch_dict(row, out)


def moe_arch_dict(row: dict, attention: dict) -> dict:
    """An MoE row's architecture: ``n_experts`` routed experts of ``moe_ffn_hidden``, ``experts_per_token``
    of them a token, ``shared_experts`` of that width every token passes through. ``ffn_hidden`` empty: every
    layer is sparse. ``ffn_hidden`` given: the first layers are dense (DeepSeek's ``first_k_dense_replace``),
    as many as make the model's parameters nearest ``params_b`` (the schema has no dense-layer count)."""
    need = "an MoE row's experts"
    experts, width = count(row, "n_experts", need), count(row, "moe_ffn_hidden", need)
    top_k = count(row, "experts_per_token", need)
    if top_k > experts:
        raise RowSkipped(f"experts_per_token {top_k} exceeds n_experts {experts}")
    shared = int(number(row, "shared_experts") or 0)
    moe = {"experts": experts, "top_k": top_k, "expert_ffn_hidden": width,
           **({"shared_expert_ffn_hidden": shared * width} if shared else {})}
    dense_ffn = count(row, "ffn_hidden")
    if dense_ffn is None:
        return {**attention, "ffn_hidden": width, "moe": moe}
    layers = attention["layers"]
    total = number(row, "params_b")
    if total is None:
        raise RowSkipped("ffn_hidden is given (some layers dense) but params_b is empty (how many are dense)")
    sizes = [model_arch({**attention, "ffn_hidden": dense_ffn, "moe": {**moe, "dense_layers": list(range(k))}}).params()
             for k in (0, 1)]
    dense = round((total * 1e9 - sizes[0]) / (sizes[1] - sizes[0])) if sizes[1] != sizes[0] else 0
    dense = min(max(dense, 0), layers - 1)
    return {**attention, "ffn_hidden": dense_ffn, "moe": {**moe, "dense_layers": list(range(dense))}}


def model_size_b(row: dict) -> float | None:
    """The model's size in billions of parameters: the row's ``params_b``, else its architecture's count;
    None where neither is a positive number (a row whose architecture does not build)."""
    stated = number(row, "params_b")
    if stated:
        return stated
    try:
        return model_arch(arch_dict(row)).params() / 1e9
    except RowSkipped:
        return None


def model_arch(entry: dict) -> ModelArch:
    """The architecture an ``arch_dict`` entry describes, read as ``job_from_dict`` reads a job's ``models``
    (``spec.model.read_arch``); one it refuses skips the row with its reason."""
    try:
        return read_arch(Fields(entry, "models.actor"), Path())
    except SpecError as err:
        raise RowSkipped(f"the row does not make a valid job: {err}") from None
