"""Host time of a decode step run eagerly: every kernel dispatched from Python, one by one, no CUDA graph.

A decode step replayed from a CUDA graph costs its kernels' GPU time plus a few µs between them
(``decode.DecodePriors.kernel_gap_s``). Run eagerly (vLLM's ``enforce_eager``), every op of every layer
goes through the Python module call, PyTorch's dispatcher and a kernel launch on the host; at decode
batch sizes the kernels are shorter than that, so the GPU waits for the host and the step costs the
host's dispatch time: layers × kernels per layer × the host time of one dispatched kernel.

The host time per kernel is the one constant here: 21 µs, fitted on ONE named published value that is
not itself a validated cell, verl_oso_1's ``generate_sequences`` (247 s inside its 321 s ``gen``, the
row's notes; verl's rollout ran vLLM with ``enforce_eager=True``, its default until verl PR #2956 of
2025-08-08, "enable vllm cuda graph in default"). Checked against verl_oso_3's ``generate_sequences``
(162 s in its notes; priced 177 s). For scale: 28 layers × 10 kernels × 21 µs = 5.9 ms a step, the order
of the 9–10 ms a 28-layer Qwen2.5-7B decoder loses eager against CUDA graphs on A800s (vllm-project/
vllm-omni issue 7960: 22–23 ms → 13 ms per token).

The decode model adds this to the engine's fixed step cost (``Priors.decode_step_overhead_s``), as it
adds the graph's kernel gaps; at large batches, where the GPU's own step time exceeds the host's, an
eager engine hides most of it behind the GPU and this overstates the step by a few per cent.
"""

from __future__ import annotations

from nereus.cost.decode import DecodePriors

EAGER_HOST_S_PER_KERNEL = 21e-6


def eager_step_overhead_s(layers: int, kernels_per_layer: float = DecodePriors().kernels_per_layer) -> float:
    """Host seconds an eager decode step of a ``layers``-layer model adds to the graphed step's cost
    (``kernels_per_layer`` on average: an MoE decoder's sparse layers launch more, ``cost.moe``)."""
    return layers * kernels_per_layer * EAGER_HOST_S_PER_KERNEL
