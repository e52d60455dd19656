"""Recovery from lost workers, the worker side: host-memory snapshots of model state addressed by global
boxes, and the rebuild of a new layout's shards from whatever still holds the state.

A *state image* is one worker's state of some models as the transition graph names it — buffer key
(model, state, tensor, box set) → components (``Holdings``), packed into one byte array — plus each
trained model's Adam facts (hyper-parameters, step count). It is self-describing: the boxes say what it
holds whatever layout the driver believes is in force, so an image taken on a worker that finished a
transition the others did not still serves. Images travel as Ray objects (a worker's return value,
owned by the driver, so it survives the worker), which is where snapshots live: host memory outside
every worker process.

``restore_state`` fills each buffer a rank's new keys need from a list of images in preference order —
live images of surviving workers first (data-parallel replicas of what the lost worker held), then the
newest snapshot — copying the intersection of every source box with every needed box and checking that
every element was covered; then installs new ``ShardedModel``\\ s around the filled buffers.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from nereus.runtime.comm.groups import ParallelGroups
from nereus.runtime.comm.transfer import TransferComm
from nereus.runtime.model.dtypes import dtype_name, torch_dtype
from nereus.runtime.parallel.dp import AdamFacts
from nereus.runtime.parallel.ep import first_copy
from nereus.runtime.parallel.sharded import ShardedModel
from nereus.runtime.transitions.holdings import (
    OPTIMIZER,
    WEIGHTS,
    Buffer,
    BufferKey,
    Holdings,
    extent,
    holdings_of,
    index_in,
)
from nereus.spec.sharding import box_volume, intersect

if TYPE_CHECKING:
    import numpy as np

    from nereus.runtime.transitions.live import KeySpec


@dataclass(frozen=True)
class Component:
    """One tensor of a buffer in an image's bytes: its dtype (``dtypes.DTYPES`` name) and element count."""

    dtype: str
    numel: int


@dataclass(frozen=True)
class ImagePiece:
    """One buffer of a state image: its key and its components, stored one after another."""

    key: BufferKey
    components: tuple[Component, ...]


@dataclass(frozen=True)
class StateImage:
    """One worker's state of some models: every buffer's bytes in one host array (Ray stores a numpy
    array without copying it through pickle: ~100× faster than a dict of tensors for a model's few hundred
    pieces), what each piece is, and each trained model's Adam settings and step count."""

    pieces: tuple[ImagePiece, ...]
    data: np.ndarray  # uint8: the components' bytes in piece order
    adam: Mapping[str, AdamFacts]


class StateLostError(RuntimeError):
    """No surviving worker and no snapshot holds part of a model's state."""


def state_image(models: dict[str, ShardedModel], key_model: dict[str, str], optimizer_for: set[str],
                weights_dp0_only: bool = False) -> StateImage:
    """Copies of the weights (and, for models in ``optimizer_for``, the Adam state) of the keys in
    ``key_model`` (key → model) this worker holds. With ``weights_dp0_only`` only data-parallel replica 0
    contributes weights (the other replicas hold the same values; under EP each expert's first holder,
    ``ep.first_copy``; under ZeRO-3 every replica, each holding its own range)."""
    held = Holdings()
    adam: dict[str, AdamFacts] = {}
    for key, model in key_model.items():
        sm = models.get(key)
        if sm is None:
            continue
        part = holdings_of(model, sm)
        for bkey, buf in part.buffers.items():
            copy = not sm.groups.layout.fsdp and not first_copy(bkey[2], sm.groups)  # ZeRO-3 ranges are all kept
            if bkey[1] == WEIGHTS and weights_dp0_only and copy:
                continue
            if bkey[1] == OPTIMIZER and model not in optimizer_for:
                continue
            held.add(bkey, buf)
        has_moments = model in optimizer_for and sm.optimizer is not None and sm.optimizer.moments() is not None
        if has_moments:
            adam[model] = sm.optimizer.facts()
    return pack({k: b.comps for k, b in held.buffers.items()}, adam)


def pack(buffers: dict[BufferKey, tuple[torch.Tensor, ...]], adam: Mapping[str, AdamFacts]) -> StateImage:
    """One host byte array for all components, and what each piece is."""
    pieces, parts = [], []
    for key, comps in buffers.items():
        pieces.append(ImagePiece(key, tuple(Component(dtype_name(c.dtype), c.numel()) for c in comps)))
        parts += [c.detach().reshape(-1).to("cpu").view(torch.uint8) for c in comps]
    data = torch.cat(parts).numpy() if parts else torch.zeros(0, dtype=torch.uint8).numpy()
    return StateImage(tuple(pieces), data, dict(adam))


def unpack(image: StateImage) -> Holdings:
    """The image's buffers as (read-only) tensors over the packed bytes, no copy."""
    with warnings.catch_warnings():  # Ray hands out the stored array read-only; it is only read here
        warnings.simplefilter("ignore", UserWarning)
        data = torch.from_numpy(image.data)
    held, offset = Holdings(), 0
    for piece in image.pieces:
        out = []
        for c in piece.components:
            dtype = torch_dtype(c.dtype)
            n = c.numel * dtype.itemsize
            out.append(data[offset: offset + n].view(dtype))
            offset += n
        held.add(piece.key, Buffer(piece.key[3], tuple(out)))
    return held


def fill(key: BufferKey, dtypes: tuple[torch.dtype, ...], images: list[Holdings], device: torch.device) -> Buffer:
    """A new buffer for ``key`` filled from the images' buffers of the same tensor and state (the first
    image to hold an element wins); raises ``StateLostError`` naming what no image covers."""
    model, state, name, bset = key
    target = Buffer(bset, tuple(torch.empty(sum(box_volume(b) for b in bset), dtype=d, device=device)
                                for d in dtypes))
    masks = [torch.zeros(extent(b), dtype=torch.bool) for b in bset]
    for image in images:
        for src in image.of_tensor(model, state, name):
            for box, mask in zip(bset, masks, strict=True):
                for sbox in src.boxes:
                    piece = intersect(box, sbox)
                    if piece is None:
                        continue
                    todo = ~mask[index_in(piece, box)]
                    if not todo.any():
                        continue
                    whole = bool(todo.all())
                    for dst, s in zip(target.view(piece), src.view(piece), strict=True):
                        if whole:
                            dst.copy_(s)
                        else:
                            dst[todo] = s[todo].to(dst.dtype)
                    mask[index_in(piece, box)] = True
    missing = [b for b, m in zip(bset, masks, strict=True) if not bool(m.all())]
    if missing:
        raise StateLostError(f"no surviving worker or snapshot holds {model}/{state} {name} {missing[0]}: "
                             f"take snapshots (run.checkpoint.snapshot_every) or keep data-parallel replicas")
    return target


def restore_state(specs: list[KeySpec], groups: dict[str, ParallelGroups], images: dict[str, list[StateImage]],
                  comm: TransferComm, schedule: str = "1f1b") -> dict[str, ShardedModel]:
    """This rank's shards of ``specs`` (``KeySpec``) under ``groups``, filled from ``images`` (model → images
    in preference order). Collective over the world (tied heads move point to point)."""
    from nereus.runtime.transitions.live import installer, new_needs

    adam: dict[str, AdamFacts] = {}
    for model, packs in images.items():
        facts = next((p.adam[model] for p in packs if model in p.adam), None)
        if facts is not None:
            adam[model] = facts
    unpacked = {m: [unpack(p) for p in packs] for m, packs in images.items()}
    held = Holdings()
    device = next((g.device for g in groups.values()), torch.device("cpu"))
    for key, dtypes in new_needs(specs, groups).items():
        if key[1] == OPTIMIZER and key[0] not in adam:
            continue  # the optimizer has not stepped yet: nothing to restore
        held.add(key, fill(key, dtypes, unpacked.get(key[0], []), device))
    return installer(specs, groups, adam, schedule, comm)(held)
