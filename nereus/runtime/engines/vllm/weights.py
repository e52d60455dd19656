"""Weights into a tensor-parallel vLLM engine, in memory.

An engine of tensor-parallel size T runs T worker processes (vLLM's multiprocess executor). A call to
every worker (``collective_rpc``) crosses a process boundary, and tensors given as its arguments arrive
as nested lists; so the driver packs the checkpoint-named tensors into one byte string
(``torch.save`` into memory, no file) and each worker unpacks it and hands the whole tensors to vLLM's
in-place reload, whose weight loaders cut that worker's shard (and fuse q/k/v and gate/up) as they do
when vLLM loads a checkpoint. ``WeightReceiver`` is the worker extension that does it (vLLM's
``worker_extension_cls``: its methods are added to every worker and called by name)."""

from __future__ import annotations

import io

import torch

# vLLM imports the extension by this path inside each engine worker process
RECEIVER = "nereus.runtime.engines.vllm.weights.WeightReceiver"


def pack(weights: dict[str, torch.Tensor]) -> bytes:
    """Checkpoint-named tensors as one byte string (contiguous copies; no autograd history)."""
    buffer = io.BytesIO()
    torch.save({name: t.detach().contiguous() for name, t in weights.items()}, buffer)
    return buffer.getvalue()


def unpack(blob: bytes) -> dict[str, torch.Tensor]:
    return torch.load(io.BytesIO(blob), weights_only=True)


class WeightReceiver:
    """Mixed into each vLLM worker (``worker_extension_cls``): ``self`` is the worker."""

    def nereus_load_weights(self, blob: bytes) -> int:
        """Whole checkpoint-named tensors in, this worker's shard of each written in place; the count."""
        weights = unpack(blob)
        self.reload_weights(weights_iterator=iter(weights.items()))  # the worker's: under its vLLM config
        return len(weights)

    def nereus_parameters(self) -> bytes:
        """This worker's parameters by vLLM's own names (its tensor-parallel shard), packed (tests)."""
        return pack(dict(self.model_runner.model.named_parameters()))
