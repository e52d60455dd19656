"""A row's optional yes/no settings (``sim.published_runs.setting``): column first, then the notes'
``key=True|False``, then the framework's default at the version its notes give."""

from __future__ import annotations

from nereus.sim.published_runs import decodes_eagerly, disaggregated_sync, framework_version, setting


def test_the_column_wins_over_the_notes() -> None:
    row = {"checkpoint_engine": "no", "notes": "checkpoint_engine=True, default CE config"}
    assert setting(row, "checkpoint_engine", "yes") == "no"


def test_notes_state_a_setting_the_schema_has_no_column_for() -> None:
    assert setting({"notes": "param sync, checkpoint_engine=False, default"}, "checkpoint_engine", "yes") == "no"
    assert setting({"notes": "checkpoint_engine = true"}, "checkpoint_engine", "no") == "yes"
    assert setting({"notes": "a checkpoint-engine micro-benchmark"}, "checkpoint_engine", "no") == "no"


def test_checkpoint_engine_from_notes_sets_the_sync_mechanism() -> None:
    fully_async = {"sync_mode": "fully_async"}
    assert disaggregated_sync(fully_async) == "checkpoint-engine"  # the recipe's default
    assert disaggregated_sync({**fully_async, "notes": "checkpoint_engine=False"}) == "tensor-broadcast"
    assert disaggregated_sync({"sync_mode": "sync", "notes": "checkpoint_engine=True"}) == "checkpoint-engine"


def test_verl_before_august_2025_decoded_eagerly() -> None:
    july = {"framework": "verl", "notes": "version: main@~2025-07 (doc 'Last updated 07/17/2025')"}
    assert framework_version(july) == (2025, 7)
    assert decodes_eagerly(july)
    assert not decodes_eagerly({**july, "notes": "version: main@~2025-10..12 (recipe)"})
    assert not decodes_eagerly({**july, "enforce_eager": "no"})
    assert not decodes_eagerly({"framework": "OpenRLHF", "notes": "version: main@2024-05"})
    assert not decodes_eagerly({"framework": "verl", "notes": "no version given"})


def test_a_streaming_rollouter_pauses_in_flight_samples_by_default() -> None:
    from nereus.sim.published_runs import pauses_in_flight

    row = {"sync_mode": "fully_async", "staleness": "0.5"}
    assert pauses_in_flight(row)  # verl's fully-async default: partial_rollout True
    assert not pauses_in_flight({**row, "notes": "partial_rollout=False"})
    assert not pauses_in_flight({**row, "staleness": "0"})  # verl applies it only above staleness 0
    assert pauses_in_flight({"sync_mode": "partial_rollout"})
    assert not pauses_in_flight({"sync_mode": "one_step_off"})
    assert pauses_in_flight({"sync_mode": "fully_async", "staleness": ""})  # verl's default threshold, 0.1


def test_verl_moves_a_trained_models_weights_through_new_pages_by_its_backend() -> None:
    """verl's Megatron offload (``.cpu().pin_memory()``) and FSDP2's ``model.cpu()`` go through new pageable
    pages; FSDP1's non-blocking copy lands in pinned memory. The actor's log-prob pass pays it, the frozen
    reference's does not: verl's Qwen3-30B-A3B colocated row publishes old_log_prob 7.9 s over ref."""
    from nereus.sim.published_predict import cost_times
    from nereus.sim.published_runs import published_run
    from tests.helpers import published_rows

    row = published_rows()["verl_fa30_1"]
    for backend, kind in (("megatron", "param"), ("fsdp2", "param"), ("fsdp", "none")):
        assert published_run({**row, "train_backend": backend}).job.options.pageable_offload == kind
    stages = cost_times(published_run(row)).stages
    assert stages["actor/inference"] - stages["reference/inference"] > 5.0  # 5.6 s of new pages
    assert float(row["t_old_logprob_s"]) - float(row["t_ref_s"]) > 5.0


def test_every_frameworks_pageable_state_is_a_kind_the_cost_model_prices() -> None:
    from nereus.cost.offload import PAGEABLE_KINDS
    from nereus.sim.published_frameworks import FRAMEWORKS

    for framework in FRAMEWORKS.values():
        assert all(kind in PAGEABLE_KINDS and kind != "none" for _, kind in framework.pageable_offload)
