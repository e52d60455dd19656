"""Prompt datasets in verl's format (Parquet or JSONL rows with ``data_source``, ``prompt`` (chat
messages), ``ability``, ``reward_model.ground_truth`` and ``extra_info``), a character tokenizer for the
built-in task, and validation whose errors name the file, the row and the field. Prompts are rendered by
the job's tokenizer (``rl.tokenizer``): an HF tokenizer's chat template, or the built-in one."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nereus.rl.tokenizer import Tokenizer

PAD, BOS, EOS = 0, 1, 2
ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz +-*=:<>,.?"


class DataError(ValueError):
    """A data file problem; the message names the file, the row (0-based) and the field."""

    def __init__(self, path: str | Path, row: int | None, field: str | None, message: str) -> None:
        where = str(path)
        if row is not None:
            where += f": row {row}"
        if field is not None:
            where += f": field '{field}'"
        super().__init__(f"{where}: {message}")


class CharTokenizer:
    """One token per character of ``ALPHABET`` after three specials (pad 0, bos 1, eos 2). Real jobs use
    the model's tokenizer; the built-in task needs no download."""

    def __init__(self, alphabet: str = ALPHABET) -> None:
        self.alphabet = alphabet
        self.index = {c: i + 3 for i, c in enumerate(alphabet)}
        self.pad_token_id, self.bos_token_id, self.eos_token_id = PAD, BOS, EOS
        self.stop_token_ids = (EOS,)

    @property
    def vocab_size(self) -> int:
        return len(self.alphabet) + 3

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; raises KeyError naming a character outside the alphabet."""
        out = []
        for c in text:
            if c not in self.index:
                raise KeyError(f"character {c!r} is not in the tokenizer's alphabet {self.alphabet!r}")
            out.append(self.index[c])
        return out

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` without specials; ids past the alphabet (a model's vocabulary may be larger)
        decode as U+FFFD so they never match an answer."""
        return "".join(self.alphabet[i - 3] if i - 3 < len(self.alphabet) else "\ufffd" for i in ids if i >= 3)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The chat template of this tokenizer: BOS, then the messages' contents in order."""
        return [BOS] + [t for m in messages for t in self.encode(m["content"])]

    def tokenizer_files(self) -> dict[str, bytes]:
        """This tokenizer as HF tokenizer files (``rl.char_tokenizer_files``), written into checkpoints."""
        from nereus.rl.char_tokenizer_files import char_tokenizer_files

        return char_tokenizer_files(self.alphabet, (PAD, BOS, EOS))


@dataclass(frozen=True)
class Prompt:
    ids: tuple[int, ...]
    ground_truth: str
    data_source: str
    index: int  # row in its file
    extra_info: dict = field(default_factory=dict, compare=False)  # verl's per-row extras, for reward functions


def _messages(value: object) -> list[dict]:
    """verl's ``prompt`` is a list of chat messages; a bare string is accepted as one user message."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise ValueError("expected a non-empty list of chat messages or a string")
    for m in value:
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise ValueError(f"expected messages like {{'role': 'user', 'content': '...'}}, got {m!r}")
    return value


def read_rows(path: str | Path) -> list[dict]:
    """Rows of a ``.jsonl`` or ``.parquet`` file as dicts."""
    path = Path(path)
    if not path.exists():
        raise DataError(path, None, None, "file not found")
    if not (path.is_file() or path.is_dir()):  # a FIFO or device would block the read or never end
        raise DataError(path, None, None, "not a regular file")
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DataError(path, None, None, "reading Parquet needs pyarrow (pip install pyarrow)") from None
        try:
            dataset = pq.ParquetDataset(path)
            check_parquet_schema(path, dataset.schema, sum(f.metadata.num_rows for f in dataset.fragments))
            return dataset.read().to_pylist()
        except DataError:
            raise
        except Exception as err:  # noqa: BLE001 - pyarrow raises several types for a damaged file
            text = " ".join(str(err).split())[:200] or type(err).__name__
            raise DataError(path, None, None, f"not a readable Parquet file: {text}") from None
    if path.suffix not in (".jsonl", ".json"):
        raise DataError(path, None, None, "expected a .jsonl or .parquet file")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as err:  # a directory, no permission, binary
        raise DataError(path, None, None, f"cannot read it as UTF-8 text: {getattr(err, 'strerror', None) or err}") \
            from None
    rows = []
    for i, line in enumerate(text.splitlines()):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(path, i, None, f"not valid JSON: {err.msg} (column {err.colno})") from None
        except (ValueError, RecursionError) as err:  # an over-long integer; nesting past the decoder's limit
            raise DataError(path, i, None, f"not valid JSON: {str(err)[:80] or 'nested too deeply'}") from None
        if not isinstance(row, dict):
            raise DataError(path, i, None, f"expected a JSON object, got {type(row).__name__}")
        rows.append(row)
    return rows


# Rows of one data file: verl's largest preprocessed sets hold ~10^5-10^6 prompts; every row is tokenised
# up front, so past this a file is refused before its rows are read.
MAX_ROWS = 10**7


def check_parquet_schema(path: Path, schema: object, rows: int) -> None:
    """Refuse a Parquet file whose columns cannot hold verl's rows, before any row is read: ``prompt`` (chat
    messages or text) and ``reward_model`` (with ``ground_truth``) present; ``data_source`` text;
    ``extra_info`` a struct or map. Values are still checked row by row (``load_prompts``)."""
    import pyarrow as pa

    if rows > MAX_ROWS:
        raise DataError(path, None, None, f"{rows:,} rows is more than a data file holds (at most {MAX_ROWS:,})")
    names = set(schema.names)
    for name in ("prompt", "reward_model"):
        if name not in names:
            raise DataError(path, None, name, f"column is missing (columns: {sorted(names)[:12]}); give verl's "
                                              "format: data_source, prompt, ability, reward_model, extra_info")
    prompt = schema.field("prompt").type
    if not (pa.types.is_string(prompt) or pa.types.is_large_string(prompt) or
            (pa.types.is_list(prompt) or pa.types.is_large_list(prompt)) and pa.types.is_struct(prompt.value_type)
            and prompt.value_type.get_field_index("content") >= 0):
        raise DataError(path, None, "prompt", f"column has type {prompt}; give a list of chat messages "
                                              "(struct<role: string, content: string>) or text")
    reward = schema.field("reward_model").type
    if not pa.types.is_struct(reward) or reward.get_field_index("ground_truth") < 0:
        raise DataError(path, None, "reward_model", f"column has type {reward}; give a struct with ground_truth")
    if "data_source" in names and not pa.types.is_string(source := schema.field("data_source").type) and \
            not pa.types.is_large_string(source) and not pa.types.is_null(source):
        raise DataError(path, None, "data_source", f"column has type {source}; give text")
    if "extra_info" in names:
        extra = schema.field("extra_info").type
        if not (pa.types.is_struct(extra) or pa.types.is_map(extra) or pa.types.is_null(extra)):
            raise DataError(path, None, "extra_info", f"column has type {extra}; give a struct or map")


def load_prompts(path: str | Path, tokenizer: Tokenizer, max_prompt_length: int, drop_overlong: bool = False,
                 notes: list[str] | None = None) -> list[Prompt]:
    """Validated, tokenised prompts of a verl-format file; any bad row raises ``DataError``. A prompt past
    ``max_prompt_length`` tokens is one too, unless ``drop_overlong`` (verl's ``data.filter_overlong_prompts``):
    then it is left out and ``notes`` gets a line with the count."""
    out, dropped = [], 0
    for i, row in enumerate(read_rows(path)):
        for key in ("prompt", "reward_model"):
            if key not in row or row[key] is None:
                raise DataError(path, i, key, "required field is missing")
        try:
            ids = tokenizer.prompt_ids(_messages(row["prompt"]))
        except (ValueError, KeyError) as err:
            raise DataError(path, i, "prompt", str(err).strip('"')) from None
        if len(ids) > max_prompt_length and drop_overlong:
            dropped += 1
            continue
        if len(ids) > max_prompt_length:
            raise DataError(path, i, "prompt", f"{len(ids)} tokens exceed the maximum prompt length "
                                               f"{max_prompt_length} (workload.prompt_length)")
        rm = row["reward_model"]
        truth = rm.get("ground_truth") if isinstance(rm, dict) else None
        if not isinstance(truth, str | int | float) or isinstance(truth, bool):
            raise DataError(path, i, "reward_model.ground_truth", f"expected a string, got {truth!r}")
        source = row.get("data_source", "unknown")
        if not isinstance(source, str):
            raise DataError(path, i, "data_source", f"expected a string, got {source!r}")
        extra = row.get("extra_info") or {}
        if not isinstance(extra, dict):
            raise DataError(path, i, "extra_info", f"expected a mapping, got {extra!r}")
        out.append(Prompt(tuple(ids), str(truth), source, i, extra))
    if dropped and notes is not None:
        notes.append(f"{path}: {dropped} rows dropped, their prompts exceed {max_prompt_length} tokens "
                     "(run.data.filter_overlong_prompts)")
    if not out:
        raise DataError(path, None, None, "no rows" + (f" left ({dropped} over the maximum prompt length)"
                                                       if dropped else ""))
    return out


def write_rows(path: str | Path, rows: list[dict]) -> Path:
    """Write rows as JSONL or Parquet (by suffix)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
