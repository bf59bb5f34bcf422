"""`RunConfig`: how a job trains, as every task reads it from the job's run.json.

`fit` derives it from its validated options (`runtime.options.FitOptions.run_config`);
the launcher carries it as an opaque JSON object (`launch.job.JobDir.write_config`),
reading only the job's id and timeout (`launch.job.JobSettings`).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from autodist.launch.errors import JobArchiveError
from autodist.launch.job import JobDir


@dataclasses.dataclass
class RunConfig:
    """How a job trains.

    Attributes:
        global_batch_size: Examples per step over all replicas.
        epochs: Passes over the data.
        steps_per_epoch: Steps per epoch (None: ceil(examples / batch)).
        shuffle: Shuffle the examples of each pass (True), or each batch's rows
            ("batch"), as Keras' `fit(shuffle=...)`: in Keras' own order when
            the job has one (`JobDir.order`), else seeded by `seed` and pass.
        seed: Seed of the shuffling when Keras' order is not known.
        step_timeout_s: Bound on one step (collectives, PS waits, session runs).
        startup_timeout_s: Bound on waiting for the cluster to come up.
        checkpoint_dir: Where the chief writes checkpoints (None: none).
        checkpoint_every_steps: Steps between checkpoints (None: each epoch's end).
        checkpoints_to_keep: The chief keeps only the newest this many
            checkpoints (None: all).
        task_step_delay_s: Worker task index (as a string) -> seconds to sleep
            before each step: an emulated slow worker, for tests and benchmarks.
        follow_steps: The driver follows every step (callbacks): the chief
            reports the global loss of each step, waits for the driver's
            decision at each epoch's end, and stops the run on request.
        job_timeout_s: Bound on the whole job (non-chief tasks waiting for
            the chief, workers waiting at an epoch's end).
        job_id: Tags the job's messages between tasks (see `mailbox`).
        probe_steps: Measure instead of training: each worker times its
            replicas' forward and backward passes on this many batches
            (after one warm-up) and applies no update (see
            `Run.measure_throughput`). 0: train.
        resize_at: Elastic runs: global step (as a string) -> number of
            worker tasks, or the list of member tasks, from that step on
            (see `elastic.segments`).
        on_failure: "stop" (a dead worker fails the job) or "continue": the
            steps are atomic (no update before every gradient is in) and
            the chief, when a step fails, saves the state after the last
            completed step (`JobDir.recovery`) so the driver can go on
            without the dead worker (see `runtime/recovery.py`).
        start_step: The first step of the run to execute (a run resumed
            after a failure); the data schedule is that of the whole run.
        monitor_every: Every this many steps each worker also fetches the
            squared gradient norms of its virtual nodes and replicas
            (`kernels.monitoring`), with the step itself. 0: never.
        elastic: Programs are built for resizing (collective version tags,
            device filters naming the members): `resize_at`, or resizes
            requested while a followed run goes (`DistributedRun.resize`).
        switch_at: Global step (as a string) -> plan from that step on: the
            index of the strategy (0: the job's, k: `plans[k - 1]`).
        plans: Strategies (text format) the run switches to, from
            `switch_at` or from `DistributedRun.replan` requests.
        epoch_weights: Followed runs with callbacks: at each epoch's end
            (but the last) the chief writes the trained weights for the
            driver, before it waits for the driver's decision.
        first_epoch: The index of the job's first epoch (`fit(initial_epoch=)`):
            seeded shuffling orders the examples of the job's pass p as pass
            `first_epoch + p`.
        learning_rate: The fixed learning rate the run starts with (the
            model's when `fit` starts, after the callbacks' `on_train_begin`
            and first `on_epoch_begin`); None: the captured one.
    """

    global_batch_size: int
    epochs: int = 1
    steps_per_epoch: int | None = None
    shuffle: bool | str = False
    seed: int = 0
    step_timeout_s: float = 60.0
    startup_timeout_s: float = 120.0
    checkpoint_dir: str | None = None
    checkpoint_every_steps: int | None = None
    checkpoints_to_keep: int | None = None
    task_step_delay_s: dict[str, float] | None = None
    follow_steps: bool = False
    job_timeout_s: float = 3600.0
    job_id: str = ""
    probe_steps: int = 0
    resize_at: dict[str, int | list[int]] | None = None
    on_failure: str = "stop"
    start_step: int = 0
    elastic: bool = False
    monitor_every: int = 0
    switch_at: dict[str, int] | None = None
    plans: list[str] | None = None
    epoch_weights: bool = False
    first_epoch: int = 0
    learning_rate: float | None = None

    def to_json(self) -> dict[str, Any]:
        """The config as run.json holds it (a JSON object)."""
        return dataclasses.asdict(self)

    @classmethod
    def of_job(cls, job: JobDir) -> RunConfig:
        """The config of `job` (its run.json).

        Raises:
            JobArchiveError: run.json is not a config this autodist wrote (not
                JSON, a field it does not know, e.g. of a newer version).
        """
        data = job.config()
        try:
            return cls(**data)
        except TypeError as e:
            known = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(str(k)[:64] for k in data if k not in known)[:5]
            raise JobArchiveError(
                f"run.json of job {str(job.path)!r} is not a config of this autodist "
                f"version: unknown fields {unknown} (a job from a newer version?) or missing "
                f"ones ({str(e)[:200]})") from None
