"""Where the run's models are: the runtime key of each (model, stage) and the placements it comes from.

One ``StageKeys`` is shared by every piece of the RL step (its generation, inference, training and weight
sync). A transition or a recovery re-places the models and updates it in place (``RLStep.use``), so each
piece reads the keys in force when it issues a call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nereus.run.setup import Placed


class StageKeys:
    """The runtime key of each (model, stage) of ``placed``: ``keys["actor", "generation"]``."""

    def __init__(self, placed: list[Placed]) -> None:
        self.placed: list[Placed] = []
        self.keys: dict[tuple[str, str], str] = {}
        self.use(placed)

    def use(self, placed: list[Placed]) -> None:
        """The models are now loaded under ``placed``."""
        self.placed = placed
        self.keys = {(p.model, p.stage): p.key for p in placed}

    def __getitem__(self, model_stage: tuple[str, str]) -> str:
        return self.keys[model_stage]
