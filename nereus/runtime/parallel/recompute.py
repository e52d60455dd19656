"""Activation recomputation (``Layout.recompute``), applied to a plain ``CausalLM`` from outside: the decoder
leaves a ``CallSlot`` around each layer and around each attention core, and this swaps in ``Recompute``,
which runs its part under ``torch.utils.checkpoint``: the forward pass keeps only the part's inputs, and the
backward pass runs the part again to rebuild what it needs (Chen et al. 2016; Korthikanti et al. 2022).

- ``full``: every decoder layer (Megatron-LM's ``recompute_granularity=full``, uniform, one layer per
  chunk): a layer stores only its input, and its forward, TP all-reduces included, runs again in backward.
- ``selective``: only the attention core, softmax(q·kᵀ)·v (``decoder.attention_core``; Megatron-LM's
  ``selective``): the queries, keys and values are kept, the core's outputs and softmax statistics are not.

Results are those of the plain model: the decoder draws no random numbers (no dropout), and each rank
recomputes in the order its backward runs, so TP ranks meet in the same all-reduces. Under ``no_grad``
(inference, generation) there is nothing to keep and the part runs as is.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from nereus.runtime.model.decoder import CausalLM


class Recompute(nn.Module):
    """A ``CallSlot`` that checkpoints its part (see the module docstring)."""

    def forward(self, fn: Callable[..., torch.Tensor], *args: object) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return fn(*args)
        # non-reentrant: parameters' gradients flow without an input that requires grad, and the kept inputs
        # go through saved-tensor hooks (the runtime's activation meter counts them); no RNG state to keep
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)


def apply_recompute(model: CausalLM, mode: str) -> CausalLM:
    """``model`` (whole or one stage) with ``mode``'s parts checkpointed: ``none``, ``selective`` or ``full``."""
    if mode not in ("none", "selective", "full"):
        raise ValueError(f"recompute {mode!r}: one of none, selective, full")
    for layer in model.model.layers.values():
        if mode == "full":
            layer.layer_call = Recompute()
        elif mode == "selective":
            layer.self_attn.core_call = Recompute()
    return model
