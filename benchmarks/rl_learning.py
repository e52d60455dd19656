"""Learning check of the RL job: runs `nereus run` on examples/ppo_tiny.yaml (adaptive: the controller's
layouts, a worker leaving and rejoining), examples/ppo_tiny_fixed.yaml (hand-picked layouts on 4 workers)
and examples/grpo_tiny.yaml, and prints wall time and held-out exact-match accuracy after the supervised
warm-start and at the end. Target: each run finishes in <= 15 minutes on the 2-core
development machine and gains >= 20 accuracy points.

    python benchmarks/rl_learning.py [--only ppo|ppo-fixed|grpo] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = {"ppo": ROOT / "examples" / "ppo_tiny.yaml", "ppo-fixed": ROOT / "examples" / "ppo_tiny_fixed.yaml",
            "grpo": ROOT / "examples" / "grpo_tiny.yaml"}
LIMIT_S, GAIN_POINTS = 15 * 60, 20.0


def run_one(name: str, out: Path) -> dict:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "nereus.cli", "run", str(EXAMPLES[name]), "--out", str(out),
                           "--json"], capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"{name}: nereus run failed with exit code {proc.returncode}")
    summary = json.loads(proc.stdout)
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"wall_s": wall, "warm": summary["warmstart_accuracy"], "final": summary["final_accuracy"],
            "steps": len(steps), "step_s": statistics.median(s["timing_s/step"] for s in steps),
            "gen_s": statistics.median(s["timing_s/gen"] for s in steps),
            "update_actor_s": statistics.median(s["timing_s/update_actor"] for s in steps),
            "response_first": steps[0]["response_length/mean"], "response_last": steps[-1]["response_length/mean"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=sorted(EXAMPLES))
    parser.add_argument("--out", type=Path, help="keep run folders here (default: a temporary folder)")
    args = parser.parse_args()
    names = [args.only] if args.only else ["ppo", "ppo-fixed", "grpo"]
    root = args.out or Path(tempfile.mkdtemp(prefix="nereus-rl-"))
    ok = True
    print(f"{'job':<10}{'wall':>9}{'steps':>7}{'step':>8}{'gen':>7}{'update':>8}{'warm-start':>12}{'final':>8}"
          f"{'gain':>8}  resp. length first->last")
    for name in names:
        r = run_one(name, root / name)
        gain = 100 * (r["final"] - r["warm"])
        passed = r["wall_s"] <= LIMIT_S and gain >= GAIN_POINTS
        ok &= passed
        print(f"{name:<10}{r['wall_s']:>8.0f}s{r['steps']:>7}{r['step_s']:>7.2f}s{r['gen_s']:>6.2f}s"
              f"{r['update_actor_s']:>7.2f}s{100 * r['warm']:>11.1f}%{100 * r['final']:>7.1f}%{gain:>+7.1f}"
              f"  {r['response_first']:.2f} -> {r['response_last']:.2f}  {'ok' if passed else 'FAIL'}", flush=True)
    print(f"(step, gen, update: medians per step; acceptance: wall <= {LIMIT_S // 60} min and gain >= "
          f"{GAIN_POINTS:.0f} points; run folders in {root})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
