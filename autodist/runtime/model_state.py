"""The user's Keras model as a run reads and writes it: its values by capture name.

A run starts from the model's weights, state and optimizer state, and puts
what was trained back into it: after a fit, and, as after Ctrl-C, whatever
survived a failure (the last step every replica completed, else the newest
checkpoint), saying which.
"""
from __future__ import annotations

import sys
from typing import Any, Mapping

import numpy as np

from autodist.ir.errors import AutodistError
from autodist.ir.graph_item import GraphItem
from autodist.launch.errors import TaskFailedError
from autodist.launch.job import JobDir
from autodist.runtime import checkpoint, optimizer_state, recovery


class ModelState:
    """Reads and writes a Keras model's values by the names of its capture.

    Args:
        model: The user's Keras model.
        graph_item: Its capture.
        keep_optimizer_state: Trained optimizer state (slots, update count)
            goes back into the model's optimizer too, as after Keras' fit.
    """

    def __init__(self, model: Any, graph_item: GraphItem, keep_optimizer_state: bool) -> None:
        self.model = model
        self.graph_item = graph_item
        self.keep_optimizer_state = keep_optimizer_state

    def _named_variables(self) -> tuple[list[tuple[str, Any]], list[tuple[str, Any]]]:
        """(trainable, state): the model's variables with their capture names."""
        from autodist.ir.capture import keras_variable_names

        trainable, state = keras_variable_names(self.model)
        non_trainable = [v for v in self.model.variables if not v.trainable]
        return (list(zip(trainable, self.model.trainable_variables)),
                list(zip(state, non_trainable)))

    def initial_values(self) -> dict[str, np.ndarray]:
        """The model's weights, state and optimizer state: where a run starts."""
        trainable, state = self._named_variables()
        values = {n: np.asarray(v.numpy()) for n, v in trainable + state}
        values.update(optimizer_state.read(self.model, self.graph_item))
        return values

    def read_state(self) -> dict[str, np.ndarray]:
        """The model's state (non-trainable) variables by capture name."""
        return {n: np.asarray(v.numpy()) for n, v in self._named_variables()[1]}

    def load_weights(self, weights: Any) -> None:
        """Puts trained values (by variable name: an .npz or a dict) into the model."""
        names = set(weights.files if hasattr(weights, "files") else weights)
        trainable, state = self._named_variables()
        for name, var in trainable + state:
            if name in names:
                var.assign(weights[name])

    def load_state(self, values: Mapping[str, np.ndarray]) -> None:
        """Weights (and, kept between fits, the optimizer's state) into the model."""
        self.load_weights(values)
        if self.keep_optimizer_state:
            optimizer_state.write(self.model, self.graph_item, values)

    def write_back(self, job: JobDir) -> None:
        """The job's trained weights, and the optimizer's state, into the model (as
        after Keras' fit, a later fit goes on from both)."""
        with np.load(job.file("final_weights.npz")) as weights:
            self.load_weights(weights)
            if self.keep_optimizer_state:
                optimizer_state.write(self.model, self.graph_item, weights)

    def keep_interrupted(self, job: JobDir) -> None:
        """After Ctrl-C: the weights the chief trained so far go into the model, if it
        wrote them in time."""
        if job.file("final_weights.npz").exists():
            self.write_back(job)
            print("autodist: interrupted; the model holds the weights trained so far",
                  file=sys.stderr, flush=True)
        else:
            print("autodist: interrupted before the chief could send its weights; the model "
                  "is unchanged", file=sys.stderr, flush=True)

    def keep_failed(self, job: JobDir, checkpoint_dir: str | None,
                    error: TaskFailedError) -> TaskFailedError:
        """After a task failed: the newest trained state that survived goes into the
        model, and the returned error (`error`'s, continued) says which.

        The chief saves the state after the last step every replica completed
        when its step fails (steps are atomic: a failed step applied nothing);
        where the chief or a parameter server died, the newest checkpoint of
        `checkpoint_dir` stands in; else the model is unchanged.
        """
        held = "the model is unchanged: no trained state could be read back (the chief or a " \
               "parameter server failed, and no checkpoint was written: fit(checkpoint_dir=...) " \
               "keeps one)"
        try:
            saved = recovery.newest_saved_state(job)
            if saved is not None:
                values, next_step = saved
                self.load_state(values)
                held = (f"the model holds the weights after step {next_step} of the run, the "
                        "last step every replica completed")
            elif checkpoint_dir and checkpoint.latest(checkpoint_dir) is not None:
                prefix = checkpoint.latest(checkpoint_dir)
                self.load_state(checkpoint.load(prefix))
                held = f"the model holds the newest checkpoint, {prefix.parent}"
        except (OSError, ValueError, KeyError, AutodistError) as e:
            held = f"the model is unchanged: its trained state could not be read back ({e})"
        print(f"autodist: task {error.task} failed; {held}", file=sys.stderr, flush=True)
        return TaskFailedError(f"{error}\n{held}", error.task, error.log)
