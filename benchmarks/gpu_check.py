"""One device, one call: the vLLM engine, a training step and the weight sync of a real-sized random model,
measured beside the cost model's predictions (measured / predicted).

    python benchmarks/gpu_check.py                       # CUDA device 0: 0.5B and 7B shapes, H200 preset
    python benchmarks/gpu_check.py --preset H100 --shapes 0.5b
    python benchmarks/gpu_check.py --device cpu --small  # a tiny shape on CPU (the test suite runs it)
    python benchmarks/gpu_check.py --smoke --json        # the tiny shape, fewest calls, JSON on the last line

Per shape (random weights, no checkpoint on disk): a training step (forward, backward, Adam) of the
plain decoder; decode time per token and prefill by batch with the runtime's native engine and, where
vLLM is installed, with the vLLM engine (``runtime.engines.vllm.server``, in a child process: vLLM takes
over torch.distributed of its process); and the weight sync into the engine (vLLM's in-place reload).
Predictions: ``cost.stages.training_cost``, ``cost.decode.step_time`` / ``prefill_time`` of the
planner's generation replica, ``cost.weight_sync.engine_reload_time``; on CPU the hardware is this
repository's measured ``examples/cpu-local.yaml`` profile. Without vLLM the torch-only parts run and the
output says what was skipped. Nothing is asserted about speed.

Also per shape: the native engine's static-buffer decode (``runtime.engines.native.graphed_decode``): one
decode step replayed as a CUDA graph and the same step eager, per token end to end (packed prefill,
sampling, stop checks), beside the loop's and the prediction; and a training forward and backward over a
long-tail batch padded and packed (``runtime.parallel.packing``): tokens per second and peak memory.
``--json`` without a path prints every figure as the last line of the output; ``--smoke`` is the tiny shape
on CPU with one repeat and two batches (seconds; the test suite reads its JSON).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nereus.cost.decode import Replica, prefill_time, step_time  # noqa: E402
from nereus.cost.hardware import Hardware  # noqa: E402
from nereus.cost.stages import generation_replica, training_cost  # noqa: E402
from nereus.cost.weight_sync import engine_reload_time  # noqa: E402
from nereus.runtime.model.decoder import ModelConfig, build_model  # noqa: E402
from nereus.spec.job import JobSpec, job_from_dict  # noqa: E402
from nereus.spec.layout import Layout, ModelStage  # noqa: E402
from nereus.spec.model import ModelArch  # noqa: E402

if TYPE_CHECKING:
    from nereus.runtime.parallel.sharded import ShardedModel

# Qwen2.5-0.5B and Qwen2.5-7B shapes (their config.json), and a tiny one vLLM's CPU attention accepts
SHAPES = {
    "0.5b": dict(layers=24, hidden=896, ffn_hidden=4864, heads=14, kv_heads=2, vocab=151936, tied_embeddings=True,
                 qkv_bias=True),
    "7b": dict(layers=28, hidden=3584, ffn_hidden=18944, heads=28, kv_heads=4, vocab=152064, qkv_bias=True),
    "small": dict(layers=2, hidden=64, ffn_hidden=128, heads=2, kv_heads=2, vocab=128),
}


@dataclass(frozen=True)
class Sizes:
    prompt: int
    new_tokens: int
    batches: tuple[int, ...]
    train_rows: int
    repeats: int


GPU_SIZES = Sizes(prompt=256, new_tokens=32, batches=(1, 4, 16, 64), train_rows=8, repeats=3)
CPU_SIZES = Sizes(prompt=16, new_tokens=32, batches=(1, 4, 16), train_rows=4, repeats=3)
SMOKE_SIZES = Sizes(prompt=8, new_tokens=4, batches=(1, 3), train_rows=4, repeats=1)
# the packed-vs-padded batch: rows of a long-tail length mix, the longest this wide (the 7B padded pass at
# 1,024 would not fit an H100's 80 GB beside its gradients)
PACK_WIDTH = {"0.5b": 1024, "7b": 512, "small": 64}


def fresh_prompts(b: int, sizes: Sizes, vocab: int) -> list[list[int]]:
    """New random prompts for every timed call, so that no engine serves them from its prefix cache."""
    return torch.randint(3, vocab, (b, sizes.prompt)).tolist()


def job_for(arch: dict, sizes: Sizes, preset: str | None) -> JobSpec:
    """A GRPO job of one device whose training step is ``train_rows`` sequences of prompt + response."""
    cluster = ({"gpu": preset, "nodes": 1, "gpus_per_node": 1} if preset else
               {"profile": str(ROOT / "examples" / "cpu-local.yaml"), "nodes": 1, "gpus_per_node": 1})
    return job_from_dict({
        "models": {"actor": arch, "reference": arch},
        "algorithm": {"name": "grpo", "samples_per_prompt": 2, "mini_batches": 1},
        "workload": {"prompts_per_step": sizes.train_rows // 2, "prompt_length": sizes.prompt,
                     "response_length": {"mean": sizes.new_tokens, "max": sizes.new_tokens}},
        "cluster": cluster, "options": {"weight_bytes": 2 if preset else 4, "recompute": "none",
                                        "sequence_parallel": False}})


def timed(fn, repeats: int) -> float:
    """Median seconds of ``repeats`` calls after one warm-up (CUDA synchronised)."""
    fn()
    out = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def training_step_s(model: torch.nn.Module, sizes: Sizes, device: str) -> float:
    opt = torch.optim.Adam(model.parameters(), lr=1e-6)
    vocab = model.cfg.arch.vocab
    tokens = torch.randint(0, vocab, (sizes.train_rows, sizes.prompt + sizes.new_tokens), device=device)

    def step() -> None:
        logits = model(tokens)[:, :-1].float()
        loss = -torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None]).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return timed(step, sizes.repeats)


def native_model(cfg: ModelConfig, device: str, dtype: torch.dtype,
                 state: dict[str, torch.Tensor]) -> ShardedModel:
    """The runtime's shard of ``state`` on a world of one (the native engine's model)."""
    import torch.distributed as dist

    from nereus.runtime.comm.groups import ParallelGroups
    from nereus.runtime.model.hf import slice_boxes
    from nereus.runtime.parallel.sharded import ShardedModel, shard_boxes

    if device == "cuda":
        torch.cuda.set_device(0)
    if not dist.is_initialized():
        store = Path(tempfile.mkdtemp()) / "store"
        dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"file://{store}", rank=0,
                                world_size=1)
    groups = ParallelGroups(Layout(recompute="none", sequence_parallel=False), [0])
    return ShardedModel(cfg, groups, slice_boxes(state, shard_boxes(cfg, groups)), dtype=dtype)  # copied to the device


def native_decode(sm: ShardedModel, sizes: Sizes) -> dict[int, dict[str, float]]:
    """Per batch: prefill seconds (one new token) and decode seconds per token of the native engine's
    per-step loop."""
    from nereus.runtime.engines.native.fixed_batch import SamplingParams, generate

    out = {}
    v = sm.cfg.arch.vocab
    for b in sizes.batches:
        one = timed(lambda b=b: generate(sm, fresh_prompts(b, sizes, v), SamplingParams(max_new_tokens=1)),
                    sizes.repeats)
        full = timed(lambda b=b: generate(sm, fresh_prompts(b, sizes, v),
                                          SamplingParams(max_new_tokens=sizes.new_tokens)), sizes.repeats)
        out[b] = {"prefill_s": one, "decode_per_token_s": (full - one) / (sizes.new_tokens - 1)}
    return out


def static_decode(sm: ShardedModel, sizes: Sizes) -> dict[int, dict[str, float | None]]:
    """Per batch, the static-buffer decode (``graphed_decode``): one step eager and (on CUDA) replayed as a
    graph, over a prefilled batch; and end to end (packed prefill, then per token: the step, sampling,
    stop checks), graphed on CUDA. Capture happens before the timed calls' prefill, in both."""
    from nereus.runtime.engines.native.graphed_decode import StaticDecode, length_bucket, static_generate
    from nereus.runtime.engines.sampling import SamplingParams

    cuda, v, out = sm.groups.device.type == "cuda", sm.cfg.arch.vocab, {}
    length = length_bucket(sizes.prompt + sizes.new_tokens)
    for b in sizes.batches:
        f: dict[str, float | None] = {"graphed_step_s": None}
        for key, capture in (("eager_step_s", False), ("graphed_step_s", True))[: 2 if cuda else 1]:
            decode = StaticDecode(sm.model, b, length, sm.dtype, capture)
            decode.prefill(fresh_prompts(b, sizes, v))
            tokens = torch.randint(3, v, (b,), device=decode.device)
            f[key] = timed(lambda d=decode, t=tokens: d.step(t), 10 * sizes.repeats)
            del decode

        def run(n: int, b: int = b) -> None:
            static_generate(sm, fresh_prompts(b, sizes, v), SamplingParams(max_new_tokens=n), capture=cuda)

        one, full = timed(lambda: run(1), sizes.repeats), timed(lambda: run(sizes.new_tokens), sizes.repeats)
        out[b] = {**f, "prefill_s": one, "decode_per_token_s": (full - one) / (sizes.new_tokens - 1)}
    return out


def tail_lengths(rows: int, width: int) -> list[int]:
    """A long-tail mix: one row ``width`` long, the others ``width`` / 2, / 3, ... (most of a padded batch
    is padding, as with GRPO's response-length tail)."""
    return [width] + [max(2, width // (2 + j)) for j in range(rows - 1)]


def peak_bytes(fn, device: str) -> int | None:
    """Peak device bytes ``fn`` allocates beyond what was allocated before (None on CPU: not measured)."""
    if device != "cuda":
        fn()
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def packed_vs_padded(model: torch.nn.Module, rows: int, width: int, device: str, repeats: int) -> dict:
    """A training forward and backward (next-token loss on real tokens) over the same long-tail rows,
    padded to the longest and packed end to end (``parallel.packing.PackedRows``): seconds, real tokens
    per second and peak memory of each."""
    from nereus.runtime.parallel.packing import PackedRows

    lengths = tail_lengths(rows, width)
    tokens = torch.randint(0, model.cfg.arch.vocab, (rows, width), device=device)
    real = torch.arange(width, device=device)[None, 1:] < torch.tensor(lengths, device=device)[:, None]
    pack = PackedRows(torch.arange(rows), tuple(lengths))
    flat = pack.pack(tokens)
    ends = torch.cumsum(torch.tensor(lengths, device=device), 0) - 1
    keep = torch.ones(flat.shape[1], dtype=torch.bool, device=device).index_fill(0, ends, False)

    def padded() -> None:  # right padding under the causal mask: the real tokens' outputs are unchanged
        lp = torch.log_softmax(model(tokens)[:, :-1].float(), -1).gather(-1, tokens[:, 1:, None])[..., 0]
        (-(lp * real).sum() / real.sum()).backward()
        model.zero_grad(set_to_none=True)

    def packed() -> None:
        logits = model(flat, seq_lens=pack.lengths)[0].float()
        lp = torch.log_softmax(logits, -1).gather(-1, pack.next_tokens(flat)[0, :, None])[..., 0]
        (-lp[keep].mean()).backward()
        model.zero_grad(set_to_none=True)

    out = {"rows": rows, "width": width, "real_tokens": sum(lengths),
           "padding_fraction": 1 - sum(lengths) / (rows * width)}
    for name, fn in (("padded", padded), ("packed", packed)):
        try:
            mem = peak_bytes(fn, device)
            secs = timed(fn, repeats)
        except torch.cuda.OutOfMemoryError:
            out[name] = {"error": "out of memory"}
            model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            continue
        out[name] = {"step_s": secs, "tokens_per_s": sum(lengths) / secs, "peak_mem_bytes": mem}
    both = "step_s" in out["padded"] and "step_s" in out["packed"]
    out["speedup"] = out["padded"]["step_s"] / out["packed"]["step_s"] if both else None
    mems = (out["padded"].get("peak_mem_bytes"), out["packed"].get("peak_mem_bytes"))
    out["peak_mem_ratio"] = mems[1] / mems[0] if all(mems) else None
    return out


def vllm_part(shape: str, small: bool) -> dict:
    """In the child process: the vLLM engine's reload and decode figures (JSON on stdout)."""
    from nereus.runtime.engines.protocol import EngineConfig
    from nereus.runtime.engines.sampling import SamplingParams
    from nereus.runtime.engines.vllm.server import LocalVllm
    from nereus.spec.rollout import RolloutEngine

    sizes = CPU_SIZES if small else GPU_SIZES
    cfg = ModelConfig(ModelArch(**SHAPES[shape]))
    dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    engine = LocalVllm(EngineConfig(cfg, sizes.prompt + sizes.new_tokens + 8, max_num_seqs=max(sizes.batches),
                                     dtype=dtype, settings=RolloutEngine(engine="vllm", gpu_memory_utilization=0.5,
                                                                  cpu_kv_cache_gib=0.25)))
    state = build_model(cfg, seed=1, dtype=getattr(torch, dtype)).state_dict()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    state = {k: v.to(device) for k, v in state.items()}
    reload = timed(lambda: engine.load_weights(state), sizes.repeats)
    out = {"reload_s": reload, "batches": {}}
    v = cfg.arch.vocab
    for b in sizes.batches:
        one = timed(lambda b=b: engine.generate(fresh_prompts(b, sizes, v), 0, SamplingParams(max_new_tokens=1)),
                    sizes.repeats)
        full = timed(lambda b=b: engine.generate(fresh_prompts(b, sizes, v), 0,
                                                 SamplingParams(max_new_tokens=sizes.new_tokens)), sizes.repeats)
        out["batches"][b] = {"prefill_s": one, "decode_per_token_s": (full - one) / (sizes.new_tokens - 1)}
    return out


def run_vllm_child(shape: str, small: bool) -> dict | None:
    """``vllm_part`` in a child process; None (and why) when vLLM is not installed or failed."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        print("  vLLM is not installed: its decode, prefill and reload are skipped (torch-only parts ran)")
        return None
    env_cmd = [sys.executable, __file__, "--part", "vllm", "--shapes", shape] + (["--small"] if small else [])
    env = {**__import__("os").environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_NO_USAGE_STATS": "1"}
    proc = subprocess.run(env_cmd, capture_output=True, text=True, env=env, timeout=1800)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        print(f"  the vLLM part failed (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}")
        return None
    return json.loads(lines[-1])


def row(name: str, measured: float, predicted: float) -> dict:
    ratio = measured / predicted if predicted > 0 else float("nan")
    print(f"  {name:<42} {measured * 1e3:>11.3f} ms {predicted * 1e3:>11.3f} ms {ratio:>8.2f}")
    return {"name": name, "measured_s": measured, "predicted_s": predicted, "ratio": ratio}


def check_shape(shape: str, device: str, preset: str | None, sizes: Sizes, vllm_small: bool | None) -> dict:
    """Every figure of one shape; ``vllm_small``: the vLLM child's size (None: no vLLM part)."""
    arch = SHAPES[shape]
    cfg, job = ModelConfig(ModelArch(**arch)), job_for(arch, sizes, preset)
    hw = Hardware(job.cluster)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    layout = Layout(micro_batch_size=sizes.train_rows, recompute="none", sequence_parallel=False)
    replica = generation_replica(hw, job.models["actor"], 1, job.options.weight_bytes)
    print(f"\n{shape}: {job.models['actor'].params() / 1e9:.2f} B parameters on {device} "
          f"(predictions: {preset or 'examples/cpu-local.yaml'})")
    print(f"  {'':<42} {'measured':>14} {'predicted':>14} {'ratio':>8}")
    model = build_model(cfg, seed=0, dtype=dtype).to(device)
    rows = [row(f"training step ({sizes.train_rows} x {sizes.prompt + sizes.new_tokens} tokens)",
                training_step_s(model, sizes, device),
                training_cost(hw, job, ModelStage("actor", "training"), layout).time())]
    packing = packed_vs_padded(model, sizes.train_rows, PACK_WIDTH[shape], device, sizes.repeats)
    sm = native_model(cfg, device, dtype, model.state_dict())
    del model
    if device == "cuda":
        torch.cuda.empty_cache()  # vLLM's child process reserves a share of the device's free memory
    vllm = run_vllm_child(shape, vllm_small) if vllm_small is not None else None
    native, static = native_decode(sm, sizes), static_decode(sm, sizes)
    path = "graphed" if device == "cuda" else "static"
    for engine, figures in (("native", native), (f"native {path}", static), ("vllm", (vllm or {}).get("batches"))):
        rows += decode_rows(engine, figures or {}, replica, sizes)
    if vllm is not None:
        rows.append(row("weight sync (engine reload)", vllm["reload_s"], engine_reload_time(hw, job, Layout())))
    print_packing(packing)
    return {"shape": shape, "device": device, "preset": preset, "rows": rows, "sizes": asdict(sizes),
            "decode": decode_summary(native, static, replica, sizes), "packing": packing}


def decode_rows(engine: str, figures: dict, replica: Replica, sizes: Sizes) -> list[dict]:
    context = sizes.prompt + sizes.new_tokens / 2
    out = []
    for b, f in figures.items():
        predicted = step_time(replica, int(b), context).total
        out.append(row(f"{engine} prefill, batch {b}", f["prefill_s"],
                       prefill_time(replica, int(b) * sizes.prompt, sizes.prompt)))
        out.append(row(f"{engine} decode per token, batch {b}", f["decode_per_token_s"], predicted))
        for key, name in (("eager_step_s", "eager step"), ("graphed_step_s", "graph replay")):
            if f.get(key) is not None:
                out.append(row(f"{engine} {name}, batch {b}", f[key], predicted))
    return out


def decode_summary(native: dict, static: dict, replica: Replica, sizes: Sizes) -> dict[str, dict]:
    """Per batch, milliseconds per decoded token: the loop's, the static decode's end to end, its step
    eager and replayed as a graph, and the prediction (``cost.decode.step_time``)."""
    ms = lambda s: None if s is None else s * 1e3  # noqa: E731
    out = {}
    for b in sizes.batches:
        predicted = step_time(replica, b, sizes.prompt + sizes.new_tokens / 2).total
        graphed = static[b]["graphed_step_s"]
        out[str(b)] = {"loop_ms_per_token": ms(native[b]["decode_per_token_s"]),
                       "static_ms_per_token": ms(static[b]["decode_per_token_s"]),
                       "eager_step_ms": ms(static[b]["eager_step_s"]), "graphed_step_ms": ms(graphed),
                       "predicted_ms_per_token": ms(predicted),
                       "graphed_over_predicted": None if graphed is None else graphed / predicted,
                       "loop_over_predicted": native[b]["decode_per_token_s"] / predicted}
    return out


def print_packing(p: dict) -> None:
    print(f"  training forward+backward, {p['rows']} long-tail rows of at most {p['width']} tokens "
          f"({p['padding_fraction']:.0%} of the padded batch is padding):")
    for name in ("padded", "packed"):
        f = p[name]
        mem = f.get("peak_mem_bytes")
        print(f"    {name:<7} " + (f["error"] if "error" in f else
                                   f"{f['step_s'] * 1e3:>10.2f} ms {f['tokens_per_s']:>12,.0f} tokens/s"
                                   + (f" peak {mem / 2**30:.2f} GiB" if mem is not None else "")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--small", action="store_true", help="the tiny shape (with --device cpu: the test suite's)")
    ap.add_argument("--smoke", action="store_true", help="the tiny shape on CPU, fewest calls, no vLLM part")
    ap.add_argument("--shapes", default=None, help="comma-separated of " + ", ".join(SHAPES))
    ap.add_argument("--preset", default="H200", help="GPU preset of the predictions (H200, H100, ...)")
    ap.add_argument("--json", nargs="?", const="-", default=None,
                    help="write the figures to this file; with or without one, print them as the last line")
    ap.add_argument("--part", choices=("vllm",), default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.smoke:
        args.device, args.small = "cpu", True
    shapes = args.shapes.split(",") if args.shapes else (["small"] if args.small else ["0.5b", "7b"])
    if args.part == "vllm":
        print(json.dumps(vllm_part(shapes[0], args.small)))
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device; run with --device cpu --small")
    torch.set_num_threads(1 if args.device == "cpu" else torch.get_num_threads())
    preset = args.preset if args.device == "cuda" else None
    sizes = SMOKE_SIZES if args.smoke else CPU_SIZES if args.small else GPU_SIZES
    results = [check_shape(s, args.device, preset, sizes, None if args.smoke else args.small) for s in shapes]
    if args.json:
        if args.json != "-":
            Path(args.json).write_text(json.dumps(results, indent=1))
        print(json.dumps(results))


if __name__ == "__main__":
    main()
