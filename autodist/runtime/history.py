"""What `fit` returns: `History`, read from the workers' results."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import keras
import numpy as np

from autodist.ir.resource_spec import ResourceSpec
from autodist.kernels import monitoring
from autodist.launch.job import JobDir
from autodist.runtime.history_events import NoiseScale, PolicyAction, Recovery, Resize
from autodist.runtime.records import MonitorSample, WorkerResult, add_states

# Smoothing of the gradient noise scale (History.noise_scale and policies).
NOISE_DECAY = 0.9


class History(keras.callbacks.History):
    """What `fit` returns: Keras' History, with what a distributed run adds.

    It is a `keras.callbacks.History`, driven by the fit's callbacks like
    Keras' own: `history` holds the per-epoch logs (the loss, the compiled
    metrics, and the `val_*` ones), `epoch` the epoch indices, `params` the
    fit's parameters, and the fit sets `model.history` to it. Per-epoch values
    are exact (every worker's examples); they replace, at the end of the run,
    the chief's estimates that a run without callbacks shows while it goes.

    Attributes:
        step_losses: The global loss of every step (weighted over replicas).
        step_times: The chief's wall time of every step, in seconds (its data and feed
            prepared, its session runs; not the reporting between steps).
        max_lead: Per worker task, the most steps it started ahead of the
            slowest task (asynchronous and bounded-staleness runs; 0 otherwise).
        resizes: Elastic runs and strategy switches: a `Resize` per
            membership change (step, workers, plan, seconds, members).
        noise_scale: Runs with `monitor_every`: a `NoiseScale` per monitored
            step (|G|², tr Σ, their ratio, its smoothed value, and the
            step's compute and communication seconds).
        actions: Runs with policies: a `PolicyAction` per action a policy
            asked for (step, action, details).
        recoveries: Runs with `on_failure="continue"`: a `Recovery` per
            failure (the step resumed at, the failed task, the workers after
            it, the steps whose loss is estimated).

    The entries are typed (`autodist.runtime.history_events`); reading them as
    dicts (`entry["step"]`) still works, deprecated.
    """

    def __init__(self) -> None:
        super().__init__()
        self.epoch: list[int] = []
        self.step_losses: list[float] = []
        self.step_times: list[float] = []
        self.max_lead: list[int] = []
        self.resizes: list[Resize] = []
        self.recoveries: list[Recovery] = []
        self.noise_scale: list[NoiseScale] = []
        self.actions: list[PolicyAction] = []


def read_results(history: History, job: JobDir, epochs: int, spec: ResourceSpec,
                 earlier_losses: Sequence[float] = (),
                 earlier_times: Sequence[float] = (), initial_epoch: int = 0,
                 metric_logs: Callable[[Sequence[Any]], dict[str, float]] | None = None
                 ) -> None:
    """Fills `history` from every worker's result of a finished job.

    Sets the per-step fields and the exact per-epoch losses (replacing what
    the callbacks recorded while the run went).

    Args:
        history: The fit's History.
        job: The (last) job.
        epochs: Epochs the job ran (at most).
        spec: The job's cluster.
        earlier_losses, earlier_times: Steps completed before a recovery.
        initial_epoch: The index of the job's first epoch.
        metric_logs: The compiled metrics' logs from their summed state
            (their exact per-epoch values replace the logged ones); None
            after a recovery, whose failed job's metric state is lost.
    """
    results = [WorkerResult.from_json(job.result(i).read_bytes())
               for i in range(spec.num_worker_tasks)
               if job.result(i).exists()]
    # Every worker ran the same steps, except asynchronous ones stopped early.
    done = min(len(r.losses) for r in results)
    losses = list(earlier_losses) + np.sum([r.losses[:done] for r in results],
                                           axis=0).tolist()
    done += len(earlier_losses)
    # The chief's epochs (their batch may have changed with the strategy), and the
    # examples of every step from the run's first.
    starts = list(results[0].epoch_starts)
    examples = list(results[0].step_examples)
    # As Keras: the epoch loss is the mean over examples (batches weighted by size).
    ran = sum(1 for start in starts[:epochs] if start < done)
    epoch_losses = []
    for e in range(ran):
        end = min(starts[e + 1], done)
        epoch_losses.append(float(np.average(losses[starts[e]:end],
                                             weights=examples[starts[e]:end])))
    history.history["loss"] = epoch_losses
    if getattr(metric_logs, "complete", False) and "loss" not in metric_logs.keys:
        del history.history["loss"]  # a custom step's logs, without a loss
    if metric_logs is not None:
        for e in range(ran):
            states: tuple = ()
            for result in results:
                if e < len(result.epoch_metrics):
                    states = add_states(states, result.epoch_metrics[e])
            for key, value in metric_logs(states).items():
                values = history.history.setdefault(key, [])
                values[e:e + 1] = [value]
    for values in history.history.values():  # logs of epochs that did not run
        del values[ran:]
    history.epoch = list(range(initial_epoch, initial_epoch + ran))
    history.step_losses = losses
    history.step_times = list(earlier_times) + list(results[0].step_times[:done])
    history.max_lead = [r.max_lead for r in results]
    history.resizes = [Resize(r.step, r.workers, r.plan, r.seconds, tuple(r.members))
                       for r in results[0].resizes]
    history.noise_scale = _noise_scale(results)


def _noise_scale(results: list[WorkerResult]) -> list[NoiseScale]:
    """Noise-scale estimates and the step's split per monitored step, from every worker."""
    by_step: dict[int, list[MonitorSample]] = {}
    for result in results:
        for record in result.monitor:
            by_step.setdefault(record.step, []).append(record.sample)
    times = results[0].step_times if results else ()
    smooth = monitoring.SmoothedNoiseScale(decay=NOISE_DECAY)
    out = []
    for step in sorted(by_step):
        sample = MonitorSample.merge(by_step[step])
        estimate = monitoring.noise_scale_fit(sample.batches, sample.sq_norms)
        if estimate is None:
            continue
        compute_s = communication_s = None
        if sample.compute_s and step < len(times):
            compute_s = max(sample.compute_s)
            communication_s = max(0.0, times[step] - compute_s)
        out.append(NoiseScale(step, estimate.gradient_sq, estimate.trace_sigma,
                              estimate.noise_scale, smooth.update(estimate).noise_scale,
                              compute_s, communication_s))
    return out
