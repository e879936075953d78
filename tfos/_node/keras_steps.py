"""Keras 3 training steps into the node's figures (TF process).

``TensorFlowTrainer.make_train_function`` is wrapped so that every call of the train
function Keras's ``fit`` makes adds its ``steps_per_execution`` to the ``keras_steps``
counter of :data:`tfos._data.figures.FIGURES`: the driver's steps/s per node
(docs/status.md). One lock and one integer addition per call, next to a training step.
Applied with tfos's Keras 3 fix, when Keras's TensorFlow trainer is imported
(:mod:`tfos._node.keras3_fix`).
"""

from __future__ import annotations

from typing import Any

from tfos._data.figures import FIGURES

__all__ = ["count_steps", "STEPS"]

#: The counter's name in the node's figures.
STEPS = "keras_steps"


def count_steps(trainer: Any) -> None:
    """Wraps ``trainer.TensorFlowTrainer.make_train_function`` (idempotent; TF process)."""
    cls: Any = getattr(trainer, "TensorFlowTrainer", None)
    original = getattr(cls, "make_train_function", None)
    if original is None or getattr(original, "_tfos_counts_steps", False):
        return  # not Keras 3's trainer as tfos knows it: no steps counted

    def make_train_function(self: Any, force: bool = False) -> Any:
        original(self, force)
        function = self.train_function
        if function is None or getattr(function, "_tfos_counted", False):
            return function
        per_call = max(1, int(getattr(self, "steps_per_execution", 1) or 1))

        def counted(*args: Any, **kwargs: Any) -> Any:
            out = function(*args, **kwargs)
            FIGURES.add(STEPS, per_call)
            return out

        counted._tfos_counted = True  # type: ignore[attr-defined]
        self.train_function = counted
        return counted

    make_train_function._tfos_counts_steps = True  # type: ignore[attr-defined]
    make_train_function.__wrapped__ = original  # type: ignore[attr-defined]
    cls.make_train_function = make_train_function
