"""Host-side (Python) unit costs behind the weight-sync model (``nereus.cost.verl_weight_sync``): what one
step of the loops that verl and vLLM run per weight tensor costs the CPU, measured on this machine's
interpreter and torch. Each figure is the fastest of many repeats (the least-disturbed run).

    python benchmarks/host_call_costs.py          # a table of unit costs
    python benchmarks/host_call_costs.py --json   # the same as one JSON line

- ``module_walk_s``: one module visited by ``dict(model.named_parameters())`` over a tree shaped like an
  inference engine's decoder (13 modules a layer: attention with its projections, rotary, kernel and q/k
  norms; the MLP block with its projections or router and fused experts; two norms), per module;
- ``mapping_entry_s``: one entry of an expert-name table built per call (a tuple of three formatted
  names and an id), per entry;
- ``name_compare_s``: one substring test of a tensor name against such an entry while scanning the table;
- ``object_collective_s``: one ``all_gather_object`` on a one-rank gloo group (pickling, the size
  exchange, the payload exchange, unpickling): the host part of the object collectives a trainer's
  parameter export runs per parameter;
- ``dtensor_gather_s``: ``full_tensor()`` of a row-sharded DTensor on a one-rank gloo mesh: the host part
  (DTensor dispatch, redistribution planning) of the gather an FSDP trainer runs per parameter to export it;
- ``eager_op_s``: one eager torch op on a small CPU tensor (a ``narrow`` then ``copy_``, per op): the host
  dispatch cost every kernel launch of a weight loader pays before the device runs it;
- ``new_page_copy_s_per_byte``: one thread copying into a freshly allocated (never touched) pageable host
  tensor, per byte: the host side of ``Tensor.to("cpu")`` from a GPU, whose driver lands each chunk of the
  transfer in a pinned staging buffer and copies it into the new tensor, faulting its pages in;
- ``pageable_copy_s_per_byte``: the same copy between host tensors already touched, per byte: the host side
  of ``Tensor.to("cuda")`` from a pageable tensor (copied into staging, then sent).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

REPEATS = 30
BATCH = 100  # calls back to back, as the export loops make them
LAYERS = 48
EXPERTS = 128


def _fastest(fn, repeats: int = REPEATS) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


class _Weight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, device="meta"))


class _Layer(nn.Module):
    """Thirteen modules: the layer, attention and its six parts, the MLP and its two parts, two norms."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.ModuleDict({"qkv": _Weight(), "out": _Weight(), "q_norm": _Weight(),
                                        "k_norm": _Weight(), "rotary": nn.Module(), "kernel": nn.Module()})
        self.mlp = nn.ModuleDict({"router": _Weight(), "experts": _Weight()})
        self.norm_in, self.norm_out = _Weight(), _Weight()


def module_walk_s() -> float:
    model = nn.ModuleList(_Layer() for _ in range(LAYERS))
    modules = sum(1 for _ in model.modules())
    return _fastest(lambda: dict(model.named_parameters())) / modules


def mapping_entry_s() -> float:
    def build() -> list:
        return [(f"experts.w{'13' if p != 'down' else '2'}_", f"experts.{e}.{p}_proj.", e, p)
                for e in range(EXPERTS) for p in ("gate", "down", "up")]
    return _fastest(build) / (3 * EXPERTS)


def name_compare_s() -> float:
    table = [(f"experts.{e}.{p}_proj.", e) for e in range(EXPERTS) for p in ("gate", "down", "up")]
    name = "model.layers.7.mlp.experts.127.up_proj.weight"  # the last entry: a full scan

    def scan() -> None:
        for fragment, _ in table:
            if fragment not in name:
                continue
    return _fastest(scan) / len(table)


def object_collective_s() -> float:
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'pg')}", rank=0, world_size=1)
        try:
            spec = (torch.Size([768, 2048]), torch.bfloat16, True, 1)
            out: list = [None]
            return _fastest(lambda: [dist.all_gather_object(out, spec) for _ in range(BATCH)]) / BATCH
        finally:
            dist.destroy_process_group()


def dtensor_gather_s() -> float:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'pg')}", rank=0, world_size=1)
        try:
            sharded = distribute_tensor(torch.zeros(8, 64), init_device_mesh("cpu", (1,)), [Shard(0)])
            return _fastest(lambda: [sharded.full_tensor() for _ in range(BATCH)]) / BATCH
        finally:
            dist.destroy_process_group()


def eager_op_s() -> float:
    dst, src = torch.zeros(4, 64), torch.ones(2, 64)
    return _fastest(lambda: [dst.narrow(0, 2, 2).copy_(src) for _ in range(BATCH)]) / (2 * BATCH)


COPY_BYTES = 256 * 2**20  # above glibc's largest mmap threshold (32 MiB): every allocation maps new pages
COPY_REPEATS = 7


def new_page_copy_s_per_byte() -> float:
    src = torch.ones(COPY_BYTES, dtype=torch.uint8)
    return _fastest(lambda: torch.empty(COPY_BYTES, dtype=torch.uint8).copy_(src), COPY_REPEATS) / COPY_BYTES


def pageable_copy_s_per_byte() -> float:
    src, dst = torch.ones(COPY_BYTES, dtype=torch.uint8), torch.zeros(COPY_BYTES, dtype=torch.uint8)
    return _fastest(lambda: dst.copy_(src), COPY_REPEATS) / COPY_BYTES


def measure() -> dict[str, float]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one rank's process copies on one thread
    try:
        return {"module_walk_s": module_walk_s(), "mapping_entry_s": mapping_entry_s(),
                "name_compare_s": name_compare_s(), "object_collective_s": object_collective_s(),
                "dtensor_gather_s": dtensor_gather_s(), "eager_op_s": eager_op_s(),
                "new_page_copy_s_per_byte": new_page_copy_s_per_byte(),
                "pageable_copy_s_per_byte": pageable_copy_s_per_byte()}
    finally:
        torch.set_num_threads(threads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    args = parser.parse_args()
    costs = measure()
    if args.json:
        print(json.dumps(costs))
        return
    for name, seconds in costs.items():
        if name.endswith("_per_byte"):
            print(f"{name:26s} {seconds * 1e9:9.3f} s/GB ({1e-9 / seconds:.2f} GB/s)")
        else:
            print(f"{name:26s} {seconds * 1e6:9.3f} us")


if __name__ == "__main__":
    main()
