"""What a speculative verification costs on a GPU, by live batch, draft length and context, beside the
cost model's ``verify_seconds`` (nereus.cost.tail.speculative).

    python benchmarks/verify_cost_gpu.py --out verify.csv              # CUDA device 0, H200 preset
    python benchmarks/verify_cost_gpu.py --predict nereus/cost/verify_h200_measured.csv   # a saved run
    python benchmarks/verify_cost_gpu.py --device cpu --small           # a tiny shape on CPU (the suite runs it)

A verification is one target forward of ``rows`` = k + 1 tokens per live sequence over its KV cache. This
script times that forward for a random model of a preset's shape (no checkpoint: the cost does not depend
on the weights) in plain PyTorch: bf16 GEMMs, FlashAttention through ``scaled_dot_product_attention`` with
the query heads of each KV head folded into the query length (GQA without copying the cache), the new
keys and values written into a preallocated cache, logits for every row and their argmax. On CUDA each
configuration is captured once in a CUDA graph and replayed, so no host launch cost is timed: the cost
model's ``graph`` engine (gpt-fast's loop), whose only costs are the GPU's. The causal mask inside the
block of k + 1 new tokens is left out: it removes k·(k + 1)/2 of the (context + k + 1)·(k + 1) scores per
head and sequence, not a cost the model prices.

The figure that decides speculation is the ratio T(b, k + 1) / T(b, 1): the verification's cost in plain
decode steps at the same live batch. The model says it stays near 1 while the step is weight-read bound
(small b) and grows toward k + 1 once the GEMMs are FLOP-bound. Nothing is asserted about speed.
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nereus.spec.model import PRESETS, ModelArch  # noqa: E402

# The presets' shapes (nereus.spec.model.PRESETS) and a tiny one for the CPU run.
SHAPES = {**PRESETS, "small": ModelArch(layers=2, hidden=64, ffn_hidden=128, heads=4, kv_heads=2, vocab=128)}


@dataclass(frozen=True)
class Config:
    shape: str
    batch: int
    rows: int
    context: int


@dataclass(frozen=True)
class Measured:
    config: Config
    seconds: float  # one forward (median over repeats of the mean over replays)


class RandomDecoder:
    """A Llama-shaped decoder with random weights, for timing only: one forward of ``rows`` new tokens
    per sequence over a KV cache of ``context`` tokens."""

    def __init__(self, shape: str, device: str, dtype: torch.dtype) -> None:
        a = SHAPES[shape]
        layers, hidden, ffn, heads, kv_heads, vocab = a.layers, a.hidden, a.ffn_hidden, a.heads, a.kv_heads, a.vocab
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.layers, self.hidden, self.device, self.dtype = layers, hidden, device, dtype
        g = torch.Generator(device=device).manual_seed(0)

        def w(*size: int) -> torch.Tensor:
            return (torch.randn(*size, generator=g, device=device, dtype=dtype) * 0.02)

        qkv = (heads + 2 * kv_heads) * self.head_dim
        self.blocks = [dict(norm1=torch.ones(hidden, device=device, dtype=dtype), qkv=w(qkv, hidden),
                            o=w(hidden, heads * self.head_dim), norm2=torch.ones(hidden, device=device, dtype=dtype),
                            gate_up=w(2 * ffn, hidden), down=w(hidden, ffn)) for _ in range(layers)]
        self.embed, self.head, self.norm = w(vocab, hidden), w(vocab, hidden), torch.ones(hidden, device=device,
                                                                                         dtype=dtype)

    def cache(self, batch: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        shape = (batch, self.kv_heads, length, self.head_dim)
        return [(torch.zeros(shape, device=self.device, dtype=self.dtype),
                 torch.zeros(shape, device=self.device, dtype=self.dtype)) for _ in range(self.layers)]

    def forward(self, tokens: torch.Tensor, cache: list, context: int, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        b, q = tokens.shape
        h, kvh, hd = self.heads, self.kv_heads, self.head_dim
        x = F.embedding(tokens, self.embed).view(b * q, self.hidden)
        for blk, (ck, cv) in zip(self.blocks, cache, strict=True):
            a = F.rms_norm(x, (self.hidden,), blk["norm1"])
            qkv = (a @ blk["qkv"].t()).view(b, q, h + 2 * kvh, hd)
            qkv = torch.cat([rotate(qkv[:, :, :h + kvh], cos, sin), qkv[:, :, h + kvh:]], dim=2)
            ck[:, :, context:context + q].copy_(qkv[:, :, h:h + kvh].transpose(1, 2))
            cv[:, :, context:context + q].copy_(qkv[:, :, h + kvh:].transpose(1, 2))
            # the h / kvh query heads sharing a KV head become rows of one query block (GQA, no KV copy)
            qf = qkv[:, :, :h].reshape(b, q, kvh, h // kvh, hd).permute(0, 2, 1, 3, 4).reshape(b, kvh, -1, hd)
            o = F.scaled_dot_product_attention(qf, ck, cv)
            o = o.view(b, kvh, q, h // kvh, hd).permute(0, 2, 1, 3, 4).reshape(b * q, h * hd)
            x = x + o @ blk["o"].t()
            a = F.rms_norm(x, (self.hidden,), blk["norm2"])
            gate, up = (a @ blk["gate_up"].t()).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ blk["down"].t()
        logits = F.rms_norm(x, (self.hidden,), self.norm) @ self.head.t()
        return logits.argmax(dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on the last dimension (half-split form, as Llama's)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def cache_bytes(shape: str, batch: int, length: int, elem: int) -> int:
    a = SHAPES[shape]
    return 2 * a.layers * batch * a.kv_heads * length * a.head_dim * elem


def time_config(model: RandomDecoder, cfg: Config, replays: int, repeats: int) -> float:
    """Seconds of one forward: on CUDA a captured graph replayed ``replays`` times per repeat (median of
    ``repeats``); on CPU the eager forward."""
    b, q, c = cfg.batch, cfg.rows, cfg.context
    dev = model.device
    cache = model.cache(b, c + q)
    tokens = torch.randint(0, 100, (b, q), device=dev)
    pos = torch.arange(c, c + q, device=dev, dtype=torch.float32)
    inv = 1.0 / (500000.0 ** (torch.arange(0, model.head_dim, 2, device=dev, dtype=torch.float32) / model.head_dim))
    ang = pos[:, None] * inv[None]
    cos, sin = (ang.cos().to(model.dtype)[None, :, None], ang.sin().to(model.dtype)[None, :, None])

    def fwd() -> torch.Tensor:
        return model.forward(tokens, cache, c, cos, sin)

    if dev != "cuda":
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fwd()
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fwd()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fwd()
    for _ in range(3):
        graph.replay()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / replays)
    return statistics.median(samples)


def measure(shape: str, batches: list[int], rows: list[int], contexts: list[int], device: str,
            cache_limit_gb: float, replays: int, repeats: int, out: list[Measured], save=None) -> list[Measured]:
    """Appends to ``out`` one row per configuration whose cache fits ``cache_limit_gb``, calling
    ``save(out)`` after each (a run cut short keeps what it measured)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = RandomDecoder(shape, device, dtype)
    for c in contexts:
        for b in batches:
            for q in rows:
                if cache_bytes(shape, b, c + q, 2) > cache_limit_gb * 1e9:
                    continue
                cfg = Config(shape, b, q, c)
                out.append(Measured(cfg, time_config(model, cfg, replays, repeats)))
                if device == "cuda":  # the configuration's cache and graph pool went with time_config's frame
                    torch.cuda.empty_cache()
                print(f"  {shape} batch {b:>4} rows {q} context {c:>5}: {out[-1].seconds * 1e3:8.3f} ms", flush=True)
                if save:
                    save(out)
    del model
    return out


def step_models(preset: str) -> dict[str, object]:
    """The cost model's replica of each preset shape on one GPU of ``preset`` (engine ``graph``: no host
    costs, as the captured forward here)."""
    from nereus.cost.decode import Replica, StepModel
    from nereus.cost.hardware import Hardware
    from nereus.spec.cluster import ClusterSpec, gpu_presets

    hw = Hardware(ClusterSpec(gpu_presets()[preset], nodes=1, gpus_per_node=8))
    return {name: StepModel(Replica(hw, arch, 1, engine="graph")) for name, arch in PRESETS.items()}


def comparison(rows: list[Measured], preset: str) -> list[dict]:
    """Per configuration of a preset shape: measured and predicted seconds (``verify_seconds``), and the
    verification's cost in plain steps (T(b, rows) / T(b, 1)) measured and predicted."""
    from nereus.cost.tail.speculative import verify_seconds

    models = step_models(preset)
    plain = {(m.config.shape, m.config.batch, m.config.context): m.seconds for m in rows if m.config.rows == 1}
    out = []
    for m in rows:
        c = m.config
        if c.shape not in models:  # the CPU run's tiny shape has no preset to predict from
            continue
        pred = verify_seconds(models[c.shape], c.batch, c.context, c.rows)
        pred_base = verify_seconds(models[c.shape], c.batch, c.context, 1)
        base = plain.get((c.shape, c.batch, c.context))
        out.append({**asdict(c), "measured_s": m.seconds, "predicted_s": pred,
                    "measured_ratio": m.seconds / base if base else math.nan,
                    "predicted_ratio": pred / pred_base})
    return out


def print_comparison(table: list[dict]) -> None:
    print(f"{'shape':<13} {'batch':>5} {'rows':>4} {'ctx':>5} {'measured':>10} {'predicted':>10} {'error':>7}"
          f" {'T/T1 meas':>9} {'T/T1 pred':>9}")
    for r in table:
        err = r["predicted_s"] / r["measured_s"] - 1
        print(f"{r['shape']:<13} {r['batch']:>5} {r['rows']:>4} {r['context']:>5} {r['measured_s'] * 1e3:>8.3f}ms"
              f" {r['predicted_s'] * 1e3:>8.3f}ms {err:>+7.1%} {r['measured_ratio']:>9.2f}"
              f" {r['predicted_ratio']:>9.2f}")
    if not table:
        print("no configuration of a preset shape to predict")
        return
    errs = [abs(r["predicted_s"] / r["measured_s"] - 1) for r in table]
    spec = [abs(r["predicted_ratio"] / r["measured_ratio"] - 1) for r in table if r["rows"] > 1]
    print(f"time: mean |error| {statistics.mean(errs):.1%}, max {max(errs):.1%} over {len(errs)} rows")
    if spec:
        print(f"verification in plain steps: mean |error| {statistics.mean(spec):.1%}, max {max(spec):.1%}"
              f" over {len(spec)} rows")


# Rows (k + 1) per shape: targets get their verifications, a draft-sized model only its plain step.
DEFAULT_ROWS = {"llama3-8b": [1, 2, 3, 4, 5, 8], "qwen2.5-7b": [1, 2, 4, 8]}
FIELDS = ("shape", "batch", "rows", "context", "seconds")


def write_rows(path: Path, rows: list[Measured], provenance: str) -> None:
    with path.open("w", newline="") as f:
        f.write(f"# {provenance}\n")
        w = csv.writer(f)
        w.writerow(FIELDS)
        for m in rows:
            c = m.config
            w.writerow((c.shape, c.batch, c.rows, c.context, f"{m.seconds:.7g}"))


def read_rows(path: Path) -> list[Measured]:
    """The rows of a ``write_rows`` file (lines starting with # are its provenance)."""
    lines = [ln for ln in path.read_text().splitlines() if not ln.startswith("#")]
    return [Measured(Config(r["shape"], int(r["batch"]), int(r["rows"]), int(r["context"])), float(r["seconds"]))
            for r in csv.DictReader(lines)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--preset", default="H200", help="GPU preset of the predictions (nereus.spec.cluster)")
    p.add_argument("--shapes", default="llama3-8b,qwen2.5-0.5b")
    p.add_argument("--rows", help="k + 1 values to measure, e.g. 1,2,4,8 (default: by shape, DEFAULT_ROWS)")
    p.add_argument("--small", action="store_true", help="the tiny shape, two batches, on CPU")
    p.add_argument("--cache-limit-gb", type=float, default=90.0)
    p.add_argument("--out", help="write the measured rows here (CSV, rewritten after every configuration)")
    p.add_argument("--predict", help="an --out file of an earlier run: print its comparison, measure nothing")
    a = p.parse_args(argv)
    if a.predict:
        print_comparison(comparison(read_rows(Path(a.predict)), a.preset))
        return 0
    if a.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu --small", file=sys.stderr)
        return 2
    # the target's verification by draft length; a small draft model's plain decode step by batch
    rows = [int(r) for r in a.rows.split(",")] if a.rows else None
    plan = ([("small", [1, 4], [1, 3], [16])] if a.small else
            [(s, [1, 2, 4, 8, 16, 32, 64, 128, 256], rows or DEFAULT_ROWS.get(s, [1]), [512, 4096])
             for s in a.shapes.split(",")])
    device = torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu"

    def save(rows: list[Measured]) -> None:
        if a.out:
            write_rows(Path(a.out), rows, f"benchmarks/verify_cost_gpu.py on {device}, torch {torch.__version__}")

    measured, t0 = [], time.perf_counter()
    for shape, batches, rows, contexts in plan:
        measure(shape, batches, rows, contexts, a.device, a.cache_limit_gb, 3 if a.small else 20, 3, measured, save)
    print(f"{len(measured)} configurations on {device} in {time.perf_counter() - t0:.0f} s", flush=True)
    if not a.small:
        try:
            print_comparison(comparison(measured, a.preset))
        except ImportError as e:  # the device may lack the planner's own dependencies
            print(f"predictions skipped ({e}): run --predict on the --json file")
    return 0


if __name__ == "__main__":
    sys.exit(main())
