"""Resume integrity: a checkpoint written to a temporary folder and renamed, ``latest`` replaced
atomically, the newest complete checkpoint chosen with a warning naming a broken one; optimizer shards
installed only under the placement they were written with, or re-sharded onto the current one; a writer
stopped after any one of its writes leaves a resumable run."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from nereus.run.checkpoint import StepWriter, resumable
from nereus.run.manifest import MANIFEST
from nereus.spec.errors import SpecError


class Stop(Exception):
    """The writer was 'killed' here."""


def _write_step(run_dir, step, hook=None):
    w = StepWriter(run_dir, step, hook)
    (w.folder / "actor").mkdir()
    (w.folder / "actor" / "model.safetensors").write_bytes(bytes([step]) * 100)
    w.wrote("actor/model.safetensors")
    (w.folder / "state.json").write_text(json.dumps({"step": step}))
    w.wrote("state.json")
    return w.commit()


def _stop_after(k):
    seen = []

    def hook(what):
        seen.append(what)
        if len(seen) == k:
            raise Stop(what)

    return hook, seen


def test_latest_and_the_step_folder_appear_only_when_complete(tmp_path):
    _write_step(tmp_path, 2)
    hook, seen = _stop_after(10**9)
    _write_step(tmp_path, 4, hook)
    writes = len(seen)  # model, state, manifest, rename, latest
    assert writes == 5
    for k in range(1, writes + 1):
        run = tmp_path / f"k{k}"
        run.mkdir()
        _write_step(run, 2)
        with pytest.raises(Stop):
            _write_step(run, 4, _stop_after(k)[0])
        step, folder, warnings = resumable(run)
        committed = k >= 4  # the folder is renamed at write 4; `latest` follows at write 5
        assert step == (4 if k == 5 else 2), k
        assert warnings == [], k  # a partial folder never carries a step name
        assert (run / "step_4").exists() == committed
        assert folder == run / f"step_{step}"
        # the next save of the same step replaces whatever the stopped one left
        _write_step(run, 4)
        assert resumable(run)[0] == 4
        assert not list(run.glob(".step_*"))


def test_broken_latest_falls_back_to_the_newest_complete_checkpoint_with_a_warning(tmp_path):
    _write_step(tmp_path, 2)
    _write_step(tmp_path, 4)
    f = tmp_path / "step_4" / "actor" / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1])
    step, folder, [warning] = resumable(tmp_path)
    assert step == 2 and folder == tmp_path / "step_2"
    assert "checkpoint step_4 is broken" in warning and "model.safetensors is truncated" in warning


def test_unreadable_latest_falls_back_with_a_warning(tmp_path):
    _write_step(tmp_path, 2)
    _write_step(tmp_path, 4)
    (tmp_path / "latest").write_text("")  # what an in-place rewrite killed mid-write used to leave
    step, _, [warning] = resumable(tmp_path)
    assert step == 4 and "not a step number" in warning


def test_no_complete_checkpoint_names_every_broken_one(tmp_path):
    _write_step(tmp_path, 2)
    (tmp_path / "step_2" / MANIFEST).write_text('{"files": {}}')
    with pytest.raises(SpecError, match=r"no complete checkpoint under .*step_2 is broken"):
        resumable(tmp_path)


def test_same_step_written_again_replaces_the_old_folder(tmp_path):
    _write_step(tmp_path, 2)
    first = (tmp_path / "step_2" / "actor" / "model.safetensors").read_bytes()
    w = StepWriter(tmp_path, 2)
    (w.folder / "state.json").write_text("{}")
    w.commit()
    assert not (tmp_path / "step_2" / "actor").exists() and first
    assert resumable(tmp_path)[0] == 2


# ----- on the runtime --------------------------------------------------------------------------------------
def _grpo(out, steps, **layouts):
    from tests.run.jobs import tiny_job

    job = tiny_job("grpo", str(out), steps=steps, checkpoint={"dir": str(out), "every": 2})
    if layouts:
        from dataclasses import replace

        ranks = {**job.run.ranks, **{k: tuple(v) for k, v in layouts.items()}}
        job = replace(job, run=replace(job.run, ranks=ranks))
    return job


def _execute(job, runtime, resume=False):
    from nereus.run.job import RLJob

    rl = RLJob(job, runtime=runtime, quiet=True)
    try:
        rl.execute(resume=resume)
    finally:
        rl.release()
    return rl


def _rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.distributed
def test_permuted_training_ranks_are_resharded_not_installed_as_written(ray_runtime, tmp_path, capfd):
    """The checkpoint's actor/training ran on workers [0,1,2,3]; the resumed job places the same layout on
    [1,0,3,2]. Installing each worker's file as written would give every worker another position's Adam
    shard (the element counts match); the resume re-shards instead, and step 3 matches an uninterrupted run."""
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    _execute(_grpo(straight, 3), ray_runtime)
    _execute(_grpo(cut, 2), ray_runtime)
    _execute(_grpo(cut, 3, **{"actor/training": [1, 0, 3, 2]}), ray_runtime, resume=True)
    a, b = _rows(straight)[2], _rows(cut)[2]
    assert b["step"] == 3
    for k in ("actor/pg_loss", "actor/kl", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
        if k in a:
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), k
    assert "re-sharding its optimizer state" in capfd.readouterr().err
    state = json.loads((cut / "step_3" / "state.json").read_text())
    assert state["placements"]["actor/training"]["ranks"] == [1, 0, 3, 2]


@pytest.mark.distributed
def test_placement_that_cannot_be_rebuilt_is_refused_by_name(ray_runtime, tmp_path):
    from nereus.run.checkpoint import placement_change
    from nereus.spec.layout import Layout

    lay = Layout.parse("pp=2,dp=2")
    assert placement_change("actor", (lay, (0, 1, 2, 3)), (lay, (0, 1, 2, 3)), 4) is None
    assert "on workers [1, 0, 3, 2]" in placement_change("actor", (lay, (0, 1, 2, 3)), (lay, (1, 0, 3, 2)), 4)
    with pytest.raises(SpecError, match=r"cannot be re-sharded on 2 workers: resume with --workers 4"):
        placement_change("actor", (lay, (0, 1, 2, 3)), (Layout.parse("dp=2"), (0, 1)), 2)


@pytest.mark.distributed
def test_stopped_after_any_write_the_run_resumes(ray_runtime, tmp_path):
    """A job's checkpoint writer stopped after its k-th write, for every k: the run folder resumes — from
    the new step once `latest` names it, else from the one before — with the optimizer state saved."""
    from nereus.run.job import RLJob

    base = tmp_path / "base"
    _execute(_grpo(base, 2), ray_runtime)  # step_2
    rl = RLJob(_grpo(base, 4), runtime=ray_runtime, quiet=True)
    rl._restore()
    try:
        hook, seen = _stop_after(10**9)
        work = tmp_path / "all"
        shutil.copytree(base, work)
        rl.dir, rl.write_hook = work, hook
        rl.save(3)
        saved = {r: {k: v.clone() for k, v in st.items()} for r, st in rl.rt.read_optimizer("actor/training").items()}
        for k in range(1, len(seen) + 1):
            run = tmp_path / f"k{k}"
            shutil.copytree(base, run)
            rl.dir, rl.write_hook = run, _stop_after(k)[0]
            with pytest.raises(Stop):
                rl.save(3)
            assert resumable(run)[0] == (3 if k == len(seen) else 2), (k, seen[k - 1])
    finally:
        rl.release()
    for k in (1, len(seen) - 1, len(seen)):  # stopped early, before `latest`, after it: resume really loads
        again = RLJob(_grpo(tmp_path / f"k{k}", 4), runtime=ray_runtime, quiet=True)
        try:
            step = again._restore()
            if step == 3:
                for r, st in again.rt.read_optimizer("actor/training").items():
                    for name, t in st.items():
                        torch.testing.assert_close(t, saved[r][name], rtol=0, atol=0)
        finally:
            again.release()
        assert step == (3 if k == len(seen) else 2)
