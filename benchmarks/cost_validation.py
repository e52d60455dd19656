"""The cost model against published GPT training measurements, side by side.

    python benchmarks/cost_validation.py
"""

from nereus.cost.published import HELD_OUT, MOE_PRETRAINING, narayanan_rows
from nereus.planner.published import held_out_prediction, moe_pretraining_tokens, row_tflops


def main() -> None:
    print("Narayanan et al. 2021, Table 1 (A100, TP/PP/DP as published):")
    errors = []
    for r in narayanan_rows():
        predicted, published = row_tflops(r), float(r["achieved_tflops_per_gpu"])
        errors.append(predicted / published - 1)
        print(f"  {r['params_billion']:>7}B TP{r['tensor_parallel']:>2} PP{r['pipeline_parallel']:>3} "
              f"{r['gpus']:>5} GPUs: predicted {predicted:6.1f} TFLOP/s, published {published:5.0f}  "
              f"({100 * errors[-1]:+5.1f}%)")
    print(f"  mean absolute error {100 * sum(map(abs, errors)) / len(errors):.1f}%, "
          f"worst {100 * max(errors, key=abs):+.1f}%")
    print("Held out:")
    for case in HELD_OUT:
        metric, predicted, published = held_out_prediction(case)
        scale = 100 if metric == "MFU" else 1
        print(f"  {case['name']:<48} {metric} predicted {scale * predicted:6.1f}, published {scale * published:6.1f}"
              f"  ({100 * (predicted / published - 1):+5.1f}%)  [{case['source']}]")
    print("Held out, Mixture-of-Experts pre-training (Megatron-Bridge performance summary, 25.11, BF16):")
    for case in MOE_PRETRAINING:
        published, hosts = case["tokens_per_s_per_gpu"], moe_pretraining_tokens(case, gpus_per_node=4)
        predicted = moe_pretraining_tokens(case)
        print(f"  {case['name']:<48} tokens/s/GPU predicted {predicted:6.0f}, published {published:5.0f}"
              f"  ({100 * (predicted / published - 1):+5.1f}%); NVLink as 4-GPU trays: {hosts:5.0f}"
              f" ({100 * (hosts / published - 1):+5.1f}%)")


if __name__ == "__main__":
    main()
