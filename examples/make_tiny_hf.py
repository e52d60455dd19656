"""Make a tiny HF model directory and a verl-format GSM8K-style dataset for examples/grpo_gsm8k_hf.yaml.

    python examples/make_tiny_hf.py runs/tiny_hf     (--help: the options; --arch qwen3 for Qwen3)

writes ``runs/tiny_hf/model/`` (a randomly initialised Qwen2ForCausalLM, or Qwen3ForCausalLM with
``--arch qwen3``, or a Mixture-of-Experts Qwen3MoeForCausalLM / MixtralForCausalLM / Qwen2MoeForCausalLM with
``--arch qwen3_moe`` / ``mixtral`` / ``qwen2_moe``: 4 experts, 2 per token; saved with ``save_pretrained``,
plus a byte-level BPE tokenizer trained with the ``tokenizers`` package on the task's text, saved as a
``PreTrainedTokenizerFast`` with a ChatML chat template) and ``runs/tiny_hf/{train,val}.parquet`` (rows
in verl's format: ``data_source``, ``prompt`` as chat messages, ``ability``, ``reward_model.ground_truth``,
``extra_info``). The model's head size is 32, the smallest vLLM's CPU build runs, so
``run.rollout.engine: vllm`` (verl's ``actor_rollout_ref.rollout.name=vllm``) takes it. Everything is
synthetic and offline; a real run points ``models.<name>.path`` at a
downloaded model (e.g. Qwen2.5-0.5B-Instruct) and ``run.data`` at verl's preprocessed GSM8K Parquet files.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML, the format of Qwen2's chat template: each message between <|im_start|>role and <|im_end|>
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."


def gsm8k_rows(count: int, seed: int) -> list[dict]:
    """``count`` distinct addition questions in verl's GSM8K row format (answers as ``#### N``)."""
    rng = random.Random(seed)
    pairs = sorted({(a, b) for a in range(1, 20) for b in range(1, 20)})
    rng.shuffle(pairs)
    rows = []
    for i, (a, b) in enumerate(pairs[:count]):
        question = f"What is {a}+{b}?"
        rows.append({"data_source": "openai/gsm8k",
                     "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
                     "ability": "math",
                     "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                     "extra_info": {"split": "train", "index": i, "question": question,
                                    "answer": f"{a} plus {b} is {a + b}. #### {a + b}"}})
    return rows


def make_tokenizer(texts: list[str], folder: Path, vocab: int = 320):
    """A byte-level BPE tokenizer trained on ``texts``, saved with ChatML specials and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(texts, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(folder)
    return tok


# The smallest Qwen2 shape that vLLM's CPU build runs: its attention takes head sizes of 32 and up
# (spec.engines' cpu_head_sizes), so hidden 64 over 2 query heads; 1 KV head keeps grouped-query
# attention, and TP 2 (the example's layouts) replicates it.
ARCH = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1}
# Qwen3 gives its head size explicitly and normalises each query and key head: 4 heads of 32 over hidden 64
# (projections twice as wide as hidden, as in Qwen3-0.6B's 16 heads of 128 over 1,024), 2 KV heads.
QWEN3_ARCH = {**ARCH, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}
# Mixture of Experts (docs/moe.md): 4 experts of width 64, 2 routed per token, on the shapes above; Qwen2-MoE
# adds its shared expert, and every family keeps the checkpoint's load-balancing loss coefficient.
MOE = {"num_experts_per_tok": 2, "router_aux_loss_coef": 0.01}
MOE_ARCHS = {
    "qwen3_moe": {**QWEN3_ARCH, **MOE, "num_experts": 4, "moe_intermediate_size": 64, "norm_topk_prob": True},
    "qwen2_moe": {**ARCH, **MOE, "num_experts": 4, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 96},
    "mixtral": {**ARCH, **MOE, "num_local_experts": 4, "intermediate_size": 64, "sliding_window": None},
}
ARCHS = ("qwen2", "qwen3", *MOE_ARCHS)


def make_model(folder: Path, vocab: int, eos: int, pad: int, seed: int = 0, arch: str = "qwen2") -> None:
    """A 2-layer Qwen2ForCausalLM with random weights (``ARCH``: hidden 64, 2 query heads of size 32, 1 KV
    head), or with ``arch="qwen3"`` a Qwen3ForCausalLM (``QWEN3_ARCH``), or an MoE model (``MOE_ARCHS``)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    shape = MOE_ARCHS.get(arch) or (QWEN3_ARCH if arch == "qwen3" else ARCH)
    cfg = AutoConfig.for_model(arch, vocab_size=vocab, **shape, max_position_embeddings=256,
                               tie_word_embeddings=False, eos_token_id=eos, pad_token_id=pad, bos_token_id=None)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder, safe_serialization=True)


def make(out: str | Path, rows: int = 48, val: int = 8, seed: int = 0, arch: str = "qwen2") -> Path:
    """Write ``out/model``, ``out/train.parquet`` and ``out/val.parquet``; returns ``out``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(out)
    (out / "model").mkdir(parents=True, exist_ok=True)
    data = gsm8k_rows(rows + val, seed)
    texts = [r["prompt"][0]["content"] + " " + r["extra_info"]["answer"] for r in data] + ["user assistant system"]
    tok = make_tokenizer(texts, out / "model")
    vocab = -(-len(tok) // 64) * 64  # rounded up, as released models pad their embedding tables
    make_model(out / "model", vocab, tok.eos_token_id, tok.pad_token_id, seed, arch)
    pq.write_table(pa.Table.from_pylist(data[:rows]), out / "train.parquet")
    pq.write_table(pa.Table.from_pylist(data[rows:]), out / "val.parquet")
    return out


def main(argv: list[str] | None = None) -> int:
    """The command line: parsed first, so ``--help`` or a bad flag prints and creates nothing."""
    parser = argparse.ArgumentParser(
        prog="make_tiny_hf.py", description="Make a tiny HF model directory (random Qwen2 + BPE tokenizer with a "
                                            "chat template) and verl-format GSM8K-style train/val Parquet files.")
    parser.add_argument("out", nargs="?", default="runs/tiny_hf", help="output folder (default: runs/tiny_hf)")
    parser.add_argument("--rows", type=int, default=48, help="training rows (default: 48)")
    parser.add_argument("--val", type=int, default=8, help="held-out rows (default: 8)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data and the weights (default: 0)")
    parser.add_argument("--arch", choices=ARCHS, default="qwen2",
                        help="qwen2 (default), qwen3 (explicit head_dim, per-head q/k norms), or a Mixture of "
                             "Experts: qwen3_moe, mixtral, qwen2_moe (4 experts, 2 per token)")
    args = parser.parse_args(argv)
    if args.rows < 1 or args.val < 1 or args.rows + args.val > 361:  # 19 x 19 distinct sums of 1..19
        parser.error("--rows and --val must be at least 1 and together at most 361")
    target = make(args.out, args.rows, args.val, args.seed, args.arch)
    print(f"wrote {target}/model ({args.arch} + BPE tokenizer with a chat template), {target}/train.parquet, "
          f"{target}/val.parquet")
    return 0


if __name__ == "__main__":
    sys.exit(main())
