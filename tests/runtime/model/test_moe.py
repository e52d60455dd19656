"""The MoE block: routing, router record/replay, the load-balancing loss, and experts held by name."""

import pytest
import torch

from nereus.runtime.model.decoder import build_model, logprobs_from_logits
from nereus.runtime.model.moe import MoEBlock, RoutingRecord, route
from tests.runtime.common import MOE


def _tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, MOE.arch.vocab, (2, 11), generator=torch.Generator().manual_seed(seed))


def test_sparse_layers_hold_experts_by_global_index():
    model = build_model(MOE, seed=0)
    names = set(model.state_dict())
    assert "model.layers.0.mlp.gate.weight" in names and "model.layers.2.mlp.experts.3.down_proj.weight" in names
    assert "model.layers.0.mlp.shared_expert_gate.weight" in names
    assert "model.layers.1.mlp.gate_proj.weight" in names and "model.layers.1.mlp.gate.weight" not in names
    assert isinstance(model.model.layers["0"].mlp, MoEBlock)
    assert list(model.model.layers["0"].mlp.experts) == ["0", "1", "2", "3"]


def test_route_renormalises_and_replays_at_given_indices():
    logits = torch.randn(5, 4)
    w, i = route(logits, 2, True)
    torch.testing.assert_close(w.sum(-1), torch.ones(5))
    probs = torch.softmax(logits, -1)
    torch.testing.assert_close(w, probs.gather(-1, i) / probs.gather(-1, i).sum(-1, keepdim=True))
    other = (i + 1) % 4
    w2, i2 = route(logits, 2, False, replay=other)
    assert torch.equal(i2, other)
    torch.testing.assert_close(w2, probs.gather(-1, other))


def test_record_then_replay_gives_the_same_logprobs_and_other_indices_change_them():
    model = build_model(MOE, seed=1).eval()
    tokens = _tokens()
    record = RoutingRecord()
    with torch.no_grad():
        free = logprobs_from_logits(model(tokens, routing=record)[:, :-1], tokens[:, 1:])
        replayed = logprobs_from_logits(model(tokens, routing=RoutingRecord(record.indices))[:, :-1], tokens[:, 1:])
        shifted = {k: (v + 1) % 4 for k, v in record.indices.items()}
        other = logprobs_from_logits(model(tokens, routing=RoutingRecord(shifted))[:, :-1], tokens[:, 1:])
    assert sorted(record.indices) == [0, 2] and record.indices[0].shape == (22, 2)
    assert torch.equal(free, replayed)
    assert (free - other).abs().max() > 1e-4


def test_replay_of_the_wrong_shape_is_refused():
    model = build_model(MOE, seed=1)
    record = RoutingRecord()
    model(_tokens(), routing=record)
    with pytest.raises(ValueError, match="layer 0"):
        model(_tokens()[:, :5], routing=RoutingRecord(record.indices))


def test_aux_loss_is_switch_loss_over_all_sparse_tokens_and_reaches_the_router():
    model = build_model(MOE, seed=2)
    record = RoutingRecord(aux=True)
    model(_tokens(), routing=record)
    loss = record.aux_loss()
    counts = sum(torch.bincount(record.indices[i].reshape(-1), minlength=4).float() for i in (0, 2))
    assert float(counts.sum()) == 2 * 22 * 2
    assert 0.5 < float(loss.detach()) < 4.0  # E·Σ f·P: top_k (=2) for uniform routing
    loss.backward()
    assert model.model.layers["0"].mlp.gate.weight.grad.abs().sum() > 0
    summed = record.aux_loss(reduce=lambda s: s * 2)  # two ranks with the same tokens: the same loss
    torch.testing.assert_close(summed, loss)


def test_an_expert_no_token_chose_gets_zero_gradients():
    model = build_model(MOE, seed=3)
    tokens = _tokens()
    forced = {i: torch.zeros(22, 2, dtype=torch.long) + torch.tensor([0, 1]) for i in (0, 2)}
    model(tokens, routing=RoutingRecord(forced)).sum().backward()
    grad = model.model.layers["0"].mlp.experts["3"].gate_proj.weight.grad
    assert grad is not None and not grad.any()


def test_joined_aux_loss_adds_its_gradient_to_the_outputs_loss():
    tokens = _tokens()
    grads = []
    for joined in (True, False):
        model = build_model(MOE, seed=4)
        record = RoutingRecord(aux=True, aux_weight=0.5 if joined else 0.0)
        y = record.join_aux_loss(model(tokens, routing=record))
        loss = y.square().mean() + (0.0 if joined else 0.5 * record.layer_aux_losses().sum())
        loss.backward()
        grads.append(model.model.layers["2"].mlp.gate.weight.grad.clone())
    torch.testing.assert_close(grads[0], grads[1])
    assert grads[0].abs().sum() > 0


def test_per_layer_aux_losses_pool_to_the_transformers_form_for_one_layer():
    model = build_model(MOE, seed=5)
    record = RoutingRecord(aux=True)
    model(_tokens(), routing=record)
    per_layer = record.layer_aux_losses()
    assert per_layer.shape == (2,)
    one = RoutingRecord(aux=True)
    one.stats = {0: record.stats[0]}
    torch.testing.assert_close(one.aux_loss(), per_layer[0])
