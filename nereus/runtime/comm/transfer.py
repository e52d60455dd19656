"""The groups a transition, a KV migration or a snapshot copy talks over, shared by the engines, the
transitions and recovery: created once by every rank of a world (``TransferComm``), and the error every
rank raises when a transfer does not complete.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


class TransitionExecutionError(RuntimeError):
    """The graph and what a rank holds disagree, or a transfer failed; the old layout is intact."""


class TransferComm:
    """The groups a transition talks over: ``transfer`` (point-to-point, the world's backend) and
    ``control`` (gloo, for the votes). Created once by every rank; ``renew`` replaces the transfer group
    after a failed transition, whose unmatched messages may still sit in it."""

    def __init__(self, timeout_s: float = 60.0) -> None:
        self.timeout = timedelta(seconds=timeout_s)
        # a group's timeout also bounds its creation (a store rendezvous of every rank); a rank that reaches
        # it late is slow, not failed, so creation gets the control group's long bound and the transfers
        # keep theirs through ``wait`` (gloo and NCCL honour a timeout given to ``Work.wait``)
        self.group_timeout = timedelta(seconds=4 * timeout_s + 30)
        self.control = dist.new_group(backend="gloo", timeout=self.group_timeout)
        self.transfer = dist.new_group(timeout=self.group_timeout)
        self.abandoned: list = []

    def renew(self) -> None:
        self.abandoned.append(self.transfer)
        self.transfer = dist.new_group(timeout=self.group_timeout)

    def wait(self, works: list) -> None:
        """Wait for point-to-point work, each at most the transfer timeout (a peer that failed never
        sends). Work given up on is kept alive, with its buffers, so the backend never writes into freed
        memory."""
        for i, w in enumerate(works):
            try:
                w.wait(self.timeout)
            except Exception as exc:
                self.abandoned.extend(works[i:])
                raise TransitionExecutionError(f"a transfer did not complete within {self.timeout.total_seconds():g}"
                                               f" s (a peer failed or hangs): {str(exc)[:200]}") from None

    def vote(self, error: str) -> str:
        """"" when every rank's ``error`` is "" (collective over the control group), else every failing
        rank's error, so each rank reports the same cause."""
        flag = torch.tensor([0 if error else 1], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.control)
        if flag.item():
            return ""
        errors: list = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error, group=self.control)
        return "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e)
