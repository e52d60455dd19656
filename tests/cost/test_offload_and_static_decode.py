"""Host offload (``cost.offload``) and static-batch generation (``cost.static_decode``): offloaded state
leaves the GPU's resident memory and costs its transfers and host update; a static batch waits for its
longest row and holds every row's cache at the full length, so it is never faster than continuous batching."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from nereus.cost.batching import _static_schedule
from nereus.cost.decode import decode_phases
from nereus.cost.hardware import Hardware, pcie_bytes_per_s
from nereus.cost.memory import trainer_weight_bytes
from nereus.cost.offload import (
    NEW_PAGE_COPY_S_PER_BYTE,
    PAGEABLE_COPY_S_PER_BYTE,
    optimizer_swap_time,
    param_put_back_time,
    updates_on_host,
)
from nereus.cost.stages import generation_cost, generation_replica, inference_cost, training_cost
from nereus.cost.static_decode import static_batch_phases
from nereus.spec.layout import Layout, ModelStage
from tests.helpers import ppo_job


def _with(job, **options):
    return replace(job, options=replace(job.options, **options))


def test_optimizer_offload_leaves_the_gpu_and_costs_a_host_update() -> None:
    job = ppo_job(gpus=8)
    hw, ms, layout = Hardware(job.cluster), ModelStage("actor", "training"), Layout(dp=8, fsdp=True, zero1=False)
    on_gpu, on_host = training_cost(hw, job, ms, layout), training_cost(hw, _with(job, offload="optimizer"), ms, layout)
    assert on_host.resident_bytes == on_gpu.resident_bytes - on_gpu.memory["optimizer"]
    assert on_host.terms["optimizer"] > on_gpu.terms["optimizer"]  # PCIe and CPU-Adam, not the GPU's Adam
    params = training_cost(hw, _with(job, offload="param+optimizer"), ms, layout)
    assert params.resident_bytes == 0 and params.transient_bytes > on_gpu.transient_bytes  # loaded for the stage


def test_a_swap_through_pageable_memory_runs_at_the_host_copies_not_the_link() -> None:
    job = _with(ppo_job(gpus=8), offload="optimizer-swap")
    hw, ms, layout = Hardware(job.cluster), ModelStage("actor", "training"), Layout(dp=8, fsdp=True, zero1=False)
    pinned = training_cost(hw, job, ms, layout)
    pageable = training_cost(hw, _with(job, pageable_offload="optimizer"), ms, layout)
    state = training_cost(hw, _with(job, offload="none"), ms, layout).memory["optimizer"]
    assert pageable.resident_bytes == pinned.resident_bytes  # the same state leaves the GPU
    assert optimizer_swap_time(hw, state, pageable=False) == pytest.approx(2 * state / pcie_bytes_per_s(hw))
    extra = state * (NEW_PAGE_COPY_S_PER_BYTE + PAGEABLE_COPY_S_PER_BYTE) - 2 * state / pcie_bytes_per_s(hw)
    assert pageable.terms["optimizer"] - pinned.terms["optimizer"] == pytest.approx(extra)
    assert not updates_on_host("param+optimizer-swap")  # the update still runs on the GPU


def test_a_trained_models_weights_put_back_through_new_pages_a_frozen_ones_pinned() -> None:
    job = _with(ppo_job(gpus=8), offload="param")
    hw, layout = Hardware(job.cluster), Layout(tp=2, dp=4)
    verl = _with(job, pageable_offload="param")  # verl's .cpu().pin_memory() of a DDP-wrapped module
    weights = trainer_weight_bytes(job.models["actor"], layout)
    new_pages = weights * (NEW_PAGE_COPY_S_PER_BYTE + PAGEABLE_COPY_S_PER_BYTE) - weights / pcie_bytes_per_s(hw)
    for ms in (ModelStage("actor", "inference"), ModelStage("actor", "training")):
        gap = inference_or_training(hw, verl, ms, layout) - inference_or_training(hw, job, ms, layout)
        assert gap == pytest.approx(new_pages, rel=1e-6)
    frozen = ModelStage("reference", "inference")  # not trained: moved with a non-blocking, pinned copy
    assert inference_or_training(hw, verl, frozen, layout) == inference_or_training(hw, job, frozen, layout)
    assert param_put_back_time(hw, weights, pageable=False) == pytest.approx(weights / pcie_bytes_per_s(hw))


def inference_or_training(hw, job, ms, layout) -> float:
    cost = (training_cost if ms.stage == "training" else inference_cost)(hw, job, ms, layout)
    return cost.terms["overhead"]


def test_static_batches_wait_for_their_longest_row() -> None:
    job = ppo_job(gpus=8)
    hw, arch, resp = Hardware(job.cluster), job.models["actor"], job.workload.response
    replica = generation_replica(hw, arch, 1, 2)
    static = static_batch_phases(replica, 512, 256, 32, resp)
    continuous = decode_phases(replica, 512, 256, 32, resp.quantiles(16), resp.mean, resp.longest(256))
    assert static.bulk_steps == 8 * resp.longest(32) and static.total_s > continuous.total_s
    assert list(_static_schedule(np.array([3, 5, 2, 4, 1]), 2)) == [0, 0, 5, 5, 9]
    lockstep = static_batch_phases(replica, 512, 256, 2, resp, lockstep=8)  # runs to its peers' longest too
    assert lockstep.bulk_steps == 128 * resp.longest(16) > 128 * resp.longest(2)


def test_the_hybrid_engine_holds_full_length_caches_and_pays_eager_launches() -> None:
    job = ppo_job(gpus=8, prompts_per_step=8192)  # more sequences a replica than either engine holds at once
    hw, ms, layout = Hardware(job.cluster), ModelStage("actor", "generation"), Layout(tp=1, dp=8)
    vllm, hybrid = generation_cost(hw, job, ms, layout), generation_cost(hw, _with(job, rollout_engine="deepspeed-he"),
                                                                         ms, layout)
    assert hybrid.detail["concurrent"] < vllm.detail["concurrent"]  # caches at prompt + max, not the mean
    assert hybrid.time() > vllm.time()
    assert generation_replica(hw, job.models["actor"], 1, 2, engine="deepspeed-he").costs.step_s > 1e-3
