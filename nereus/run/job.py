"""``nereus run``: set up (data, warm-start, layouts, workers), run the steps with metrics and periodic
checkpoints, evaluate held-out accuracy, resume from the latest checkpoint.

A checkpoint ``<dir>/step_<N>/`` holds every trained model as an HF checkpoint (``config.json`` +
``model.safetensors``, layout-independent) and its Adam state per worker of its training layout as
safetensors (``optim/<model>/rank<r>.safetensors``: fp32 master shard, moments, step count; no pickle),
plus ``state.json``, and last ``MANIFEST.json`` (every file's size and SHA-256: ``--resume`` refuses a
truncated or corrupted checkpoint by name). The initial weights (warm-start) live in ``<dir>/init/``.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from nereus.rl.data import EOS, PAD, CharTokenizer, Prompt
from nereus.rl.task import exact_match
from nereus.run.driver import Stepper
from nereus.run.manifest import verify_manifest, write_manifest
from nereus.run.metrics import MetricsLog, Progress
from nereus.run.setup import TRAINED, Placed, check_batches, datasets, model_configs, place
from nereus.run.warmstart import initial_checkpoints
from nereus.runtime.failover import WorkerLostError
from nereus.runtime.generate import SamplingParams
from nereus.runtime.hf import save_checkpoint
from nereus.spec.errors import SpecError
from nereus.spec.job import JobSpec


class RLJob:
    def __init__(self, job: JobSpec, runtime: object | None = None, out_dir: str | Path | None = None,
                 quiet: bool = False, workers: int | None = None) -> None:
        if job.run is None:
            raise SpecError("run", "`nereus run` needs a `run:` section (see docs/rl.md)")
        if workers:
            job = replace(job, run=replace(job.run, workers=workers))
        self.job, self.run, self.quiet = job, job.run, quiet
        self.dir = Path(out_dir or job.run.checkpoint_dir)
        self.tok = CharTokenizer()
        self.cfgs = model_configs(job, self.tok)
        self.adaptive = None
        if self.run.adapt is not None:  # the controller picks (and later changes) every layout
            from nereus.run.adaptive import initial_placement

            self.ctrl, self.plan, self.placed = initial_placement(job)
        else:
            self.placed = place(job)
        check_batches(job, self.placed)
        self.train, self.val = datasets(job, self.tok, self.dir)
        self._own_runtime = runtime is None
        self.rt = runtime
        self.state: dict = {}
        self.recovered: dict | None = None  # metrics the step after a recovery adds
        self.recoveries: list[dict] = []
        self.snapshot_s = 0.0

    def say(self, text: str) -> None:
        if not self.quiet:
            print(text, file=sys.stderr, flush=True)

    # ----- models -------------------------------------------------------------------------------------
    def _start(self, source: dict[str, Path]) -> None:
        if self.rt is None:
            from nereus.runtime.workers import Runtime

            start = self.run.workers
            if self.run.adapt:  # the workers available at first, and at least those the plan uses (resume)
                start = max(self.run.adapt.workers_at(0, self.run.workers),
                            1 + max(r for p in self.placed for r in p.ranks))
            self.rt = Runtime(start, max_workers=self.run.max_workers)
        loaded = set()
        for p in self.placed:
            if p.key not in loaded:
                self.rt.load(p.key, self.cfgs[p.model], p.layout, list(p.ranks), checkpoint=source[p.model])
                loaded.add(p.key)
        self.stepper = Stepper(self.job, self.rt, self.placed, self.tok, self.train)
        self.rt.forget_snapshots()  # a runtime handed in may hold another job's

    def replace_placed(self, placed: list[Placed]) -> None:
        """After a live transition: the layouts and workers every model-stage now runs on."""
        self.placed = placed
        self.stepper.placed = placed
        self.stepper.key = {(p.model, p.stage): p.key for p in placed}

    def release(self) -> None:
        if self.rt is None:
            return
        for key in {p.key for p in self.placed}:
            self.rt.release(key)
        if self._own_runtime:
            self.rt.shutdown()

    def evaluate(self, prompts: list[Prompt]) -> float:
        """Exact-match accuracy of greedy responses on ``prompts`` at the final response-length limit."""
        gen = next(p for p in self.placed if p.stage == "generation")
        ids = [list(p.ids) for p in prompts]
        pad = (-len(ids)) % gen.layout.dp
        params = SamplingParams(max_new_tokens=self.job.workload.response.max, temperature=0.0,
                                eos_token_id=EOS, pad_token_id=PAD)
        out = self.rt.generate(gen.key, ids + ids[:1] * pad, params)[: len(ids)]
        hits = [exact_match(self.tok.decode([t for t in r if t != EOS]), p.ground_truth, bool(r) and r[-1] == EOS)
                for p, r in zip(prompts, out, strict=True)]
        return sum(hits) / len(hits)

    # ----- checkpoints --------------------------------------------------------------------------------
    def save(self, step: int) -> Path:
        """Write ``step_<step>`` (after ``step`` steps) and point ``latest`` at it."""
        path = self.dir / f"step_{step}"
        for model in TRAINED:
            if model not in self.job.algorithm.models:
                continue
            key = next(p.key for p in self.placed if p.model == model and p.stage == "training")
            save_checkpoint(path / model, self.cfgs[model], self.rt.read_weights(key))
            for rank, st in self.rt.read_optimizer(key).items():
                (path / "optim" / model).mkdir(parents=True, exist_ok=True)
                save_file(st, str(path / "optim" / model / f"rank{rank}.safetensors"))
        if self.adaptive is not None:  # the plan in force: a resumed run starts on it (optimizer files per rank)
            self.state["plan"] = self.adaptive.plan.to_dict()
        (path / "state.json").write_text(json.dumps({**self.state, "step": step}, indent=1))
        write_manifest(path)  # last: a checkpoint with a manifest is complete
        (self.dir / "latest").write_text(str(step))
        return path

    def _restore(self) -> int:
        latest = self.dir / "latest"
        if not latest.exists():
            raise SpecError("--resume", f"no checkpoint under {self.dir} (no 'latest' file)")
        step = int(latest.read_text())
        path = self.dir / f"step_{step}"
        verify_manifest(path)
        verify_manifest(self.dir / "init")
        self.state = json.loads((path / "state.json").read_text())
        if self.run.adapt is not None and "plan" in self.state:
            from nereus.run.setup import placed_from_plan
            from nereus.spec.layout import Plan

            self.plan = Plan.from_dict(self.state["plan"], f"{path / 'state.json'}.plan")
            self.ctrl.plan = self.plan
            self.placed = placed_from_plan(self.plan)
        source = {m: (path / m if m in TRAINED else self.dir / "init" / m) for m in self.job.algorithm.models}
        self._start(source)
        lr = {"actor": self.run.actor_lr, "critic": self.run.critic_lr}
        for p in self.placed:
            folder = path / "optim" / p.model
            if p.stage == "training" and folder.exists():
                states = {w: load_file(str(folder / f"rank{w}.safetensors")) for w in p.ranks}
                self.rt.write_optimizer(p.key, states, lr[p.model])
        self._trim_metrics(step)
        return step

    def _trim_metrics(self, step: int) -> None:
        path = self.dir / "metrics.jsonl"
        if path.exists():
            keep = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
            path.write_text("".join(line + "\n" for line in keep))

    # ----- the run ------------------------------------------------------------------------------------
    def _step(self, step: int, log: MetricsLog, bar: Progress) -> dict[str, float]:
        """One step, its adaptation, evaluation, metrics and checkpoint."""
        last = self.stepper.step(step)
        last["nereus/snapshot_s"], self.snapshot_s = self.snapshot_s, 0.0
        if self.recovered is not None:
            last.update(self.recovered)
            self.recovered = None
        if self.adaptive is not None:
            last.update(self.adaptive.after_step(step, last))
        done = step + 1
        if done % self.run.eval_every == 0 or done == self.run.steps:
            last["val/accuracy"] = self.evaluate(self.val)
        log.log(done, last)
        bar.update(done)
        every = self.run.checkpoint_every
        if (every and done % every == 0) or done == self.run.steps:
            self.save(done)
        return last

    def recover(self, err: WorkerLostError, step: int, lost_work_s: float = 0.0) -> int:
        """Continue on the surviving workers after ``err``: the planner's plan for them, state from live
        replicas and the snapshot (``Runtime.recover``); returns the step to redo from. ``lost_work_s``: the
        time the failed step ran before the loss showed."""
        from nereus.run.adaptive import controller_for, plan_text, survivor_plan
        from nereus.run.setup import placed_from_plan
        from nereus.runtime.live import KeySpec

        if not self.run.snapshot_every:
            raise SpecError("run.checkpoint.snapshot_every", f"{err}; without host-memory snapshots the run cannot "
                            "continue: set snapshot_every ≥ 1, or resume from the last checkpoint (--resume)") from err
        self.say(f"\n  step {step + 1}: {err}; recovering on the survivors")
        ctrl = self.adaptive.ctrl if self.adaptive is not None else controller_for(self.job)
        plan: dict = {}

        def place(n: int) -> list:
            if self.adaptive is not None:  # no more than the availability schedule grants
                n = min(n, self.adaptive.backend.available(self.rt.snapshot_step))
            plan["plan"] = survivor_plan(ctrl, n, self.rt.snapshot_step)
            plan["placed"] = placed_from_plan(plan["plan"])
            return [KeySpec(p.key, p.model, p.stage, self.cfgs[p.model], p.layout, p.ranks) for p in plan["placed"]]

        out = self.rt.recover(place, err.lost)
        self.replace_placed(plan["placed"])
        if plan["plan"].num_gpus < len(self.rt.workers) and self.adaptive is not None:
            self.rt.resize(plan["plan"].num_gpus)  # survivors beyond what the schedule grants leave
        if self.adaptive is not None:
            self.adaptive.replanned(plan["plan"], out["resume_step"], out["wall_s"])
        live, snap = ", ".join(out["live_state"]) or "none", ", ".join(out["snapshot_only"]) or "none"
        self.say(f"  recovered in {out['wall_s']:.2f} s on {out['workers']} workers (live state: {live}; "
                 f"from the snapshot: {snap}); redoing from step {out['resume_step'] + 1}\n"
                 f"    plan: {plan_text(plan['plan'])}")
        self.recoveries.append({"step": step, "lost_work_s": lost_work_s,
                                **{k: v for k, v in out.items() if k != "seconds"}, **out["seconds"]})
        self.recovered = {"nereus/recovery_s": out["wall_s"], "nereus/lost_work_s": lost_work_s,
                          "nereus/lost_workers": float(len(out["lost"]))}
        return out["resume_step"]

    def _fresh(self) -> None:
        # one thread: the workers share the same cores, and oversubscribed BLAS threads slow tiny models ~10x
        torch.set_num_threads(1)
        t0 = time.perf_counter()
        losses = initial_checkpoints(self.dir / "init", {m: self.cfgs[m] for m in self.job.algorithm.models},
                                     self.train, self.tok, self.run.warmstart, self.run.seed)
        write_manifest(self.dir / "init")
        self.say(f"warm-start: {time.perf_counter() - t0:.1f}s, " +
                 ", ".join(f"{k.split('/')[1]} {v:.4f}" for k, v in losses.items()))
        self._start({m: self.dir / "init" / m for m in self.job.algorithm.models})
        acc = self.evaluate(self.val)
        self.state = {"warmstart_accuracy": acc, **losses}
        self.say(f"held-out accuracy after warm-start: {100 * acc:.1f}% ({len(self.val)} prompts)")

    def execute(self, resume: bool = False) -> dict:
        """Run the job to ``run.steps``; returns the summary (accuracies, metrics of the last step)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        start = self._restore() if resume else 0
        if not resume:
            self._fresh()
        log = MetricsLog(self.dir / "metrics.jsonl", resume, quiet=self.quiet)
        bar = Progress(self.run.steps, start, quiet=self.quiet)
        last: dict[str, float] = {}
        if self.run.adapt is not None:
            from nereus.run.adaptive import AdaptiveLoop

            self.adaptive = AdaptiveLoop(self, self.ctrl, self.plan)
        try:
            step = start
            while step < self.run.steps:
                every = self.run.snapshot_every
                if every and step % every == 0 and self.rt.latest_snapshot_step != step:
                    self.snapshot_s = self.rt.snapshot(step)
                t_step = time.perf_counter()
                try:
                    last = self._step(step, log, bar)
                except WorkerLostError as err:
                    step = self.recover(err, step, time.perf_counter() - t_step)
                    log.rewind(step)  # steps after the snapshot are redone, and logged again
                    continue
                step += 1
        finally:
            log.close()
            adapt = self.adaptive.close() if self.adaptive is not None else None
        summary = {"warmstart_accuracy": self.state.get("warmstart_accuracy"),
                   "final_accuracy": last.get("val/accuracy"), "last": last, "recoveries": self.recoveries}
        if adapt is not None:
            summary["adaptation"] = adapt
            self.say(f"\nlive transitions: {adapt['transitions']} ({adapt['transition_s']:.2f} s, "
                     f"{100 * adapt['transition_share']:.2f}% of the run); controller overhead "
                     f"{100 * adapt['controller_overhead_share']:.2f}% of run time; `nereus report "
                     f"{self.dir / 'run_record.json'}` renders the run")
        if summary["final_accuracy"] is not None and summary["warmstart_accuracy"] is not None:
            w, f = summary["warmstart_accuracy"], summary["final_accuracy"]
            self.say(f"\nheld-out accuracy: warm-start {100 * w:.1f}% -> final {100 * f:.1f}% "
                     f"({100 * (f - w):+.1f} points)")
        return summary
