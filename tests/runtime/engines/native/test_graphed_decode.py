"""The static-buffer decode (``runtime.engines.native.graphed_decode``) as it runs on CPU (no graph
capture; on a CUDA machine the same tests replay captured graphs): the same tokens and log-probs as the
per-step loop (``fixed_decode``) for batches smaller than their bucket, EOS stops, per-row limits and
sampling; the packed prefill fills the caches the loop's padded prefill does; the engine's option picks
the path. In this process, on a world of one (no processes started)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nereus.runtime.comm.groups import ParallelGroups
from nereus.runtime.engines.native.engine import NativeEngine
from nereus.runtime.engines.native.fixed_decode import FixedDecode
from nereus.runtime.engines.native.graphed_decode import (
    StaticDecode,
    batch_bucket,
    decode_path,
    length_bucket,
    static_generate,
)
from nereus.runtime.engines.protocol import EngineConfig
from nereus.runtime.engines.sampling import SamplingParams
from nereus.runtime.model.decoder import KVCache, build_model
from nereus.runtime.model.hf import slice_boxes
from nereus.runtime.parallel.sharded import ShardedModel, shard_boxes, tied_head
from nereus.spec.layout import Layout
from nereus.spec.levers import Speculation
from nereus.spec.rollout import RolloutEngine
from tests.runtime.common import GQA, MOE, QWEN3
from tests.runtime.one_rank import world  # noqa: F401  (the fixture)

LAYOUT = Layout(micro_batch_size=1, recompute="none", sequence_parallel=False)


def sharded(cfg, dtype: torch.dtype) -> ShardedModel:
    groups = ParallelGroups(LAYOUT, tied_embeddings=tied_head(cfg))
    state = build_model(cfg, seed=1).state_dict()
    return ShardedModel(cfg, groups, slice_boxes(state, shard_boxes(cfg, groups)), dtype=dtype)


def prompts(n: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (2 + (i * 5) % 9,), generator=g).tolist() for i in range(n)]


def assert_same(sm: ShardedModel, ps: list[list[int]], sp: SamplingParams, atol: float) -> None:
    want = FixedDecode(sm, ps, sp).run()
    got = static_generate(sm, ps, sp, capture=True)  # a CUDA graph on a GPU; on CPU the same step, eagerly
    assert [toks for toks, _ in got.rows] == want.rows
    for (_, lps), ref in zip(got.rows, want.row_logps, strict=True):
        assert torch.allclose(torch.tensor(lps), torch.tensor(ref), atol=atol, rtol=0)
    assert got.stats.iterations == want.iterations


@pytest.mark.parametrize("cfg", [GQA, QWEN3, MOE], ids=["gqa", "qwen3", "moe"])
@pytest.mark.usefixtures("world")
def test_greedy_equals_the_loop(cfg) -> None:
    sm = sharded(cfg, torch.float32)
    for n in (1, 3, 5):  # buckets 1, 4, 8: padding rows decode beside the real ones
        assert_same(sm, prompts(n, cfg.arch.vocab), SamplingParams(max_new_tokens=7), atol=1e-5)


@pytest.mark.usefixtures("world")
def test_eos_limits_and_sampling_equal_the_loop() -> None:
    sm = sharded(GQA, torch.float64)  # float64: rounding cannot move a sampled token across a boundary
    ps = prompts(6, GQA.arch.vocab)
    free = FixedDecode(sm, ps, SamplingParams(max_new_tokens=9)).run().rows
    eos = SamplingParams(max_new_tokens=9, eos_token_id=free[0][2])  # row 0 stops at its third token
    assert_same(sm, ps, eos, atol=1e-12)
    assert_same(sm, ps, replace(eos, resumed=(3, 0, 8, 0, 0, 1), resumed_done=frozenset({4})), atol=1e-12)
    assert_same(sm, ps, replace(eos, temperature=0.9, top_p=0.9, top_k=20, seed=4), atol=1e-12)


@pytest.mark.usefixtures("world")
def test_packed_prefill_fills_the_caches() -> None:
    """Each prompt's keys and values land in its cache row from position 0; its last logits equal those
    of the prompt run alone without a cache."""
    sm = sharded(GQA, torch.float64)
    ps = prompts(3, GQA.arch.vocab)
    decode = StaticDecode(sm.model, len(ps), 32, torch.float64, capture=False)
    logits = decode.prefill(ps)
    assert decode.offset.tolist() == [len(p) for p in ps] + [0]  # bucket 4: one padding row
    for j, p in enumerate(ps):
        alone = sm.model(torch.tensor([p], device=decode.device))[0, -1]
        assert torch.allclose(logits[j], alone, atol=1e-10)
        assert decode.caches[0].k[j, :, len(p):].abs().sum() == 0 and decode.caches[0].k[j, :, : len(p)].abs().sum() > 0


class HostReads(TorchDispatchMode):
    """Counts the ops that bring a tensor's value to the host (``.item()``, ``int(t)``, a boolean mask's
    ``nonzero``): on a GPU each is a sync, and none may happen inside a CUDA graph being captured."""

    READS = ("aten._local_scalar_dense", "aten.nonzero", "aten.item")

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).startswith(self.READS):
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


def test_the_step_reads_nothing_on_the_host() -> None:
    """What makes the step capturable, checked on CPU: no op of it reads a tensor's value on the host,
    where the per-row path of ``KVCache.update`` does (the check fires)."""
    model = build_model(QWEN3, seed=1)
    decode = StaticDecode(model, 3, 64, torch.float32, capture=False)
    decode.prefill(prompts(3, QWEN3.arch.vocab))
    new = torch.tensor([1, 2, 3])
    with HostReads() as mode:
        decode.step(new)
        decode.step(new)
    assert mode.reads == []
    cache = KVCache(2, 2, 8, 4, torch.float32, torch.device("cpu"))
    with HostReads() as mode:
        cache.update(torch.ones(2, 2, 1, 4), torch.ones(2, 2, 1, 4), torch.tensor([3, 5]))
    assert mode.reads


def test_buckets() -> None:
    assert [batch_bucket(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]
    assert [length_bucket(n) for n in (1, 64, 65)] == [64, 64, 128]
    with pytest.raises(ValueError, match="at least one row"):
        batch_bucket(0)


@pytest.mark.usefixtures("world")
def test_engine_option_picks_the_path() -> None:
    sm = sharded(GQA, torch.float32)
    plain = SamplingParams(max_new_tokens=5)
    cuda = sm.groups.device.type == "cuda"  # this file runs on a GPU machine too (docs/generation.md)
    assert decode_path("auto", sm, plain) == ("graphed" if cuda else "loop")  # CPU: the per-step loop
    assert decode_path("graphed", sm, plain) == ("graphed" if cuda else "static")  # CPU: the buffers, eager
    assert decode_path("static", sm, plain) == "static" and decode_path("loop", sm, plain) == "loop"
    spec = Speculation("ngram", 2, 8, prompt_lookup_max=3)
    for other in (replace(plain, slots=2), replace(plain, speculation=spec), replace(plain, keep_groups=1)):
        assert decode_path("static", sm, other) == "loop"  # what the static path does not run
    settings = RolloutEngine(native_decode="static")  # run.rollout.native_decode reaches the engine
    assert NativeEngine.open(sm, EngineConfig(GQA, 64, settings=settings), None)[0].decode == "static"
    ps = prompts(4, GQA.arch.vocab)
    static = NativeEngine("static").generate(sm, ps, plain, None)
    loop = NativeEngine("loop").generate(sm, ps, plain, None)
    assert [r[0] for r in static.rows] == [r[0] for r in loop.rows]
