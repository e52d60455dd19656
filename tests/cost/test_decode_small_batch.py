"""The decode model at small batch and across TP degrees, against published figures it was not set on.

``nereus/cost/decode_small_batch.csv`` (its header cites every source) holds batch/concurrency 1-16 rows at
TP 1-8 from gpt-fast, SGLang, vLLM V1, NVIDIA NIM (TensorRT-LLM) and vLLM V0. One set of priors predicts
every row; each row's engine supplies only its host costs (``spec.engines.ENGINE_TRAITS``, looked up by the
row's engine name). vLLM V0's rows are reported, not validated: its host work per step and per sequence
grows with the TP group, a term the model does not carry. Run ``python tests/cost/test_decode_small_batch.py``
for the table.
"""

from __future__ import annotations

import csv
import re
from importlib import resources

import pytest

from nereus.cost.decode import Precision, Replica, step_time
from nereus.cost.decode_events import generation_time
from nereus.cost.hardware import Hardware
from nereus.spec.cluster import ClusterSpec, gpu_presets
from nereus.spec.engines import engine_traits
from nereus.spec.model import PRESETS, ModelArch

# Llama-2-7B (meta-llama/Llama-2-7b-hf config.json): MHA, 11008 FFN, 32k vocabulary.
ARCHS = {"llama2-7b": ModelArch(32, 4096, 11008, 32, 32, 32000), **PRESETS}
VALIDATED = ("GPTFAST", "SGLANG-DOCS", "EAGLE-PR173", "VLLM-PR16937", "NIM-BENCH")
REPORTED = ("VLLM-ISSUE16300",)


def rows() -> list[dict[str, str]]:
    text = resources.files("nereus.cost").joinpath("decode_small_batch.csv").read_text()
    return list(csv.DictReader(line for line in text.splitlines() if not line.startswith("#")))


def replica(row: dict[str, str]) -> Replica:
    gpu = gpu_presets()[re.match(r"[AH]\d00", row["gpu"]).group(0)]
    hw = Hardware(ClusterSpec(gpu, nodes=1, gpus_per_node=8))
    engine = engine_traits(row["engine"])  # vLLM V0 is priced as vLLM (and misses by its host work)
    return Replica(hw, ARCHS[row["arch"]], int(row["tp"]), Precision.of(row["precision"]), engine.name,
                   engine_costs=engine.host)


def predict(row: dict[str, str]) -> float:
    """The row's figure as the model predicts it, in the row's unit."""
    r, b = replica(row), int(row["batch"])
    isl, osl = int(row["input_len"]), int(row["output_len"])
    if row["unit"] == "s":  # one batch end to end: prefill, then osl - 1 decode steps
        return generation_time(r, isl, [osl] * b, b).total_s
    step = step_time(r, b, isl + osl / 2).total  # a decode step at the mean context of the generation
    return step * 1e3 if row["unit"] == "ms" else b / step


def errors() -> list[tuple[dict[str, str], float, float]]:
    """(row, predicted, error) with error = predicted time per token / published − 1 (negative: too fast)."""
    out = []
    for row in rows():
        pred, pub = predict(row), float(row["value"])
        err = pub / pred - 1 if row["unit"] == "tokens/s" else pred / pub - 1
        out.append((row, pred, err))
    return out


def by_source(errs: list[tuple[dict[str, str], float, float]]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for row, _, err in errs:
        out.setdefault(row["source_id"], []).append(err)
    return out


@pytest.fixture(scope="module")
def errs() -> list[tuple[dict[str, str], float, float]]:
    table = errors()
    print("\n" + markdown(table))
    return table


def test_every_validated_source_is_within_a_fifth_on_average(errs) -> None:
    """The phase-1 acceptance: small-batch rows of at least two more sources within 20% mean error.
    Measured: gpt-fast, SGLang (two sources), vLLM V1 and NIM each within 20% mean (tables in
    docs/cost-model.md)."""
    groups = by_source(errs)
    for source in VALIDATED:
        mean = sum(abs(e) for e in groups[source]) / len(groups[source])
        assert mean <= 0.20, (source, mean)
    assert all(abs(e) <= 0.30 for s in VALIDATED for e in groups[s])


def test_tp_sweeps_keep_their_shape(errs) -> None:
    """gpt-fast's TP sweeps at batch 1: the model's per-token latency falls with TP as the published one
    does (7B: 1 -> 8, 70B: 2 -> 8), and the errors along a sweep stay within 20 points of each other (a
    fixed cost that did not fall with TP, or an all-reduce priced per rank, would tilt them)."""
    for model in ("Llama-2-7B", "Llama-2-70B"):
        sweep = [(int(r["tp"]), p, e) for r, p, e in errs if r["source_id"] == "GPTFAST" and r["model"] == model]
        sweep.sort()
        assert all(a[1] < b[1] for a, b in zip(sweep, sweep[1:], strict=False)), sweep  # tokens/s rises
        assert max(e for *_, e in sweep) - min(e for *_, e in sweep) <= 0.20, sweep


def test_vllm_v0_rows_are_slower_than_the_model_says(errs) -> None:
    """What the model does not carry, measured: vLLM 0.7.2's V0 engine on A100 is 17-48% slower than the
    model at batch 1-16 and TP 2-8, worst at TP 8 and batch 16 (its host work per sequence grows with the
    TP group: about 190, 290 and 370 µs per sequence per step at TP 2, 4 and 8 from the batch-16 minus
    batch-1 rows). If this fails the model gained such a term: move the rows into the validated set."""
    v0 = by_source(errs)["VLLM-ISSUE16300"]
    assert all(e < -0.10 for e in v0) and min(v0) < -0.35


def markdown(errs: list[tuple[dict[str, str], float, float]]) -> str:
    out = ["| row | source | GPU | model | prec | engine | TP | batch | in/out | published | predicted | error |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row, pred, err in errs:
        out.append(f"| {row['row_id']} | {row['source_id']} | {row['gpu'][:4]} | {row['model']} | {row['precision']} | "
                   f"{row['engine']} | {row['tp']} | {row['batch']} | {row['input_len']}/{row['output_len']} | "
                   f"{float(row['value']):,.2f} {row['unit']} | {pred:,.2f} | {err:+.1%} |")
    out.append("")
    for source, es in by_source(errs).items():
        tag = "validated" if source in VALIDATED else "reported"
        out.append(f"{source} ({tag}): mean |error| {sum(abs(e) for e in es) / len(es):.1%}, "
                   f"max {max(abs(e) for e in es):.1%} over {len(es)} rows")
    return "\n".join(out)


if __name__ == "__main__":
    print(markdown(errors()))
