"""An HF model directory checked before any process starts: ``config.json`` (``model.arch_from_hf``), the
safetensors weights against that config, and the tokenizer files' kinds and sizes.

Safetensors (https://huggingface.co/docs/safetensors, "Format"): 8 bytes, a little-endian unsigned length
N, then N bytes of JSON header — tensor name → ``{"dtype", "shape", "data_offsets": [begin, end]}`` plus an
optional ``__metadata__`` map of strings — then the data, whose offsets count from the header's end. The
header is read here with the strict JSON reader, without torch and without reading the data. Every tensor
is checked: its name is a weight of the model the config describes (``sharding.model_tensors``), its shape
is the one the config gives it, its dtype is a floating-point type the runtime converts, and its byte range
is exactly shape × item size, inside the file, with the ranges tiling the data section without gaps or
overlaps (the rule the safetensors library applies itself). A sharded checkpoint's
``model.safetensors.index.json`` must list every tensor of its shards and nothing else, in files of the
same directory. Before these checks an embedding one column wider than ``hidden_size`` loaded its
first columns and trained; a truncated file started Ray and four workers and died 39 s later.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

from nereus.spec.errors import SpecError, brief
from nereus.spec.fields import Fields
from nereus.spec.files import load_json, open_regular, read_json_file
from nereus.spec.model import ModelArch, arch_from_hf, hf_value_head
from nereus.spec.moe import mixtral_name
from nereus.spec.sharding import model_tensors

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
# The safetensors library refuses headers over 100 MB (safetensors/src/tensor.rs, MAX_HEADER_SIZE).
MAX_HEADER_BYTES = 100_000_000
# Item sizes of the safetensors dtypes (safetensors/src/tensor.rs, ``Dtype``); weights must be floating point.
ITEM_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
              "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")  # what ``runtime.model.hf.load_boxes`` converts to the compute dtype
# Buffers some checkpoints carry that are not weights (older transformers saved RoPE's inverse frequencies).
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
# Tokenizer and generation files the runtime may read, and how large each may be: tokenizer.json of a
# 256k vocabulary is ~35 MB (Gemma); the others are kilobytes to a few MB (vocab.json, merges.txt).
TOKENIZER_FILE_BYTES = {"tokenizer.json": 512 * 2**20, "tokenizer.model": 64 * 2**20, "vocab.json": 64 * 2**20,
                        "merges.txt": 64 * 2**20, "tokenizer_config.json": 16 * 2**20,
                        "special_tokens_map.json": 2**20, "added_tokens.json": 16 * 2**20,
                        "chat_template.jinja": 2**20, "chat_template.json": 2**20, "generation_config.json": 2**20}
JSON_TOKENIZER_FILES = ("tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                        "chat_template.json", "added_tokens.json")


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors header."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def read_header(path: Path, where: str) -> dict[str, TensorEntry]:
    """Every tensor of the safetensors file ``path``, its byte ranges checked against the file."""
    with open_regular(path, "safetensors") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise SpecError(where, f"{path} is {size} bytes, too short for a safetensors file (truncated?)")
        (length,) = struct.unpack("<Q", f.read(8))
        if length > MAX_HEADER_BYTES or length > size - 8:
            raise SpecError(where, f"{path}: its header claims {length:,} bytes but the file has {size - 8:,} after "
                                   "the length (truncated, or not a safetensors file)")
        raw = f.read(length)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise SpecError(where, f"{path}: its header is not UTF-8 JSON (not a safetensors file)") from None
    header = load_json(text, f"{where}: {path}", "safetensors header")
    if not isinstance(header, dict):
        raise SpecError(where, f"{path}: its header is not a JSON object (not a safetensors file)")
    entries = {}
    for name, meta in header.items():
        if name == "__metadata__":
            if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
                raise SpecError(where, f"{path}: __metadata__ must map names to strings")
            continue
        entries[name] = _entry(path, name, meta, where)
    _check_tiling(path, entries, size - 8 - length, where)
    return entries


def _entry(path: Path, name: str, meta: object, where: str) -> TensorEntry:
    at = f"{where}: {path}: tensor {brief(name)}"
    f = Fields(meta, at)
    dtype = f.get("dtype", str, choices=list(ITEM_BYTES))
    shape = f.get_list("shape", int)
    offsets = f.get_list("data_offsets", int)
    f.finish()
    if any(d < 0 or d > 2**40 for d in shape):
        raise SpecError(at, f"shape {brief(shape)} has a negative or impossible dimension")
    if len(offsets) != 2 or not 0 <= offsets[0] <= offsets[1]:
        raise SpecError(at, f"data_offsets {brief(offsets)} is not [begin, end] with 0 <= begin <= end")
    count = 1
    for d in shape:
        count *= d
    if count * ITEM_BYTES[dtype] != offsets[1] - offsets[0]:
        raise SpecError(at, f"holds {offsets[1] - offsets[0]:,} bytes but {dtype} of shape {list(shape)} needs "
                            f"{count * ITEM_BYTES[dtype]:,} (a damaged file)")
    return TensorEntry(name, dtype, tuple(shape), offsets[0], offsets[1])


def _check_tiling(path: Path, entries: dict[str, TensorEntry], data_bytes: int, where: str) -> None:
    """The tensors' byte ranges cover the data section exactly, one after another."""
    at = 0
    for e in sorted(entries.values(), key=lambda e: (e.begin, e.end)):
        if e.begin != at:
            what = "overlaps the tensor before it" if e.begin < at else "leaves a gap before it"
            raise SpecError(where, f"{path}: tensor {brief(e.name)} {what} (bytes {e.begin:,}..{e.end:,}; a damaged "
                                   "file)")
        at = e.end
    if at != data_bytes:
        how = "the file is truncated" if at > data_bytes else "the file has bytes no tensor holds"
        raise SpecError(where, f"{path}: its tensors span {at:,} bytes of data but the file has {data_bytes:,}: "
                               f"{how}")


def weight_files(folder: Path, where: str) -> dict[str, TensorEntry]:
    """Every tensor of the checkpoint in ``folder`` (one ``model.safetensors`` or the shards an index names)."""
    index = folder / INDEX
    if index.exists():
        return _sharded(folder, index, where)
    if not (folder / SINGLE).exists():
        others = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
        hint = (f" ({others[0]} is a pickle file, which can run code when loaded: convert it to safetensors)"
                if others else "")
        raise SpecError(where, f"{folder} has no {SINGLE} or {INDEX}{hint}")
    return read_header(folder / SINGLE, where)


def _sharded(folder: Path, index: Path, where: str) -> dict[str, TensorEntry]:
    data = read_json_file(index, "safetensors index")
    weight_map = Fields(data, f"{where}: {index}").get("weight_map", dict)
    out: dict[str, TensorEntry] = {}
    headers: dict[str, dict[str, TensorEntry]] = {}
    for name, file in weight_map.items():
        if not isinstance(file, str) or not file or Path(file).name != file or file in (".", ".."):
            raise SpecError(where, f"{index}: tensor {brief(name)} is in {brief(file)}, not a file of this directory")
        if file not in headers:
            headers[file] = read_header(folder / file, where)
        if name not in headers[file]:
            raise SpecError(where, f"{index} puts tensor {brief(name)} in {file}, which does not hold it")
        out[name] = headers[file][name]
    for file, entries in headers.items():
        unlisted = sorted(set(entries) - {n for n, f in weight_map.items() if f == file})
        if unlisted:
            raise SpecError(where, f"{folder / file} holds {brief(unlisted[0])}, which {INDEX} does not list")
    return out


def check_weights(folder: Path, arch: ModelArch, value_head: bool, where: str, mixtral: bool = False) -> None:
    """Refuse, naming the tensor and the fix, weights that are not the model ``config.json`` describes:
    a missing or unknown tensor, a shape other than the config's, a dtype that is not floating point.
    ``mixtral``: the MoE tensors carry Mixtral's names (``moe.mixtral_name``)."""
    found = weight_files(folder, where)
    rename = mixtral_name if mixtral else str
    expected = {rename(t.name): t.shape for t in model_tensors(arch, value_head)}
    if arch.tied_embeddings and not value_head:  # a tied checkpoint may carry its head's copy, or not
        expected.setdefault("lm_head.weight", (arch.vocab, arch.hidden))
    config = f"{folder / 'config.json'}"
    for name, entry in found.items():
        if name.endswith(IGNORED_SUFFIXES):
            continue
        if name not in expected:
            raise SpecError(where, f"{folder}: tensor {brief(name)} is not a weight of the {arch.layers}-layer model "
                                   f"{config} describes: the config and the weights disagree; give the config.json "
                                   "that belongs to these weights")
        if entry.shape != expected[name]:
            raise SpecError(where, f"{folder}: tensor {name} has shape {list(entry.shape)} but {config} (hidden_size "
                                   f"{arch.hidden}, vocab_size {arch.vocab}, intermediate_size {arch.ffn_hidden}, "
                                   f"{arch.heads} heads of {arch.head_dim}, {arch.kv_heads} KV heads) needs "
                                   f"{list(expected[name])}; "
                                   "give the config.json that belongs to these weights")
        if entry.dtype not in FLOAT_DTYPES:
            raise SpecError(where, f"{folder}: tensor {name} is {entry.dtype}; weights must be one of "
                                   f"{list(FLOAT_DTYPES)} (quantised checkpoints are not supported)")
    missing = [n for n in expected if n not in found and not (n == "lm_head.weight" and arch.tied_embeddings)]
    if missing:
        raise SpecError(where, f"{folder}: tensor {missing[0]} is missing ({len(missing)} of the {len(expected)} "
                               f"weights {config} describes are missing); give the complete checkpoint")


def check_tokenizer_files(folder: Path, where: str) -> None:
    """Refuse tokenizer files the tokenizer library could hang on or choke on before it reads them: a
    directory, FIFO or device in their place, a file past its size, a JSON file that does not parse to an
    object. The library itself then loads them once (``rl.tokenizer.HFTokenizer``)."""
    for name, limit in TOKENIZER_FILE_BYTES.items():
        path = folder / name
        if not os.path.lexists(path):
            continue
        with open_regular(path, f"tokenizer ({name})") as f:
            size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise SpecError(where, f"{path} is {size / 2**20:.0f} MiB, more than any {name} (at most "
                                   f"{limit / 2**20:.0f} MiB); give the model's own tokenizer files")
        if name in JSON_TOKENIZER_FILES:
            data = read_json_file(path, name, limit)
            if not isinstance(data, dict):
                raise SpecError(where, f"{path} holds {type(data).__name__}, not a JSON object")


def check_model_dir(folder: Path, where: str) -> None:
    """The whole pre-flight of one HF model directory: ``config.json``, weights, tokenizer files."""
    config = read_json_file(folder / "config.json", "HuggingFace config.json")
    arch = arch_from_hf(config, f"{where}<{folder / 'config.json'}>")
    check_weights(folder, arch, hf_value_head(config), where, mixtral=config.get("model_type") == "mixtral")
    check_tokenizer_files(folder, where)
