"""One device, one call: the vLLM engine, a training step and the weight sync of a real-sized random model,
measured beside the cost model's predictions (measured / predicted).

    python benchmarks/gpu_check.py                       # CUDA device 0: 0.5B and 7B shapes, H200 preset
    python benchmarks/gpu_check.py --preset H100 --shapes 0.5b
    python benchmarks/gpu_check.py --device cpu --small  # a tiny shape on CPU (the test suite runs it)

Per shape (random weights, no checkpoint on disk): a training step (forward, backward, Adam) of the
plain decoder; decode time per token and prefill by batch with the runtime's native engine and, where
vLLM is installed, with the vLLM engine (``runtime.engines.vllm.server``, in a child process: vLLM takes
over torch.distributed of its process); and the weight sync into the engine (vLLM's in-place reload).
Predictions: ``cost.stages.training_cost``, ``cost.decode.step_time`` / ``prefill_time`` of the
planner's generation replica, ``cost.weight_sync.engine_reload_time``; on CPU the hardware is this
repository's measured ``examples/cpu-local.yaml`` profile. Without vLLM the torch-only parts run and the
output says what was skipped. Nothing is asserted about speed.
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

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nereus.cost.decode import prefill_time, step_time  # noqa: E402
from nereus.cost.hardware import Hardware  # noqa: E402
from nereus.cost.stages import generation_replica, training_cost  # noqa: E402
from nereus.cost.weight_sync import engine_reload_time  # noqa: E402
from nereus.runtime.model.decoder import ModelConfig, build_model  # noqa: E402
from nereus.spec.job import JobSpec, job_from_dict  # noqa: E402
from nereus.spec.layout import Layout, ModelStage  # noqa: E402
from nereus.spec.model import ModelArch  # noqa: E402

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


def training_step_s(cfg: ModelConfig, sizes: Sizes, device: str, dtype: torch.dtype) -> float:
    model = build_model(cfg, seed=0, dtype=dtype).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-6)
    tokens = torch.randint(0, cfg.arch.vocab, (sizes.train_rows, sizes.prompt + sizes.new_tokens), device=device)

    def step() -> None:
        logits = model(tokens)[:, :-1].float()
        loss = -torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None]).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return timed(step, sizes.repeats)


def native_decode(cfg: ModelConfig, sizes: Sizes, device: str, dtype: torch.dtype) -> dict[int, dict[str, float]]:
    """Per batch: prefill seconds (one new token) and decode seconds per token of the native engine."""
    import torch.distributed as dist

    from nereus.runtime.comm.groups import ParallelGroups
    from nereus.runtime.engines.native.fixed_batch import SamplingParams, generate
    from nereus.runtime.model.hf import slice_boxes
    from nereus.runtime.parallel.sharded import ShardedModel, shard_boxes

    if device == "cuda":
        torch.cuda.set_device(0)
    if not dist.is_initialized():
        store = Path(tempfile.mkdtemp()) / "store"
        dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"file://{store}", rank=0,
                                world_size=1)
    groups = ParallelGroups(Layout(recompute="none", sequence_parallel=False), [0])
    state = build_model(cfg, seed=0, dtype=dtype).state_dict()
    sm = ShardedModel(cfg, groups, slice_boxes(state, shard_boxes(cfg, groups)), dtype=dtype)  # copied to the device
    out = {}
    v = cfg.arch.vocab
    for b in sizes.batches:
        one = timed(lambda b=b: generate(sm, fresh_prompts(b, sizes, v), SamplingParams(max_new_tokens=1)),
                    sizes.repeats)
        full = timed(lambda b=b: generate(sm, fresh_prompts(b, sizes, v),
                                          SamplingParams(max_new_tokens=sizes.new_tokens)), sizes.repeats)
        out[b] = {"prefill_s": one, "decode_per_token_s": (full - one) / (sizes.new_tokens - 1)}
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
    print(f"  {name:<34} {measured * 1e3:>11.3f} ms {predicted * 1e3:>11.3f} ms {ratio:>8.2f}")
    return {"name": name, "measured_s": measured, "predicted_s": predicted, "ratio": ratio}


def check_shape(shape: str, device: str, preset: str | None, small: bool) -> dict:
    sizes = CPU_SIZES if small else GPU_SIZES
    arch = SHAPES[shape]
    cfg, job = ModelConfig(ModelArch(**arch)), job_for(arch, sizes, preset)
    hw = Hardware(job.cluster)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    layout = Layout(micro_batch_size=sizes.train_rows, recompute="none", sequence_parallel=False)
    replica = generation_replica(hw, job.models["actor"], 1, job.options.weight_bytes)
    context = sizes.prompt + sizes.new_tokens / 2
    print(f"\n{shape}: {job.models['actor'].params() / 1e9:.2f} B parameters on {device} "
          f"(predictions: {preset or 'examples/cpu-local.yaml'})")
    print(f"  {'':<34} {'measured':>14} {'predicted':>14} {'ratio':>8}")
    rows = [row(f"training step ({sizes.train_rows} x {sizes.prompt + sizes.new_tokens} tokens)",
                training_step_s(cfg, sizes, device, dtype),
                training_cost(hw, job, ModelStage("actor", "training"), layout).time())]
    if device == "cuda":
        torch.cuda.empty_cache()  # vLLM's child process reserves a share of the device's free memory
    vllm = run_vllm_child(shape, small)
    for engine, figures in (("native", native_decode(cfg, sizes, device, dtype)),
                            ("vllm", (vllm or {}).get("batches"))):
        for b, f in (figures or {}).items():
            rows.append(row(f"{engine} prefill, batch {b}", f["prefill_s"],
                            prefill_time(replica, int(b) * sizes.prompt, sizes.prompt)))
            rows.append(row(f"{engine} decode per token, batch {b}", f["decode_per_token_s"],
                            step_time(replica, int(b), context).total))
    if vllm is not None:
        rows.append(row("weight sync (engine reload)", vllm["reload_s"], engine_reload_time(hw, job, Layout())))
    return {"shape": shape, "device": device, "preset": preset, "rows": rows, "sizes": asdict(sizes)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--small", action="store_true", help="the tiny shape (with --device cpu: the test suite's)")
    ap.add_argument("--shapes", default=None, help="comma-separated of " + ", ".join(SHAPES))
    ap.add_argument("--preset", default="H200", help="GPU preset of the predictions (H200, H100, ...)")
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument("--part", choices=("vllm",), default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    shapes = args.shapes.split(",") if args.shapes else (["small"] if args.small else ["0.5b", "7b"])
    if args.part == "vllm":
        print(json.dumps(vllm_part(shapes[0], args.small)))
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device; run with --device cpu --small")
    torch.set_num_threads(1 if args.device == "cpu" else torch.get_num_threads())
    preset = args.preset if args.device == "cuda" else None
    results = [check_shape(s, args.device, preset, args.small) for s in shapes]
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
