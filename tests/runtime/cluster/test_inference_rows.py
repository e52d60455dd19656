"""The driver puts a packed inference's answers back in batch order: each data-parallel replica answers its
share of the rows dealt by tokens (``spec.packing.replica_shares``), in batch order within the share."""

from types import SimpleNamespace

import torch

from nereus.runtime.cluster.runtime_roles.inference import InferenceOps
from nereus.spec.layout import Layout
from nereus.spec.packing import replica_shares


def _driver(layout: Layout) -> SimpleNamespace:
    return SimpleNamespace(specs={"k": SimpleNamespace(layout=layout)})


def test_packed_replicas_answers_return_in_batch_order():
    lengths = torch.tensor([12, 3, 7, 2, 12, 5, 9, 4])
    tokens = torch.zeros(8, 12, dtype=torch.long)
    shares = replica_shares(lengths.tolist(), 2)
    assert shares != [[0, 1, 2, 3], [4, 5, 6, 7]]  # dealt by tokens, not in consecutive blocks
    # each replica answers its rows in batch order (``sharded_forward``): row i's answer is i here
    parts = [torch.tensor(share, dtype=torch.float)[:, None].expand(-1, 11) for share in shares]
    got = InferenceOps._rows(_driver(Layout(dp=2, max_token_len=20)), "k", tokens, lengths, parts)
    torch.testing.assert_close(got[:, 0], torch.arange(8, dtype=torch.float))
    # padded layouts answer consecutive blocks, concatenated as they come
    blocks = [torch.arange(4.0)[:, None], torch.arange(4.0, 8.0)[:, None]]
    got = InferenceOps._rows(_driver(Layout(dp=2)), "k", tokens, lengths, blocks)
    torch.testing.assert_close(got[:, 0], torch.arange(8, dtype=torch.float))
