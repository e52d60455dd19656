"""Checksums of a checkpoint folder: ``MANIFEST.json`` lists every file's size and SHA-256, written after
the files themselves, so a checkpoint without one was not finished. Resuming verifies it first and
refuses by name, before anything is loaded (untrusted files; resume integrity):

- a listed file that is missing, truncated or corrupted;
- a file in the folder that the manifest does not list (nothing unverified is ever read);
- a manifest that lists nothing (it would verify nothing);
- a manifest edited after it was written: it carries ``manifest_sha256``, the SHA-256 of its own other
  fields in canonical JSON, so changing a file *and* its checksum in the manifest is caught too.

The self-checksum guards against accidents (an edit, a partial copy, a tool rewriting files), not an
adversary who recomputes it; the run folder's permissions are what keep other users out.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from nereus.spec.errors import SpecError
from nereus.spec.files import atomic_write_text

MANIFEST = "MANIFEST.json"
FORMAT = 2  # 2: lists every file and checksums itself; 1 had no self-checksum
_BLOCK = 1 << 20


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_BLOCK):
            h.update(block)
    return h.hexdigest()


def _self_checksum(body: dict) -> str:
    """SHA-256 of the manifest's fields other than the checksum itself, as canonical JSON."""
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _listing(folder: Path) -> list[str]:
    """Every file under ``folder`` (recursively), the manifest and its temporary excepted, as relative paths."""
    def skipped(p: Path) -> bool:  # the manifest, and a temporary of it left by a driver killed mid-write
        return p.parent == folder and (p.name == MANIFEST or p.name.startswith(f".{MANIFEST}.") and
                                       p.name.endswith(".tmp"))

    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and not skipped(p))


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``path`` through a temporary sibling and a rename: a reader sees the old file or the new one,
    never a half-written one; a failed write removes the temporary (``spec.files.atomic_write_text``)."""
    atomic_write_text(path, text)


def write_manifest(folder: Path) -> Path:
    """Record every file under ``folder`` (recursively, the manifest itself excepted) and checksum the record."""
    entries = {rel: {"bytes": (folder / rel).stat().st_size, "sha256": sha256(folder / rel)}
               for rel in _listing(folder)}
    body = {"format": FORMAT, "files": entries}
    write_text_atomic(folder / MANIFEST, json.dumps({**body, "manifest_sha256": _self_checksum(body)}, indent=1))
    return folder / MANIFEST


def _read(path: Path, where: str) -> dict[str, dict]:
    """The manifest's file entries, once its own checksum and shape are checked."""
    try:
        data = json.loads(path.read_text())
        body = {k: v for k, v in data.items() if k != "manifest_sha256"}
        entries, claimed = data["files"], data.get("manifest_sha256")
        ok_shape = isinstance(entries, dict) and all(
            isinstance(m, dict) and isinstance(m.get("bytes"), int) and isinstance(m.get("sha256"), str)
            for m in entries.values())
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError, RecursionError):
        raise SpecError(where, f"{path} is not a valid manifest; the checkpoint cannot be trusted") from None
    if claimed is None:
        raise SpecError(where, f"{path} has no manifest_sha256 (written before manifests checksummed "
                               "themselves, or edited): the checkpoint cannot be trusted")
    if claimed != _self_checksum(body):
        raise SpecError(where, f"{path} was changed after it was written (its manifest_sha256 does not match "
                               "its contents): the checkpoint cannot be trusted")
    if not ok_shape:
        raise SpecError(where, f"{path} is not a valid manifest; the checkpoint cannot be trusted")
    odd = [rel for rel in entries if Path(rel).is_absolute() or ".." in Path(rel).parts]
    if odd:
        raise SpecError(where, f"{path} lists {odd[0]!r}, outside its folder: the checkpoint cannot be trusted")
    if not entries:
        raise SpecError(where, f"{path} lists no files, so it verifies nothing: the checkpoint cannot be trusted")
    return entries


def verify_manifest(folder: Path, where: str = "--resume", required: tuple[str, ...] = ()) -> None:
    """Raise ``SpecError`` naming the first problem of ``folder``: no manifest, an invalid, edited or empty
    one, a file of ``required`` it does not list, a listed file missing, truncated or corrupted, or a file
    present but not listed."""
    path = folder / MANIFEST
    if not path.is_file():
        raise SpecError(where, f"{folder} has no {MANIFEST}: the checkpoint was not finished writing (or predates "
                               "checksums); resume from an earlier one by pointing 'latest' at it")
    entries = _read(path, where)
    for rel in required:
        if rel not in entries:
            raise SpecError(where, f"{folder / rel} is not listed in {path}: the checkpoint is incomplete")
    for rel, meta in entries.items():
        f = folder / rel
        if not f.is_file():
            raise SpecError(where, f"{f} is missing from the checkpoint (listed in {MANIFEST})")
        size = f.stat().st_size
        if size != meta["bytes"]:
            raise SpecError(where, f"{f} is truncated or grown: {size} bytes, the checkpoint wrote {meta['bytes']}")
        if sha256(f) != meta["sha256"]:
            raise SpecError(where, f"{f} is corrupted: its SHA-256 differs from the one the checkpoint wrote")
    extra = [rel for rel in _listing(folder) if rel not in entries]
    if extra:
        raise SpecError(where, f"{folder / extra[0]} is not listed in {path} (an unverified file; "
                               f"{len(extra)} in all): remove it or resume from another checkpoint")
