"""The one error type of a job spec, plan or layout: it names the key path and the fix."""


class SpecError(ValueError):
    """Bad input in a spec; ``path`` is the dotted key path (``models.actor.layers``)."""

    def __init__(self, path: str, message: str) -> None:
        self.path = path
        self.message = message
        super().__init__(f"{path}: {message}" if path else message)


class InfeasibleError(ValueError):
    """No layout of some model-stage fits the devices it may use.

    Carries the model-stage, the smallest per-device memory any layout needs and the capacity, so the
    message tells the user how far off the job is.
    """

    def __init__(self, model_stage: str, needed_bytes: float, capacity_bytes: float, detail: str = "") -> None:
        self.model_stage = model_stage
        self.needed_bytes = needed_bytes
        self.capacity_bytes = capacity_bytes
        if needed_bytes > 0:
            msg = (f"{model_stage}: no layout fits: it needs at least {needed_bytes / 1e9:.1f} GB per device, "
                   f"capacity is {capacity_bytes / 1e9:.1f} GB" + (f" ({detail})" if detail else ""))
        else:
            msg = f"{model_stage}: {detail}"
        super().__init__(msg)


class RuntimeFailure(RuntimeError):
    """The machine or cluster failed the run (a wait past its deadline, workers that never answered), not
    the input and not the code: the CLI prints one line and exits 1; checkpoints already written stay
    valid for ``--resume``."""
