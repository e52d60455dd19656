"""Checkpoint checksums: a finished checkpoint verifies; a missing manifest, a missing, truncated or
corrupted file is refused by name (the error a resume prints), before anything is loaded."""

from __future__ import annotations

import pytest

from nereus.run.manifest import MANIFEST, verify_manifest, write_manifest
from nereus.spec.errors import SpecError


@pytest.fixture
def checkpoint(tmp_path):
    (tmp_path / "actor").mkdir()
    (tmp_path / "actor" / "model.safetensors").write_bytes(bytes(range(256)) * 40)
    (tmp_path / "state.json").write_text('{"step": 3}')
    write_manifest(tmp_path)
    return tmp_path


def test_a_finished_checkpoint_verifies(checkpoint):
    verify_manifest(checkpoint)


def test_unfinished_checkpoint_without_manifest(checkpoint):
    (checkpoint / MANIFEST).unlink()
    with pytest.raises(SpecError, match="no MANIFEST.json: the checkpoint was not finished"):
        verify_manifest(checkpoint)


def test_truncated_file_is_named(checkpoint):
    f = checkpoint / "actor" / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(SpecError, match=r"model.safetensors is truncated or grown: 10140 bytes, the checkpoint "
                                        r"wrote 10240"):
        verify_manifest(checkpoint)


def test_corrupted_file_is_named(checkpoint):
    f = checkpoint / "actor" / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[5000] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(SpecError, match="model.safetensors is corrupted"):
        verify_manifest(checkpoint)


def test_missing_file_is_named(checkpoint):
    (checkpoint / "state.json").unlink()
    with pytest.raises(SpecError, match="state.json is missing"):
        verify_manifest(checkpoint)
