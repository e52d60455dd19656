"""Checksums of a checkpoint folder: ``MANIFEST.json`` lists every file's size and SHA-256, written after
the files themselves, so a checkpoint without one was not finished. Resuming verifies it first and
refuses a truncated or corrupted file by name instead of loading it (issue 9: untrusted files)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from nereus.spec.errors import SpecError

MANIFEST = "MANIFEST.json"
_BLOCK = 1 << 20


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_BLOCK):
            h.update(block)
    return h.hexdigest()


def write_manifest(folder: Path) -> Path:
    """Record every file under ``folder`` (recursively, the manifest itself excepted)."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)
    entries = {str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": sha256(p)} for p in files}
    tmp = folder / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"files": entries}, indent=1))
    tmp.replace(folder / MANIFEST)  # atomic: a manifest is complete or absent
    return folder / MANIFEST


def verify_manifest(folder: Path, where: str = "--resume") -> None:
    """Raise ``SpecError`` naming the first missing, truncated or corrupted file of ``folder``."""
    path = folder / MANIFEST
    if not path.exists():
        raise SpecError(where, f"{folder} has no {MANIFEST}: the checkpoint was not finished writing (or predates "
                               "checksums); resume from an earlier one by pointing 'latest' at it")
    try:
        entries = json.loads(path.read_text())["files"]
    except (ValueError, KeyError, TypeError):
        raise SpecError(where, f"{path} is not a valid manifest; the checkpoint cannot be trusted") from None
    for rel, meta in entries.items():
        f = folder / rel
        if not f.is_file():
            raise SpecError(where, f"{f} is missing from the checkpoint (listed in {MANIFEST})")
        size = f.stat().st_size
        if size != meta["bytes"]:
            raise SpecError(where, f"{f} is truncated or grown: {size} bytes, the checkpoint wrote {meta['bytes']}")
        if sha256(f) != meta["sha256"]:
            raise SpecError(where, f"{f} is corrupted: its SHA-256 differs from the one the checkpoint wrote")
