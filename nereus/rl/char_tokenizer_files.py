"""The built-in character tokenizer (``rl.data.CharTokenizer``) as the files an HF tokenizer loads from, so a
checkpoint of the built-in task carries its tokenizer like an HF model's does:
``AutoTokenizer.from_pretrained(step_<N>/actor)`` (or ``tokenizers.Tokenizer.from_file(.../tokenizer.json)``)
encodes and decodes as the run did, and the folder can be a later job's ``models.actor.path``.

``tokenizer.json`` is the ``tokenizers`` library's serialised form, written here as plain JSON (no
dependency): a word-level model whose vocabulary maps each character of the alphabet to its id, a
pre-tokenizer that splits the text into single characters, and a decoder that joins the pieces without
spaces. The three specials are added tokens named in brackets, which no alphabet character can spell, so
a prompt's text never reads as one. A character outside the alphabet has no id (the library refuses it,
as ``CharTokenizer.encode`` does). ``tokenizer_config.json`` names the specials and the chat template:
BOS, then each message's content, as ``CharTokenizer.prompt_ids``.
"""

from __future__ import annotations

import json

SPECIAL_NAMES = ("[PAD]", "[BOS]", "[EOS]")  # ids 0, 1, 2 (rl.data's PAD, BOS, EOS)
CHAT_TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"


def char_tokenizer_files(alphabet: str, specials: tuple[int, int, int]) -> dict[str, bytes]:
    """``tokenizer.json`` and ``tokenizer_config.json`` (name → contents) of a tokenizer giving the
    ``i``-th character of ``alphabet`` id ``i + 3`` and ``SPECIAL_NAMES`` the ids ``specials`` (pad, bos, eos)."""
    if any(c in "[]" for c in alphabet):
        raise ValueError(f"the alphabet {alphabet!r} holds a bracket, which spells the special tokens' names")
    ids = dict(zip(SPECIAL_NAMES, specials, strict=True))
    vocab = {**ids, **{c: i + 3 for i, c in enumerate(alphabet)}}
    added = [{"id": i, "content": name, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for name, i in sorted(ids.items(), key=lambda kv: kv[1])]
    tokenizer = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
                 # every character a piece of its own (a newline, which "." skips, stays a piece and is refused)
                 "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "."}, "behavior": "Isolated",
                                   "invert": False},
                 "post_processor": None, "decoder": {"type": "Fuse"},
                 "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}}
    pad, bos, eos = SPECIAL_NAMES
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": pad, "bos_token": bos, "eos_token": eos,
              "clean_up_tokenization_spaces": False,  # " ." stays " .": characters are decoded as they are
              "chat_template": CHAT_TEMPLATE}
    return {"tokenizer.json": json.dumps(tokenizer, indent=1, ensure_ascii=False).encode(),
            "tokenizer_config.json": json.dumps(config, indent=1).encode()}
