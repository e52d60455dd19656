"""The job spec: models, algorithm, workload, cluster and options, validated on load."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from nereus.spec.algorithms import (
    ADVANTAGE_ESTIMATORS,
    DEFAULT_ESTIMATOR,
    NEEDS_CRITIC,
    NEEDS_GROUPS,
    NEEDS_SUM_PI_SQUARED,
)
from nereus.spec.cluster import ClusterSpec, read_cluster
from nereus.spec.effective import EffectiveConfig, effective_config
from nereus.spec.engines import PRICING_ENGINE, installed_distribution
from nereus.spec.errors import SpecError
from nereus.spec.fields import MAX_SEQUENCES, MAX_STEPS, MAX_TOKENS, Fields
from nereus.spec.files import read_yaml_file
from nereus.spec.layout import RECOMPUTE, ModelStage
from nereus.spec.model import ModelArch, arch_from_hf_config, read_arch
from nereus.spec.parallel_dims import ParallelDims
from nereus.spec.response import ResponseLength
from nereus.spec.rollout import check_rollout_engine
from nereus.spec.run import RunSpec, read_run
from nereus.spec.run_dapo import check_dapo, check_keep_rate
from nereus.spec.run_moe import check_router_replay
from nereus.spec.trace import load_trace
from nereus.spec.user_algorithms import DeclaredAlgorithms, read_algorithm_modules
from nereus.spec.user_code import check_target, resolve_target

# PPO's epochs over one step's batch: published runs use 1-4; a count past 1,000 is a typo, and each epoch
# is a full pass of every training stage.
MAX_EPOCHS = 1000
ROLES = ("actor", "critic", "reference", "reward")
ALGORITHMS = ("ppo", "grpo", "train")
VALUE_HEAD_ROLES = ("critic", "reward")


@dataclass(frozen=True)
class Workload:
    prompts_per_step: int = 0
    prompt_length: int = 0
    response: ResponseLength | None = None
    global_batch: int = 0  # training-only jobs: sequences per step
    sequence_length: int = 0  # training-only jobs
    # the expected share of generated groups dynamic sampling keeps (run.filter_groups): generation is priced
    # for 1 / filter_keep_rate batches a step (1.0: no dynamic sampling)
    filter_keep_rate: float = 1.0


@dataclass(frozen=True)
class Algorithm:
    name: str
    models: tuple[str, ...]
    samples_per_prompt: int = 1
    mini_batches: int = 1  # optimizer updates per step (PPO mini-batches)
    epochs: int = 1
    adv_estimator: str = ""  # a name in nereus.spec.algorithms.ADVANTAGE_ESTIMATORS; "" for training-only
    # False: the old log-probs are the ones the rollout engine recorded while sampling, and the actor's
    # inference stage is not run (``check_old_log_prob`` says when that is exact)
    recompute_old_log_prob: bool = True


@dataclass(frozen=True)
class Options:
    recompute: str = "selective"  # or "auto": the planner chooses per layout
    sequence_parallel: bool = True
    zero1: bool = True
    fsdp: bool | str = False  # True, False or "auto" (the planner tries both)
    interleave: int | str = "auto"
    micro_batch_size: int | str = "auto"
    # expert parallelism of an MoE model's layouts: "auto" (the planner tries every ep that divides dp and
    # the expert count, ``planner.candidates``) or a fixed degree; dense models always have ep=1
    ep: int | str = "auto"
    attention: str = "flash"  # "standard" materialises the s×s scores (Megatron 2021)
    grad_bytes: int = 4  # fp32 gradient accumulation buffers (Megatron main_grad)
    weight_bytes: int = 2  # bf16 weights on GPUs; 4 where the runtime computes in fp32 (CPU workers)
    # model-stages of one phase on disjoint GPUs run at the same time; False where the runtime runs them
    # one after another (the CPU runtime's driver does, docs/rl.md)
    concurrent_stages: bool = True
    # a layout without a token budget (max_token_len 0) pads each row to the step's longest, as the Nereus
    # runtime does (set from its capability, ``RuntimeCapability.planning_options``); False: rows at their
    # own length, micro_batch_size of them (verl's use_remove_padding); priced in ``cost.stage_tokens``
    padded_batches: bool = False
    # the engine whose traits price the rollout (``spec.engines``; not a job-file key): the planner's vLLM-like
    # pricing engine, or a published run's own (``sim.published_runs``: DeepSpeed-Chat's Hybrid Engine)
    rollout_engine: str = PRICING_ENGINE
    # training state kept in host memory (``cost.offload``: none, param, optimizer, param+optimizer; not a
    # job-file key): a published run's, as verl's param_offload / optimizer_offload and DeepSpeed's offload set it
    offload: str = "none"
    # of that state, what its framework moves through newly allocated pageable host memory each time
    # (``cost.offload.PAGEABLE_KINDS``; "param": a trained model's weights): a published run's framework's
    # (``sim.published_frameworks``; not a job-file key)
    pageable_offload: str = "none"
    # sequences an engine replica is handed per generate call, each call waited for before the next (0: its
    # whole share in one call); a published run's framework's (``sim.published_frameworks``; not a job-file key)
    rollout_call_sequences: int = 0
    # fraction of its datasheet peak a training stage's GEMMs reach (0: the ``gemm_efficiency`` prior,
    # ``cost.hardware``): a published run's framework's measured training throughput
    # (``sim.published_frameworks``; not a job-file key)
    training_efficiency: float = 0.0
    # the share of each rollout GPU's memory its engine may take, weights, activations and KV cache together
    # (vLLM's and verl's ``gpu_memory_utilization``; 0: the ``kv_memory_fraction`` prior of what is free,
    # ``cost.hardware.kv_cache_budget``): a published run's, as its row or framework sets it
    # (``sim.published_frameworks``; not a job-file key)
    gpu_memory_utilization: float = 0.0


@dataclass(frozen=True)
class JobSpec:
    name: str
    models: dict[str, ModelArch]
    algorithm: Algorithm
    workload: Workload
    cluster: ClusterSpec
    options: Options
    run: RunSpec | None = None  # the optional `run:` section (nereus run)
    # model -> HF model directory (``models.<name>.path``): the weights, config and tokenizer it starts from
    paths: dict[str, str] = field(default_factory=dict)

    def model_stages(self) -> list[ModelStage]:
        """Every model-stage the algorithm runs each step, in stage order."""
        alg = self.algorithm
        if alg.name == "train":
            return [ModelStage(alg.models[0], "training")]
        out = [ModelStage("actor", "generation")]
        out += [ModelStage(m, "inference") for m in ("actor", "reference", "critic", "reward")
                if m in alg.models and (m != "actor" or alg.recompute_old_log_prob)]
        out += [ModelStage(m, "training") for m in ("actor", "critic") if m in alg.models]
        return out

    def has_value_head(self, model: str) -> bool:
        return model in VALUE_HEAD_ROLES

    def sequences_per_step(self) -> int:
        if self.algorithm.name == "train":
            return self.workload.global_batch
        return self.workload.prompts_per_step * self.algorithm.samples_per_prompt

    def with_gpus(self, total: int) -> JobSpec:
        return replace(self, cluster=self.cluster.with_gpus(total))

    def with_response(self, response: ResponseLength) -> JobSpec:
        return replace(self, workload=replace(self.workload, response=response))


def _read_response(f: Fields, base_dir: Path) -> ResponseLength:
    if f.has("trace"):  # the lengths of one step of a trace (nereus.spec.trace)
        path = Path(f.get("trace", str))
        step = f.get("step", int, 0, minimum=0, maximum=MAX_STEPS)
        f.finish()
        return load_trace(path if path.is_absolute() else base_dir / path).response_at(step)
    mean = f.get("mean", float, minimum=1, maximum=MAX_TOKENS)
    longest = f.get("max", int, minimum=1, maximum=MAX_TOKENS)
    dist = f.get("distribution", str, "lognormal", choices=["lognormal", "fixed"])
    sigma = f.get("sigma", float, 0.6, minimum=0, maximum=3)
    f.finish()
    if mean > longest:
        raise SpecError(f.key_path("mean"), f"mean ({mean}) exceeds max ({longest}); lower mean or raise max")
    return ResponseLength(mean, longest, dist, sigma)


def _read_algorithm(f: Fields, models: dict[str, ModelArch], extra_estimators: tuple[str, ...] = ()) -> Algorithm:
    name = f.get("name", str, choices=ALGORITHMS)
    # By default every defined role takes part (GRPO has no critic); a training-only job trains its model.
    default = list(models)[:1] if name == "train" else [
        m for m in ROLES if m in models and not (name == "grpo" and m == "critic")]
    used = f.get_list("models", str, default)
    for i, m in enumerate(used):
        if m not in models:
            raise SpecError(f"{f.key_path('models')}[{i}]", f"{m!r} is not defined under 'models' ({sorted(models)})")
    if name == "train" and len(used) != 1:
        raise SpecError(f.key_path("models"), "a training-only job trains exactly one model")
    if name != "train":
        for i, m in enumerate(used):
            if m not in ROLES:
                raise SpecError(f"{f.key_path('models')}[{i}]", f"{m!r} is not a role; choose from {list(ROLES)}")
        if "actor" not in used:
            raise SpecError(f.key_path("models"), f"{name} needs an 'actor'")
        if name == "ppo" and "critic" not in used:
            raise SpecError(f.key_path("models"), "ppo needs a 'critic' (GAE); use grpo for critic-free training")
    alg = Algorithm(
        name=name,
        models=tuple(used),
        samples_per_prompt=f.get("samples_per_prompt", int, 1 if name != "grpo" else 8, minimum=1,
                                 maximum=MAX_SEQUENCES),
        mini_batches=f.get("mini_batches", int, 1, minimum=1, maximum=MAX_SEQUENCES),
        epochs=f.get("epochs", int, 1, minimum=1, maximum=MAX_EPOCHS),
        adv_estimator=_read_estimator(f, name, used, extra_estimators),
        recompute_old_log_prob=f.get("recompute_old_log_prob", bool, True),
    )
    f.finish()
    if alg.adv_estimator in NEEDS_GROUPS and alg.samples_per_prompt < 2:
        raise SpecError(f.key_path("samples_per_prompt"), f"{alg.adv_estimator} (algorithm.adv_estimator) compares "
                        "each response with the others to its prompt: give at least 2 responses per prompt, not "
                        f"{alg.samples_per_prompt} (verl's rollout.n > 1)")
    if alg.adv_estimator in NEEDS_SUM_PI_SQUARED and not alg.recompute_old_log_prob:
        raise SpecError(f.key_path("recompute_old_log_prob"), f"{alg.adv_estimator} reads Σπ² from the actor's "
                        "old-log-prob pass (verl's actor.calculate_sum_pi_squared): keep it true")
    return alg


def _read_estimator(f: Fields, name: str, used: list[str], extra: tuple[str, ...] = ()) -> str:
    """``algorithm.adv_estimator``: a built-in name or one ``run.algorithm_modules`` declares (``extra``)."""
    if name == "train":
        if f.has("adv_estimator"):
            raise SpecError(f.key_path("adv_estimator"), "a training-only job has no advantages; remove the key")
        return ""
    estimator = f.get("adv_estimator", str, DEFAULT_ESTIMATOR[name], choices=(*ADVANTAGE_ESTIMATORS, *extra))
    if estimator in NEEDS_CRITIC and "critic" not in used:
        raise SpecError(f.key_path("adv_estimator"), f"{estimator} needs a 'critic' under algorithm.models, which "
                        f"algorithm.name {name} leaves out: give algorithm.name: ppo with a models.critic (verl's "
                        "critic.model.path), or a critic-free estimator such as grpo")
    return estimator


def _read_workload(f: Fields, alg: Algorithm, base_dir: Path) -> Workload:
    if alg.name == "train":
        wl = Workload(global_batch=f.get("global_batch", int, minimum=1, maximum=MAX_SEQUENCES),
                      sequence_length=f.get("sequence_length", int, minimum=1, maximum=MAX_TOKENS))
    else:
        wl = Workload(prompts_per_step=f.get("prompts_per_step", int, minimum=1, maximum=MAX_SEQUENCES),
                      prompt_length=f.get("prompt_length", int, minimum=1, maximum=MAX_TOKENS),
                      response=_read_response(f.sub("response_length", required=True), base_dir),
                      filter_keep_rate=f.get("filter_keep_rate", float, 1.0))
    f.finish()
    sequences = wl.global_batch or wl.prompts_per_step * alg.samples_per_prompt
    if sequences > MAX_SEQUENCES:
        raise SpecError(f.key_path("prompts_per_step"), f"{sequences:,} sequences per step (prompts x samples) is "
                        f"more than nereus plans for (at most {MAX_SEQUENCES:,}); give fewer prompts or samples")
    if sequences % alg.mini_batches:
        raise SpecError("algorithm.mini_batches",
                        f"{alg.mini_batches} does not divide the {sequences} sequences of a step")
    return wl


def _bool_or_auto(f: Fields, key: str) -> bool | str:
    value = f.get(key, (bool, str), False)
    if isinstance(value, str) and value != "auto":
        raise SpecError(f.key_path(key), f"{value!r} is not allowed; give true, false or 'auto'")
    return value


def _read_options(f: Fields, runs: bool = False) -> Options:
    """``options``; ``runs``: the job has a ``run`` section, whose runtime recomputes activations only when
    asked (recompute defaults to none there; a planning-only job's default is Megatron's selective)."""
    def auto_or_int(key: str) -> int | str:
        value = f.get(key, (int, str), "auto")
        if isinstance(value, str) and value != "auto":
            raise SpecError(f.key_path(key), f"{value!r} is not allowed; give a positive integer or 'auto'")
        if isinstance(value, int) and value < 1:
            raise SpecError(f.key_path(key), f"{value} is out of range; must be >= 1 or 'auto'")
        return value

    opts = Options(
        recompute=f.get("recompute", str, "none" if runs else "selective", choices=[*RECOMPUTE, "auto"]),
        sequence_parallel=f.get("sequence_parallel", bool, True),
        zero1=f.get("zero1", bool, True),
        fsdp=_bool_or_auto(f, "fsdp"),
        interleave=auto_or_int("interleave"),
        micro_batch_size=auto_or_int("micro_batch_size"),
        ep=auto_or_int("ep"),
        attention=f.get("attention", str, "flash", choices=["flash", "standard"]),
        grad_bytes=f.get("grad_bytes", int, 4, choices=[2, 4]),
        weight_bytes=f.get("weight_bytes", int, 2, choices=[2, 4]),
        concurrent_stages=f.get("concurrent_stages", bool, True),
    )
    f.finish()
    return opts


def _read_model(f: Fields, base_dir: Path) -> tuple[ModelArch, str | None]:
    """A model entry: ``path: DIR`` (an HF model directory: config.json, safetensors, tokenizer files;
    the architecture comes from its config) or an architecture (``read_arch``)."""
    if not f.has("path"):
        return read_arch(f, base_dir), None
    path = Path(f.get("path", str))
    path = path if path.is_absolute() else base_dir / path
    f.finish()
    if not path.is_dir():
        raise SpecError(f.key_path("path"), f"{str(path)!r} is not a directory; give an HF model directory "
                                            "(config.json, model.safetensors, tokenizer files)")
    return arch_from_hf_config(path / "config.json", f.key_path("path")), str(path)


def _check_paths(paths: dict[str, str], used: tuple[str, ...]) -> None:
    """Pretrained and random-initialised models do not mix: with any ``path``, every model of the
    algorithm has one (the critic's and reference's may be the actor's directory, as in verl)."""
    if not paths:
        return
    missing = [m for m in used if m not in paths]
    if missing:
        raise SpecError(f"models.{missing[0]}", "give path: like the other models (an HF model directory; "
                                                "the critic and reference may use the actor's)")


def job_from_dict(data: object, base_dir: Path = Path(".")) -> JobSpec:
    root = Fields(data, "")
    models_f = root.sub("models", required=True)
    models, paths = {}, {}
    for name in models_f.data:
        models[str(name)], path = _read_model(models_f.sub(str(name)), base_dir)
        if path is not None:
            paths[str(name)] = path
    if not models:
        raise SpecError("models", "define at least one model")
    modules, declared = _algorithm_modules(root, base_dir)
    algorithm = _read_algorithm(root.sub("algorithm", required=True), models, declared.adv_estimators)
    _check_paths({m: p for m, p in paths.items() if m in algorithm.models}, algorithm.models)
    job = JobSpec(
        name=root.get("name", str, "job"),
        models={m: models[m] for m in algorithm.models},
        algorithm=algorithm,
        workload=_read_workload(root.sub("workload", required=True), algorithm, base_dir),
        cluster=read_cluster(root.sub("cluster", required=True), base_dir),
        options=_read_options(root.sub("options"), runs=root.has("run")),
        paths={m: p for m, p in paths.items() if m in algorithm.models},
    )
    if root.has("run"):
        if algorithm.name == "train":
            raise SpecError("run", "`nereus run` runs RL jobs (ppo, grpo); this is a training-only job")
        job = replace(job, run=read_run(root.sub("run"), job.model_stages(), job.workload.response.max,
                                        declared.policy_losses))
        job = replace(job, run=replace(job.run, algorithm_modules=modules))
        job = replace(job, run=_reward_function(job.run, base_dir))
        run = job.run
        for name, layout in run.layouts.items():
            ParallelDims.of(layout, job.models[name.split("/")[0]], f"run.layouts.{name}")
        check_rollout_engine(run.rollout_engine, {m: a.head_dim for m, a in job.models.items()}, run.layouts,
                             installed_distribution(run.rollout_engine.traits), job.models["actor"].moe is not None)
        check_old_log_prob(job.algorithm, run)
        check_router_replay(run.router_replay, job.models["actor"].moe is not None)
        check_dapo(run, job.algorithm.samples_per_prompt, job.algorithm.models)
    check_keep_rate(job.workload.filter_keep_rate, job.run)
    root.finish()
    return job


def check_old_log_prob(alg: Algorithm, run: RunSpec) -> None:
    """``algorithm.recompute_old_log_prob: false`` only where the engine's sampled log-probs are the trainer's
    old log-probs: every trained token sampled by the weights being trained (no lag, no run-ahead step), by
    an engine that records each token's log-prob from the same fp32 forward and the same untempered, uncut
    logits as the trainer's inference (``EngineTraits.exact_logprobs``: the native engine, within 1e-6 on the
    long-tail task; vLLM's are its kernels' numbers, up to 0.2 apart from an fp32 trainer's in bf16)."""
    if alg.recompute_old_log_prob:
        return
    key = "algorithm.recompute_old_log_prob"
    why = {"run.rollout.engine": not run.rollout_engine.traits.exact_logprobs, "run.policy_lag": run.policy_lag > 0,
           "run.async.enabled": run.async_mode.on, "run.rollout.partial_rollout": run.rollout_partial is not None}
    for name, refuses in why.items():
        if refuses:
            raise SpecError(key, f"false needs the native engine's on-policy samples (its log-probs are then "
                                 f"the trainer's), which {name} rules out: "
                                 "set it to true or change that key")


def _algorithm_modules(root: Fields, base_dir: Path) -> tuple[tuple[str, ...], DeclaredAlgorithms]:
    """``run.algorithm_modules`` resolved, and the estimators and losses their decorators declare, read
    before the sections that name them (``spec.user_algorithms``: no user code runs)."""
    run = root.data.get("run") if isinstance(root.data, dict) else None
    if not isinstance(run, dict) or run.get("algorithm_modules") is None:
        return (), DeclaredAlgorithms()
    return read_algorithm_modules(run["algorithm_modules"], base_dir)


def _reward_function(run: RunSpec, base_dir: Path) -> RunSpec:
    """``run.reward_function`` with a relative file resolved against the job file's folder, checked
    without running it (``spec.user_code``): the code runs only once the job is accepted."""
    if run.reward_function is None:
        return run
    target = resolve_target(run.reward_function, base_dir, "run.reward_function")
    check_target(target, "run.reward_function")
    return replace(run, reward_function=target)


def load_job(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> JobSpec:
    """Read and validate a job spec; every error is a ``SpecError`` naming the key path. ``overrides``
    (``key.path=value``, nereus.spec.overrides) change the raw tree first, so they are validated alike."""
    return load_effective(path, overrides)[0]


def load_effective(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> tuple[JobSpec, EffectiveConfig]:
    """``load_job`` and the effective config it validated (``spec.effective``); an error names the key as the
    user typed it (a verl override's key, not the Nereus key it set)."""
    path = Path(path)
    config = effective_config(read_yaml_file(path, "job"), overrides)
    try:
        return job_from_dict(config.tree, path.parent), config
    except SpecError as err:
        raise config.typed.rename(err) from None
