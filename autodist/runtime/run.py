"""DistributedRun: train a Keras model with a Strategy on a cluster, Keras-like."""
from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil
import sys
import tempfile
from typing import Any

import numpy as np

from autodist.ir.errors import AutodistError
from autodist.ir.graph_item import GraphItem
from autodist.ir.resource_spec import ResourceSpec
from autodist.ir.strategy import Strategy
from autodist.kernels.optimizers import check_supported as check_optimizer
from autodist.runtime import checkpoint
from autodist.runtime import data as batching
from autodist.runtime.job import JobDir, RunConfig
from autodist.runtime.launcher import LocalCluster


@dataclasses.dataclass
class History:
    """What `fit` returns.

    Attributes:
        history: {"loss": [mean loss of each epoch, over examples]}, as Keras' History.
        step_losses: The global loss of every step (weighted over replicas).
        step_times: The chief's time of every step, in seconds.
        epoch: Epoch indices.
        max_lead: Per worker task, the most steps it started ahead of the
            slowest task (asynchronous and bounded-staleness runs; 0 otherwise).
    """

    history: dict[str, list[float]]
    step_losses: list[float]
    step_times: list[float]
    epoch: list[int]
    max_lead: list[int] = dataclasses.field(default_factory=list)


class DistributedRun:
    """A Keras model, a Strategy and a ResourceSpec, ready to train.

    Args:
        model: A compiled Keras 3 model. Trained weights are written back to it.
        strategy: How to distribute it (validated against the model here).
        resource_spec: The cluster; local specs are launched as processes.
        graph_item: The model's capture, if already made.
        job_dir: Where job files and task logs go (default: a new temp dir,
            removed after a successful fit).
        step_timeout_s: Bound on one step of any task (no hang).
        startup_timeout_s: Bound on the cluster coming up.
        task_step_delay_s: Worker task -> seconds of sleep before each step,
            to emulate a slow worker (tests, benchmarks).
    """

    def __init__(self, model, strategy: Strategy, resource_spec: ResourceSpec, *,
                 graph_item: GraphItem | None = None, job_dir: str | None = None,
                 step_timeout_s: float = 60.0, startup_timeout_s: float = 120.0,
                 task_step_delay_s: dict[int, float] | None = None) -> None:
        from autodist.ir.capture import capture  # pylint: disable=import-outside-toplevel

        self.model = model
        self.graph_item = graph_item or capture(model)
        self.strategy = strategy
        self.resource_spec = resource_spec
        strategy.validate(self.graph_item, resource_spec)
        check_optimizer(self.graph_item.optimizer)
        self.job_dir = job_dir
        self.step_timeout_s = step_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.last_job_dir: pathlib.Path | None = None
        self.task_step_delay_s = {str(k): float(v) for k, v in (task_step_delay_s or {}).items()}

    def fit(self, x: Any, y: Any = None, *, batch_size: int = 32, epochs: int = 1,
            steps_per_epoch: int | None = None, shuffle: bool = False, seed: int = 0,
            verbose: int = 1, timeout_s: float = 3600.0, checkpoint_dir: str | None = None,
            checkpoint_every_steps: int | None = None,
            initial_checkpoint: str | None = None) -> History:
        """Trains on the cluster and writes the trained weights into the model.

        Args:
            x: Input array, or a list of arrays for a multi-input model.
            y: Target array.
            batch_size: The global batch (split over all replicas).
            epochs: Passes over the data.
            steps_per_epoch: Steps per epoch (default: all batches).
            shuffle: Shuffle each epoch with a seeded permutation (the order
                differs from Keras' own shuffling; use False to compare).
            seed: Seed of the shuffling.
            verbose: 1 shows a progress line.
            timeout_s: Bound on the whole fit.
            checkpoint_dir: The chief writes checkpoints here (see
                `autodist.runtime.checkpoint`), atomically.
            checkpoint_every_steps: Steps between checkpoints (default: at the
                end of each epoch).
            initial_checkpoint: Continue from this checkpoint: variables,
                optimizer slots and update count (else the model's weights
                and fresh optimizer state).

        Returns:
            A History with per-step and per-epoch losses.
        """
        if y is None:
            raise AutodistError("fit needs targets y (datasets are not supported yet)")
        inputs = self._inputs(x)
        targets = self._cast(np.asarray(y), self._target_info())
        n = len(targets)
        if any(len(a) != n for a in inputs):
            raise AutodistError(f"x and y have different numbers of examples: "
                                f"{[len(a) for a in inputs]} vs {n}")
        if batch_size < 1:
            raise AutodistError(f"batch_size must be >= 1. Received: {batch_size}")
        config = RunConfig(global_batch_size=batch_size, epochs=epochs,
                           steps_per_epoch=steps_per_epoch, shuffle=shuffle, seed=seed,
                           step_timeout_s=self.step_timeout_s,
                           startup_timeout_s=self.startup_timeout_s,
                           checkpoint_dir=str(checkpoint_dir) if checkpoint_dir else None,
                           checkpoint_every_steps=checkpoint_every_steps,
                           task_step_delay_s=self.task_step_delay_s or None)
        if checkpoint_every_steps is not None and checkpoint_every_steps < 1:
            raise AutodistError("checkpoint_every_steps must be >= 1. "
                                f"Received: {checkpoint_every_steps}")
        init_values = self._initial_values()
        if initial_checkpoint:
            init_values.update(checkpoint.load(initial_checkpoint))
        path = pathlib.Path(self.job_dir or tempfile.mkdtemp(prefix="autodist-job-"))
        path.mkdir(parents=True, exist_ok=True)
        job = JobDir(path)
        self.last_job_dir = path
        job.write(self.graph_item, self.strategy, self.resource_spec, config,
                  init_values, inputs, targets)
        steps = batching.steps_per_epoch(n, batch_size, steps_per_epoch)
        progress = _Progress(job, steps * epochs, verbose)
        with LocalCluster(job, self.resource_spec) as cluster:
            cluster.wait_ready(self.startup_timeout_s)
            cluster.wait_workers(timeout_s, on_poll=progress.update)
        progress.finish()
        sizes = [len(batching.batch_rows(np.arange(n), s, batch_size)) for s in range(steps)]
        history = self._history(job, sizes, epochs)
        self._write_back(job)
        if self.job_dir is None:
            shutil.rmtree(path, ignore_errors=True)
        return history

    # ------------------------------------------------------------ helpers
    def _x_infos(self):
        return [i for i in self.graph_item.inputs if i.role != "y"]

    def _target_info(self):
        return next(i for i in self.graph_item.inputs if i.role == "y")

    def _inputs(self, x) -> list[np.ndarray]:
        arrays = list(x) if isinstance(x, (list, tuple)) else [x]
        infos = self._x_infos()
        if len(arrays) != len(infos):
            raise AutodistError(f"the model takes {len(infos)} inputs "
                                f"({[i.name for i in infos]}); received {len(arrays)}")
        return [self._cast(np.asarray(a), info) for a, info in zip(arrays, infos)]

    @staticmethod
    def _cast(array: np.ndarray, info) -> np.ndarray:
        expected = list(info.shape)[1:]
        if list(array.shape[1:]) != expected:
            raise AutodistError(f"input {info.name!r} needs examples of shape {expected}; "
                                f"received an array of shape {list(array.shape)}")
        return np.ascontiguousarray(array.astype(info.dtype, copy=False))

    def _initial_values(self) -> dict[str, np.ndarray]:
        from autodist.ir.capture import keras_variable_names  # pylint: disable=C0415

        trainable, state = keras_variable_names(self.model)
        values = {n: np.asarray(v.numpy()) for n, v in zip(trainable,
                                                             self.model.trainable_variables)}
        non_trainable = [v for v in self.model.variables if not v.trainable]
        values.update({n: np.asarray(v.numpy()) for n, v in zip(state, non_trainable)})
        return values

    def _write_back(self, job: JobDir) -> None:
        from autodist.ir.capture import keras_variable_names  # pylint: disable=C0415

        trainable, state = keras_variable_names(self.model)
        non_trainable = [v for v in self.model.variables if not v.trainable]
        with np.load(job.file("final_weights.npz")) as weights:
            for name, var in list(zip(trainable, self.model.trainable_variables)) + \
                    list(zip(state, non_trainable)):
                if name in weights.files:
                    var.assign(weights[name])

    def _history(self, job: JobDir, batch_sizes: list[int], epochs: int) -> History:
        results = [json.loads(job.result(i).read_text())
                   for i in range(self.resource_spec.num_worker_tasks)
                   if job.result(i).exists()]
        losses = np.sum([r["losses"] for r in results], axis=0).tolist()
        steps = len(batch_sizes)
        # As Keras: the epoch loss is the mean over examples (batches weighted by size).
        epoch_losses = [float(np.average(losses[e * steps:(e + 1) * steps], weights=batch_sizes))
                        for e in range(epochs)]
        return History(history={"loss": epoch_losses}, step_losses=losses,
                       step_times=results[0]["step_times"], epoch=list(range(epochs)),
                       max_lead=[int(r.get("max_lead", 0)) for r in results])


class _Progress:
    """A one-line progress display fed by the chief's progress file."""

    def __init__(self, job: JobDir, total: int, verbose: int) -> None:
        self.path = job.file("progress.jsonl")
        self.total = total
        self.verbose = verbose
        self.seen = 0

    def update(self) -> None:
        if not self.verbose or not self.path.exists():
            return
        lines = self.path.read_text().splitlines()
        if len(lines) == self.seen or not lines:
            return
        self.seen = len(lines)
        try:
            last = json.loads(lines[-1])
        except json.JSONDecodeError:
            return
        width = 30
        done = int(width * self.seen / max(self.total, 1))
        sys.stdout.write(f"\r{self.seen}/{self.total} [{'=' * done}{'.' * (width - done)}] "
                         f"- loss: {last['loss']:.4f} - {last['time'] * 1e3:.1f} ms/step")
        sys.stdout.flush()

    def finish(self) -> None:
        self.update()
        if self.verbose:
            sys.stdout.write("\n")

