"""The tokenizer interface the RL code uses, and its two implementations: the built-in character
tokenizer of the built-in task (``rl.data.CharTokenizer``) and an HF tokenizer loaded from a model
directory (``tokenizer.json`` / ``tokenizer_config.json``, the ``transformers`` package), whose chat
template renders a row's messages as verl does (``apply_chat_template`` with ``add_generation_prompt``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol, runtime_checkable

from nereus.spec.errors import SpecError, cut
from nereus.spec.hf_files import TOKENIZER_FILE_BYTES, check_tokenizer_files


@runtime_checkable
class Tokenizer(Protocol):
    """What rollouts, rewards, data loading and checkpoints read of a tokenizer."""

    pad_token_id: int
    eos_token_id: int
    bos_token_id: int | None
    stop_token_ids: tuple[int, ...]  # every id that ends a response, eos_token_id first

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def prompt_ids(self, messages: list[dict]) -> list[int]: ...

    def tokenizer_files(self) -> dict[str, bytes]:
        """The files (name → contents) ``AutoTokenizer.from_pretrained`` loads this tokenizer from: every
        checkpoint carries them."""
        ...


class HFTokenizer:
    """An HF fast tokenizer from a model directory. ``prompt_ids`` renders chat messages through the
    tokenizer's chat template with the generation prompt appended (the assistant turn's header), then
    tokenises the text without adding specials again (the template already wrote them)."""

    def __init__(self, path: str | Path, where: str = "models.actor.path") -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise SpecError(where, "an HF model's tokenizer needs the transformers package "
                                   "(pip install transformers tokenizers)") from None
        self.path = Path(path)
        check_tokenizer_files(self.path, where)  # no FIFO, directory or oversized file for the library to meet
        try:
            self.hf = AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)
        except Exception as err:  # noqa: BLE001 - the library raises many types (and Rust's bare Exception)
            what = _culprit(self.path) or f"no loadable tokenizer in {self.path} ({type(err).__name__}: " \
                                          f"{_first_line(err)})"
            raise SpecError(where, f"{what}; the directory needs the model's own tokenizer.json and "
                                   "tokenizer_config.json") from None
        if self.hf.eos_token_id is None:
            raise SpecError(where, f"the tokenizer in {self.path} has no eos_token; set it in tokenizer_config.json")
        if not getattr(self.hf, "chat_template", None):
            raise SpecError(where, f"the tokenizer in {self.path} has no chat_template; prompts are chat "
                                   "messages (verl's format) and are rendered through it")
        try:  # a template of the wrong type, or one that fails to render, is refused now rather than per row
            self.prompt_ids([{"role": "user", "content": "1+1"}])
        except ValueError as err:
            raise SpecError(where, str(err)) from None
        self.eos_token_id = int(self.hf.eos_token_id)
        # no pad token (Llama): pad with EOS, as verl does; padding is masked everywhere it appears
        self.pad_token_id = int(self.hf.pad_token_id if self.hf.pad_token_id is not None else self.eos_token_id)
        self.bos_token_id = self.hf.bos_token_id
        self.stop_token_ids = model_stop_ids(self.path, self.eos_token_id)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)  # added tokens included (``hf.vocab_size`` leaves them out)

    def encode(self, text: str) -> list[int]:
        return list(self.hf(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=True)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """Token ids of ``messages`` rendered by the chat template; a template that fails (a Jinja error, a
        ``raise_exception`` for messages it refuses) is a ValueError naming the template's folder."""
        try:
            text = self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as err:  # noqa: BLE001 - Jinja and transformers raise many types
            raise ValueError(f"the chat template of {self.path} fails on these messages ({type(err).__name__}: "
                             f"{_first_line(err)})") from None
        if not isinstance(text, str):
            raise ValueError(f"the chat template of {self.path} renders {type(text).__name__}, not text")
        return self.encode(text)

    def tokenizer_files(self) -> dict[str, bytes]:
        """The tokenizer and generation files of the model directory it was loaded from, as they are."""
        return {name: (self.path / name).read_bytes() for name in TOKENIZER_FILE_BYTES
                if (self.path / name).is_file()}


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return cut(text.splitlines()[0] if text else "no message", 300)


def _culprit(folder: Path) -> str:
    """Which file the library failed on, when it is ``tokenizer.json`` (its errors do not name the file):
    loading that file alone with the ``tokenizers`` package tells. Only run once loading has failed."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        return ""
    try:
        from tokenizers import Tokenizer as RustTokenizer

        RustTokenizer.from_file(str(path))
    except Exception as err:  # noqa: BLE001 - the Rust library raises a bare Exception
        return f"{path} does not load as a tokenizer ({_first_line(err)})"
    return ""


def _ids(value: object) -> list[int]:
    """An ``eos_token_id`` entry of a config: one id or a list of them (anything else: none)."""
    items = value if isinstance(value, list) else [value]
    return [int(v) for v in items if isinstance(v, int) and not isinstance(v, bool)]


def model_stop_ids(path: Path, eos: int) -> tuple[int, ...]:
    """The ids that end a response of the model in ``path``: the tokenizer's EOS, then the ``eos_token_id``
    list of ``generation_config.json`` and of ``config.json`` (Llama 3 Instruct lists ``<|end_of_text|>``
    and ``<|eot_id|>``; transformers' ``generate`` and vLLM stop on every id of the generation config)."""
    out = [eos]
    for name in ("generation_config.json", "config.json"):
        file = path / name
        if file.is_file():
            try:
                out += _ids(json.loads(file.read_text()).get("eos_token_id"))
            except (ValueError, AttributeError):  # not a JSON object: config.json's own check names it
                continue
    return tuple(dict.fromkeys(out))
