"""The log-probs recorded while generating (KV cache, left-padded prompts, sampling, EOS) equal those the
inference pass and the training pass compute for the same tokens packed as the RL step packs them, under
every layout with TP·PP·DP ≤ 4. A mismatch — a pad or stop token handled differently — silently breaks
PPO's ratio."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from nereus.run.rollout import pack
from nereus.runtime.cluster.launch import run_world
from nereus.runtime.comm.groups import ParallelGroups
from nereus.runtime.engines.native.fixed_batch import SamplingParams, generate_with_logprobs
from nereus.runtime.model.decoder import build_model
from nereus.runtime.model.hf import slice_boxes
from nereus.runtime.parallel.batch import TrainBatch
from nereus.runtime.parallel.sharded import ShardedModel, shard_boxes, tied_head
from tests.runtime.common import MQA, all_layouts

EOS = 7  # MQA's eos_token_id


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(8, MQA.arch.vocab, (2 + (i * 3) % 6,), generator=g).tolist() for i in range(12)]


def _check(layout, state: dict) -> None:
    groups = ParallelGroups(layout, tied_embeddings=tied_head(MQA))
    params = SamplingParams(max_new_tokens=6, temperature=1.0, eos_token_id=EOS, seed=4)
    sm, out = None, None
    if groups.member:
        sm = ShardedModel(MQA, groups, slice_boxes(state, shard_boxes(MQA, groups)))
        out = generate_with_logprobs(sm, _prompts(), params)
        out = out.rows if out is not None else None
    # every rank of a replica needs its responses to build the batch: share them from the output ranks
    shared: list = [None] * dist.get_world_size()
    dist.all_gather_object(shared, (groups.coords.dp_rank, out) if sm is not None and sm.is_output_rank else None)
    if sm is not None:
        out = next(o for s in shared if s is not None and s[0] == groups.coords.dp_rank for o in [s[1]])
        prompts = _prompts()
        rows = sm.replica_rows(len(prompts))
        roll = pack(prompts[rows], [r for r, _ in out], [lp for _, lp in out], EOS)
        assert roll.mask.sum() > len(out)  # several tokens per response
        full = torch.zeros(len(prompts), roll.tokens.shape[1], dtype=torch.long)
        full[rows] = roll.tokens  # the engine takes its replica's rows of the whole batch
        inference = sm.logprobs(full)
        seen: list[torch.Tensor] = []

        def loss(y, mb):
            seen.append(y.detach().clone())
            return y.sum() * 0.0

        sm.backward(TrainBatch(full), loss)
        if sm.is_output_rank:
            msg = layout.short()
            torch.testing.assert_close(roll.response_frame(inference), roll.gen_logp, atol=2e-5, rtol=0, msg=msg)
            training = torch.cat(seen)
            torch.testing.assert_close(roll.response_frame(training), roll.gen_logp, atol=2e-5, rtol=0, msg=msg)
    dist.barrier()
    groups.destroy()


def test_pack_has_stopped_and_cut_off_responses():
    roll = pack([[9, 9], [9]], [[3, EOS], [4, 5, 6]], [[-0.5, -0.25], [-1.0, -2.0, -3.0]], EOS)
    assert roll.tokens.tolist() == [[9, 9, 3, EOS], [9, 4, 5, 6]]
    # positions of the [B, T-1] log-prob frame that predict each response token (padding clamped in range)
    assert roll.index.tolist() == [[1, 2, 2], [0, 1, 2]]
    assert roll.mask.tolist() == [[1, 1, 0], [1, 1, 1]]
    assert roll.finished.tolist() == [True, False]
    assert roll.last.tolist() == [3, 3]
    assert roll.gen_logp.tolist() == [[-0.5, -0.25, 0.0], [-1.0, -2.0, -3.0]]


def _body(rank: int, world: int) -> None:
    state = build_model(MQA, seed=1).state_dict()
    for layout in all_layouts(world):
        _check(layout, state)


@pytest.mark.distributed
@pytest.mark.rayless  # no Ray: may run beside the Ray tests
def test_generation_logprobs_equal_training_logprobs_under_every_layout():
    run_world(_body, 4, timeout_s=60)
