"""``nereus run``: set up (data, warm-start, layouts, workers), run the steps with metrics and periodic
checkpoints, evaluate held-out accuracy, resume from the latest checkpoint.

A checkpoint ``<dir>/step_<N>/`` holds every trained model as an HF checkpoint (``config.json`` +
``model.safetensors``, layout-independent) and its Adam state per worker of its training layout as
safetensors (``optim/<model>/rank<r>.safetensors``: fp32 master shard, moments, step count; no pickle),
plus ``state.json`` (with the layout and worker order each optimizer shard was written under), and last
``MANIFEST.json`` (every file's size and SHA-256, checksummed itself). ``run.checkpoint`` writes a step to a
temporary folder renamed when complete and replaces ``latest`` atomically; ``--resume`` refuses a truncated,
corrupted, unlisted or relabelled file by name, falls back to the newest complete checkpoint with a warning,
and re-shards optimizer state written under another placement (docs/reliability.md). The initial weights
(warm-start) live in ``<dir>/init/``.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from nereus.control.backend import RecoveryMetrics, WorkersLost
from nereus.control.loop import ControlLoop, Observer, StepOutcome
from nereus.control.record import RunRecord
from nereus.rl.data import Prompt
from nereus.rl.rewards import RewardRouter, correct
from nereus.rl.user_registry import load_algorithm_modules
from nereus.run.adaptive import AdaptationLog, engine_text, policy_for
from nereus.run.backend import RuntimeBackend, plan_text
from nereus.run.checkpoint import (
    STATE,
    StepWriter,
    WriteHook,
    optimizer_tag,
    placement_change,
    placement_record,
    read_optimizer_files,
    resumable,
    written_training,
)
from nereus.run.driver import RLStep
from nereus.run.manifest import verify_manifest, write_manifest, write_text_atomic
from nereus.run.metrics import MetricsLog, Progress, check_loggers, prepare_resume
from nereus.run.midstep import move_line
from nereus.run.setup import (
    EVALUATION,
    TRAINED,
    Placed,
    check_batches,
    check_model_dirs,
    check_rule_reward,
    datasets,
    model_configs,
    placed_from_plan,
    reward_router,
    tokenizer_for,
)
from nereus.run.tail_decisions import LeverLog
from nereus.run.warmstart import (
    check_sources,
    initial_checkpoints,
    initial_sources,
    pretrained_checkpoints,
    write_sources,
)
from nereus.runtime.cluster.workers import Runtime
from nereus.runtime.engines.native.fixed_batch import SamplingParams
from nereus.runtime.engines.sampling import derive_seed
from nereus.runtime.hosts.raylocal import SESSION, session_record
from nereus.runtime.model.hf import save_checkpoint
from nereus.runtime.transitions.live import KeySpec
from nereus.spec.errors import SpecError
from nereus.spec.files import read_json_file
from nereus.spec.generation import SetSpeculation
from nereus.spec.job import JobSpec
from nereus.spec.layout import Plan
from nereus.spec.parallel_dims import ParallelDims
from nereus.spec.run import resolve_steps


class RLJob(Observer):
    """One RL job on the runtime: set-up, then the control loop (``control.loop``) over its backend
    (``run.backend.RuntimeBackend``); as the loop's observer it logs, evaluates and checkpoints each step."""

    def __init__(self, job: JobSpec, runtime: Runtime | None = None, out_dir: str | Path | None = None,
                 quiet: bool = False, workers: int | None = None, address: str | None = None) -> None:
        if job.run is None:
            raise SpecError("run", "`nereus run` needs a `run:` section (see docs/rl.md)")
        if workers is not None:
            job = replace(job, run=replace(job.run, workers=workers))
        self.job, self.run, self.quiet = job, job.run, quiet
        self.address = address  # a Ray cluster to join (``nereus run --address``); None: a local Ray
        self.dir = Path(out_dir or job.run.checkpoint_dir)
        check_model_dirs(job)  # HF directories' files, before any library reads them (spec.hf_files)
        self.tok = tokenizer_for(job)  # the actor's HF tokenizer (models.actor.path) or the built-in one
        self.cfgs = model_configs(job, self.tok)
        self.notes: list[str] = []  # what loading the data dropped (run.data.filter_overlong_prompts)
        self.train, self.val = datasets(job, self.tok, self.dir, self.notes)
        if not job.run.steps:  # run.total_epochs: the steps follow from the training rows
            job = replace(job, run=resolve_steps(job.run, len(self.train), job.workload.prompts_per_step))
            self.job, self.run = job, job.run
        # adaptive: the controller picks (and later changes) every layout; fixed: the job's own layouts
        self.policy, self.plan, self._placed = policy_for(job)
        check_batches(job, self._placed)
        check_loggers(self.run.logger)  # a missing wandb/mlflow fails now, not after the warm-start
        check_rule_reward(job, self.train + self.val)
        # the user's reward function (run.reward_function) is imported by ``execute`` once every check passed
        # (and before the header, in a child process: run.user_check)
        self.reward: RewardRouter | None = None
        self._own_runtime = runtime is None
        self.rt = runtime
        self.backend: RuntimeBackend | None = None
        self.record = RunRecord(self.policy.name, job.name, "runtime", self.run.seed)
        self.state: dict = {}
        self.recoveries: list[dict] = []
        self.warnings: list[str] = []  # broken checkpoints a resume skipped
        self.last: dict[str, float] = {}
        self.adaptation: AdaptationLog | None = None
        self.levers = LeverLog() if job.run.rollout_levers == "auto" else None
        self.midstep_log: AdaptationLog | None = None
        self._ran_on: Plan | None = None  # the plan the step being observed ran on (its metric line names it)
        self.log: MetricsLog | None = None
        self.bar: Progress | None = None

    @property
    def placed(self) -> list[Placed]:
        """Every model-stage's runtime placement now (the backend's, once the workers run)."""
        return self.backend.placed if self.backend is not None else self._placed

    def say(self, text: str) -> None:
        if not self.quiet:
            print(text, file=sys.stderr, flush=True)

    # ----- models -------------------------------------------------------------------------------------
    def _start(self, source: dict[str, Path], optim: Path | None = None) -> None:
        """Start (or take) the workers and load every key from ``source``; with ``optim`` (a checkpoint's
        folder) also install each trained model's Adam state — under the layout and worker order the
        checkpoint recorded, re-sharded onto the current placement by the transition executor if it differs."""
        if self.rt is None:
            start = self.run.workers
            if self.run.adapt:  # the workers available at first, and at least those the plan uses (resume)
                start = max(self.run.adapt.workers_at(0, self.run.workers),
                            1 + max(r for p in self.placed for r in p.ranks))
            self.rt = Runtime(start, address=self.address, max_workers=self.run.max_workers)
            record = session_record()  # for `nereus cleanup --dir` and `nereus scale` (docs/reliability.md)
            if record is not None:
                write_text_atomic(self.dir / SESSION, json.dumps(record, indent=1))
        written = self._written(optim) if optim is not None else {}
        loaded = set()
        for p in self.placed:
            if p.key not in loaded:
                layout, ranks = written.get(p.key, (p.layout, p.ranks))  # the checkpoint's, to re-shard from
                self.rt.load(p.key, self.cfgs[p.model], layout, list(ranks), checkpoint=source[p.model])
                loaded.add(p.key)
        if optim is not None:
            self._install_optimizers(optim, written)
        if self.reward is None:  # workers run: the job was accepted (``execute`` imports it before this)
            self.reward = reward_router(self.job)
        rl_step = RLStep(self.job, self.rt, self.placed, self.tok, self.train, self.reward)
        if "kl_ctrl" in self.state:  # a resume: the in-reward KL coefficient the next step starts with
            rl_step.reward_kl.load_state_dict(self.state["kl_ctrl"])
        rl_step.open_engine()
        self.backend = RuntimeBackend(self.job, self.rt, self.cfgs, rl_step, self._placed, self.plan, self.say)
        self.backend.scale_file = self.dir / "scale.json"
        self.rt.forget_snapshots()  # a runtime handed in may hold another job's

    def release(self) -> None:
        if self.rt is None:
            return
        for key in {p.key for p in self.placed}:
            self.rt.release(key)
        if self._own_runtime:
            self.rt.shutdown()

    def evaluate(self, prompts: list[Prompt], step: int = 0) -> float:
        """Accuracy on ``prompts`` at the final response-length limit: the share of responses each row's
        ``data_source`` rule scores correct (``rl.rewards.correct``; exact match for the built-in task).
        Greedy, one response a prompt, unless ``run.rollout.val_kwargs`` samples ``n`` (their mean: verl's
        ``mean@n``) from a seed of the run's and ``step``'s alone, so that evaluating leaves the training's
        draws as they are and two runs of one seed are evaluated on the same draws at the same step."""
        gen = next(p for p in self.placed if p.stage == "generation")
        vk = self.run.val_kwargs
        rows = [p for p in prompts for _ in range(vk.samples)]
        ids = [list(p.ids) for p in rows]
        pad = (-len(ids)) % gen.layout.dp
        tok = self.tok
        params = SamplingParams(max_new_tokens=self.job.workload.response.max, temperature=vk.sampling_temperature,
                                top_p=vk.top_p, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                seed=derive_seed(self.run.seed, EVALUATION, step), stop_token_ids=tok.stop_token_ids)
        out = self.rt.generate(gen.key, ids + ids[:1] * pad, params)[: len(ids)]
        stops = tok.stop_token_ids
        hits = [correct(p.data_source, tok.decode([t for t in r if t not in stops]), p.ground_truth,
                        bool(r) and r[-1] in stops, p.extra_info) >= 1.0 for p, r in zip(rows, out, strict=True)]
        return sum(hits) / len(hits)

    # ----- checkpoints --------------------------------------------------------------------------------
    write_hook: WriteHook | None = None  # tests: called after each write of a checkpoint (to stop it there)

    def save(self, step: int) -> Path:
        """Write ``step_<step>`` (after ``step`` steps) and point ``latest`` at it (``checkpoint.StepWriter``:
        a temporary folder renamed when complete, ``latest`` replaced atomically)."""
        out = StepWriter(self.dir, step, self.write_hook)
        tokenizer = self.tok.tokenizer_files()  # in each model's folder: AutoTokenizer loads the checkpoint
        try:
            for model in TRAINED:
                if model not in self.job.algorithm.models:
                    continue
                p = next(p for p in self.placed if p.model == model and p.stage == "training")
                save_checkpoint(out.folder / model, self.cfgs[model], self.rt.read_weights(p.key),
                                source=self.job.paths.get(model), tokenizer=tokenizer)
                out.wrote(f"{model}/")
                (out.folder / "optim" / model).mkdir(parents=True, exist_ok=True)
                for rank, st in self.rt.read_optimizer(p.key).items():
                    name = f"optim/{model}/rank{rank}.safetensors"
                    save_file(st, str(out.folder / name), metadata=optimizer_tag(model, p.layout, p.ranks, rank))
                    out.wrote(name)
            if self.run.adapt is not None:  # the plan in force: a resumed run starts on it (optimizer files per rank)
                self.state["plan"] = self.backend.plan.to_dict()
            self.state["placements"] = placement_record(self.placed)  # which shard each optimizer file holds
            self.state["kl_ctrl"] = self.backend.rl_step.reward_kl.state_dict()  # run.kl_ctrl's coefficient
            (out.folder / STATE).write_text(json.dumps({**self.state, "step": step}, indent=1))
            out.wrote(STATE)
            return out.commit()
        except BaseException:
            out.discard()  # no half-written folder stays behind
            raise

    def _resume_point(self) -> tuple[int, Path, list[str]]:
        """Everything a resume checks before any worker starts or the run imports user code: the checkpoint
        ``checkpoint.resumable`` picks (warning about each broken one it skips), ``init/``, ``state.json``,
        and ``metrics.jsonl`` (a damaged one is refused, never cut). Returns (step, folder, metric lines kept)."""
        step, path, warnings = resumable(self.dir)
        for text in warnings:
            print(f"nereus: warning: {text}", file=sys.stderr, flush=True)
        self.warnings = warnings
        verify_manifest(self.dir / "init")
        check_sources(self.dir / "init", self.job.paths)
        state = read_json_file(path / STATE, "checkpoint state")
        if not isinstance(state, dict):
            raise SpecError("--resume", f"{path / STATE} holds {type(state).__name__}, not a checkpoint state")
        self.state = state
        if self.run.adapt is not None and "plan" in self.state:
            where = f"{path / 'state.json'}.plan"
            self.plan = Plan.from_dict(self.state["plan"], where)
            for p in self.plan.placements:  # the same check a job file's layouts pass
                ParallelDims.of(p.layout, self.job.models[p.model_stage.model], f"{where}.{p.model_stage}")
            self._placed = placed_from_plan(self.plan, self.job)
        return step, path, prepare_resume(self.dir / "metrics.jsonl", step)

    def _restore(self, point: tuple[int, Path, list[str]] | None = None) -> int:
        """Load the checkpoint ``_resume_point`` chose (``point``, or chosen now) and rewrite
        ``metrics.jsonl`` to the lines it keeps."""
        step, path, metric_lines = point if point is not None else self._resume_point()
        init = initial_sources(self.dir / "init", self.job.algorithm.models, self.job.paths)
        source = {m: (path / m if m in TRAINED else init[m]) for m in self.job.algorithm.models}
        self._start(source, optim=path)
        if (self.dir / "metrics.jsonl").exists():
            write_text_atomic(self.dir / "metrics.jsonl", "".join(line + "\n" for line in metric_lines))
        return step

    def _written(self, path: Path) -> dict[str, tuple]:
        """Training key → (layout, ranks) the checkpoint at ``path`` wrote its optimizer shards under, for the
        keys whose current placement differs (to load them so first and re-shard); refuses by name when that
        placement cannot be rebuilt on the current workers."""
        models = [m for m in TRAINED if m in self.job.algorithm.models]
        old = written_training(self.state, path, models)
        out = {}
        for p in self.placed:
            if p.stage == "training":
                change = placement_change(p.model, old[p.model], (p.layout, p.ranks), len(self.rt.workers))
                if change:
                    print(f"nereus: {change}: re-sharding its optimizer state onto this run's placement",
                          file=sys.stderr, flush=True)
                    out[p.key] = old[p.model]
        return out

    def _install_optimizers(self, path: Path, written: dict[str, tuple]) -> None:
        """Each trained model's Adam state from ``path``, under the placement it was written with; keys placed
        differently now move to their current layout through the transition executor (weights and Adam state)."""
        lr = {"actor": self.run.actor_lr, "critic": self.run.critic_lr}
        moved = []
        for p in self.placed:
            if p.stage != "training":
                continue
            layout, ranks = written.get(p.key, (p.layout, p.ranks))
            states = read_optimizer_files(path / "optim" / p.model, p.model, layout, ranks)
            self.rt.write_optimizer(p.key, states, lr[p.model])
            if p.key in written:
                moved.append(KeySpec(p.key, p.model, p.stage, self.cfgs[p.model], p.layout, p.ranks))
        if moved:
            self.rt.transition(moved, self.job)

    # ----- the run: the loop's observer ---------------------------------------------------------------
    def step_done(self, o: StepOutcome) -> None:
        """After a step and its transition: metrics line, evaluation, progress and checkpoint."""
        step = o.metrics.step
        last = dict(o.metrics.detail)
        if self.adaptation is not None:
            last.update(self.adaptation.step_metrics(o, self._ran_on))
            if o.transition is not None:
                tm, d = o.transition, o.decision
                self.say(f"\n  transition after step {step + 1} ({d.action}: {d.reason}): {tm.seconds:.2f} s measured, "
                         f"{d.cost_s:.2f} s predicted ({tm.predicted_s:.2f} s of it moving bytes), "
                         f"{tm.bytes_moved / 2**20:.1f} MiB moved"
                         f"{engine_text(tm, self.job.run.rollout_engine.traits.label)}; predicted step "
                         f"{d.current_s:.2f} s -> {d.candidate_s:.2f} s")
                self.say(f"    new plan: {plan_text(o.plan)}")
        if self.levers is not None:
            extra, line = self.levers.step_done(step, self._ran_on.levers, o.metrics.step_time_s, o.plan.levers,
                                                o.plan == self._ran_on)
            last.update(extra)
            if line is not None:
                self.say(line)
        self._ran_on = o.plan
        for entry in o.metrics.generation:  # decisions inside the step (the loop put them in the record)
            if self.midstep_log is not None:
                self.midstep_log.write(entry.to_json())
            lever_switch = self.levers is not None and isinstance(entry.decision, SetSpeculation)  # said above
            if not lever_switch and (line := move_line(entry)) is not None:
                self.say(line)
        done = step + 1
        if (self.run.eval_every and done % self.run.eval_every == 0) or done == self.run.steps:
            last["val/accuracy"] = self.evaluate(self.val, done)
        self.log.log(done, last)
        self.bar.update(done)
        every = self.run.checkpoint_every
        if (every and done % every == 0) or done == self.run.steps:
            self.save(done)
        self.last = last

    def recovered(self, lost: WorkersLost, rec: RecoveryMetrics) -> None:
        """Workers died mid-step; the backend recovered onto the survivors at the snapshot's step."""
        out = rec.detail
        self.log.rewind(rec.resume_step)  # steps after the snapshot are redone, and logged again
        self._ran_on = rec.plan
        if self.adaptation is not None:
            self.adaptation.write({"step": rec.resume_step, "action": "recover", "reason": "lost worker(s)",
                                   "plan": rec.plan.to_dict(), "transition_s": rec.seconds, "overhead_s": 0.0})
        live, snap = ", ".join(out["live_state"]) or "none", ", ".join(out["snapshot_only"]) or "none"
        self.say(f"  recovered in {out['wall_s']:.2f} s on {out['workers']} workers (live state: {live}; "
                 f"from the snapshot: {snap}); redoing from step {out['resume_step'] + 1}\n"
                 f"    plan: {plan_text(rec.plan)}")
        self.recoveries.append({"step": lost.step, "lost_work_s": lost.elapsed_s, **out})

    def _fresh(self) -> None:
        # one thread: the workers share the same cores, and oversubscribed BLAS threads slow tiny models ~10x
        torch.set_num_threads(1)
        t0 = time.perf_counter()
        cfgs, init = {m: self.cfgs[m] for m in self.job.algorithm.models}, self.dir / "init"
        if self.job.paths:  # pretrained (models.<name>.path): no warm-start
            losses = {}
            pretrained_checkpoints(init, cfgs, self.job.paths)
        else:
            losses = initial_checkpoints(init, cfgs, self.train, self.tok, self.run.warmstart, self.run.seed,
                                         self.job.workload.response.max)
            self.say(f"warm-start: {time.perf_counter() - t0:.1f}s, " +
                     ", ".join(f"{k.split('/')[1]} {v:.4g}" for k, v in losses.items()))
        write_sources(init, self.job.paths)  # the manifest of a job read wholly from HF directories lists this
        write_manifest(init)
        self._start(initial_sources(init, self.job.algorithm.models, self.job.paths))
        acc = self.evaluate(self.val)
        self.state = {"warmstart_accuracy": acc, **losses}
        start = "of the pretrained model" if self.job.paths else "after warm-start"
        self.say(f"held-out accuracy {start}: {100 * acc:.1f}% ({len(self.val)} prompts)")

    def execute(self, resume: bool = False) -> dict:
        """Run the job to ``run.steps``; returns the summary (accuracies, metrics of the last step)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        for note in self.notes:
            self.say(f"nereus: {note}")
        point = self._resume_point() if resume else None
        load_algorithm_modules(self.job.run.algorithm_modules)  # user code runs only now: the job is accepted
        self.reward = reward_router(self.job)
        start = self._restore(point) if point is not None else 0
        if point is None:
            self._fresh()
        self.log = MetricsLog(self.dir / "metrics.jsonl", resume, quiet=self.quiet, loggers=self.run.logger,
                              name=self.job.name, total=self.run.steps)
        self.bar = Progress(self.run.steps, start, quiet=self.quiet)
        if self.run.adapt is not None:
            self.adaptation = AdaptationLog(self.dir / "decisions.jsonl")
        if self.run.rollout_midstep is not None:  # a second appender of the same decision log
            self.midstep_log = AdaptationLog(self.dir / "decisions.jsonl")
        loop = ControlLoop(self.policy, self.backend, self.record, observer=self)
        self._ran_on = loop.start(self.backend.plan, start)
        try:
            loop.run(self.run.steps, start)
        finally:
            self.log.close()
            if self.adaptation is not None:
                self.adaptation.close()
            if self.midstep_log is not None:
                self.midstep_log.close()
            self.record.save(self.dir / "run_record.json")
        return self._summary()

    def _summary(self) -> dict:
        last = self.last
        summary = {"warmstart_accuracy": self.state.get("warmstart_accuracy"),
                   "final_accuracy": last.get("val/accuracy"), "last": last, "recoveries": self.recoveries}
        if self.adaptation is not None:
            summary["adaptation"] = adapt = self.record.summary()
            self.say(f"\nlive transitions: {adapt['transitions']} ({adapt['transition_s']:.2f} s, "
                     f"{100 * adapt['transition_share']:.2f}% of the run); controller overhead "
                     f"{100 * adapt['controller_overhead_share']:.2f}% of run time; `nereus report "
                     f"{self.dir / 'run_record.json'}` renders the run")
        if self.levers is not None and self.levers.spans:
            summary["levers"] = [asdict(s) for s in self.levers.spans]
            self.say("\ntail levers (run.rollout.levers: auto):\n" + "\n".join(self.levers.summary()))
        if summary["final_accuracy"] is not None and summary["warmstart_accuracy"] is not None:
            w, f = summary["warmstart_accuracy"], summary["final_accuracy"]
            self.say(f"\nheld-out accuracy: warm-start {100 * w:.1f}% -> final {100 * f:.1f}% "
                     f"({100 * (f - w):+.1f} points)")
        return summary
