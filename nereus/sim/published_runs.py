"""Published end-to-end RL runs as Nereus jobs and plans, built from a row's own fields only.

A row of the ``e2e_runs.csv`` schema (``nereus/cost/e2e_runs.md``: model architecture, GPU kind and count,
placement, rollout TP, training backend and degrees, batch, lengths, sync mode, published stage seconds)
becomes a ``JobSpec`` through ``job_from_dict`` (as a job file is read) and a ``Plan`` of the run's
layouts, which ``nereus.sim.published_predict`` prices with the cost model or runs on the simulator. No
row has a knob of its own: what a row leaves empty takes one stated rule for every row (below), and what
no rule covers skips the row with its reason (``RowSkipped``), never a silent guess.

Rules for what the schema leaves out or a row leaves empty (docs/cost-model.md, "End-to-end RL runs"):

- lengths: the published mean prompt / response length; when only the cap is published, a prompt's mean
  is ``UNSTATED_PROMPT_FRACTION`` of its cap and a response's ``UNSTATED_RESPONSE_TOKENS`` (at most half
  its cap); when only a prompt's mean is, its cap is that mean over the same fraction. Responses are
  log-normal with ``RESPONSE_SIGMA``, clipped at the cap; a mean longer than its cap skips the row.
- rollout TP: the row's, else verl's example scripts' for a model of that size (``sim.recipes``; an MoE
  model's from verl's MoE scripts).
- the framework's own defaults where the schema has no column (``sim.published_frameworks``; verl's for
  a framework it does not list): a learned reward model, padded micro-batches, DeepSpeed-Chat's prompts at
  their cap, its Hybrid Engine for ``rollout_engine`` other, OpenRLHF's GPU groups and generate calls,
  mini-batch sizes, the weight-sync mechanism, and the ``offload`` column's host state.
- micro-batches: verl's dynamic batching (token budget per GPU) at its recipes' budgets, for every row
  (a framework that pads: rows as wide as the step's longest).
- PPO mini-batches of the framework's prompts (``FrameworkDefaults.mini_batch_prompts``; verl's DAPO
  scripts' 32), a verl MoE row's recipe's (the schema has no mini-batch count): one optimizer
  update each, micro-batched by token budget within it, so a pipeline's bubble and FSDP's gathers are paid
  per mini-batch; more prompts where those would leave a training rank none (``update_prompts``); one update
  a step when the prompts do not split into them.
- the batch through verl's driver padded to the length caps (``padded_tokens``, ``cost.controller``).
- recomputation in training as each backend runs by default in verl's recipes: FSDP and DeepSpeed with
  gradient checkpointing (``enable_gradient_checkpointing=True``, full recompute), Megatron without
  (verl/trainer/config/engine/megatron.yaml: ``recompute_granularity: null``).
- weight sync: verl's hybrid engine (``hybrid-reshard``) when colocated; when the rollout has GPUs of its
  own, verl's tensor-by-tensor NCCL broadcast (``tensor-broadcast``) or its checkpoint engine
  (``checkpoint-engine``; ``cost.verl_weight_sync``) as the row's optional ``checkpoint_engine`` column
  says, else a ``checkpoint_engine=True|False`` its notes state (``setting``), else verl's default: on for
  fully-async rows, off for the others.
- a colocated row that leaves ``offload`` empty and whose rollout finds no memory beside the trainer's
  resident state (``published_predict.with_room_for_the_rollout``): the run ran, so its trainer's state was
  off the GPU during the rollout; priced as parameters offloaded between stages and the optimizer swapped
  in for the update (``param+optimizer-swap``), as NeMo RL's Megatron worker does on every colocated run
  (``offload_after_refit``, ``prepare_for_training``) and verl's ``param_offload`` / ``optimizer_offload`` do.
- a fully asynchronous trainer uses the rollout's log-probs: no old-log-prob pass (verl's fully_async
  recipe, as the rows' notes say).
- the rollout decodes from CUDA graphs (vLLM's default) unless the row's ``enforce_eager`` says yes
  (verl's key; an optional column, else its notes' ``enforce_eager=``, else the framework's default at the
  version the notes give: verl before 2025-08 ran eagerly, ``decodes_eagerly``; an MoE row of verl takes
  its nearest MoE recipe's, all of which set it, ``verl_moe_recipe``): then every decode step
  also pays the host's eager dispatch (``cost.eager``) in the engine's fixed step cost (the cluster prior
  ``decode_step_overhead_s``).
- an MoE row (``arch`` moe): its experts from ``n_experts``, ``experts_per_token``, ``moe_ffn_hidden`` and
  ``shared_experts`` (``sim.published_arch``; dense layers from ``params_b`` when ``ffn_hidden`` is given), its
  EP from ``train_ep`` / ``rollout_ep`` (``expert_parallel``). Attention is what the columns say: MLA
  (DeepSeek-V3) is priced as multi-head attention with the row's kv heads of hidden / n_heads, which
  overstates its KV cache; Qwen3's q/k norms are left out (2 x head_dim parameters a layer).
- a pipeline depth that does not split the layers evenly (DeepSeek-V3's 61 layers at PP12) is Megatron's
  uneven split, the remainder on the first and last stages (``num_layers_in_first/last_pipeline_stage``,
  which verl's DeepSeek-V3 script sets): priced at its fullest stage, which sets a synchronous 1F1B
  pipeline's pace (``spec.parallel_dims.fullest_stage_layers``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from nereus.cost.decode import DecodePriors
from nereus.cost.eager import eager_step_overhead_s
from nereus.cost.fully_async import STALENESS_THRESHOLD
from nereus.cost.hardware import Priors
from nereus.cost.moe import decode_kernels_per_layer
from nereus.cost.stage_tokens import padded_width
from nereus.sim.published_arch import arch_dict
from nereus.sim.published_cells import (
    RowSkipped,
    as_written,
    canonical,
    count,
    enum,
    is_bound,
    number,
    setting,
    text,
)
from nereus.sim.published_frameworks import (
    FIXED_MICRO_BATCH,
    call_sequences,
    default_pools,
    dynamic_batch,
    framework_of,
    framework_recompute,
    framework_rollout_tp,
    is_verl,
    placement,
    priced_as_framework,
    unmodelled,
    update_prompts,
    verl_moe_recipe,
    with_calls,
    with_reward_model,
)
from nereus.sim.recipes import system_recipe_tp
from nereus.spec.cluster import gpu_presets, nvlink_node
from nereus.spec.errors import SpecError
from nereus.spec.job import JobSpec, job_from_dict
from nereus.spec.layout import Layout, ModelStage, Placement, Plan
from nereus.spec.parallel_dims import layer_problem, tp_splits

# Published per-step values a row may carry, in table order (``e2e_runs.md``).
STAGE_COLUMNS = ("t_gen_s", "t_old_logprob_s", "t_ref_s", "t_values_s", "t_update_actor_s",
                 "t_update_critic_s", "t_weight_sync_s", "t_step_s")
COLUMNS = (*STAGE_COLUMNS, "tok_per_s_per_gpu")
SYNC_MODES = ("sync", "one_step_off", "fully_async", "partial_rollout")
BACKENDS = {"fsdp": "fsdp", "fsdp2": "fsdp", "deepspeed": "fsdp", "megatron": "megatron"}
ALGORITHMS = ("ppo", "grpo", "dapo", "reinforce_pp", "rloo", "other")
# A mean prompt length a row does not publish, as a fraction of its cap: DAPO-Math-17k prompts in DAPO's
# template are a few hundred tokens of a 2,048 cap (one eighth). A prior, not fitted to any row.
UNSTATED_PROMPT_FRACTION = 1 / 8
# A mean response length a row does not publish. Caps (8K-28K in verl's DAPO rows) are headroom for the
# tail, not a scale of the mean. One of the validation's two global constants, fitted together with
# ``cost.controller.CONTROLLER_S_PER_TOKEN_SLOT`` on three NAMED cells (verl_oso_1's old_log_prob,
# verl_oso_3's and verl_fa_2's update_actor) and reported on every other cell (docs/cost-model.md,
# "End-to-end RL runs").
UNSTATED_RESPONSE_TOKENS = 750
FITTED_ON = ("verl_oso_1", "verl_oso_3", "verl_fa_2")
# Spread of log response lengths: the DAPO trace's (traces/long_tail_dapo.yaml), Seer and TLT's long tails
# (docs/sources/rl_length_dynamics.md).
RESPONSE_SIGMA = 1.0
# verl's dynamic batching packs a GPU's share into micro-batches of at most this many tokens: its DAPO
# recipes set actor.ppo_max_token_len_per_gpu = 2 x (max prompt + max response) and the log-prob budgets
# 3 x (recipe/dapo and recipe/fully_async_policy scripts); verl's key, per GPU whatever the TP and PP (its
# megatron_actor.py scales it by CP only, which the validation prices as DP).
TRAIN_BUDGET_PER_TOKEN_CAP = 2
INFER_BUDGET_PER_TOKEN_CAP = 3
BUDGETS = (TRAIN_BUDGET_PER_TOKEN_CAP, INFER_BUDGET_PER_TOKEN_CAP)
GPUS_PER_NODE = 8  # HGX/DGX nodes, when a row leaves gpus_per_node empty


@dataclass(frozen=True)
class PublishedRun:
    run_id: str
    job: JobSpec
    plan: Plan
    sync_mode: str
    published: dict[str, float]  # column -> published value (only the columns the row has)
    staleness: float = STALENESS_THRESHOLD  # verl fully_async's threshold (``staleness_threshold``)
    padded_tokens: int = 0  # token slots of every sequence as the batch travels: max prompt + max response
    # the rollouter pauses its in-flight samples at a parameter sync and resumes them after (verl's
    # async_training.partial_rollout), instead of waiting for them to end
    partial_rollout: bool = False
    # the row's ``offload`` cell is filled (its trainer's host state is the row's, not a default)
    offload_stated: bool = True


# The framework version a row's notes give, "version: main@~2025-07" or "main@2025-08" (year, month).
NOTE_VERSION = re.compile(r"version:\s*\S*?@~?(\d{4})-(\d{2})")
# verl's rollout.enforce_eager defaulted to True until verl PR #2956 ("enable vllm cuda graph in default",
# verl/trainer/config, merged 2025-08-08): a verl run of an earlier version decodes eagerly.
VERL_CUDA_GRAPHS_SINCE = (2025, 8)


def framework_version(row: dict) -> tuple[int, int] | None:
    """(year, month) of the framework version the row's notes give, None when they give none."""
    found = NOTE_VERSION.search(text(row, "notes"))
    return (int(found.group(1)), int(found.group(2))) if found else None


def decodes_eagerly(row: dict) -> bool:
    """The rollout runs without CUDA graphs: the row's ``enforce_eager`` (column or notes), else the
    framework's default at its version (verl before ``VERL_CUDA_GRAPHS_SINCE``), else no (vLLM's default)."""
    version = framework_version(row)
    old_verl = is_verl(row) and version is not None and version < VERL_CUDA_GRAPHS_SINCE
    eager = old_verl or bool((recipe := verl_moe_recipe(row)) is not None and recipe.enforce_eager)
    return setting(row, "enforce_eager", "yes" if eager else "no") == "yes"


def published_bounds(row: dict) -> dict[str, str]:
    """The row's published figures given as bounds ("<0.3"), as written: not values, never compared."""
    return {c: text(row, c) for c in COLUMNS if is_bound(row, c)}


def published_values(row: dict) -> dict[str, float]:
    """The row's published figures; one given as a bound (``published_bounds``) is left out."""
    bounds = published_bounds(row)
    return {c: v for c in COLUMNS if c not in bounds and (v := number(row, c)) is not None}


# Words a GPU's name may carry besides its kind and memory that do not make it another product: the vendor,
# the SXM form factor every catalogue entry is, its memory's type, the board or rack it sits in (a GB200's
# "NVL72" is the rack the catalogue's GB200 describes). Any other word ("PCIe", "NVL") names a product the
# catalogue does not hold, and the row is skipped. A count written with the kind ("8xH100", "H100 x 8": a
# node's or the run's GPUs) is not part of the kind either: the row's count columns say how many there are.
GPU_COUNT = re.compile(r"^\d+\s*[X\u00d7*]\s*|\s*[X\u00d7*]\s*\d+$")
GPU_NAME_NOISE = {"NVIDIA", "SXM", "SXM4", "SXM5", "SXM6", "HBM", "HBM2", "HBM2E", "HBM3", "HBM3E", "GPU", "GPUS",
                  "HGX", "DGX", "NVL72", "TENSOR", "CORE"}


def gpu_name(row: dict) -> str:
    """The preset of the row's GPU kind and memory ('H20-96G': H20's 96 GB, 'A100-40G': A100's 40 GB one,
    'NVIDIA H100 80GB HBM3', 'H100 SXM' and '8xH100' the catalogue's H100); skipped where the catalogue has
    no such memory ('H100-94G') or the name holds a word of another product ('H100 PCIe')."""
    kind, presets = as_written(row, "gpu"), gpu_presets()
    spaced = re.sub(r"(\d+)\s+(GB?)\b", r"\1\2", GPU_COUNT.sub("", kind.strip().upper()))  # "96 GB" as "96GB"
    words = [w for w in re.split(r"[^0-9A-Z]+", spaced) if w and w not in GPU_NAME_NOISE]
    families = [w for w in words if w in presets and w != "OTHER"]
    sizes = [m.group(1) for w in words if (m := re.fullmatch(r"(\d+)GB?", w))]
    other = [w for w in words if w not in families and not re.fullmatch(r"\d+GB?|GB?", w)]
    if len(families) != 1 or len(sizes) > 1 or other:
        raise RowSkipped(f"gpu={kind!r} is not in the GPU catalogue (nereus/spec/hardware.csv)")
    family = families[0]
    if sizes and f"{family}-{sizes[0]}GB" not in presets:
        raise RowSkipped(f"gpu={kind!r}: the catalogue's {family} is {presets[family].name} (nereus/spec/hardware.csv)")
    return f"{family}-{sizes[0]}GB" if sizes else family


def prompt_cap(row: dict) -> int | None:
    """The prompts' cap: ``max_prompt_len``, else their published mean read through the prior for an unstated
    mean the other way (mean / ``UNSTATED_PROMPT_FRACTION``); None where neither is given."""
    cap, mean = count(row, "max_prompt_len"), number(row, "mean_prompt_len")
    return max(1, round(mean / UNSTATED_PROMPT_FRACTION)) if cap is None and mean else cap


def padded_slots(row: dict, job: JobSpec) -> int:
    """Token slots of a sequence padded to the caps: the prompt's cap (``prompt_cap``, else the job's prompt
    length, as a weight-sync row that reads no lengths has) plus the response's."""
    return (prompt_cap(row) or job.workload.prompt_length) + job.workload.response.max


def mean_length(row: dict, which: str) -> tuple[int, int]:
    """(mean, cap) of prompts or responses: the published mean, else the stated fraction of the cap; a
    prompt's cap from its mean where only that is published (``prompt_cap``)."""
    cap = prompt_cap(row) if which == "prompt" else count(row, f"max_{which}_len")
    mean = number(row, f"mean_{which}_len")
    if cap is None and mean is None:
        raise RowSkipped(f"max_{which}_len and mean_{which}_len are empty (lengths set every stage's time)")
    if cap is None:
        why = "the longest response sets the rollout's tail" if which == "response" else "a mean of 0 gives no cap"
        raise RowSkipped(f"max_{which}_len is empty ({why})")
    if mean is None:
        mean = cap * UNSTATED_PROMPT_FRACTION if which == "prompt" else min(UNSTATED_RESPONSE_TOKENS, cap / 2)
    if mean > cap:  # a typo or a mean of something else (prompt + response): not a length this cap allows
        raise RowSkipped(f"mean_{which}_len {text(row, f'mean_{which}_len')} exceeds max_{which}_len "
                         f"{text(row, f'max_{which}_len')} (no {which} is longer than its cap)")
    return max(1, round(mean)), cap


def weight_sync_only(published: dict[str, float]) -> bool:
    """A row that publishes only the trainer-to-rollout weight transfer (its batch does not enter it)."""
    return set(published) == {"t_weight_sync_s"}


def job_of(row: dict, published: dict[str, float]) -> JobSpec:
    gpu = gpu_name(row)
    total = count(row, "gpus_total", "the GPU count")
    per_node = count(row, "gpus_per_node") or min(total, GPUS_PER_NODE)
    if total % per_node:
        raise RowSkipped(f"gpus_total {total} is not a multiple of gpus_per_node {per_node}"
                         + ("" if text(row, "gpus_per_node") else f" (empty: {GPUS_PER_NODE}, an HGX node's)"))
    per_node = nvlink_node(gpu_presets()[gpu].nvlink_domain, total, per_node)
    enum(row, "algorithm", ALGORITHMS, "other")
    critic = enum(row, "critic", ("yes", "no"), "yes" if text(row, "algorithm") == "ppo" else "no") == "yes"
    reference = enum(row, "reference", ("yes", "no"), "no") == "yes"
    sync_mode = enum(row, "sync_mode", SYNC_MODES, "sync")
    arch = arch_dict(row)
    models = {"actor": arch, **({"critic": arch} if critic else {}), **({"reference": arch} if reference else {})}
    models = with_reward_model(row, models, "ppo" if critic else "grpo")  # a framework's learned reward model
    framework = framework_of(row)
    if weight_sync_only(published):  # nominal batch, a sequence a GPU: the weight transfer does not depend on it
        prompts, samples, (prompt, _), (response, cap), per_update = total, 2, (1, 1), (1, 1), total  # 1 update
    else:
        prompts = count(row, "prompts_per_step", "the batch")
        samples = count(row, "samples_per_prompt") or 1
        (prompt, prompt_cap), (response, cap) = mean_length(row, "prompt"), mean_length(row, "response")
        per_update = update_prompts(row, total, samples)  # every training rank a sequence, at the least
        prompt = prompt_cap if framework.prompt_at_cap else prompt  # DeepSpeed-Chat pads prompts to the cap
    mini_batches = prompts // per_update if prompts % per_update == 0 else 1
    data = {
        "name": text(row, "run_id"),
        "models": models,
        "algorithm": {"name": "ppo" if critic else "grpo", "samples_per_prompt": samples,
                      "mini_batches": mini_batches,
                      # one response per prompt and no critic: no group to compare, REINFORCE++'s batch baseline
                      **({} if critic or samples > 1 else {"adv_estimator": "reinforce_plus_plus"}),
                      "recompute_old_log_prob": sync_mode not in ("fully_async", "partial_rollout")},
        "workload": {"prompts_per_step": prompts, "prompt_length": prompt,
                     "response_length": {"mean": response, "max": cap, "sigma": RESPONSE_SIGMA}},
        "cluster": {"gpu": gpu, "nodes": total // per_node, "gpus_per_node": per_node,
                    **_eager_priors(row, arch)},
    }
    if unmodelled(row):  # an engine or offload kind Nereus does not price
        raise RowSkipped(unmodelled(row))
    try:
        return priced_as_framework(row, job_from_dict(data))
    except SpecError as err:
        raise RowSkipped(f"the row does not make a valid job: {err}") from None


def _eager_priors(row: dict, arch: dict) -> dict:
    """The cluster's ``priors`` for a rollout run eagerly (``enforce_eager`` yes): the engine's fixed step
    cost plus the host's eager dispatch of every kernel of a step (an MoE layer's more, ``cost.moe``);
    nothing for a CUDA-graph rollout."""
    if not decodes_eagerly(row):
        return {}
    layers = arch["layers"]
    sparse = layers - len(arch["moe"].get("dense_layers", ())) if "moe" in arch else 0
    shared = "moe" in arch and arch["moe"].get("shared_expert_ffn_hidden", 0) > 0
    kernels = decode_kernels_per_layer(layers, sparse, DecodePriors().kernels_per_layer, shared)
    return {"priors": {"decode_step_overhead_s": Priors().decode_step_overhead_s
                       + eager_step_overhead_s(layers, kernels)}}


def published_run(row: dict) -> PublishedRun:
    """The row as a job and plan; ``RowSkipped`` says why a row cannot be priced."""
    row = canonical(row)
    run_id = text(row, "run_id") or "(no run_id)"
    published = published_values(row)
    if not published:
        bounds = [f"{c} published {written!r}" for c, written in published_bounds(row).items()]
        raise RowSkipped(f"{', '.join(bounds)}: a bound, not a value, and nothing else to compare" if bounds
                         else "no published time or throughput")
    job = job_of(row, published)
    padded = padded_slots(row, job)
    plan = plan_of(row, job, weight_sync_only(published))
    actor, gen = plan.placement("actor/training").layout, plan.placement("actor/generation").layout
    calls = call_sequences(row, job.models["actor"].params() / 1e9, job.algorithm.samples_per_prompt, actor.dp, gen.dp)
    return PublishedRun(run_id, with_calls(job, calls), plan, enum(row, "sync_mode", SYNC_MODES, "sync"),
                        published, staleness_threshold(row), padded, pauses_in_flight(row),
                        bool(text(row, "offload")))


def staleness_threshold(row: dict) -> float:
    """The row's ``staleness``, else verl's default (``cost.fully_async.STALENESS_THRESHOLD``)."""
    stated = number(row, "staleness")
    return STALENESS_THRESHOLD if stated is None else stated


def pauses_in_flight(row: dict) -> bool:
    """Partial rollout: the ``partial_rollout`` sync mode, or a fully-async row whose notes do not turn
    verl's ``async_training.partial_rollout`` off (True in fully_async_ppo_trainer.yaml and its
    Megatron twin). verl applies it only at a staleness threshold above 0 (docs/advance/fully_async.md)."""
    mode = text(row, "sync_mode").lower()  # as ``enum`` reads it
    if mode == "partial_rollout":
        return True
    return mode == "fully_async" and staleness_threshold(row) > 0 and setting(row, "partial_rollout", "yes") == "yes"


def _split(row: dict, job: JobSpec) -> tuple[tuple[int, ...], dict[str, tuple[int, ...]]]:
    """GPUs of the rollout and of each model: all of them colocated, else the rollout's first, the trainer's
    after them; a disaggregated row without pool sizes by its framework's documented split, each model on
    a group of its own (``published_frameworks.default_pools``)."""
    total, models = job.cluster.num_gpus, job.models
    if placement(row) == "colocated":
        every = tuple(range(total))
        return every, dict.fromkeys(models, every)
    stated = text(row, "gen_gpus") or text(row, "train_gpus")
    pools = None if stated else default_pools(row, total, tuple(models))
    if pools is not None:
        return pools["generation"], {m: pools[m] for m in models}
    why = "a disaggregated run's pool sizes"
    gen, train = count(row, "gen_gpus", why), count(row, "train_gpus", why)
    if gen + train > total:
        raise RowSkipped(f"gen_gpus + train_gpus ({gen} + {train}) exceed gpus_total {total}")
    return tuple(range(gen)), dict.fromkeys(models, tuple(range(gen, gen + train)))


def balanced_micro_batch(share: int, budget: float, seq: int) -> int:
    """Sequences per micro-batch when a share is packed into as few token-budget micro-batches as fit,
    balanced by tokens (verl's dynamic batching): ceil(share / micro-batches)."""
    micro_batches = math.ceil(share / max(1, int(budget // seq)))
    return max(1, math.ceil(share / micro_batches))


def _trainer_layouts(row: dict, job: JobSpec, gpus: int) -> tuple[Layout, Layout]:
    """Training and inference layouts on the trainer's GPUs, micro-batched by token budget."""
    backend = BACKENDS.get(enum(row, "train_backend", (*BACKENDS, "other"), "fsdp"))
    if backend is None:
        raise RowSkipped(f"train_backend={text(row, 'train_backend')!r} is not modelled")
    tp, pp = (count(row, "train_tp") or 1, count(row, "train_pp") or 1) if backend == "megatron" else (1, 1)
    if gpus % (tp * pp):
        raise RowSkipped(f"train_tp x train_pp ({tp} x {pp}) does not divide the {gpus} training GPUs")
    deep = layer_problem(job.models["actor"].layers, pp, priced=True)  # uneven: priced at its fullest stage
    if deep is not None:
        raise RowSkipped(f"train_pp {pp} {deep.reason.split(';')[0]}")
    dp = gpus // (tp * pp)
    wl = job.workload
    # a row's tokens in a micro-batch: its own length, or the step's longest where the framework pads
    seq = padded_width(job) if job.options.padded_batches else wl.prompt_length + round(wl.response.mean)
    cap = padded_slots(row, job)
    per_update = job.sequences_per_step() // job.algorithm.mini_batches  # verl asserts one a rank at least
    if per_update < dp:
        raise RowSkipped(f"a mini-batch's {per_update} sequences leave some of the {dp} training ranks none")
    share = max(1, job.sequences_per_step() // dp)  # an inference pass takes the whole batch
    update_share = max(1, share // job.algorithm.mini_batches)  # an update takes a mini-batch
    fsdp, megatron = backend == "fsdp" and dp > 1, backend == "megatron"
    recipe = verl_moe_recipe(row)  # a verl MoE row runs its script's budgets and recompute
    recompute = (recipe and recipe.recompute) or framework_recompute(row) or ("none" if megatron else "full")
    train_budget, infer_budget = (recipe.budget_per_cap,) * 2 if recipe and recipe.budget_per_cap else BUDGETS
    ep = expert_parallel(row, "train_ep", job, dp)
    if dynamic_batch(row) or job.options.padded_batches:
        train_rows = balanced_micro_batch(update_share, train_budget * cap, seq)
        infer_rows = balanced_micro_batch(share, infer_budget * cap, seq)
    else:  # rows at their own length, a fixed count of them (the framework's micro-batch settings)
        train_rows, infer_rows = (min(n, part) for n, part in zip(FIXED_MICRO_BATCH, (update_share, share),
                                                                   strict=True))
    train = Layout(tp=tp, pp=pp, dp=dp, ep=ep, fsdp=fsdp, zero1=not fsdp, recompute=recompute,
                   micro_batch_size=train_rows)
    infer = Layout(tp=tp, pp=pp, dp=dp, ep=ep, fsdp=fsdp, zero1=not fsdp, recompute="none",
                   micro_batch_size=infer_rows)
    return train, infer


def expert_parallel(row: dict, key: str, job: JobSpec, dp: int) -> int:
    """The row's EP degree (``train_ep`` / ``rollout_ep``) as Nereus's ``ep`` (experts split over ep of the
    dp ranks, attention data parallel): its largest divisor that divides both dp and the expert count; 1
    for a dense model or an empty cell. Megatron forms its expert groups over tp x dp ranks (an EP8 with
    expert TP1 under TP8 and DP1 shards the experts across the TP ranks), which Nereus prices as experts
    tensor parallel over tp: the same share of experts per rank, without the all-to-all. An empty
    ``train_ep`` is a node's GPUs (``gpus_per_node``): verl's Megatron recipes for Qwen3-30B-A3B and
    DeepSeek-V3 run EP8, one NVLink domain; an empty ``rollout_ep`` is 1 (vLLM's default, no
    enable_expert_parallel)."""
    moe = job.models["actor"].moe
    if moe is None:
        return 1
    ep = count(row, key) or (job.cluster.gpus_per_node if key == "train_ep" else 1)
    return math.gcd(ep, dp, moe.experts)


def _rollout_tp(row: dict, job: JobSpec, gen_gpus: int) -> int:
    arch = job.models["actor"]
    tp = count(row, "rollout_tp") or framework_rollout_tp(row, arch.params() * job.options.weight_bytes,
                                                          job.cluster.gpu.memory_bytes, gen_gpus, arch.heads) or None
    if tp is None:
        params_b = job.models["actor"].params() / 1e9
        recipe = verl_moe_recipe(row)  # an MoE model: verl's MoE script of its size, not a dense one's
        tp = recipe.rollout_tp if recipe else system_recipe_tp("verl", job.algorithm.name, params_b)[0]
        # a script's TP the rollout GPUs (or heads, KV heads too) do not split into: the largest below it that does
        tp = max(t for t in range(1, min(gen_gpus, tp) + 1) if gen_gpus % t == 0 and tp_splits(arch, t))
    if gen_gpus % tp:
        raise RowSkipped(f"rollout_tp {tp} does not divide the {gen_gpus} rollout GPUs")
    return tp


def disaggregated_sync(row: dict) -> str:
    """The weight-sync mechanism of a rollout on its own GPUs: verl's checkpoint engine where the row's
    ``checkpoint_engine`` says yes. An optional column; empty or absent, verl's default: on in its
    fully-async recipe (fully_async_ppo_trainer.yaml, ``checkpoint_engine.enable: True``), absent from
    the others (one-step-off broadcasts tensor by tensor)."""
    fully_async = text(row, "sync_mode").lower() in ("fully_async", "partial_rollout")
    engine = setting(row, "checkpoint_engine", "yes" if fully_async else "no") == "yes"
    return "checkpoint-engine" if engine else "tensor-broadcast"


def plan_of(row: dict, job: JobSpec, nominal: bool = False) -> Plan:
    total = job.cluster.num_gpus
    gen_gpus, groups = _split(row, job)
    tp = _rollout_tp(row, job, len(gen_gpus))
    layouts = {n: _trainer_layouts(row, job, n) for n in {len(g) for g in groups.values()}}  # (train, infer)
    if nominal:  # a weight-sync row: one sequence a replica, whatever the layouts
        layouts = {n: tuple(Layout(**{**lay.to_dict(), "micro_batch_size": 1}) for lay in pair)
                   for n, pair in layouts.items()}
    gen_dp = len(gen_gpus) // tp
    placements = [Placement(ModelStage("actor", "generation"),
                            Layout(tp=tp, dp=gen_dp, ep=expert_parallel(row, "rollout_ep", job, gen_dp)), gen_gpus)]
    for ms in job.model_stages()[1:]:
        gpus = groups[ms.model]
        placements.append(Placement(ms, layouts[len(gpus)][0 if ms.stage == "training" else 1], gpus))
    colocated = gen_gpus == groups["actor"]
    framework = framework_of(row)
    sync = framework.colocated_sync if colocated else (framework.disaggregated_sync or disaggregated_sync(row))
    return Plan(tuple(placements), total, strategy="colocated" if colocated else "disaggregated", weight_sync=sync)
