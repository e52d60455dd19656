"""Router replay in the RL loop's passes: the experts the native engine routed every position to while generating,
replayed in the inference and training forwards of the same rows (padded and packed micro-batches), give the
generation's log-probs; with the router's weights moved (numerics drift between engine and trainer) replay keeps
the generation's experts where the trainer's own routing switches them."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from nereus.run.rollout import Rollout, pack
from nereus.runtime.comm.groups import ParallelGroups
from nereus.runtime.engines.native.fixed_batch import generate_with_logprobs
from nereus.runtime.engines.sampling import SamplingParams
from nereus.runtime.model.decoder import build_model
from nereus.runtime.model.hf import slice_boxes
from nereus.runtime.model.moe import RoutingRecord
from nereus.runtime.model.routes import replay_record, sparse_layer_ids
from nereus.runtime.parallel.batch import TrainBatch
from nereus.runtime.parallel.sharded import ShardedModel, shard_boxes, tied_head
from nereus.spec.layout import Layout
from tests.runtime.common import MOE
from tests.runtime.one_rank import world  # noqa: F401  (the fixture)

PADDED = Layout(micro_batch_size=2, recompute="none", sequence_parallel=False)
PACKED = replace(PADDED, max_token_len=40)


def sharded(layout: Layout, state: dict) -> ShardedModel:
    groups = ParallelGroups(layout, tied_embeddings=tied_head(MOE))
    return ShardedModel(MOE, groups, slice_boxes(state, shard_boxes(MOE, groups)))


def rollout(sm: ShardedModel, record: bool = True) -> Rollout:
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(6, MOE.arch.vocab, (2 + (i * 3) % 7,), generator=g).tolist() for i in range(6)]
    params = SamplingParams(max_new_tokens=7, temperature=1.0, eos_token_id=MOE.eos_token_id, seed=2,
                            record_routes=record)
    out = generate_with_logprobs(sm, prompts, params)
    return pack(prompts, [r for r, _ in out.rows], [lp for _, lp in out.rows], MOE.eos_token_id, routes=out.routes)


def trained_logp(sm: ShardedModel, batch: TrainBatch) -> torch.Tensor:
    """The training forward's log-probs [B, T−1] (what the loss reads)."""
    seen: list[torch.Tensor] = []

    def loss(y, mb):
        seen.append(y.detach().clone())
        return y.sum() * 0.0

    sm.backward(batch, loss)
    if not sm.token_budget:
        return torch.cat(seen)
    rows = torch.cat([p.rows for _, p in sm.packed_micro_batches(batch)])  # micro-batches in the order they ran
    out = torch.zeros_like(torch.cat(seen))
    out[rows] = torch.cat(seen)
    return out


@pytest.mark.usefixtures("world")
def test_generation_records_every_fed_position() -> None:
    sm = sharded(PADDED, build_model(MOE, seed=1).state_dict())
    roll = rollout(sm)
    layers = sparse_layer_ids(MOE.arch)
    assert layers == [0, 2] and roll.routes.shape == (*roll.tokens.shape, 2, MOE.arch.moe.top_k)
    assert roll.routes.dtype == torch.int16
    # the record is the experts the model's own routing picks for the packed sequences (up to rounding ties)
    own = RoutingRecord()
    sm.model(roll.tokens, routing=own)
    fed = torch.arange(roll.tokens.shape[1])[None] < (roll.lengths - 1)[:, None]  # all but each row's last token
    for j, layer in enumerate(layers):
        want = own.indices[layer].reshape(*roll.tokens.shape, -1)[fed].sort(-1).values
        got = roll.routes[:, :, j][fed].long().sort(-1).values
        assert (got == want).float().mean() > 0.99
    assert rollout(sm, record=False).routes is None


@pytest.mark.parametrize("layout", [PADDED, PACKED], ids=["padded", "packed"])
@pytest.mark.usefixtures("world")
def test_replay_gives_the_generation_logprobs(layout) -> None:
    sm = sharded(layout, build_model(MOE, seed=1).state_dict())
    roll = rollout(sm)
    lengths = roll.lengths if layout.max_token_len else None
    inference = sm.logprobs(roll.tokens, lengths, roll.routes)
    torch.testing.assert_close(roll.response_frame(inference), roll.gen_logp, atol=2e-5, rtol=0)
    training = trained_logp(sm, TrainBatch(roll.tokens, lengths=lengths, routes=roll.routes))
    torch.testing.assert_close(roll.response_frame(training), roll.gen_logp, atol=2e-5, rtol=0)


@pytest.mark.usefixtures("world")
def test_replay_keeps_the_experts_when_the_router_drifts() -> None:
    state = build_model(MOE, seed=1).state_dict()
    roll = rollout(sharded(PADDED, state))
    # the trainer's router a little off the engine's (another kernel, another precision)
    g = torch.Generator().manual_seed(9)
    drifted = {k: v + 0.05 * torch.randn(v.shape, generator=g) if k.endswith("mlp.gate.weight") else v
               for k, v in state.items()}
    sm = sharded(PADDED, drifted)
    layers = sparse_layer_ids(MOE.arch)
    fed = torch.arange(roll.tokens.shape[1])[None] < (roll.lengths - 1)[:, None]
    own, replayed = RoutingRecord(), replay_record(roll.routes, layers)
    sm.model(roll.tokens, routing=own)
    sm.model(roll.tokens, routing=replayed)
    for j, layer in enumerate(layers):
        gen = roll.routes[:, :, j].long()
        assert torch.equal(replayed.indices[layer].reshape(gen.shape)[fed], gen[fed])
    switched = sum(int((own.indices[layer].reshape(*roll.tokens.shape, -1).sort(-1).values
                        != roll.routes[:, :, j].long().sort(-1).values).any(-1)[fed].sum())
                   for j, layer in enumerate(layers))
    assert switched > 0  # the drifted router routes some positions elsewhere
    gap = lambda logp: (roll.response_frame(logp).exp() - roll.gen_logp.exp()).abs()[roll.mask.bool()]  # noqa: E731
    with_replay, without = gap(sm.logprobs(roll.tokens, None, roll.routes)), gap(sm.logprobs(roll.tokens))
    assert with_replay.mean() < without.mean()
