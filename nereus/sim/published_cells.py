"""A published-runs row's cells read as values (``sim.published_runs``): text, numbers, whole counts, one of
a column's known words, and yes/no settings a row states in its notes. A cell that is none of what its
column holds skips the row with the reason (``RowSkipped``), never a crash or a silent guess."""

from __future__ import annotations

import math
import re

from nereus.spec.engines import ENGINE_TRAITS

# The largest whole number a row's count may hold (GPUs, tokens, sequences): the largest published runs
# count ~10^5 GPUs or 10^6 tokens a sequence, so a cell beyond 2^31 - 1 is a typo.
LARGEST_COUNT = 2**31 - 1
# The most layers a row's model may have: the deepest published LLMs have ~10^2 (Llama-3.1-405B 126), and
# the architecture is built layer by layer, so a typo's count would stall the validation, not price a model.
LARGEST_LAYERS = 10_000
# A yes/no setting a schema without its column states in ``notes`` as ``key=True|False`` (the shared
# verl rows: "checkpoint_engine=False, default CE config").
NOTE_SETTING = r"\b{key}\s*=\s*(true|false|yes|no)\b"


# Spellings of an enumerated column's value that mean one of the schema's values (e2e_runs.md), after case,
# blanks and hyphens are set aside: verl's own words for a placement ("colocate"; "standalone", its rollout
# mode on GPUs of its own, verl/workers/rollout/replica.py ``RolloutMode``) and its recipes' names for a mode
# ("one_step_off_policy", "fully_async_policy", verl/experimental), the words papers use for a
# placement or mode ("co-located", "decoupled", "on-policy", "1-step-off"), Megatron's and PyTorch FSDP's
# other names (NeMo RL's "DTensor" backend is FSDP2's ``fully_shard`` over DTensors), DeepSpeed named by its
# ZeRO-3 stage, yes/no as true/false, and algorithms that run another's stages with a different loss: GSPO
# and Dr. GRPO run GRPO's (no critic, a group of samples a prompt; Zheng et al. 2025, arXiv:2507.18071; Liu
# et al. 2025, arXiv:2503.20783), REINFORCE++ with a group baseline runs REINFORCE++'s.
YES_NO = {"true": "yes", "false": "no", "y": "yes", "n": "no"}
SYNONYMS = {
    "placement": {"colocate": "colocated", "hybrid_engine": "colocated", "co_located": "colocated",
                  "separate": "disaggregated", "separated": "disaggregated", "disaggregate": "disaggregated",
                  "disagg": "disaggregated", "decoupled": "disaggregated", "standalone": "disaggregated"},
    "sync_mode": {"on_policy": "sync", "synchronous": "sync", "1_step_off": "one_step_off",
                  "one_step_off_async": "one_step_off", "one_step_off_policy": "one_step_off",
                  "fully_asynchronous": "fully_async", "fully_async_policy": "fully_async"},
    "train_backend": {"megatron_core": "megatron", "mcore": "megatron", "megatron_lm": "megatron",
                      "fsdp1": "fsdp", "torch_fsdp": "fsdp", "pytorch_fsdp": "fsdp", "dtensor": "fsdp2",
                      "deepspeed_zero3": "deepspeed", "deepspeed_zero_3": "deepspeed", "zero3": "deepspeed",
                      "zero_3": "deepspeed"},
    "algorithm": {"gspo": "grpo", "dr_grpo": "grpo", "dr._grpo": "grpo", "reinforce++": "reinforce_pp",
                  "reinforce++_baseline": "reinforce_pp"},
    "critic": YES_NO,
    "reference": YES_NO,
    "dynamic_bsz": YES_NO,
    "enforce_eager": YES_NO,
    "partial_rollout": YES_NO,
    "checkpoint_engine": YES_NO,
}
# The ``offload`` column's other spellings: "no" as none; "yes" is offload on without its kind, which the
# schema writes as an empty cell (e2e_runs.md). Otherwise its parts, in either order, joined by "+", ",",
# "&", "/" or "and", each named as configs and papers name it (verl's ``param_offload`` /
# ``optimizer_offload``, "optimizer states", "weights").
OFFLOAD_SYNONYMS = {"no": "none", "false": "none", "off": "none", "yes": "", "true": "", "on": ""}
OFFLOAD_PARTS = {"param": "param", "params": "param", "parameter": "param", "parameters": "param",
                 "weights": "param", "param_offload": "param", "optimizer": "optimizer", "optim": "optimizer",
                 "optimizer_state": "optimizer", "optimizer_states": "optimizer", "optimizer_offload": "optimizer"}
OFFLOAD_JOINS = r"\s*(?:\+|,|&|/|\band\b)\s*"
# Columns whose words are joined by underscores in the schema ("one_step_off"); ``offload`` joins by "+".
UNDERSCORED = ("placement", "sync_mode", "train_backend", "algorithm", "critic", "reference", "dynamic_bsz",
               "enforce_eager", "partial_rollout", "checkpoint_engine")
# Where ``canonical`` keeps the cells as the row wrote them, for the reasons a row is skipped.
WRITTEN = "_as_written"
# A cell that says its value is not stated, as tables write that ("N/A", "-"): the schema's empty cell.
NOT_STATED = {"n/a", "na", "-", "\u2013", "\u2014", "?", "unknown", "not stated", "tbd"}


def canonical(row: dict) -> dict:
    """The row with its enumerated cells as the schema spells them: lower case, hyphens and blanks as
    underscores (blanks dropped around ``offload``'s "+"), and the ``SYNONYMS`` mapped; a cell that says its
    value is not stated (``NOT_STATED``) empty. What is still not a known word skips the row where the
    column is read, naming the cell as the row wrote it."""
    out, written = dict(row), {}
    for key, value in row.items():
        if key != WRITTEN and isinstance(value, str) and value.strip().lower() in NOT_STATED:
            out[key], written[key] = "", value.strip()
    for key in UNDERSCORED:
        if text(out, key):
            word = re.sub(r"[\s-]+", "_", text(out, key).lower())
            out[key], written[key] = SYNONYMS.get(key, {}).get(word, word), text(out, key)
    if text(out, "offload"):
        out["offload"], written["offload"] = offload_word(text(out, "offload")), text(out, "offload")
    out[WRITTEN] = {**row.get(WRITTEN, {}), **written}
    return out


def offload_word(written: str) -> str:
    """An ``offload`` cell as the schema spells it (``OFFLOAD_SYNONYMS``, ``OFFLOAD_PARTS``): "param",
    "optimizer" or "param+optimizer", "none", empty for offload on without its kind; a cell with a part that
    is not one of those is kept as written, lower case, and skips the row where it is read."""
    word = written.strip().lower()
    if word in OFFLOAD_SYNONYMS:
        return OFFLOAD_SYNONYMS[word]
    parts = [re.sub(r"\s+", "_", part) for part in re.split(OFFLOAD_JOINS, word)]
    if not all(part in OFFLOAD_PARTS for part in parts):
        return word
    kinds = {OFFLOAD_PARTS[part] for part in parts}
    return "+".join(k for k in ("param", "optimizer") if k in kinds)


# A version after a name ("vLLM 0.8.5", "SGLang v0.4.6.post1", "verl v0.5"): the name is what comes before it.
TRAILING_VERSION = re.compile(r"[\s_-]*\(?v?\d+(\.\w+)*\)?$", re.IGNORECASE)


def squashed(name: str) -> str:
    """A name as looked up: case, blanks, hyphens, underscores and punctuation set aside ('NeMo RL' and
    'nemo_rl', 'TensorRT-LLM' and 'tensorrt llm' are one name)."""
    return "".join(c for c in name.lower() if c.isalnum())


# Every name of every engine the catalogue declares, squashed: its key and its ``aliases``.
ENGINE_NAMES = {squashed(n): key for key, t in ENGINE_TRAITS.items() for n in (key, *t.aliases)}


def named_in(written: str, names: dict):
    """The entry of ``names`` (keyed by squashed names) a cell names: as written, or without a version
    after the name ("vLLM 0.8.5", "verl v0.5"); None when it names none."""
    for word in (written, TRAILING_VERSION.sub("", written)):
        if word.strip() and squashed(word) in names:
            return names[squashed(word)]
    return None


def engine_named(written: str) -> str | None:
    """The rollout engine (``spec.engines`` key) a cell names: the key or one of the engine's ``aliases``
    (how published tables name it: "TensorRT-LLM", "vLLM") in any case, with hyphens, blanks or underscores
    anywhere ("trt-llm"), or followed by a version ("vLLM 0.8.5"); None when no engine is so named."""
    return named_in(written, ENGINE_NAMES)


class RowSkipped(Exception):
    """A row the model cannot price; the message is the reason the validation prints."""


def text(row: dict, key: str) -> str:
    return (row.get(key) or "").strip()


# A published figure given as a bound ("<0.3": verl's "most of time under 300ms") is not a value to compare.
BOUND_MARKS = ("<", ">", "≤", "≥")
# Marks of an approximate figure ("~7", "≈ 7"): the figure is read as it is printed.
APPROXIMATE_MARKS = ("~", "≈")


def is_bound(row: dict, key: str) -> bool:
    """The cell gives a bound, not a value ("<0.3")."""
    return text(row, key).startswith(BOUND_MARKS)


# A unit after a number that is the column's own (e2e_runs.md): seconds after a time, tokens after a length,
# GPUs after a count of them, B after a count of parameters in billions ("365.28 s", "8192 tokens", "64 GPUs",
# "7.6B").
UNIT_WORDS = (("_s", ("s", "sec", "secs", "second", "seconds")), ("_len", ("token", "tokens", "tok")),
              ("gpus", ("gpu", "gpus")), ("gpus_total", ("gpu", "gpus")), ("gpus_per_node", ("gpu", "gpus")),
              ("params_b", ("b",)))
# A length cap written in thousands ("28K"): RL configs give caps in multiples of 1,024 (verl's scripts'
# ``max_response_length=$((1024 * 28))``, which its fully-async doc writes "28K tokens", 28,672 in this data
# set), so K is 1,024 there and a cap's K is read so; elsewhere a K is not read.
CAP_COLUMNS = ("max_prompt_len", "max_response_len")
# Columns holding a share of a whole, which tables also write in percent ("50%": 0.5).
SHARE_COLUMNS = ("staleness", "gpu_memory_utilization")
# A parallel degree written after its own name ("TP4", "tp=4", "EP 8"), as tables and launch flags write
# them (``train_cp`` is not read: the validation prices context parallelism as DP, e2e_runs.md).
DEGREE_NAMES = ("tp", "pp", "ep")  # each the name a column ending "_<name>" holds the degree of


def _without_unit(key: str, value: str) -> tuple[str, float]:
    """The cell's number text without the column's unit word or degree name, and the multiplier its K or %
    stands for."""
    degree = re.fullmatch(r"([a-z]+)\s*[=:]?\s*(\d+)", value, re.IGNORECASE)
    name, number = (degree.group(1).lower(), degree.group(2)) if degree else ("", "")
    if name in DEGREE_NAMES and key.endswith(f"_{name}"):
        return number, 1.0
    words = next((w for end, w in UNIT_WORDS if key.endswith(end)), ())
    unit = re.match(r"^(.*?[\dkK])\s*([a-z]+)$", value, re.IGNORECASE)  # "8K tokens": a cap's K, then its unit
    if unit and unit.group(2).lower() in words:
        value = unit.group(1)
    if key in CAP_COLUMNS and re.fullmatch(r"\d+\s*[kK]", value):
        return value[:-1].strip(), 1024.0
    if key in SHARE_COLUMNS and value.endswith("%"):
        return value[:-1].strip(), 0.01
    return value, 1.0


def number(row: dict, key: str) -> float | None:
    """A numeric cell: None when empty; thousands separators ("1,024"), a mark of an approximate figure
    ("~7"), the column's unit ("365.28 s") and a length cap's K ("28K", 28,672) are read past; a cell that is
    not a number skips the row."""
    value = text(row, key)
    if not value:
        return None
    digits, scale = _without_unit(key, value.lstrip("".join(APPROXIMATE_MARKS)).strip())
    digits = re.sub(r"(?<=\d)[,_](?=\d{3}\b)", "", digits)
    try:
        out = float(digits) * scale
    except ValueError:
        raise RowSkipped(f"{key}={value!r} is not a number") from None
    if not math.isfinite(out) or out < 0:
        raise RowSkipped(f"{key}={value!r} is not a finite non-negative number")
    return out


def count(row: dict, key: str, required: str = "", largest: int = LARGEST_COUNT) -> int | None:
    """A positive whole number up to ``largest``; with ``required`` (why it is needed) an empty cell skips
    the row."""
    value = number(row, key)
    if value is None:
        if required:
            raise RowSkipped(f"{key} is empty ({required})")
        return None
    if value < 1 or value != int(value):
        raise RowSkipped(f"{key}={text(row, key)!r} is not a positive whole number")
    if value > largest:
        raise RowSkipped(f"{key}={text(row, key)!r} is larger than any run's (at most {largest:,})")
    return int(value)


def layer_count(row: dict) -> int:
    """The model's ``n_layers`` (required), at most ``LARGEST_LAYERS``."""
    layers = count(row, "n_layers", "the architecture", LARGEST_LAYERS)
    assert layers is not None  # required: an empty cell raised
    return layers


def as_written(row: dict, key: str) -> str:
    """The cell as the row wrote it, before ``canonical`` read it: what a reason to skip the row names."""
    return row.get(WRITTEN, {}).get(key, text(row, key))


def enum(row: dict, key: str, choices, default: str = "") -> str:
    value = text(row, key).lower() or default
    if value not in choices:
        raise RowSkipped(f"{key}={as_written(row, key)!r} is not modelled (known: {', '.join(choices)})")
    return value


def setting(row: dict, key: str, default: str) -> str:
    """An optional yes/no setting: the row's column, else a ``key=True|False`` its notes state, else
    ``default``."""
    if text(row, key):
        return enum(row, key, ("yes", "no"))
    stated = re.search(NOTE_SETTING.format(key=key), text(row, "notes"), re.IGNORECASE)
    if stated is None:
        return default
    return "yes" if stated.group(1).lower() in ("true", "yes") else "no"
