"""Router replay's data: the experts each sparse layer chose for every position of a sequence, recorded while
generating and replayed when training computes log-probs (``moe.RoutingRecord``; docs/moe.md, "Router replay").

A sequence's routes are one tensor [positions, sparse layers, top_k] (int16: expert counts stay far below
32,768), the sparse layers in layer order, a position for each token the generation fed the model: the
prompt's (from the prefill) and every sampled token but the last (from the decode steps; the last sampled token
is never fed). A batch's routes are [B, T, sparse layers, top_k] in the frame of its ``tokens``; positions no
generation fed (a row's last token, padding) hold experts 0..k-1, valid indices whose outputs no loss reads.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from nereus.runtime.model.moe import RoutingRecord
from nereus.spec.model import ModelArch

ROUTE_DTYPE = torch.int16


def sparse_layer_ids(arch: ModelArch) -> list[int]:
    """Global indices of the layers whose MLP routes to experts, in order ([] for a dense model)."""
    return [] if arch.moe is None else [i for i in range(arch.layers) if arch.moe.sparse(i)]


def stacked(indices: Mapping[int, torch.Tensor], layers: list[int]) -> torch.Tensor:
    """[tokens, len(layers), k] of one forward's recorded ``indices`` (``RoutingRecord.indices``)."""
    return torch.stack([indices[i] for i in layers], dim=1).to(ROUTE_DTYPE)


def replay_record(routes: torch.Tensor, layers: list[int], **record: object) -> RoutingRecord:
    """A ``RoutingRecord`` replaying ``routes`` [..., len(layers), k] in the order of the forward's flattened
    input (padded [b, T] or packed [1, L] positions); ``record``: its other arguments (the load-balancing
    loss's)."""
    flat = routes.reshape(-1, *routes.shape[-2:]).long()
    return RoutingRecord(replay={layer: flat[:, j] for j, layer in enumerate(layers)}, **record)


def routes_frame(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    """[B, width, layers, top_k] of each row's routes from position 0 (``rows[b]`` [n, layers, top_k]), experts
    0..k-1 elsewhere."""
    layers, top_k = rows[0].shape[1:]
    out = torch.arange(top_k, dtype=ROUTE_DTYPE).expand(len(rows), width, layers, top_k).clone()
    for b, r in enumerate(rows):
        if len(r):
            n = min(len(r), width)
            out[b, :n] = r[:n].to(ROUTE_DTYPE)
    return out


class RouteLog:
    """The routes of a batch's rows as a generation feeds them: each forward's record, kept per row for the
    positions the row actually advanced by (a finished row's fed pad is not kept)."""

    def __init__(self, rows: int, layers: list[int], top_k: int) -> None:
        self.layers, self.top_k = layers, top_k
        self.parts: list[list[torch.Tensor]] = [[] for _ in range(rows)]

    def keep(self, record: RoutingRecord, shape: tuple[int, int], positions: torch.Tensor) -> None:
        """Row ``b`` keeps the routes of its chunk positions where ``positions[b]`` [B, w] (bool) is set;
        ``shape``: the forward's token batch (B, w)."""
        got = stacked(record.indices, self.layers).reshape(*shape, len(self.layers), -1).cpu()
        for b, keep in enumerate(positions.tolist()):
            picked = [j for j, k in enumerate(keep) if k]
            if picked:
                self.parts[b].append(got[b, picked])

    def rows(self) -> list[torch.Tensor]:
        """Each row's routes [positions fed, layers, k]."""
        empty = torch.zeros(0, len(self.layers), self.top_k, dtype=ROUTE_DTYPE)
        return [torch.cat(p) if p else empty for p in self.parts]
