import json
import math
from dataclasses import replace

import pytest

from nereus.cli import main
from nereus.cost.hardware import Hardware
from nereus.cost.plan_cost import estimate_plan
from nereus.cost.sync_host_costs import engine_load_time, export_time
from nereus.cost.verl_weight_sync import COLOCATED_BUCKET_BYTES, hybrid_reshard_time
from nereus.cost.weight_sync import gather_broadcast_time
from nereus.sim.baselines import POLICIES, make_policy
from nereus.sim.recipes import RECIPES, fixed_recipe_tp, system_recipe_tp
from nereus.sim.report import write_report
from nereus.sim.run import simulate
from nereus.spec import load_job
from nereus.spec.trace import load_trace
from tests.conftest import EXAMPLES, ROOT
from tests.control.test_controller import small_job, trace


@pytest.mark.parametrize("name", POLICIES)
def test_every_policy_runs_and_reports(name):
    record = simulate(small_job(32), trace(12), name, seed=1, steps=12)
    s = record.summary()
    assert s["steps"] == 12 and s["mean_step_s"] > 0 and s["tokens_per_s"] > 0


def test_baselines_have_the_shape_they_model():
    job = small_job(32)
    verl = make_policy("verl-like", job).initial_plan(32)
    assert verl.strategy == "colocated" and verl.weight_sync == "hybrid-reshard"
    assert all(p.layout.tp == p.layout.pp == 1 and (p.layout.fsdp or p.layout.dp == 1)
               for p in verl.placements if p.model_stage.stage != "generation")
    orl = make_policy("openrlhf-like", job).initial_plan(32)
    assert orl.weight_sync == "gather-broadcast"
    gpu_sets = [set(p.gpus) for p in orl.placements]
    rollout = set(orl.placement("actor/generation").gpus)
    assert all(not (s & rollout) for s, p in zip(gpu_sets, orl.placements, strict=True)
               if p.model_stage.stage != "generation")
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("deepspeed-chat", job)


def test_recipe_baselines_start_from_the_cited_scripts_rollout_tp():
    job = load_job(EXAMPLES / "ppo_8b_h100.yaml")  # Llama-3-8B: the scripts set rollout TP 1, 2, 2 and 4
    assert fixed_recipe_tp(8.03)[0] == 2
    assert system_recipe_tp("OpenRLHF", "ppo", 8.03)[0] == 2
    assert system_recipe_tp("verl", "ppo", 8.03)[0] == 4  # TP 4 and TP 1 scripts: the larger
    assert system_recipe_tp("verl", "grpo", 8.03)[0] == 2
    for name, tp in (("fixed-recipe", 2), ("verl-like", 4), ("openrlhf-like", 2)):
        policy = make_policy(name, job)
        plan = policy.initial_plan(64)
        assert plan.placement("actor/generation").layout.tp == tp, name
        assert all(p.layout.tp == p.layout.pp == 1 for p in plan.placements if p.model_stage.stage != "generation")
    for r in RECIPES:  # each recipe names the script and the commit it was read at
        assert r.url.startswith("https://github.com/") and len(r.commit) == 40 and r.path.endswith(".sh")
    # a model whose heads refuse the recipe's TP gets the nearest that divides them (0.5B: 14 heads)
    small = make_policy("fixed-recipe", small_job(16)).initial_plan(16)
    assert small.placement("actor/generation").layout.tp == 2


def test_fixed_dp_is_the_fixed_oracle():
    job = small_job(16)
    a, b = make_policy("fixed-dp", job), make_policy("fixed-oracle", job)
    assert a.name == b.name == "fixed-oracle" and a.initial_plan(16) == b.initial_plan(16)


def test_weight_sync_mechanisms_cost_what_they_move():
    job = load_job(EXAMPLES / "ppo_8b_h100.yaml")
    hw = Hardware(job.cluster)
    weights = job.models["actor"].params() * 2
    orl = make_policy("openrlhf-like", job).initial_plan(64)
    train, gen = orl.placement("actor/training"), orl.placement("actor/generation")
    # the whole model leaves one rank: no faster than the model over one InfiniBand link
    assert gather_broadcast_time(hw, job, train, gen) > weights / job.cluster.gpu.inter_node_bytes_per_s
    direct = estimate_plan(hw, job, replace(orl, weight_sync="direct")).phase_times["weight_sync"]
    assert estimate_plan(hw, job, orl).phase_times["weight_sync"] > 1.5 * direct
    verl = make_policy("verl-like", job).initial_plan(64)
    train, gen = verl.placement("actor/training"), verl.placement("actor/generation")
    copies = hw.hbm_time(2 * weights) + hw.hbm_time(2 * weights / gen.layout.tp)
    buckets = math.ceil(weights / COLOCATED_BUCKET_BYTES)
    assert hybrid_reshard_time(hw, job, train, gen) == pytest.approx(
        export_time(hw, job, train.layout) + engine_load_time(job, calls=buckets) + copies)
    assert export_time(hw, job, train.layout) > hw.all_gather_time(weights, train.layout.dp)  # bytes and loop
    assert estimate_plan(hw, job, verl).phase_times["weight_sync"] == pytest.approx(
        hybrid_reshard_time(hw, job, train, gen))


def test_trace_files_cite_sources_and_load():
    paths = sorted((ROOT / "traces").glob("*.yaml"))
    assert len(paths) >= 4
    for path in paths:
        t = load_trace(path)
        assert len(t.source) > 40, f"{path.name} must cite where its numbers come from"


def test_simulate_and_report_cli(tmp_path, capsys):
    t = tmp_path / "t.yaml"
    t.write_text((ROOT / "traces" / "r1_zero_growth.yaml").read_text())
    runs = []
    for policy in ("nereus", "fixed-oracle"):
        out = tmp_path / f"{policy}.json"
        assert main(["simulate", str(t), "--job", str(EXAMPLES / "ppo_tiny_cpu.yaml"), "--policy", policy,
                     "--steps", "15", "--out", str(out), "--json"]) == 0
        runs.append(str(out))
    summary = json.loads(capsys.readouterr().out.split("\n}\n")[0] + "\n}")
    assert summary["summary"]["steps"] == 15
    outputs = write_report(runs, tmp_path / "rep")
    assert outputs["step_latency"].stat().st_size > 1000 and outputs["workload"].exists()
    timeline = json.loads(outputs["timeline"].read_text())
    assert {e["name"] for e in timeline["traceEvents"] if e["ph"] == "X"} >= {"generation", "training"}
    assert "| nereus |" in outputs["markdown"].read_text()
    assert main(["simulate", str(t), "--job", str(EXAMPLES / "ppo_tiny_cpu.yaml"), "--policy", "magic"]) == 2
    assert "--policy: 'magic' is not a policy" in capsys.readouterr().err
    lagged = tmp_path / "lag1.json"
    assert main(["simulate", str(t), "--job", str(EXAMPLES / "ppo_tiny_cpu.yaml"), "--policy", "april-like",
                 "--policy-lag", "1", "--steps", "4", "--out", str(lagged), "--json"]) == 0
    assert json.loads(lagged.read_text())["summary"]["policy_lag_max"] == 1
    assert main(["simulate", str(t), "--job", str(EXAMPLES / "ppo_tiny_cpu.yaml"), "--policy-lag", "2"]) == 2
    assert "--policy-lag: 2; give 0" in capsys.readouterr().err


def test_failure_rates_are_drawn_per_seed_and_merged_with_explicit_failures():
    base = trace(200, failures=[{"step": 7, "gpus": 8}])
    t = base.__class__(**{**base.__dict__, "failure_rate": (50.0, 8)})
    a, b, c = t.with_sampled_failures(1), t.with_sampled_failures(1), t.with_sampled_failures(2)
    assert a.failures == b.failures != c.failures
    assert (7, 8) in a.failures and len(a.failures) > 2
    assert a.with_sampled_failures(5) is a  # drawn once


def test_checkpoint_restart_loses_more_than_live_recovery():
    from nereus.control.loop import Recovery

    job = small_job(32)
    tr = trace(40, gpus=[{"step": 0, "gpus": 32}], failures=[{"step": 25, "gpus": 8}])
    live = simulate(job, tr, "nereus", seed=2, steps=40, recovery=Recovery("live")).summary()
    restart = simulate(job, tr, "nereus", seed=2, steps=40,
                       recovery=Recovery("restart", checkpoint_every=10, restart_s=120)).summary()
    assert live["failures"] == restart["failures"] == 1
    assert restart["lost_s"] > 120 + live["lost_s"]


def test_a_growing_batch_follows_the_gpus_for_the_simulator_and_the_policies():
    from nereus.sim.backend import SimBackend
    from nereus.sim.workload import GrowingBatchJob

    job = GrowingBatchJob.of(small_job(32), prompts_per_gpu=8)
    assert job.sequences_per_step() == 256 and job.with_gpus(16).sequences_per_step() == 128
    assert job.prompts_for(12) == 64  # whole nodes only: 8 usable GPUs
    tr = trace(10, gpus=[{"step": 0, "gpus": 16}, {"step": 5, "gpus": 32}])
    backend = SimBackend(job, tr, initial_gpus=16)
    assert [len(backend.draw_lengths(s)) for s in (4, 5)] == [128, 256]
    fixed = simulate(small_job(32), tr, "fixed-oracle", seed=1, steps=10, initial_gpus=16)
    grown = simulate(job, tr, "fixed-oracle", seed=1, steps=10, initial_gpus=16)
    tokens = [s["tokens"] for s in grown.steps]
    fixed_tokens = [s["tokens"] for s in fixed.steps]
    # same lengths drawn per sequence, twice the sequences once the cluster doubles
    assert tokens[5] / tokens[4] > 1.5 and 0.67 < fixed_tokens[5] / fixed_tokens[4] < 1.5
    assert grown.steps[0]["gpus"] == 16 and grown.steps[-1]["gpus"] == 32


@pytest.mark.slow
@pytest.mark.parametrize("job_name", ["ppo_8b_h100.yaml", "grpo_7b_h100.yaml"])
def test_verl_like_finds_a_layout_at_the_longest_responses_of_the_long_tail_traces(job_name):
    # 20,480-token responses: verl trains them with gradient checkpointing (its example scripts), and
    # two inference passes tied at the largest transient no longer block the planner's memory swaps.
    job = load_job(EXAMPLES / job_name)
    for name in ("long_tail_dapo", "r1_zero_growth"):
        tr = load_trace(ROOT / "traces" / f"{name}.yaml")
        step_job = job.with_response(tr.response_at(tr.steps - 1))
        plan = make_policy("verl-like", step_job).initial_plan(step_job.cluster.num_gpus)
        training = [p.layout for p in plan.placements if p.model_stage.stage == "training"]
        assert training and all(t.recompute == "full" and t.fsdp for t in training)
        assert estimate_plan(Hardware(step_job.cluster), step_job, plan).feasible


def test_a_baseline_whose_recipe_fits_no_layout_after_growing_takes_any_layout_that_fits(monkeypatch):
    """A grown job none of the recipe's layouts fits (memory at its longer responses) gets the best layout
    its strategies allow, as an operator's fix after the out-of-memory error, not a crashed comparison."""
    import nereus.sim.baselines as baselines
    from nereus.planner.search import Constraints
    from nereus.sim.baselines import StaticPolicy
    from nereus.spec.errors import InfeasibleError

    job = small_job(32)
    policy = StaticPolicy("pinned", job, Constraints(("colocated",), lambda ms, layout: layout.tp == 1), True)
    policy.initial_plan(16)
    real, asked = baselines.search, []

    def recipe_never_fits(hw, target, forecast, constraints):
        asked.append(constraints)
        if constraints.layout_filter is not None:
            raise InfeasibleError("actor/training", 81e9, 80e9)
        return real(hw, target, forecast, constraints=constraints)

    monkeypatch.setattr(baselines, "search", recipe_never_fits)
    result = policy._search(job)
    assert len(asked) == 3 and asked[-1].strategies == ("colocated",) and asked[-1].layout_filter is None
    assert result.plan.strategy == "colocated"
    assert policy.pinned == {p.model_stage: (p.layout.tp, p.layout.pp) for p in result.plan.placements}
    monkeypatch.setattr(baselines, "search", lambda *a, **k: (_ for _ in ()).throw(InfeasibleError("x", 2, 1)))
    with pytest.raises(InfeasibleError):  # nothing fits at all: the comparison cannot go on
        policy._search(job)
