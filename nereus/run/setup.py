"""What a run needs before its first step: model configs, the layout and workers of every model-stage
(fixed in the job's ``run.layouts`` or chosen by the planner), the runtime keys that share a layout, and
the datasets."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from nereus.planner.defaults import runtime_options
from nereus.rl.data import CharTokenizer, Prompt, load_prompts, write_rows
from nereus.rl.rewards import RewardRouter
from nereus.rl.task import reverse_rows, split_rows
from nereus.rl.tokenizer import HFTokenizer, Tokenizer
from nereus.runtime.capability import CAPABILITY, priced_as_run
from nereus.runtime.engines.sampling import derive_seed
from nereus.runtime.model.decoder import ModelConfig
from nereus.runtime.model.hf import read_config
from nereus.spec.capability import UnsupportedLayout
from nereus.spec.errors import InfeasibleError, SpecError
from nereus.spec.hf_files import check_model_dir
from nereus.spec.job import JobSpec
from nereus.spec.layout import Layout
from nereus.spec.packing import PackingSpec, token_budget
from nereus.spec.parallel_dims import check_split, tp_splits
from nereus.spec.rollout import one_engine_per_replica

TRAINED = ("actor", "critic")
# What a seed drawn by ``derive_seed(run.seed, purpose, ...)`` is for: each purpose has its own streams, so
# no two uses of one run's seed (or of two runs' seeds) share one
PROMPT_ORDER, SAMPLING, MINI_BATCH_ORDER, HELD_OUT_SPLIT, SPARE_PROMPTS, EVALUATION = 1, 2, 3, 4, 5, 6
DYNAMIC_SAMPLING_PROMPTS = 7  # the further generation batches of run.filter_groups (run.draws)


@dataclass(frozen=True)
class Placed:
    """One model-stage's layout, the workers it runs on and the runtime key holding its shards."""

    model: str
    stage: str
    layout: Layout
    ranks: tuple[int, ...]
    key: str


def check_model_dirs(job: JobSpec) -> None:
    """Every HF model directory the job names (``models.<name>.path``), checked before any library loads a
    file of it and before any process starts: config, every safetensors header against the config,
    tokenizer files (``spec.hf_files.check_model_dir``). A directory shared by several models is read once."""
    seen: set[str] = set()
    for name, path in job.paths.items():
        if path not in seen:
            seen.add(path)
            check_model_dir(Path(path), f"models.{name}.path")


def tokenizer_for(job: JobSpec) -> Tokenizer:
    """The actor's HF tokenizer (chat template included) when the job gives ``models.actor.path``; the
    built-in character tokenizer of the built-in task otherwise."""
    path = job.paths.get("actor")
    return HFTokenizer(path, "models.actor.path") if path else CharTokenizer()


def model_configs(job: JobSpec, tok: Tokenizer) -> dict[str, ModelConfig]:
    """Each model's runtime config: a pretrained model's from its ``config.json`` (RoPE base, norm epsilon
    and special tokens as the checkpoint has them), a random-initialised one's from its architecture."""
    if job.paths and job.run is not None and (job.run.warmstart.actor_steps or job.run.warmstart.reward_steps):
        raise SpecError("run.warmstart", "the warm-start trains random weights on the built-in task; remove it "
                                         "when models.<name>.path gives pretrained weights")
    out = {}
    for name, arch in job.models.items():
        key = f"models.{name}.path" if name in job.paths else f"models.{name}.vocab"
        if arch.vocab < tok.vocab_size:
            raise SpecError(key, f"vocab_size {arch.vocab} is smaller than the tokenizer's {tok.vocab_size} tokens")
        if name in job.paths:
            cfg = read_config(job.paths[name])
            if name == "reward" and not cfg.value_head:
                raise SpecError(key, f"{job.paths[name]} is not a reward model: give a *ForSequenceClassification "
                                     "checkpoint with num_labels: 1 (its score at the last token is the reward)")
        else:
            cfg = ModelConfig(arch, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
        out[name] = cfg.with_value_head(job.has_value_head(name))
    return out


def check_rule_reward(job: JobSpec, prompts: list[Prompt]) -> None:
    """Under ``run.rule_reward: auto`` without a user function, every ``data_source`` of ``prompts`` needs
    a scorer (checked before anything runs; the error lists them)."""
    if job.run.reward_function is None:
        RewardRouter(job.run.rule_reward).check_sources({p.data_source for p in prompts}, "run.rule_reward")


def reward_router(job: JobSpec) -> RewardRouter:
    """The job's rule reward (``run.rule_reward``, ``run.reward_function``). A user function is imported
    here, so this is called only once the job is accepted (``RLJob.execute``): a refused job never ran it."""
    return RewardRouter(job.run.rule_reward, job.run.reward_function)


def _planned(job: JobSpec) -> dict[str, tuple[Layout, tuple[int, ...]]]:
    """The planner's layouts for the model-stages the job leaves open, on ``run.workers`` devices: only
    layouts the runtime runs (``runtime_layout_ok``, the adaptive controller's filter: batches that split,
    as ``check_batches`` then requires), so no refusal blames a ``run.layouts`` the user never wrote."""
    from nereus.cost.hardware import Hardware
    from nereus.planner.search import Constraints, search

    sized, capability = priced_as_run(job.with_gpus(job.run.workers))
    allowed = Constraints(layout_filter=lambda ms, lay: runtime_layout_ok(job, ms.stage, lay, ms.model),
                          capability=capability)
    try:
        plan = search(Hardware(sized.cluster), sized, constraints=allowed).plan
    except InfeasibleError:
        _check_some_layout_splits(job, sized)
        raise
    return {str(p.model_stage): (p.layout, tuple(p.gpus)) for p in plan.placements}


def _check_some_layout_splits(job: JobSpec, sized: JobSpec) -> None:
    """Refuse, naming the batch keys, a job whose batch no layout of some model-stage splits over its DP
    replicas and micro-batches on any number of the workers (the keys are written as the user typed them:
    ``spec.typed_keys``)."""
    from nereus.planner.candidates import enumerate_layouts

    for ms in sized.model_stages():
        layouts = [lay for g in range(1, job.run.workers + 1) for lay in enumerate_layouts(sized, ms, g)]
        if any(batch_split_problem(job, ms.stage, lay) is None for lay in layouts):
            continue
        size = _batch_size(job, ms.stage)
        key, what = ("algorithm.mini_batches", "mini-batch") if ms.stage == "training" else (
            "workload.prompts_per_step", "batch")
        raise SpecError(key, f"no layout of {ms} on 1 to {job.run.workers} workers splits its {what} of {size} "
                             "sequences into DP replicas x micro-batches: change workload.prompts_per_step, "
                             "algorithm.samples_per_prompt or algorithm.mini_batches so that one does, or "
                             "options.micro_batch_size")


def _shared_key(placed: list[Placed], model: str, stage: str, layout: Layout, ranks: tuple[int, ...]) -> str | None:
    """An existing key this model-stage can use: same model, workers and parallelism; inference also needs
    the same micro-batch size and token budget (generation does not micro-batch). ZeRO-1 only matters to the
    optimizer."""
    for p in placed:
        same = (p.model, p.ranks, p.layout.tp, p.layout.pp, p.layout.dp) == (model, ranks, layout.tp, layout.pp,
                                                                             layout.dp)
        batching = (p.layout.micro_batch_size, p.layout.max_token_len) == (layout.micro_batch_size,
                                                                            layout.max_token_len)
        if same and stage != "training" and (stage == "generation" or batching):
            return p.key
    return None


def place(job: JobSpec) -> list[Placed]:
    """Every model-stage's placement, training first. Model-stages of one model that can share a copy of
    the weights share a runtime key; a model's training key holds the weights its other keys follow."""
    run = job.run
    stages = job.model_stages()
    planned = _planned(job) if any(str(ms) not in run.layouts for ms in stages) else {}
    order = {"training": 0, "inference": 1, "generation": 2}
    out: list[Placed] = []
    for ms in sorted(stages, key=lambda m: order[m.stage]):
        name = str(ms)
        if name in run.layouts:
            written = run.layouts[name]
            layout, ranks = runtime_options(written, CAPABILITY), run.ranks.get(name, tuple(range(written.world)))
        else:
            layout, ranks = planned[name]
        try:
            layout = CAPABILITY.as_run(layout, ms.stage)
        except UnsupportedLayout as err:
            raise SpecError(f"run.layouts.{name}", str(err)) from None
        ranks = tuple(ranks)
        check_split(job.models[ms.model], layout.tp, f"run.layouts.{name}")
        if not engine_runs(job, ms.stage, layout):  # the planner's choice; a written one is refused in spec
            raise SpecError(f"run.layouts.{name}", f"{layout.short()}: "
                            f"{one_engine_per_replica(job.run.rollout_engine.traits)}: give a layout tp=T,dp=N")
        if max(ranks) >= run.workers:
            raise SpecError(f"run.layouts.{name}", f"uses worker {max(ranks)} but the run has {run.workers} "
                                                   "workers (run.workers or --workers)")
        layout = packed(run.packing, ms.model, ms.stage, layout, job.workload.prompt_length + job.workload.response.max)
        key = _shared_key(out, ms.model, ms.stage, layout, ranks) or name
        out.append(Placed(ms.model, ms.stage, layout, ranks, key))
    return out


def packed(spec: PackingSpec, model: str, stage: str, layout: Layout, max_seq: int) -> Layout:
    """``layout`` with the token budget ``run.packing`` gives ``model``'s ``stage`` (``spec.packing``), or as
    it is when that gives none (a budget a written layout holds stays)."""
    budget = token_budget(spec, model, stage, layout.micro_batch_size, max_seq)
    return replace(layout, max_token_len=budget) if budget else layout


def placed_from_plan(plan, job: JobSpec | None = None) -> list[Placed]:
    """A controller's plan as runtime placements: one key per model-stage, named after it (keys stay the
    same across transitions; buffers that coincide on a worker are shared by the executor anyway). The
    controller plans within ``CAPABILITY``; ``as_run`` turns off what changes nothing for a stage; ``job``'s
    ``run.packing`` sets each layout's token budget (``packed``)."""
    order = {"training": 0, "inference": 1, "generation": 2}
    spec = job.run.packing if job is not None and job.run is not None else PackingSpec()
    seq = job.workload.prompt_length + job.workload.response.max if job is not None else 0
    return [Placed(p.model_stage.model, p.model_stage.stage,
                   packed(spec, p.model_stage.model, p.model_stage.stage,
                          CAPABILITY.as_run(p.layout, p.model_stage.stage), seq), tuple(p.gpus), str(p.model_stage))
            for p in sorted(plan.placements, key=lambda p: (order[p.model_stage.stage], str(p.model_stage)))]


def engine_runs(job: JobSpec, stage: str, layout: Layout) -> bool:
    """Whether the rollout engine runs ``layout`` for ``stage``: a generation layout within its pipeline
    degree (``EngineTraits.max_pp``; vLLM runs one engine per DP replica, of its TP size: pp=1)."""
    return stage != "generation" or job.run is None or job.run.rollout_engine.traits.runs_pp(layout.pp)


def runtime_layout_ok(job: JobSpec, stage: str, layout: Layout, model: str) -> bool:
    """What the runtime can run of this job: a layout ``CAPABILITY`` supports for the stage (and the
    rollout engine for generation), TP that splits whole heads, batches that split over DP and
    micro-batches (``check_batches``)."""
    if CAPABILITY.supports(layout, stage) or not engine_runs(job, stage, layout):
        return False
    if not tp_splits(job.models[model], layout.tp):
        return False
    return batch_split_problem(job, stage, layout) is None


def _batch_split(job: JobSpec, stage: str, layout: Layout) -> tuple[int, int]:
    """Sequences a stage's batch holds (training: one mini-batch) and the multiple it must be of: DP
    replicas times micro-batch size (generation does not micro-batch)."""
    return _batch_size(job, stage), layout.dp * (layout.micro_batch_size if stage != "generation" else 1)


def _batch_size(job: JobSpec, stage: str) -> int:
    """Sequences a stage's batch holds: a step's, one mini-batch of them for training."""
    n = job.sequences_per_step()
    return n // job.algorithm.mini_batches if stage == "training" else n


def batch_split_problem(job: JobSpec, stage: str, layout: Layout) -> str | None:
    """Why the stage's batch (training: one mini-batch) does not split over ``layout``'s DP replicas and
    micro-batches; None when it does. The one check of the planner's filter and of ``check_batches``."""
    size, per = _batch_split(job, stage, layout)
    if size % per == 0:
        return None
    what = "mini-batch" if stage == "training" else "batch"
    return (f"the {what} of {size} sequences does not split into dp={layout.dp} x "
            f"micro_batch_size={layout.micro_batch_size}")


def check_batches(job: JobSpec, placed: list[Placed]) -> None:
    """Each stage's batch must split over its DP replicas and micro-batches (and mini-batches)."""
    for p in placed:
        why = batch_split_problem(job, p.stage, p.layout)
        if why is not None:
            raise SpecError(f"run.layouts.{p.model}/{p.stage}", why)


def datasets(job: JobSpec, tok: Tokenizer, root: Path, notes: list[str] | None = None) -> tuple[list[Prompt],
                                                                                             list[Prompt]]:
    """Training and held-out prompts: the job's files (their rows in order), or the built-in task written to
    ``root/data``. With ``run.data.filter_overlong_prompts`` rows past the maximum prompt length are dropped
    and ``notes`` gets a line per file saying how many."""
    d, limit = job.run.data, job.workload.prompt_length
    notes = [] if notes is None else notes

    def read(files: tuple[str, ...]) -> list[Prompt]:
        return [p for file in files for p in load_prompts(file, tok, limit, d.filter_overlong_prompts, notes)]

    if not d.train and not isinstance(tok, CharTokenizer):
        raise SpecError("run.data.train", "give a verl-format .parquet/.jsonl file: the built-in task is written "
                                          "for the built-in tokenizer, not the model's")
    if d.train:
        train = read(d.train)
        if d.val:
            return train, read(d.val)
        # no validation file: hold out the last rows (at most a tenth) so accuracy is on unseen prompts
        k = min(d.val_size, len(train) // 10)
        if k < 1:
            raise SpecError("run.data.val", f"{', '.join(d.train)} has {len(train)} rows: too few to hold out "
                                            "validation prompts; give a val file")
        return train[:-k], train[-k:]
    # one pool of distinct prompts, split at random: held-out and training prompts share a distribution
    pool = reverse_rows(d.train_size + d.val_size, job.run.seed, d.max_digits)
    train_rows, val_rows = split_rows(pool, d.val_size, derive_seed(job.run.seed, HELD_OUT_SPLIT))
    train = load_prompts(write_rows(root / "data" / "train.jsonl", train_rows), tok, limit)
    val = load_prompts(write_rows(root / "data" / "val.jsonl", val_rows), tok, limit)
    return train, val
