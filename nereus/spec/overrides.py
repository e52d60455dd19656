"""Command-line overrides of a job spec, as verl users write them with Hydra: ``key.path=value``.

Each override sets one key of the raw YAML tree *before* validation, so the overridden value is checked
exactly as if it were in the file and every error names the key (``run.clip_ratio: expected a number,
got 'high'``; an unknown key gets the spec's nearest-key hint). Values are YAML scalars or flow
collections (``3``, ``0.2``, ``true``, ``null``, ``k3``, ``[console, jsonl]``). ``+key=value`` is accepted
as Hydra's "add" form and ``~key`` deletes a key (back to its default).

verl's own key paths are accepted where Nereus has the same knob with the same meaning (``VERL_KEYS``,
listed side by side in docs/rl.md): ``actor_rollout_ref.actor.clip_ratio=0.3`` sets ``run.clip_ratio``.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from nereus.spec.errors import SpecError
from nereus.spec.files import load_yaml

_ACTOR, _ROLLOUT = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"

# verl key path -> Nereus key path, only where the meaning is the same (verl/trainer/config/ppo_trainer.yaml).
VERL_KEYS = {
    "algorithm.adv_estimator": "algorithm.adv_estimator",
    "algorithm.gamma": "run.gamma",
    "algorithm.lam": "run.lam",
    "algorithm.norm_adv_by_std_in_grpo": "run.norm_adv_by_std_in_grpo",
    "algorithm.kl_penalty": "run.kl_penalty",
    "algorithm.kl_ctrl.kl_coef": "run.kl_coef",
    "data.train_files": "run.data.train",
    "data.val_files": "run.data.val",
    "data.train_batch_size": "workload.prompts_per_step",
    "data.max_prompt_length": "workload.prompt_length",
    "data.max_response_length": "workload.response_length.max",
    "actor_rollout_ref.model.path": "models.actor.path",
    f"{_ACTOR}.optim.lr": "run.actor_lr",
    f"{_ACTOR}.grad_clip": "run.grad_clip",
    f"{_ACTOR}.clip_ratio": "run.clip_ratio",
    f"{_ACTOR}.clip_ratio_low": "run.clip_ratio_low",
    f"{_ACTOR}.clip_ratio_high": "run.clip_ratio_high",
    f"{_ACTOR}.clip_ratio_c": "run.clip_ratio_c",
    f"{_ACTOR}.loss_agg_mode": "run.loss_agg_mode",
    f"{_ACTOR}.entropy_coeff": "run.entropy_coeff",
    f"{_ACTOR}.use_kl_loss": "run.use_kl_loss",
    f"{_ACTOR}.kl_loss_coef": "run.kl_loss_coef",
    f"{_ACTOR}.kl_loss_type": "run.kl_loss_type",
    f"{_ACTOR}.ppo_epochs": "algorithm.epochs",
    f"{_ROLLOUT}.n": "algorithm.samples_per_prompt",
    f"{_ROLLOUT}.temperature": "run.temperature",
    f"{_ROLLOUT}.top_p": "run.top_p",
    f"{_ROLLOUT}.max_num_seqs": "run.rollout.slots",
    f"{_ROLLOUT}.name": "run.rollout.engine",
    f"{_ROLLOUT}.gpu_memory_utilization": "run.rollout.gpu_memory_utilization",
    f"{_ROLLOUT}.enforce_eager": "run.rollout.enforce_eager",
    "critic.model.path": "models.critic.path",
    "critic.optim.lr": "run.critic_lr",
    "critic.grad_clip": "run.grad_clip",
    "critic.cliprange_value": "run.value_clip",
    "reward_model.model.path": "models.reward.path",
    "trainer.total_training_steps": "run.steps",
    "trainer.logger": "run.logger",
    "trainer.default_local_dir": "run.checkpoint.dir",
    "trainer.experiment_name": "name",
    "trainer.nnodes": "cluster.nodes",
    "trainer.n_gpus_per_node": "cluster.gpus_per_node",
}


# Top-level sections of verl's config that Nereus does not have: a key under one of them that is not in
# VERL_KEYS has no Nereus knob of the same meaning.
VERL_ONLY_SECTIONS = ("actor_rollout_ref", "data", "critic", "reward_model", "trainer", "custom_reward_function",
                      "ray_init")


def parse_override(text: str) -> tuple[str, Any, bool]:
    """(Nereus key path, value, delete?) of one ``key.path=value`` / ``+key.path=value`` / ``~key.path``."""
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
    if key in VERL_KEYS:
        return VERL_KEYS[key], value, delete
    if key.split(".")[0] in VERL_ONLY_SECTIONS:
        raise SpecError(key, "a verl key without a Nereus knob of the same meaning; docs/rl.md lists verl's keys "
                             "next to Nereus's")
    return key, value, delete


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


# verl's in-reward KL switch (algorithm.use_kl_in_reward) and controller type have no key of their own in
# Nereus: the KL is in the reward when run.kl_coef > 0, with a fixed coefficient.
VERL_DEFAULT_KL_COEF = 0.001  # verl's algorithm.kl_ctrl.kl_coef


def _verl_kl_switch(data: dict, path: str, value: Any) -> bool:
    """Apply verl's ``algorithm.use_kl_in_reward`` / ``algorithm.kl_ctrl.type``; True if ``path`` was one."""
    if path == "algorithm.use_kl_in_reward":
        if not isinstance(value, bool):
            raise SpecError(path, f"expected true or false, got {value!r}")
        run = data.get("run")
        current = run.get("kl_coef") if isinstance(run, dict) else None
        if not value:
            set_key(data, "run.kl_coef", 0.0)
        elif not current:  # on, and no coefficient yet: verl's default
            set_key(data, "run.kl_coef", VERL_DEFAULT_KL_COEF)
        return True
    if path == "algorithm.kl_ctrl.type":
        if value != "fixed":
            raise SpecError(path, f"{value!r}: only a fixed KL coefficient (run.kl_coef) is implemented")
        return True
    return False


def apply_overrides(data: Any, overrides: Sequence[str]) -> Any:
    """A copy of the raw spec tree ``data`` with ``overrides`` applied in order (later ones win)."""
    if not overrides:
        return data
    out = copy.deepcopy(data) if data is not None else {}
    if not isinstance(out, dict):
        raise SpecError("<root>", f"the job file holds {type(out).__name__}, not a mapping; overrides need one")
    for text in overrides:
        path, value, delete = parse_override(text)
        if delete or not _verl_kl_switch(out, path, value):
            set_key(out, path, value, delete)
    return out
