"""Command-line overrides of a job spec, as verl users write them with Hydra: ``key.path=value``.

Each override sets one key of the raw YAML tree *before* validation, so the overridden value is checked
exactly as if it were in the file and every error names the key (``run.clip_ratio: expected a number,
got 'high'``; an unknown key gets the spec's nearest-key hint). Values are YAML scalars or flow
collections (``3``, ``0.2``, ``true``, ``null``, ``k3``, ``[console, jsonl]``). ``+key=value`` is accepted
as Hydra's "add" form and ``~key`` deletes a key (back to its default).

verl's own key paths are read by ``nereus.spec.verl_keys.TABLE`` (listed in docs/rl.md): mapped where
Nereus has the same knob with the same meaning (``actor_rollout_ref.actor.clip_ratio=0.3`` sets
``run.clip_ratio``), derived where it takes a computation, ignored with a note where they only tune verl's
engines, refused with the reason otherwise. Two verl keys that set one Nereus key (actor's and critic's
``grad_clip``) must agree. ``resolve_overrides`` collects every problem instead of raising the first
(``nereus run ... --cfg job``, ``spec.cfg_job``); verl's parallel degrees become ``run.layouts``
(``spec.verl_layouts``), its ``trainer.nnodes`` x ``n_gpus_per_node`` ``run.workers``. No job-file value is
left contradicting an override: an estimator given makes ``algorithm.name`` (and the critic) follow, as
verl's need for a critic follows its estimator, and what cannot agree is refused naming both keys.
"""

from __future__ import annotations

import copy
import difflib
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from nereus.spec.algorithms import ADVANTAGE_ESTIMATORS, NEEDS_CRITIC
from nereus.spec.errors import SpecError
from nereus.spec.files import load_yaml
from nereus.spec.verl_keys import DERIVED, IGNORED, MAPPED, REFUSED, TABLE, VERL_SECTIONS, lookup
from nereus.spec.verl_layouts import DEGREES, LayoutDegrees

# verl key path -> Nereus key path, where the meaning is the same (the mapped rows of ``verl_keys.TABLE``)
VERL_KEYS = {k: v.target for k, v in TABLE.items() if v.kind == MAPPED}


def _split(text: str) -> tuple[str, Any, bool]:
    """(key path as written, value, delete?) of one ``key.path=value`` / ``+key.path=value`` / ``~key.path``."""
    delete = text.startswith("~")
    body = text[1:] if delete or text.startswith("+") else text
    key, sep, raw = body.partition("=")
    key = key.strip()
    if delete and sep:
        raise SpecError(key, f"override {text!r}: ~key deletes a key and takes no value; write ~{key}")
    if not key or not delete and not sep or any(not part for part in key.split(".")):
        raise SpecError(text, "not an override; write key.path=value (e.g. run.clip_ratio=0.3) or ~key.path")
    try:  # the strict loader: no duplicate keys, bounded nesting, no over-long integers
        value = None if delete else load_yaml(raw, key)
    except SpecError as err:
        raise SpecError(key, f"override value {raw[:60]!r} is {err.message}") from None
    if key.split(".")[0] in VERL_SECTIONS and lookup(key) is None:
        raise SpecError(key, "a verl key Nereus does not know; docs/rl.md lists verl's keys and what Nereus does "
                             "with each" + did_you_mean(key))
    return key, value, delete


def did_you_mean(key: str) -> str:
    """``; did you mean 'KEY'?`` naming the closest verl key of ``verl_keys.TABLE`` (empty if none is close:
    keys share long prefixes, so only a near-identical one is offered)."""
    close = difflib.get_close_matches(key, TABLE, n=1, cutoff=0.85)
    return f"; did you mean {close[0]!r}?" if close else ""


def parse_override(text: str) -> tuple[str, Any, bool]:
    """(Nereus key path, value, delete?) of one override; a mapped verl key is translated, other verl keys
    (``verl_keys.TABLE``: derived, ignored, refused) come back as written for ``apply_overrides``."""
    key, value, delete = _split(text)
    return VERL_KEYS.get(key, key), value, delete


def _child(node: Any, key: str, where: str, create: bool) -> Any:
    """The item ``key`` of a mapping or (by index) a list."""
    if isinstance(node, list):
        if not key.isdigit() or int(key) >= len(node):
            raise SpecError(where, f"is not an index of the {len(node)}-item list above it")
        return node[int(key)]
    if key not in node or node[key] is None:
        if not create:
            return None
        node[key] = {}
    return node[key]


def set_key(data: dict, path: str, value: Any, delete: bool = False) -> None:
    """Set (or delete) the key ``path`` of the tree ``data`` in place, creating missing mappings."""
    parts = path.split(".")
    node: Any = data
    for i, part in enumerate(parts[:-1]):
        where = ".".join(parts[: i + 1])
        node = _child(node, part, where, create=not delete)
        if node is None:
            return  # deleting under a section that is not there: nothing to do
        if not isinstance(node, (dict, list)):
            raise SpecError(where, f"is {node!r}, not a section; cannot set {path} under it")
    last = parts[-1]
    if isinstance(node, list):
        if not last.isdigit() or int(last) >= len(node):
            raise SpecError(path, f"is not an index of the {len(node)}-item list above it")
        if delete:
            raise SpecError(path, "list items cannot be deleted by an override; override the whole list")
        node[int(last)] = value
    elif delete:
        node.pop(last, None)
    else:
        node[last] = value


VERL_DEFAULT_KL_COEF = 0.001  # verl's algorithm.kl_ctrl.kl_coef, what use_kl_in_reward=true turns on
VERL_REWARD_FUNCTION = "compute_score"  # verl's default custom_reward_function.name


def _accepted(value: Any, accept: tuple) -> bool:
    """``value`` is one of ``accept`` (type-strict: ``1`` is not ``true``)."""
    return any(type(value) is type(a) and value == a for a in accept)


def _positive_int(key: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise SpecError(key, f"expected a positive integer, got {value!r}")
    return value


def _int(key: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise SpecError(key, f"expected an integer, got {value!r}")
    return value


def fate(key: str, value: Any) -> str:
    """What Nereus does with the verl key ``key`` set to ``value``, in words (``nereus run ... --cfg job``)."""
    entry = lookup(key)
    if entry is None:
        return "unknown"
    if entry.kind == MAPPED:
        return f"-> {entry.target}"
    if entry.kind == DERIVED:
        return f"-> {entry.target} (derived: {entry.reason})"
    if entry.kind == REFUSED and _accepted(value, entry.accept):
        return f"passes: {value!r} is what Nereus does"
    return f"{entry.kind}: {entry.reason}"


class VerlOverrides:
    """The verl keys of one command line (``verl_keys.TABLE``) applied to a raw spec tree: each mapped key set
    (two that set one Nereus key must agree), ignored keys noted, refused ones raised, and the derived ones
    resolved once every override is in (``finish``), since they read each other. ``touched``: verl key ->
    the Nereus key paths it set (so a validation error can be traced to the override behind it)."""

    def __init__(self, out: dict) -> None:
        self.out = out
        self.set_by: dict[str, tuple[str, Any]] = {}  # Nereus key -> (verl key, value) that set it
        self.mini: dict[str, int] = {}  # verl's ppo_mini_batch_size per model
        self.reward: dict[str, str] = {}  # custom_reward_function path and name
        self.degrees = LayoutDegrees()
        self.bypass = False  # verl's algorithm.rollout_correction.bypass_mode
        self.correction: dict[str, Any] = {}  # its rollout_is, rollout_is_threshold
        self.kl: dict[str, Any] = {}  # algorithm.use_kl_in_reward and algorithm.kl_ctrl.kl_coef, as given
        self.world: dict[str, int] = {}  # trainer.nnodes and trainer.n_gpus_per_node, as given
        self.notes: list[str] = []
        self.touched: dict[str, set[str]] = {}

    def _put(self, key: str, path: str, value: Any, delete: bool = False) -> None:
        self.touched.setdefault(key, set()).add(path)
        parts = path.split(".")
        models = self.out.get("models")
        if len(parts) == 3 and parts[0] == "models" and parts[2] == "path" and isinstance(models, dict) and not delete:
            models[parts[1]] = {"path": value}  # a checkpoint replaces the job's architecture (it has its own)
            return
        set_key(self.out, path, value, delete)

    def apply(self, key: str, value: Any, delete: bool) -> None:
        entry = lookup(key)
        if entry is None:
            raise SpecError(key, "a verl key Nereus does not know" + did_you_mean(key))
        if entry.kind == MAPPED:
            self._set(key, entry.target, value, delete)
        elif delete:
            if entry.kind == DERIVED:
                raise SpecError(key, f"cannot be deleted; delete {entry.target} with ~{entry.target}")
        elif entry.kind == IGNORED:
            self.notes.append(f"nereus: ignoring {key}={value!r}: {entry.reason}")
        elif entry.kind == REFUSED:
            if not _accepted(value, entry.accept):
                raise SpecError(key, f"{value!r}: {entry.reason}")
        else:
            self._derived(key, value)

    def _set(self, key: str, target: str, value: Any, delete: bool = False) -> None:
        """Set ``target`` from verl's ``key``; another verl key that set it to something else is refused."""
        other = self.set_by.get(target)
        if other is not None and other[0] != key and other[1] != value and not delete:
            raise SpecError(key, f"{value!r} differs from {other[0]}={other[1]!r}, and both set {target}: Nereus has "
                                 "one value for actor and critic; give them the same value")
        self.set_by[target] = (key, value)
        self._put(key, target, value, delete)

    def _derived(self, key: str, value: Any) -> None:
        if key in DEGREES:
            self.degrees.add(key, value)
        elif key == "algorithm.use_kl_in_reward":
            if not isinstance(value, bool):
                raise SpecError(key, f"expected true or false, got {value!r}")
            self.kl[key] = value  # resolved with kl_ctrl.kl_coef in ``finish``: the order of the two is no matter
        elif key == "algorithm.kl_ctrl.kl_coef":
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise SpecError(key, f"expected a number, got {value!r}")
            self.kl[key] = value
        elif key == "algorithm.rollout_correction.bypass_mode":  # bypass: the rollout's log-probs are pi_old
            if not isinstance(value, bool):
                raise SpecError(key, f"expected true or false, got {value!r}")
            self.bypass = value
            if value:
                self._set(key, "run.policy_loss.loss_mode", "bypass_mode")
                self._put(key, "algorithm.recompute_old_log_prob", False)
        elif key.startswith("algorithm.rollout_correction.rollout_is"):
            self.correction[key] = "none" if value is None else value  # verl's null: no correction
        elif key == "actor_rollout_ref.model.path":
            self._set(key, "models.actor.path", value)
            if isinstance(self.out.get("models"), dict) and "reference" in self.out["models"]:
                self._put(key, "models.reference.path", value)  # verl's reference is the actor's start
        elif key.endswith(".ppo_mini_batch_size"):
            self.mini[key] = _positive_int(key, value)
        elif key.endswith(".enable_gradient_checkpointing"):  # HF gradient checkpointing: every layer re-run
            if not isinstance(value, bool):
                raise SpecError(key, f"expected true or false, got {value!r}")
            self._set(key, "options.recompute", "full" if value else "none")
        elif key.startswith("custom_reward_function."):
            if not isinstance(value, str) or not value:
                raise SpecError(key, f"expected a non-empty string, got {value!r}")
            self.reward[key.rsplit(".", 1)[1]] = value
        elif key == "reward_model.enable":
            self._reward_model(key, value)
        elif key in ("trainer.nnodes", "trainer.n_gpus_per_node"):
            self.world[key] = _positive_int(key, value)
            self._put(key, TABLE[key].target, value)
        elif key in ("trainer.save_freq", "trainer.test_freq"):  # verl's -1: never; Nereus's 0: only at the end
            self._put(key, TABLE[key].target, max(0, _int(key, value)))
        else:
            raise SpecError(key, "a derived verl key without a rule (a bug: see nereus.spec.overrides)")

    def _reward_model(self, key: str, value: Any) -> None:
        if not isinstance(value, bool):
            raise SpecError(key, f"expected true or false, got {value!r}")
        models = self.out.get("models")
        has = isinstance(models, dict) and "reward" in models
        if value and not has:
            raise SpecError(key, "the job has no reward model: add models.reward (a *ForSequenceClassification "
                                 "checkpoint, reward_model.model.path) or drop the key")
        if not value and has:
            raise SpecError(key, "the job has a reward model (models.reward): remove it from the job to run "
                                 "without one")

    def finish(self, problems: list[SpecError]) -> None:
        """Resolve the keys that read others: verl's mini-batch size, the reward function's path and name,
        and the parallel degrees (``verl_layouts``); each problem is added to ``problems``."""
        for part in (self._algorithm, self._mini_batches, self._reward_function, self._workers, self._layouts,
                     self._rollout_correction, self._kl_in_reward, self._unused_critic_keys):
            try:
                part()
            except SpecError as err:
                problems.append(err)

    def _algorithm(self) -> None:
        """The job file's algorithm made to agree with the estimator a command line gives: verl has no
        algorithm name, GAE trains a critic and every other estimator none (verl's ``need_critic``), so
        ``algorithm.name`` follows (ppo with GAE, grpo otherwise), noted; a name the command line gives too
        must agree. A critic dropped that way (or by ``algorithm.name=grpo``) takes its layouts and its entry
        of ``algorithm.models`` along; one added puts itself on that list."""
        alg, models = self.out.get("algorithm"), self.out.get("models")
        if not isinstance(alg, dict) or alg.get("name") not in ("ppo", "grpo"):
            return
        has_critic = isinstance(models, dict) and "critic" in models
        given = self.set_by.get("algorithm.adv_estimator")
        if given is not None and given[1] in ADVANTAGE_ESTIMATORS:
            key, estimator = given
            want, name = ("ppo" if estimator in NEEDS_CRITIC else "grpo"), alg["name"]
            if want != name and "algorithm.name" in self.touched:
                raise SpecError(key, f"{estimator} {'needs a critic' if want == 'ppo' else 'trains no critic'}, "
                                     f"but algorithm.name={name} {'has none' if want == 'ppo' else 'trains one'}: "
                                     f"give algorithm.name={want}, or drop one of the two")
            if want != name and (want == "grpo" or has_critic):  # gae without a critic: validation refuses it
                self._put(key, "algorithm.name", want)
                self.notes.append(f"nereus: {key}={estimator}: algorithm.name {name} -> {want} (the job file's): "
                                  f"as in verl, only gae trains a critic")
        if "algorithm.name" in self.touched or given is not None:
            self._critic_follows(alg["name"], has_critic, "algorithm.name" if given is None else given[0])

    def _workers(self) -> None:
        """verl's GPUs, ``trainer.nnodes`` x ``trainer.n_gpus_per_node``, are the devices the job runs on:
        ``run.workers`` (before the parallel degrees fill them), the planner's cluster beside it; the one not
        given is the job file's ``cluster`` value (verl's default, 1 node, without one). A job whose workers
        follow ``run.adapt.availability`` cannot also take verl's count: refused."""
        if not self.world:
            return
        key = sorted(self.world)[-1]  # trainer.nnodes, else trainer.n_gpus_per_node
        cluster, run = self.out.get("cluster"), self.out.get("run")
        def given(verl: str, field: str, default: int) -> int:
            value = self.world.get(verl, cluster.get(field) if isinstance(cluster, dict) else None)
            return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else default
        workers = given("trainer.nnodes", "nodes", 1) * given("trainer.n_gpus_per_node", "gpus_per_node", 1)
        adapt = run.get("adapt") if isinstance(run, dict) else None
        if isinstance(adapt, dict) and adapt.get("availability"):
            raise SpecError(key, f"the job's workers follow run.adapt.availability, not verl's {workers} GPUs: remove "
                                 "run.adapt.availability (~run.adapt.availability) to run on them, or drop the key")
        for verl in self.world:
            self._put(verl, "run.workers", workers)

    def _critic_follows(self, name: str, has_critic: bool, cause: str) -> None:
        """The job file's ``algorithm.models`` and critic layouts made to agree with ``name``, which the
        override ``cause`` set."""
        alg, run = self.out["algorithm"], self.out.get("run")
        listed = alg.get("models")
        if isinstance(listed, list) and name == "grpo" and "critic" in listed:
            self._put(cause, "algorithm.models", [m for m in listed if m != "critic"])
        if isinstance(listed, list) and name == "ppo" and has_critic and "critic" not in listed:
            self._put(cause, "algorithm.models", [*listed, "critic"])
        layouts = run.get("layouts") if isinstance(run, dict) else None
        typed = {p for paths in self.touched.values() for p in paths}
        dropped = [s for s in (layouts or {}) if name == "grpo" and str(s).startswith("critic/")
                   and f"run.layouts.{s}" not in typed] if isinstance(layouts, dict) else []
        for stage in dropped:
            self._put(cause, f"run.layouts.{stage}", None, delete=True)
        if dropped:
            self.notes.append(f"nereus: {cause}: no critic is trained, so the job file's run.layouts of "
                              f"{', '.join(dropped)} are not used")

    def _unused_critic_keys(self) -> None:
        """verl's ``critic.*`` keys on a job that trains no critic (GRPO, or a model list without one) set
        nothing that runs: each is noted, never silently kept."""
        alg = self.out.get("algorithm") if isinstance(self.out.get("algorithm"), dict) else {}
        listed = alg.get("models")
        no_critic = alg.get("name") == "grpo" or (isinstance(listed, list) and "critic" not in listed)
        for key in sorted(k for k in self.touched if k.startswith("critic.")) if no_critic else ():
            self.notes.append(f"nereus: ignoring {key}: the job trains no critic (algorithm.name "
                              f"{alg.get('name')}), so nothing uses it")

    def _kl_in_reward(self) -> None:
        """verl's reward KL: ``use_kl_in_reward`` gates ``kl_ctrl.kl_coef`` (``run.kl_coef``; 0 is off), whatever
        the order given. Off (verl's default when absent, unless the job's own ``run.kl_coef`` turns the
        penalty on): the coefficient is not used, as in verl; on without one: the job's, else verl's 0.001."""
        use, coef = self.kl.get("algorithm.use_kl_in_reward"), self.kl.get("algorithm.kl_ctrl.kl_coef")
        run = self.out.get("run")
        current = run.get("kl_coef") if isinstance(run, dict) else None
        job_on = isinstance(current, (int, float)) and not isinstance(current, bool) and current > 0
        if use is False or (use is None and coef is not None and not job_on):
            if coef is not None:
                why = "is false" if use is False else "is not given (verl's default: false)"
                self.notes.append(f"nereus: ignoring algorithm.kl_ctrl.kl_coef={coef!r}: algorithm.use_kl_in_reward "
                                  f"{why}, so verl does not use it; add algorithm.use_kl_in_reward=true to use it")
            if use is False:
                self._put("algorithm.use_kl_in_reward", "run.kl_coef", 0.0)
        elif coef is not None:
            self._put("algorithm.kl_ctrl.kl_coef", "run.kl_coef", coef)
        elif use and not job_on:  # on, and no coefficient: verl's default
            self._put("algorithm.use_kl_in_reward", "run.kl_coef", VERL_DEFAULT_KL_COEF)

    def _mini_batches(self) -> None:
        if not self.mini:
            return
        sizes = set(self.mini.values())
        if len(sizes) > 1:
            raise SpecError(sorted(self.mini)[-1], f"{self.mini}: actor and critic must use one mini-batch size "
                                                   "(Nereus trains both on the same mini-batches)")
        key, size = next(iter(self.mini.items()))
        prompts = (self.out.get("workload") or {}).get("prompts_per_step")
        if not isinstance(prompts, int) or isinstance(prompts, bool) or prompts % size:
            raise SpecError(key, f"{size} prompts must divide data.train_batch_size (workload.prompts_per_step "
                                 f"= {prompts!r}): Nereus splits a step into train_batch_size / "
                                 "ppo_mini_batch_size mini-batches")
        self._put(key, "algorithm.mini_batches", prompts // size)

    def _reward_function(self) -> None:
        if not self.reward:
            return
        run = self.out.get("run") if isinstance(self.out.get("run"), dict) else {}
        current = run.get("reward_function") if isinstance(run.get("reward_function"), str) else ""
        path, _, name = current.rpartition(":")
        path, name = self.reward.get("path", path), self.reward.get("name", name or VERL_REWARD_FUNCTION)
        if not path:
            raise SpecError("custom_reward_function.name", "needs custom_reward_function.path (the file or "
                                                           "module defining it) or run.reward_function")
        self._put(f"custom_reward_function.{sorted(self.reward)[0]}", "run.reward_function", f"{path}:{name}")

    def _rollout_correction(self) -> None:
        """verl's importance-sampling settings: the bypass_mode loss's when bypass is on, else the asynchronous
        mode's (``run.async``), the two places Nereus corrects for an off-policy rollout."""
        section = "run.policy_loss.rollout_correction" if self.bypass else "run.async"
        for key, value in self.correction.items():
            self._put(key, f"{section}.{key.rsplit('.', 1)[1]}", value)

    def _layouts(self) -> None:
        for stage in self.degrees.given:  # before writing: a stage written before a refused one is traced too
            for other, (stages, _) in DEGREES.items():  # every degree key of the stage set its layout
                if stage in stages:
                    self.touched.setdefault(other, set()).add(f"run.layouts.{stage}")
        self.degrees.finish(self.out, self.notes)


@dataclass
class Resolution:
    """Overrides applied to a raw spec tree, every problem collected instead of raised (``--cfg job``):
    ``fates`` holds (override as written, what Nereus does with it) for each verl key; ``touched`` the Nereus
    key paths each override's key set."""

    tree: Any
    fates: list[tuple[str, str]] = field(default_factory=list)
    problems: list[SpecError] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    touched: dict[str, set[str]] = field(default_factory=dict)


def resolve_overrides(data: Any, overrides: Sequence[str], parsed: dict | None = None) -> Resolution:
    """A copy of the raw spec tree ``data`` with ``overrides`` applied in order (later ones win); an override
    with a problem is left out and its problem kept, in command-line order, the later resolution steps' after.
    ``parsed``: a cache of split overrides for a caller that resolves the same ones again."""
    if not overrides:
        return Resolution(data)
    out = copy.deepcopy(data) if data is not None else {}
    if not isinstance(out, dict):
        raise SpecError("<root>", f"the job file holds {type(out).__name__}, not a mapping; overrides need one")
    verl, result = VerlOverrides(out), Resolution(out)
    for text in overrides:
        try:
            if parsed is None or text not in parsed:
                split = _split(text)
                parsed = {} if parsed is None else parsed
                parsed[text] = split
            key, value, delete = parsed[text]
            value = copy.deepcopy(value)  # the tree may be changed later; the cache stays as parsed
            if lookup(key) is not None:
                result.fates.append((text, fate(key, value)))
                verl.apply(key, value, delete)
            else:
                verl.touched.setdefault(key, set()).add(key)
                set_key(out, key, value, delete)
        except SpecError as err:
            result.problems.append(err)
    verl.finish(result.problems)
    result.notes, result.touched = list(dict.fromkeys(verl.notes)), verl.touched
    return result


def apply_overrides(data: Any, overrides: Sequence[str]) -> Any:
    """A copy of the raw spec tree ``data`` with ``overrides`` applied in order (later ones win); the first
    problem is raised, each ignored verl key is noted on stderr."""
    result = resolve_overrides(data, overrides)
    if result.problems:
        raise result.problems[0]
    for note in result.notes:
        print(note, file=sys.stderr)
    return result.tree
