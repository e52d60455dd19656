"""The cost of a speculative verification in plain decode steps, T(b, k + 1) / T(b, 1), as the cost model
prices it (``speculative.verify_seconds``) against the forwards measured on an H200
(``nereus/cost/verify_h200_measured.csv``, measured by ``benchmarks/verify_cost_gpu.py``; its header says how).

The ratio is what decides speculation at a live batch: a verification yields ``expected_tokens(α, k)``
tokens for that many plain steps. Absolute times are not compared here: the benchmark's plain-PyTorch
forward (cuBLAS GEMV, no split-KV decode attention) is slower than the engines the model prices
(``python benchmarks/verify_cost_gpu.py --predict nereus/cost/verify_h200_measured.csv`` prints both).
The asserts are bounds a model regression would break, wider than the errors printed by
``python tests/cost/test_verify_measured.py``.
"""

from __future__ import annotations

import csv
import statistics
from importlib import resources

from nereus.cost.decode import Replica, StepModel
from nereus.cost.hardware import Hardware
from nereus.cost.tail.speculative import expected_tokens, verify_seconds
from nereus.spec.cluster import ClusterSpec, gpu_presets
from nereus.spec.model import PRESETS


def measured() -> dict[tuple[str, int, int, int], float]:
    text = resources.files("nereus.cost").joinpath("verify_h200_measured.csv").read_text()
    rows = csv.DictReader(line for line in text.splitlines() if not line.startswith("#"))
    return {(r["shape"], int(r["batch"]), int(r["rows"]), int(r["context"])): float(r["seconds"]) for r in rows}


def ratios() -> list[tuple[tuple[str, int, int, int], float, float]]:
    """(shape, batch, rows, context), measured and predicted T(b, rows) / T(b, 1), for every rows > 1."""
    hw = Hardware(ClusterSpec(gpu_presets()["H200"], nodes=1, gpus_per_node=8))
    table = measured()
    # captured forwards: no host costs, the ``graph`` engine
    models = {shape: StepModel(Replica(hw, PRESETS[shape], 1, engine="graph")) for shape, *_ in table}
    out = []
    for (shape, b, q, c), seconds in sorted(table.items()):
        if q == 1:
            continue
        m = models[shape]
        predicted = verify_seconds(m, b, c, q) / verify_seconds(m, b, c, 1)
        out.append(((shape, b, q, c), seconds / table[(shape, b, 1, c)], predicted))
    return out


def test_verification_in_plain_steps_matches_the_h200_by_batch_and_draft_length() -> None:
    rows = ratios()
    errors = [abs(p / m - 1) for _, m, p in rows]
    assert {shape for (shape, *_), _, _ in rows} == {"llama3-8b", "qwen2.5-7b"} and len(rows) >= 130
    assert statistics.mean(errors) < 0.10  # measured 6.1%
    assert max(errors) < 0.25  # measured 17.9% (Qwen2.5-7B, batch 256, 8 rows, context 4,096)


def test_the_model_says_where_speculation_pays_as_the_h200_does() -> None:
    # Speculation pays at a row when the tokens a verification yields exceed its cost in plain steps.
    for alpha in (0.6, 0.75):
        agree = [(expected_tokens(alpha, q - 1) > m) == (expected_tokens(alpha, q - 1) > p)
                 for (_, _, q, _), m, p in ratios()]
        assert sum(agree) >= 0.95 * len(agree)  # measured: 136 and 138 of 139


def test_verification_turns_compute_bound_with_the_batch() -> None:
    by_batch = {b: (m, p) for (shape, b, q, c), m, p in ratios() if shape == "llama3-8b" and q == 8 and c == 512}
    batches = sorted(by_batch)
    for small, large in zip(batches, batches[1:], strict=False):
        assert by_batch[large][0] >= by_batch[small][0] * 0.98 and by_batch[large][1] >= by_batch[small][1]
    assert by_batch[1][0] < 1.15 and by_batch[1][1] < 1.15  # weight-read bound: 8 rows cost one step
    assert by_batch[256][0] > 4 and by_batch[256][1] > 4  # FLOP-bound: 8 rows cost over 4 steps


if __name__ == "__main__":
    rows = ratios()
    print(f"{'shape':<10} {'batch':>5} {'rows':>4} {'ctx':>5} {'measured':>9} {'predicted':>9} {'error':>7}")
    for (shape, b, q, c), m, p in rows:
        print(f"{shape:<10} {b:>5} {q:>4} {c:>5} {m:>9.2f} {p:>9.2f} {p / m - 1:>+7.1%}")
    errors = [abs(p / m - 1) for _, m, p in rows]
    print(f"mean |error| {statistics.mean(errors):.1%}, max {max(errors):.1%} over {len(rows)} rows")
