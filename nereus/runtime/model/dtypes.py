"""Torch dtypes by the names a job's config, a ``KeySpec`` and a state image use: one explicit table, so a
name that is not a dtype is refused by name instead of reaching into the ``torch`` namespace."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import torch

DTYPES: Mapping[str, torch.dtype] = MappingProxyType({
    "float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8,
    "bool": torch.bool,
})
NAMES: Mapping[torch.dtype, str] = MappingProxyType({d: name for name, d in DTYPES.items()})


def torch_dtype(name: str) -> torch.dtype:
    """The dtype called ``name`` (``"bfloat16"``); a ``ValueError`` listing the known names otherwise."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}: use one of {', '.join(DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    """The table's name of ``dtype`` (the inverse of ``torch_dtype``)."""
    try:
        return NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} has no name in nereus.runtime.model.dtypes.DTYPES") from None
