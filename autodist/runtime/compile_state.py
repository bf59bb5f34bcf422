"""What a capture was made of: the Keras model's `compile` and its trainable variables.

A capture traces the step of the model as it was compiled (its optimizer,
loss and metrics) over the variables trainable then, and a strategy places
and synchronizes each of those variables. Keras' fine-tuning flow changes
both between fits: `base_model.trainable = True` (or `layer.trainable =
False`) and `compile` again with another optimizer or learning rate. A run
of the old capture would silently train the old set of variables with the
old optimizer and loss, so a fit refuses it before launch, naming what
changed: the model is captured and planned again by `autodist.optimize(model)`
(the trained weights are in the model; the new optimizer starts fresh, as
in Keras).

Setting `model.optimizer.learning_rate` between fits is no change here: the
run trains with the model's rate, as Keras does.
"""
from __future__ import annotations

from typing import Any

from autodist.ir.errors import AutodistError

# What the error advises.
_AGAIN = ("call autodist.optimize(model) again (or autodist.capture(model) and "
          "autodist.distribute with a strategy for that capture) and fit the new plan: the "
          "model holds the trained weights, and a new optimizer starts fresh, as in Keras")


class ModelChangedError(AutodistError):
    """The model was compiled again, or its trainable variables changed, since capture."""


class CompileState:
    """A Keras model's compile and trainable variables, as a capture saw them.

    Keras makes a new loss tracker at every `compile` call, so it marks one
    compile (with the optimizer object, which `compile` replaces); the
    trainable variables are held by identity.

    Args:
        model: The compiled Keras model, as it is captured (None, or no Keras model: a
            plan of a GraphItem alone, where nothing can change).
    """

    def __init__(self, model: Any) -> None:
        self._tracker = getattr(model, "_loss_tracker", None)
        self._optimizer = getattr(model, "optimizer", None)
        self._trainable = _trainable(model)

    def changes(self, model: Any) -> list[str]:
        """What differs in `model` now, in words (empty: nothing)."""
        out = []
        if getattr(model, "_loss_tracker", None) is not self._tracker or \
                getattr(model, "optimizer", None) is not self._optimizer:
            out.append("the model was compiled again (its optimizer, loss and metrics are "
                       "new)")
        now = _trainable(model)
        if len(now) != len(self._trainable) or \
                any(a is not b for a, b in zip(now, self._trainable)):
            was = {id(v) for v in self._trainable}
            is_now = {id(v) for v in now}
            unfrozen = [v.path for v in now if id(v) not in was]
            frozen = [v.path for v in self._trainable if id(v) not in is_now]
            parts = [f"{len(unfrozen)} trainable now ({_some(unfrozen)})"] if unfrozen else []
            parts += [f"{len(frozen)} frozen now ({_some(frozen)})"] if frozen else []
            out.append("the model's trainable variables changed: " + ("; ".join(parts) or
                                                               "their order"))
        return out

    def check(self, model: Any, what: str) -> None:
        """Raises ModelChangedError where `model` changed since capture.

        Args:
            model: The model as `what` is about to train it.
            what: Who trains it, for the message (e.g. "this DistributedRun").
        """
        changes = self.changes(model)
        if not changes:
            return
        todo = _AGAIN
        if len(changes) == 1 and changes[0].startswith("the model's trainable"):
            # Keras' fit warns and goes on with the compiled variables; its optimizer is
            # built for them.
            todo = "compile the model again (Keras' fit, too, trains the variables of the " \
                   "last compile until then), then " + _AGAIN
        raise ModelChangedError(
            f"{' and '.join(changes)} since {what} captured it; its capture and strategy are "
            "for the model as it was, and would train the old variables with the old "
            f"optimizer and loss. To train the model as it is now, {todo}")


def check_capture_matches(model: Any, trainable_names: list[str]) -> None:
    """Raises ModelChangedError where a capture's trainable variables (`trainable_names`,
    capture's names) are not the model's now (a capture made before `trainable`
    changed). A capture given to `distribute` is checked so; whether the model was
    compiled again since cannot be told from a GraphItem (it may come from a file)."""
    from autodist.ir.capture import keras_variable_names

    if not hasattr(model, "trainable_variables"):
        return   # no Keras model: nothing to compare
    now = keras_variable_names(model)[0]
    if now != list(trainable_names):
        added = [n for n in now if n not in set(trainable_names)]
        removed = [n for n in trainable_names if n not in set(now)]
        raise ModelChangedError(
            f"the capture is of other trainable variables than the model's now ({len(now)} "
            f"trainable; {len(added)} not in the capture: {_some(added)}; {len(removed)} of "
            f"the capture not trainable now: {_some(removed)}): the model's trainable flags "
            f"changed since it was captured. {_AGAIN[0].upper()}{_AGAIN[1:]}")


def _trainable(model: Any) -> tuple:
    return tuple(getattr(model, "trainable_variables", None) or ())


def _some(names: list[str], shown: int = 4) -> str:
    """The first names, and how many more."""
    text = ", ".join(names[:shown])
    return text + (f", ... {len(names) - shown} more" if len(names) > shown else "")
