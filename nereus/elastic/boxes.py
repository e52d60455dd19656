"""Box algebra on global tensor coordinates: a box is ``((start, stop), ...)`` per dimension and a box
set is a tuple of disjoint boxes (a ZeRO shard may be several boxes, see ``nereus.spec.sharding``)."""

from __future__ import annotations

from nereus.spec.sharding import Box, box_volume, intersect

BoxSet = tuple[Box, ...]


def set_volume(boxes: BoxSet) -> int:
    return sum(box_volume(b) for b in boxes)


def subtract(a: Box, b: Box) -> list[Box]:
    """``a`` minus ``b`` as disjoint boxes: slabs below and above ``b`` along each dimension in turn."""
    if intersect(a, b) is None:
        return [a]
    out: list[Box] = []
    rest = list(a)
    for d, ((a0, a1), (b0, b1)) in enumerate(zip(a, b, strict=True)):
        if a0 < b0:
            out.append(tuple(rest[:d]) + ((a0, b0),) + tuple(rest[d + 1:]))
        if b1 < a1:
            out.append(tuple(rest[:d]) + ((b1, a1),) + tuple(rest[d + 1:]))
        rest[d] = (max(a0, b0), min(a1, b1))
    return out


def intersect_sets(a: BoxSet, b: BoxSet) -> BoxSet:
    """Common part of two box sets (each made of disjoint boxes, so the result is disjoint too)."""
    out = []
    for x in a:
        for y in b:
            z = intersect(x, y)
            if z is not None:
                out.append(z)
    return tuple(out)


def set_contains(outer: BoxSet, inner: BoxSet) -> bool:
    """Whether every element of ``inner`` lies in ``outer`` (``outer`` disjoint)."""
    return set_volume(intersect_sets(inner, outer)) == set_volume(inner)


def bounding(boxes: BoxSet) -> Box:
    if len(boxes) == 1:
        return boxes[0]
    return tuple((min(b[d][0] for b in boxes), max(b[d][1] for b in boxes)) for d in range(len(boxes[0])))
