"""Checkpoint checksums: a finished checkpoint verifies; a missing manifest, a missing, truncated,
corrupted or unlisted file, an empty or edited manifest are refused by name (the error a resume prints),
before anything is loaded (resume integrity)."""

from __future__ import annotations

import json

import pytest

from nereus.run.manifest import MANIFEST, sha256, verify_manifest, write_manifest
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


def test_unlisted_file_is_named(checkpoint):
    (checkpoint / "actor" / "extra.safetensors").write_bytes(b"not checked")
    with pytest.raises(SpecError, match=r"actor/extra.safetensors is not listed in .*MANIFEST.json"):
        verify_manifest(checkpoint)


def _edit_manifest(folder, edit) -> None:
    data = json.loads((folder / MANIFEST).read_text())
    edit(data)
    (folder / MANIFEST).write_text(json.dumps(data))


def test_empty_manifest_verifies_nothing_and_is_refused(tmp_path):
    (tmp_path / "state.json").write_text("{}")
    write_manifest(tmp_path)
    (tmp_path / "state.json").unlink()
    write_manifest(tmp_path)  # a correctly self-checksummed manifest of an empty folder
    with pytest.raises(SpecError, match="lists no files, so it verifies nothing"):
        verify_manifest(tmp_path)


def test_hand_written_empty_manifest_is_refused(checkpoint):
    (checkpoint / MANIFEST).write_text('{"files": {}}')
    with pytest.raises(SpecError, match="no manifest_sha256"):
        verify_manifest(checkpoint)


def test_edited_file_with_a_fresh_checksum_in_the_manifest_is_caught(checkpoint):
    """An edited state.json whose new size and SHA-256 were written into the manifest: the manifest's own
    checksum no longer matches."""
    f = checkpoint / "state.json"
    f.write_text('{"step": 4}')

    def refresh(data):
        data["files"]["state.json"] = {"bytes": f.stat().st_size, "sha256": sha256(f)}

    _edit_manifest(checkpoint, refresh)
    with pytest.raises(SpecError, match="was changed after it was written"):
        verify_manifest(checkpoint)


def test_required_file_must_be_listed(checkpoint):
    with pytest.raises(SpecError, match="config.json is not listed"):
        verify_manifest(checkpoint, required=("config.json",))


def test_entry_outside_the_folder_is_refused(checkpoint):
    from nereus.run.manifest import _self_checksum

    def escape(data):
        data["files"]["../x"] = {"bytes": 1, "sha256": "0" * 64}
        body = {k: v for k, v in data.items() if k != "manifest_sha256"}
        data["manifest_sha256"] = _self_checksum(body)

    _edit_manifest(checkpoint, escape)
    with pytest.raises(SpecError, match="outside its folder"):
        verify_manifest(checkpoint)
