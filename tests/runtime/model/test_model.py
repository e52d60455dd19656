"""The decoder's hand-written backward passes against autograd, and stage splits of the plain model."""

import torch
import torch.nn.functional as F

from nereus.runtime.model.decoder import CausalLM, _RMSNormFn, _SwiGLU, build_model
from tests.runtime.common import GQA


def test_rmsnorm_backward_matches_autograd():
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: _RMSNormFn.apply(a, b, 1e-6), (x, w))
    plain = w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(_RMSNormFn.apply(x, w, 1e-6), plain)


def test_swiglu_backward_matches_autograd():
    g = torch.randn(3, 7, dtype=torch.float64, requires_grad=True)
    u = torch.randn(3, 7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(_SwiGLU.apply, (g, u))
    torch.testing.assert_close(_SwiGLU.apply(g, u), F.silu(g) * u)


def test_stages_compose_to_the_whole_model():
    whole = build_model(GQA, seed=3)
    state = whole.state_dict()
    first = CausalLM(GQA, range(0, 2), first=True, last=False)
    last = CausalLM(GQA, range(2, 3), first=False, last=True)
    first.load_state_dict({k: v for k, v in state.items() if k in first.state_dict()})
    last.tied_head = torch.nn.Parameter(state["model.embed_tokens.weight"].clone())
    last.load_state_dict({k: v for k, v in state.items() if k in last.state_dict()} | {
        "tied_head": state["model.embed_tokens.weight"]})
    tokens = torch.randint(0, GQA.arch.vocab, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(last(first(tokens)), whole(tokens))
