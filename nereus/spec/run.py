"""The optional ``run:`` section of a job spec: what ``nereus run`` needs beyond planning — data, steps,
learning rates, PPO/GRPO coefficients, the response-length curriculum, checkpoints and fixed layouts.
Names follow verl's config where one exists (``clip_ratio``, ``kl_loss_coef``, ``lam``...)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from nereus.spec import run_train_knobs as knobs
from nereus.spec.algorithms import KL_KINDS, KL_UNSUPPORTED, LOGGERS, LOSS_AGG_MODES
from nereus.spec.errors import SpecError
from nereus.spec.fields import MAX_SEED, MAX_STEPS, Fields
from nereus.spec.layout import Layout, ModelStage
from nereus.spec.levers import TailBatching
from nereus.spec.packing import PackingSpec, read_packing
from nereus.spec.rollout import PartialRolloutConfig, RolloutEngine
from nereus.spec.run_algorithm import PolicyLossSpec, read_policy_loss
from nereus.spec.run_dapo import FilterGroupsSpec, OverlongBufferSpec, read_filter_groups, read_overlong_buffer
from nereus.spec.run_moe import read_router_replay
from nereus.spec.run_rollout import MidstepSpec, ValKwargs, read_rollout_section

# auto: the row's data_source picks the rule (nereus.rl.rewards, as verl's default reward manager does)
RULES = ("auto", "exact_match", "digit_match", "none")

# Local worker processes of one run: each is a Ray actor holding a torch process group member, and the
# runtime is tested up to a few; 64 is already far past what one host's cores time-share usefully.
MAX_WORKERS = 64
# The built-in task generates every prompt up front, in memory: 10^6 prompts is ~100x its default sets.
MAX_DATASET = 10**6
@dataclass(frozen=True)
class DataSpec:
    # verl-format .jsonl/.parquet files, their rows read in order (verl's data.train_files may list several);
    # none: the built-in task
    train: tuple[str, ...] = ()
    val: tuple[str, ...] = ()
    filter_overlong_prompts: bool = False  # verl's: drop rows longer than the maximum prompt length (else an error)
    train_size: int = 2000  # built-in task only
    val_size: int = 200
    max_digits: int = 6


@dataclass(frozen=True)
class WarmStart:
    """Supervised warm-start of a randomly initialised actor (and reward model) on the built-in task."""

    actor_steps: int = 0
    reward_steps: int = 0
    batch: int = 64
    lr: float = 3e-3
    # share of the actor's target spread over the vocabulary (Szegedy et al. 2016): keeps the policy's
    # entropy off zero, so sampled responses still differ and GRPO groups have advantages to learn from
    label_smoothing: float = 0.0
    # > 0: stop the actor's warm-start (at most actor_steps) once greedy decoding solves this share of
    # training prompts, so that every seed starts RL from a comparable policy (the supervised curve of the
    # built-in task jumps within a few steps, at a step that differs by seed)
    target_accuracy: float = 0.0


def value_at(schedule: tuple[tuple[int, int], ...], step: int, default: int) -> int:
    """The value a (from step, value) schedule with increasing steps gives at ``step``."""
    out = default
    for start, value in schedule:
        if step >= start:
            out = value
    return out


@dataclass(frozen=True)
class AdaptSpec:
    """``run.adapt``: the controller chooses and changes the layouts while the job runs.
    ``availability``: (from step, workers) — Ray workers that join or leave; the rest tune the controller
    (``nereus.control.ControllerConfig``)."""

    availability: tuple[tuple[int, int], ...] = ()
    horizon: int = 30
    cooldown: int = 5
    min_gain: float = 0.03
    margin: float = 0.5
    replan_every: int = 25
    fit_every: int = 5
    # False: decide on the profile's predictions alone, never on measured times (a reproducible run)
    calibrate: bool = True

    def workers_at(self, step: int, default: int) -> int:
        return value_at(self.availability, step, default)


# run.rollout.midstep.transfer: how a moved sequence's KV caches reach the other replica
# run.async.enabled: off, on, or chosen by the step-time prediction after the warm-up steps (nereus.run.asyncmode)
ASYNC_MODES = ("false", "true", "auto")
# run.async.rollout_is: verl's algorithm.rollout_correction.rollout_is (token, sequence, null); "none" is null
ROLLOUT_IS_LEVELS = ("token", "sequence", "none")
# run.async.rollout_is_mode: truncate = verl's TIS clamp (Yao et al. 2025); mask = AReaL's behav_imp_weight_cap
ROLLOUT_IS_MODES = ("truncate", "mask")


@dataclass(frozen=True)
class AsyncSpec:
    """``run.async``: generation of step k+1 overlaps inference and training of step k (docs/async.md).

    ``staleness``: the most policy versions a trained sample may lag the policy being trained (AReaL's
    ``rollout.max_head_offpolicyness``; verl's fully-async recipe bounds it as a share of samples,
    ``async_training.staleness_threshold``). The off-policy correction weights each token by
    π_old/π_rollout (decoupled PPO, Fu et al. 2025, arXiv:2505.24298), names as verl's
    ``algorithm.rollout_correction``."""

    enabled: str = "false"  # one of ASYNC_MODES
    staleness: int = 1
    rollout_is: str = "token"
    rollout_is_threshold: float = 2.0  # verl's default
    rollout_is_mode: str = "truncate"

    @property
    def on(self) -> bool:
        """Whether the async machinery runs at all (``true``, or ``auto`` deciding)."""
        return self.enabled != "false"


@dataclass(frozen=True)
class RunSpec:
    seed: int = 0
    steps: int = 20  # 0 until resolved from total_epochs (``resolve_steps``)
    workers: int = 4
    total_epochs: int = 0  # verl's trainer.total_epochs: steps = epochs × (train rows // prompts per step)
    data: DataSpec = field(default_factory=DataSpec)
    warmstart: WarmStart = field(default_factory=WarmStart)
    curriculum: tuple[tuple[int, int], ...] = ()  # (from step, max response length)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # verl's rollout.top_k: the k most likely tokens, before top_p; -1 or 0: off
    actor_lr: float = 3e-4  # 1e-3 collapses the tiny examples on some seeds (docs/rl.md, "Learning settings")
    critic_lr: float = 1e-3
    clip_ratio: float = 0.2
    grad_clip: float = 1.0  # global gradient-norm clipping of actor and critic updates (verl's default); 0: off
    # verl's optim.lr_warmup_steps / lr_warmup_steps_ratio (constant schedule with linear warm-up), both models
    lr_warmup_steps: int = 0  # <= 0 (verl's default -1): the ratio decides
    lr_warmup_steps_ratio: float = 0.0  # used when lr_warmup_steps is 0: int(ratio × steps)
    # run.lr_scheduler_type, run.min_lr_ratio, run.num_cycles (verl's optim.*): constant or cosine after warm-up
    lr_schedule: knobs.LrScheduleSpec = field(default_factory=knobs.LrScheduleSpec)
    critic_warmup: int = 0  # verl's trainer.critic_warmup: the actor trains from (1-based) step critic_warmup on
    weight_decay: float = 0.0  # AdamW's decoupled weight decay of actor and critic (verl's optim.weight_decay)
    clip_ratio_high: float | None = None
    clip_ratio_low: float | None = None  # verl's names; each defaults to clip_ratio
    clip_ratio_c: float = 3.0  # dual-clip bound for negative advantages (verl's default; Ye et al. 2020)
    loss_agg_mode: str = "token-mean"  # actor and critic loss aggregation (nereus.rl.core.agg_loss)
    policy_loss: PolicyLossSpec = field(default_factory=PolicyLossSpec)  # run.policy_loss (rl.policy_losses)
    norm_adv_by_std_in_grpo: bool = True
    entropy_coeff: float = 0.0  # entropy bonus: the loss subtracts coeff × the full-vocabulary entropy
    value_clip: float = 0.5
    gamma: float = 1.0
    lam: float = 1.0
    use_kl_loss: bool = False  # GRPO: KL as a loss term; PPO: KL as a reward penalty
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "k3"
    kl_coef: float = 0.0  # in-reward KL penalty (PPO)
    kl_ctrl: knobs.KlCtrlSpec = field(default_factory=knobs.KlCtrlSpec)  # run.kl_ctrl: kl_coef fixed or adaptive
    kl_penalty: str = "k1"
    rule_reward: str = "auto"
    reward_function: str | None = None  # "package.module:function" with verl's signature (rl.rewards)
    # user modules registering estimators and losses (spec.user_algorithms; resolved by the job reader)
    algorithm_modules: tuple[str, ...] = ()
    reward_model_coef: float = 0.0
    eval_every: int = 5  # 0: only at the end
    checkpoint_dir: str = "runs/job"
    checkpoint_every: int = 0  # 0: only at the end
    snapshot_every: int = 1  # host-memory snapshots for recovery from a lost worker (0: none)
    layouts: dict[str, Layout] = field(default_factory=dict)  # model-stage -> layout ('search': the planner)
    ranks: dict[str, tuple[int, ...]] = field(default_factory=dict)
    adapt: AdaptSpec | None = None
    logger: tuple[str, ...] | None = None  # verl's trainer.logger; None: console, JSONL, TensorBoard if installed
    # run.rollout.slots (verl: actor_rollout_ref.rollout.max_num_seqs): > 0 generates with the continuous-
    # batching engine, this many sequences at a time per replica (runtime.engines.native.decode_engine); 0: the
    # fixed batch (an engine's own default where it has one: EngineTraits.default_slots)
    rollout_slots: int = 0
    # run.rollout.pad_to_max: pack rollouts to the longest possible prompt + response (not the longest
    # present), so that with run.overlap inference starts on a generation replica's rows once it finishes
    rollout_pad_to_max: bool = False
    # run.rollout.midstep: mid-step moves of unfinished sequences between generation replicas; None: off
    rollout_midstep: MidstepSpec | None = None
    # run.rollout.engine (verl: actor_rollout_ref.rollout.name): native or vllm, with the engine's settings
    rollout_engine: RolloutEngine = field(default_factory=RolloutEngine)
    # run.rollout.tail_batching: over-launch and defer unfinished groups (run.tail); None: off
    rollout_tail: TailBatching | None = None
    # run.rollout.partial_rollout: carry unfinished responses to the next step (run.partial); None: off
    rollout_partial: PartialRolloutConfig | None = None
    # run.rollout.levers: "auto" lets the controller choose the tail levers (speculative decoding, tail
    # batching) by the cost model, step by step (control.tail_policy, run.tail_decisions); "none": only the keys above
    rollout_levers: str = "none"
    # run.overlap: model-stages on disjoint workers run at once (run.overlap.Calls); results are identical
    overlap: bool = False
    # run.rollout.val_kwargs (verl's): greedy by default; sampled, n responses per held-out prompt
    val_kwargs: ValKwargs = field(default_factory=ValKwargs)
    # run.async (a Python keyword, hence the field name): one-step-off-policy generation, see AsyncSpec
    async_mode: AsyncSpec = field(default_factory=AsyncSpec)
    # run.policy_lag: how many steps a trained token may lag the policy being trained (spec.levers):
    # 0 strictly on-policy (layouts, speculative decoding, tail batching); 1 also partial rollout and
    # one-step asynchrony
    policy_lag: int = 0
    # run.filter_groups / run.overlong_buffer: DAPO's dynamic sampling and overlong reward shaping (run_dapo)
    filter_groups: FilterGroupsSpec = field(default_factory=FilterGroupsSpec)
    overlong_buffer: OverlongBufferSpec = field(default_factory=OverlongBufferSpec)
    packing: PackingSpec = field(default_factory=PackingSpec)  # run.packing: packed token-budget micro-batches
    router_replay: bool | None = None  # run.router_replay (run_moe): None = on for an MoE actor

    @property
    def max_workers(self) -> int:
        return max([self.workers] + [n for _, n in (self.adapt.availability if self.adapt else ())])

    @property
    def warmup_steps(self) -> int:
        """Steps of linear learning-rate warm-up: ``lr_warmup_steps``, else ``lr_warmup_steps_ratio`` ×
        ``steps`` (verl's rule: a non-positive step count defers to the ratio)."""
        return self.lr_warmup_steps if self.lr_warmup_steps > 0 else int(self.lr_warmup_steps_ratio * self.steps)

    def lr_at(self, lr: float, step: int, model: str = "") -> float:
        """The learning rate of step ``step`` (0-based) for base rate ``lr``: verl's schedules with warm-up
        (``LrScheduleSpec.ratio``: lr × step / warm-up steps until the warm-up ends — so the first step's
        updates run at 0, as verl's do — then constant or cosine). The actor's schedule counts only the
        steps it trained (``run.critic_warmup``): ``model`` is the model updated."""
        done = knobs.actor_updates_before(self.critic_warmup, step) if model == "actor" else step
        return lr * self.lr_schedule.ratio(done, self.warmup_steps, self.steps)

    def max_response_length(self, step: int, final: int) -> int:
        """The curriculum's limit at ``step`` (the workload's ``response_length.max`` without one)."""
        return value_at(self.curriculum, step, final)


def _schedule(f: Fields, key: str, value: str, minimum: int, maximum: int) -> tuple[tuple[int, int], ...]:
    """``key: [{step: S, <value>: V}, ...]`` with increasing steps, as (S, V) pairs."""
    where = f.key_path(key)
    out = []
    for i, item in enumerate(f.get(key, list, [])):
        g = Fields(item, f"{where}[{i}]")
        out.append((g.get("step", int, minimum=0), g.get(value, int, minimum=minimum, maximum=maximum)))
        g.finish()
    if any(b[0] <= a[0] for a, b in zip(out, out[1:], strict=False)):
        raise SpecError(where, "steps must increase")
    return tuple(out)


def _curriculum(f: Fields, final: int) -> tuple[tuple[int, int], ...]:
    out = _schedule(f, "curriculum", "max_response_length", 1, final)
    if out and out[0][0] != 0:
        raise SpecError(f"{f.key_path('curriculum')}[0].step", "the curriculum must start at step 0")
    return out


def _adapt(f: Fields) -> AdaptSpec | None:
    if not f.has("adapt"):
        return None
    a = f.sub("adapt")
    avail = _schedule(a, "availability", "workers", 1, MAX_WORKERS)
    spec = AdaptSpec(availability=avail, horizon=a.get("horizon", int, 30, minimum=1),
                     cooldown=a.get("cooldown", int, 5, minimum=0), min_gain=a.get("min_gain", float, 0.03, minimum=0),
                     margin=a.get("margin", float, 0.5, minimum=0),
                     replan_every=a.get("replan_every", int, 25, minimum=1),
                     fit_every=a.get("fit_every", int, 5, minimum=1), calibrate=a.get("calibrate", bool, True))
    a.finish()
    return spec


def _async(f: Fields) -> AsyncSpec:
    """``run.async``: ``enabled`` (true, false, auto), ``staleness``, ``rollout_is``,
    ``rollout_is_threshold``, ``rollout_is_mode``."""
    a = f.sub("async")
    raw = a.data.get("enabled", False)
    if isinstance(raw, bool):
        a.get("enabled", bool, False)
        enabled = "true" if raw else "false"
    else:
        enabled = a.get("enabled", str, "false", choices=ASYNC_MODES)
    staleness = a.get("staleness", int, 1, minimum=1)
    if staleness != 1:  # the weight sync waits for every queued generation: a deeper queue adds staleness only
        raise SpecError(a.key_path("staleness"), f"{staleness}: only 1 is supported (generation runs one step "
                        "ahead; the per-step weight sync waits for queued generations, so a deeper queue would "
                        "add staleness without more overlap). Use 1, or enabled: false for on-policy steps")
    threshold = a.get("rollout_is_threshold", float, 2.0)
    if threshold <= 1:
        raise SpecError(a.key_path("rollout_is_threshold"), f"{threshold} must exceed 1 (it caps the importance "
                        "weight pi_old/pi_rollout from above; verl's default is 2.0)")
    spec = AsyncSpec(enabled=enabled, staleness=staleness,
                     rollout_is=a.get("rollout_is", str, "token", choices=ROLLOUT_IS_LEVELS),
                     rollout_is_threshold=threshold,
                     rollout_is_mode=a.get("rollout_is_mode", str, "truncate", choices=ROLLOUT_IS_MODES))
    a.finish()
    return spec


def _layouts(f: Fields, stages: list[ModelStage]) -> tuple[dict[str, Layout], dict[str, tuple[int, ...]]]:
    known = {str(ms) for ms in stages}
    layouts, ranks = {}, {}
    for key in f.data:
        where = f.key_path(str(key))
        if key not in known:
            raise SpecError(where, f"not a model-stage of this job; choose from {sorted(known)}")
        g = f.sub(str(key)) if isinstance(f.data[key], dict) else None
        text = g.get("layout", str) if g else f.get(str(key), str)
        layouts[key] = Layout.parse(text, where)
        if g is not None:
            rk = g.get_list("ranks", int, list(range(layouts[key].world)))
            if len(rk) != layouts[key].world or len(set(rk)) != len(rk) or min(rk, default=0) < 0:
                raise SpecError(f"{where}.ranks", f"give {layouts[key].world} distinct worker ranks (>= 0)")
            ranks[key] = tuple(rk)
            g.finish()
    f.finish()
    return layouts, ranks


def _check_task_size(d: Fields, data: DataSpec) -> None:
    """The built-in task draws distinct digit strings by rejection (``nereus.rl.task.reverse_rows``): asking
    for more than exist never finishes, and near all of them it slows down like a coupon collector, so at
    most half of the strings of up to ``max_digits`` digits may be drawn."""
    if data.train:
        return
    distinct = sum(10**n for n in range(1, data.max_digits + 1))
    wanted = data.train_size + (data.val_size if not data.val else 0)
    if wanted > distinct // 2:
        raise SpecError(d.key_path("train_size"), f"the built-in task has {distinct:,} distinct prompts of up to "
                        f"{data.max_digits} digits; {wanted:,} (train_size + val_size) is more than half of them. "
                        "Raise max_digits or lower the sizes")


def _steps(f: Fields) -> int:
    """``steps``; with ``total_epochs`` and no ``steps``, 0 until the data is read (``resolve_steps``). Given
    both, ``steps`` wins, as verl's total_training_steps wins over total_epochs."""
    default = 0 if f.data.get("total_epochs") and not f.has("steps") else 20
    return f.get("steps", int, default, minimum=1, maximum=MAX_STEPS)


def resolve_steps(spec: RunSpec, train_rows: int, prompts_per_step: int) -> RunSpec:
    """``spec`` with ``steps`` from ``total_epochs`` when it was not given: whole batches of the training
    rows per epoch (verl's dataloader drops the last partial batch)."""
    if spec.steps:
        return spec
    steps = spec.total_epochs * (train_rows // prompts_per_step)
    if steps < 1:
        raise SpecError("run.total_epochs", f"{train_rows} training rows make no whole step of {prompts_per_step} "
                                            "prompts (data.train_batch_size); give run.steps or more rows")
    return replace(spec, steps=min(steps, MAX_STEPS))


def _files(d: Fields, key: str) -> tuple[str, ...]:
    """``run.data.train`` / ``val``: one file or a list of them (verl's ``data.train_files``)."""
    raw = d.data.get(key)
    if isinstance(raw, list):
        files = d.get_list(key, str)
        if not files:
            raise SpecError(d.key_path(key), "an empty list; give at least one file (or remove the key)")
        return tuple(files)
    value = d.get(key, str, None)
    return () if value is None else (value,)


def _kl_kind(f: Fields, key: str, default: str) -> str:
    """A KL estimator's name: Nereus's (k1, k2, k3) or verl's (kl, mse, low_var_kl, abs)."""
    value = f.data.get(key)
    if isinstance(value, str) and value in KL_UNSUPPORTED:  # a list or mapping is refused by f.get below
        raise SpecError(f.key_path(key), f"{value!r}: {KL_UNSUPPORTED[value]}")
    return f.get(key, str, default, choices=KL_KINDS)


def _logger(f: Fields) -> tuple[str, ...] | None:
    """``logger``: a list of sinks (verl's trainer.logger) or one name."""
    if not f.has("logger") or f.data["logger"] is None:
        f.get("logger", list, None)
        return None
    raw = f.data["logger"]
    items = f.get_list("logger", str) if isinstance(raw, list) else [f.get("logger", str)]
    for i, name in enumerate(items):
        if name not in LOGGERS:
            raise SpecError(f"{f.key_path('logger')}[{i}]", f"{name!r} is not a logger; choose from {list(LOGGERS)}")
    return tuple(dict.fromkeys(items))


def _clip_ratio_c(f: Fields) -> float:
    value = f.get("clip_ratio_c", float, 3.0)
    if value <= 1:
        raise SpecError(f.key_path("clip_ratio_c"), f"{value} must exceed 1 (dual-clip caps the loss of negative "
                                                    "advantages at ratio c; verl's default is 3.0)")
    return value


def _data(d: Fields) -> DataSpec:
    data = DataSpec(train=_files(d, "train"), val=_files(d, "val"),
                    filter_overlong_prompts=d.get("filter_overlong_prompts", bool, False),
                    train_size=d.get("train_size", int, 2000, minimum=1, maximum=MAX_DATASET),
                    val_size=d.get("val_size", int, 200, minimum=1, maximum=MAX_DATASET),
                    max_digits=d.get("max_digits", int, 6, minimum=1, maximum=30))
    d.finish()
    _check_task_size(d, data)
    return data


def _warmstart(w: Fields) -> WarmStart:
    warm = WarmStart(actor_steps=w.get("actor_steps", int, 0, minimum=0, maximum=MAX_STEPS),
                     reward_steps=w.get("reward_steps", int, 0, minimum=0, maximum=MAX_STEPS),
                     batch=w.get("batch", int, 64, minimum=1, maximum=MAX_DATASET),
                     lr=w.get("lr", float, 3e-3, minimum=0),
                     label_smoothing=w.get("label_smoothing", float, 0.0, minimum=0, maximum=0.5),
                     target_accuracy=w.get("target_accuracy", float, 0.0, minimum=0, maximum=1))
    w.finish()
    return warm


def read_run(f: Fields, stages: list[ModelStage], final_response: int, extra_losses: tuple[str, ...] = ()) -> RunSpec:
    """``run:``; ``extra_losses``: the policy losses ``run.algorithm_modules`` declare."""
    data, warm = _data(f.sub("data")), _warmstart(f.sub("warmstart"))
    layouts, ranks = _layouts(f.sub("layouts"), stages)
    ckpt, ro = f.sub("checkpoint"), read_rollout_section(f)
    spec = RunSpec(
        seed=f.get("seed", int, 0, minimum=0, maximum=MAX_SEED),
        steps=_steps(f),
        total_epochs=f.get("total_epochs", int, 0, minimum=0, maximum=MAX_STEPS),
        workers=f.get("workers", int, 4, minimum=1, maximum=MAX_WORKERS), data=data, warmstart=warm,
        curriculum=_curriculum(f, final_response),
        temperature=f.get("temperature", float, 1.0, minimum=0), top_p=f.get("top_p", float, 1.0, minimum=0, maximum=1),
        top_k=knobs.read_top_k(f), lr_schedule=knobs.read_lr_schedule(f),
        critic_warmup=knobs.read_critic_warmup(f, stages),
        actor_lr=f.get("actor_lr", float, 3e-4, minimum=0), critic_lr=f.get("critic_lr", float, 1e-3, minimum=0),
        clip_ratio=f.get("clip_ratio", float, 0.2, minimum=0),
        grad_clip=f.get("grad_clip", float, 1.0, minimum=0),
        lr_warmup_steps=f.get("lr_warmup_steps", int, 0, minimum=-1, maximum=MAX_STEPS),
        lr_warmup_steps_ratio=f.get("lr_warmup_steps_ratio", float, 0.0, minimum=0, maximum=1),
        weight_decay=f.get("weight_decay", float, 0.0, minimum=0),
        clip_ratio_high=f.get("clip_ratio_high", float, None, minimum=0),
        clip_ratio_low=f.get("clip_ratio_low", float, None, minimum=0, maximum=1),
        clip_ratio_c=_clip_ratio_c(f),
        loss_agg_mode=f.get("loss_agg_mode", str, "token-mean", choices=LOSS_AGG_MODES),
        policy_loss=read_policy_loss(f, extra_losses),
        algorithm_modules=tuple(f.get_list("algorithm_modules", str, [])),
        norm_adv_by_std_in_grpo=f.get("norm_adv_by_std_in_grpo", bool, True),
        entropy_coeff=f.get("entropy_coeff", float, 0.0, minimum=0),
        value_clip=f.get("value_clip", float, 0.5, minimum=0),
        gamma=f.get("gamma", float, 1.0, minimum=0, maximum=1), lam=f.get("lam", float, 1.0, minimum=0, maximum=1),
        use_kl_loss=f.get("use_kl_loss", bool, False), kl_loss_coef=f.get("kl_loss_coef", float, 0.001, minimum=0),
        kl_loss_type=_kl_kind(f, "kl_loss_type", "k3"),
        kl_coef=f.get("kl_coef", float, 0.0, minimum=0), kl_penalty=_kl_kind(f, "kl_penalty", "k1"),
        kl_ctrl=knobs.read_kl_ctrl(f),
        rule_reward=f.get("rule_reward", str, "auto", choices=RULES),
        reward_function=f.get("reward_function", str, None),
        reward_model_coef=f.get("reward_model_coef", float, 0.0, minimum=0),
        eval_every=f.get("eval_every", int, 5, minimum=0),
        checkpoint_dir=ckpt.get("dir", str, "runs/job"), checkpoint_every=ckpt.get("every", int, 0, minimum=0),
        snapshot_every=ckpt.get("snapshot_every", int, 1, minimum=0),
        layouts=layouts, ranks=ranks, adapt=_adapt(f), logger=_logger(f), rollout_slots=ro.slots,
        rollout_pad_to_max=ro.pad_to_max, rollout_midstep=ro.midstep, rollout_engine=ro.engine,
        rollout_tail=ro.tail, rollout_partial=ro.partial, rollout_levers=ro.levers, policy_lag=ro.policy_lag,
        overlap=f.get("overlap", bool, False), async_mode=_async(f), val_kwargs=ro.val_kwargs,
        filter_groups=read_filter_groups(f.sub("filter_groups")),
        overlong_buffer=read_overlong_buffer(f.sub("overlong_buffer"), final_response),
        packing=read_packing(f.sub("packing")), router_replay=read_router_replay(f))
    ckpt.finish()
    f.finish()
    _check_run(f, spec)
    return spec


# Below this a temperature divides logits past float32's range (vLLM's _SAMPLING_EPS treats it as greedy)
MIN_TEMPERATURE = 1e-5


def _check_sampling(f: Fields, spec: RunSpec) -> None:
    """Sampling parameters that would leave no token to draw (``runtime.engines.sampling.sample``):
    ``top_p`` 0 keeps no token, a temperature just above 0 turns the logits into infinities."""
    if spec.top_p <= 0:
        raise SpecError(f.key_path("top_p"), f"{spec.top_p} keeps no token to sample from; give a value in (0, 1] "
                                             "(1: no nucleus cut; greedy decoding is temperature: 0)")
    if 0 < spec.temperature < MIN_TEMPERATURE:
        raise SpecError(f.key_path("temperature"), f"{spec.temperature} overflows the logits; give 0 for greedy "
                                                   f"decoding or at least {MIN_TEMPERATURE:g}")


def _check_run(f: Fields, spec: RunSpec) -> None:
    """Checks across ``run`` keys, once each key is valid on its own."""
    _check_sampling(f, spec)
    if spec.adapt is not None and spec.layouts:
        raise SpecError(f.key_path("layouts"), "with run.adapt the controller chooses every layout: remove "
                                               "run.layouts (or run.adapt to keep them fixed)")
    if spec.adapt is not None and spec.async_mode.on:
        raise SpecError(f.key_path("async.enabled"), "run.async with run.adapt is not supported yet (the controller "
                                                     "reads stage times a run-ahead generation changes): remove one")
    if spec.async_mode.on and (spec.rollout_tail is not None or spec.rollout_partial is not None):
        raise SpecError(f.key_path("async.enabled"), "run.async with tail_batching or partial_rollout is not "
                                                     "supported (both reorder the prompts a run-ahead step draws): "
                                                     "remove one")
    for key, rk in spec.ranks.items():
        if max(rk) >= spec.workers:
            raise SpecError(f"{f.key_path('layouts')}.{key}.ranks", f"ranks must be below run.workers ({spec.workers})")
    for key, lay in spec.layouts.items():
        if key not in spec.ranks and lay.world > spec.workers:
            raise SpecError(f"{f.key_path('layouts')}.{key}", f"{lay.world} ranks exceed run.workers ({spec.workers})")
    gen = spec.layouts.get("actor/generation")
    if spec.rollout_midstep is not None and gen is not None and gen.dp < 2:
        raise SpecError(f"{f.key_path('rollout')}.midstep.enabled", f"mid-step moves go between generation "
                        f"replicas, and run.layouts.actor/generation has dp={gen.dp}: give it dp >= 2")
