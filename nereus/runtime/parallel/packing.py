"""Packed sequences and token-budget micro-batches: the rows of a padded batch cut to their real lengths
and laid end to end, so that no layer, attention or LM-head column runs on padding.

A layout with ``max_token_len`` > 0 packs (verl's ``use_remove_padding`` with ``use_dynamic_bsz`` and
``ppo_max_token_len_per_gpu``): a training batch's rows are dealt to the data-parallel replicas longest
first, each to the replica holding the fewest tokens, and each replica's rows are grouped into micro-batches
of at most ``max_token_len`` tokens, longest first, each to the emptiest micro-batch it fits in (a row longer
than the budget runs alone). Every rank of a layout computes the same plan from the same lengths, so the
pipeline stages agree on each micro-batch's activation shape [1, tokens, hidden] without exchanging it. The
plan itself (``spec.packing.replica_shares``, ``token_budget_groups``) is torch-free: the cost model prices
the micro-batches it makes (``cost.stage_tokens``).

Outputs go back to the padded frame the losses and the driver read ([b, T−1] next-token log-probs, [b, T]
values), zero at padding: a loss reads them only where its mask is 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class PackedRows:
    """One packed micro-batch: ``rows`` of a padded batch (indices into the tensor it was cut from), each
    ``lengths[j]`` real tokens long, laid end to end as one sequence of ``sum(lengths)`` tokens."""

    rows: torch.Tensor  # [b] long
    lengths: tuple[int, ...]

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    def pack(self, padded: torch.Tensor) -> torch.Tensor:
        """[1, Σ lengths, ...] of ``padded`` [b, T, ...] (this micro-batch's rows, in order), each row cut
        to its length."""
        return torch.cat([row[:n] for row, n in zip(padded, self.lengths, strict=True)])[None]

    def next_tokens(self, packed: torch.Tensor) -> torch.Tensor:
        """The token after each position of ``packed`` [1, L] within its sequence (0 at a sequence's last
        position, which predicts nothing the batch holds)."""
        out = torch.zeros_like(packed)
        at = self._index(True)[2].to(packed.device)
        out[0, at] = packed[0, at + 1]
        return out

    def unpack(self, packed: torch.Tensor, width: int, next_token: bool) -> torch.Tensor:
        """[b, width, ...] in the padded frame of ``packed`` [1, L, ...], zero at padding; ``next_token``:
        the next-token frame (position t of a row predicts its token t+1; a sequence's last position is
        dropped). Differentiable."""
        rows, cols, flat = self._index(next_token)
        out = packed.new_zeros((len(self.lengths), width, *packed.shape[2:]))
        return out.index_put((rows.to(packed.device), cols.to(packed.device)), packed[0, flat.to(packed.device)])

    def _index(self, next_token: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self._next_index if next_token else self._all_index

    @cached_property
    def _all_index(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _frame_index(self.lengths, 0)

    @cached_property
    def _next_index(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _frame_index(self.lengths, 1)


def _frame_index(lengths: tuple[int, ...], drop: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row, column, packed position) of every kept position: each sequence's first len − ``drop``."""
    lens = torch.tensor(lengths, dtype=torch.long)
    kept = (lens - drop).clamp(min=0)
    starts = torch.cumsum(lens, 0) - lens
    total = int(kept.sum())
    first = torch.repeat_interleave(torch.cumsum(kept, 0) - kept, kept, output_size=total)
    cols = torch.arange(total) - first
    rows = torch.repeat_interleave(torch.arange(len(lengths)), kept, output_size=total)
    return rows, cols, torch.repeat_interleave(starts, kept, output_size=total) + cols


def row_lengths(lengths: torch.Tensor | None, rows: int, width: int) -> list[int]:
    """Each row's real tokens: ``lengths`` (a batch's ``TrainBatch.lengths``), else the whole width."""
    if lengths is None:
        return [width] * rows
    out = [int(n) for n in lengths.tolist()]
    if len(out) != rows or min(out, default=1) < 1 or max(out, default=0) > width:
        raise ValueError(f"row lengths {out[:8]}... do not fit {rows} rows of {width} tokens")
    return out
