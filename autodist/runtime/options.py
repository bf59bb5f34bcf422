"""`FitOptions`: every option of `DistributedRun.fit`, and every check of them.

`fit` takes its keyword arguments (`FitArguments`, typed) into one
`FitOptions` (`FitOptions.from_arguments`), which checks them against the
strategy and the cluster before anything starts (`check`), so a bad option
is an error naming it and what was received, never a cluster that starts and
then fails or trains something else. What the options imply for the run (who
follows it, whether membership may change, which strategies are switched
to) is derived here too, and so is the job's `RunConfig` (`run_config`), in
this one place.
"""
from __future__ import annotations

import dataclasses
import difflib
import uuid
from typing import Any, Mapping, Sequence, TypedDict

from autodist.adapt.policy_interface import Policy, Replanner
from autodist.ir.errors import AutodistError, UnknownArgumentError
from autodist.ir.graph_item import GraphItem
from autodist.ir.resource_spec import ResourceSpec
from autodist.ir.strategy import Strategy
from autodist.runtime.elastic import check_elastic, check_switch
from autodist.runtime.run_config import RunConfig

ON_FAILURE = ("stop", "continue")
_HOOKS = ("set_model", "set_params", "on_train_begin", "on_epoch_begin", "on_train_batch_begin",
          "on_train_batch_end", "on_epoch_end", "on_train_end")


class FitArguments(TypedDict, total=False):
    """The keyword arguments of `DistributedRun.fit` (and `Plan.fit`), typed.

    See `DistributedRun.fit` for each one's meaning; `FitOptions` holds them
    checked, with the same names and defaults.
    """

    batch_size: int | None
    epochs: int
    steps_per_epoch: int | None
    shuffle: bool | str
    seed: int
    verbose: int
    timeout_s: float
    checkpoint_dir: str | None
    checkpoint_every_steps: int | None
    checkpoints_to_keep: int | None
    initial_checkpoint: str | None
    callbacks: Sequence[Any] | None
    resize_at: Mapping[int, int | Sequence[int]] | None
    elastic: bool
    switch_at: Mapping[int, Strategy] | None
    policies: Sequence[Policy] | None
    replanner: Replanner | None
    on_failure: str
    monitor_every: int
    validation_data: Any
    validation_split: float
    validation_batch_size: int | None
    validation_steps: int | None
    validation_freq: int | Sequence[int]
    initial_epoch: int
    sample_weight: Any
    class_weight: Mapping[int, float] | None


@dataclasses.dataclass
class FitOptions:
    """The options of one `fit` (see `DistributedRun.fit` for each one's meaning)."""

    batch_size: int | None = None
    epochs: int = 1
    steps_per_epoch: int | None = None
    shuffle: bool | str = True
    seed: int = 0
    verbose: int = 1
    timeout_s: float = 3600.0
    checkpoint_dir: str | None = None
    checkpoint_every_steps: int | None = None
    checkpoints_to_keep: int | None = None
    initial_checkpoint: str | None = None
    callbacks: Sequence[Any] = ()
    resize_at: Mapping[int, int | Sequence[int]] | None = None
    elastic: bool = False
    switch_at: Mapping[int, Strategy] | None = None
    policies: Sequence[Policy] = ()
    replanner: Replanner | None = None
    on_failure: str = "stop"
    monitor_every: int = 0
    validation_data: Any = None
    validation_split: float = 0.0
    validation_batch_size: int | None = None
    validation_steps: int | None = None
    validation_freq: int | Sequence[int] = 1
    initial_epoch: int = 0
    sample_weight: Any = None
    class_weight: Mapping[int, float] | None = None

    @classmethod
    def from_arguments(cls, arguments: Mapping[str, Any]) -> FitOptions:
        """The options from `fit`'s keyword arguments.

        Raises:
            UnknownArgumentError: an argument `fit` does not take (named,
                with the closest one it does; a `TypeError`, as Python's own).
        """
        known = [f.name for f in dataclasses.fields(cls)]
        for name in arguments:
            if name not in known:
                close = difflib.get_close_matches(str(name), known, n=1)
                raise UnknownArgumentError(f"fit() got an unexpected keyword argument {name!r}"
                                + (f"; did you mean {close[0]!r}?" if close else
                                   f"; it takes {', '.join(known)}"))
        options = cls(**arguments)
        if options.checkpoint_dir:
            options.checkpoint_dir = str(options.checkpoint_dir)
        return options

    def __post_init__(self) -> None:
        self.callbacks = list(self.callbacks or [])
        self.policies = list(self.policies or [])
        if self.policies:
            self.elastic = True

    @property
    def validates(self) -> bool:
        return self.validation_data is not None or bool(self.validation_split)

    @property
    def followed(self) -> bool:
        """The driver follows every step (callbacks, policies or validation run)."""
        return bool(self.callbacks or self.policies or self.validates)

    @property
    def job_epochs(self) -> int:
        """Epochs the job runs: from `initial_epoch` to `epochs`."""
        return self.epochs - self.initial_epoch

    def should_validate(self, epoch: int) -> bool:
        """Whether epoch `epoch` (0-based, counted as Keras does) ends with validation."""
        if not self.validates:
            return False
        if isinstance(self.validation_freq, int):
            return (epoch + 1) % self.validation_freq == 0
        return epoch + 1 in self.validation_freq

    @property
    def membership_may_change(self) -> bool:
        """Workers or strategies may change during the run."""
        return bool(self.elastic or self.resize_at or self.switch_at)

    def switch_plans(self) -> tuple[list[str], dict[str, int]]:
        """The strategies switched to (as text, in order of first use) and step -> plan."""
        plans: list[str] = []
        by_step: dict[str, int] = {}
        for step, new in sorted((self.switch_at or {}).items()):
            text = new.to_text()
            if text not in plans:
                plans.append(text)
            by_step[str(int(step))] = plans.index(text) + 1
        return plans, by_step

    def run_config(self, *, global_batch_size: int, shuffle: bool | str,
                   step_timeout_s: float, startup_timeout_s: float,
                   task_step_delay_s: dict[str, float] | None) -> RunConfig:
        """The job's config for these options, on an input of `global_batch_size`
        whose workers shuffle as `shuffle` says, under the run's timeouts."""
        plans, switch_at = self.switch_plans()
        return RunConfig(
            global_batch_size=global_batch_size, epochs=self.job_epochs,
            steps_per_epoch=self.steps_per_epoch, shuffle=shuffle, seed=self.seed,
            step_timeout_s=step_timeout_s, startup_timeout_s=startup_timeout_s,
            checkpoint_dir=self.checkpoint_dir,
            checkpoint_every_steps=self.checkpoint_every_steps,
            checkpoints_to_keep=self.checkpoints_to_keep,
            task_step_delay_s=task_step_delay_s or None, follow_steps=self.followed,
            job_timeout_s=self.timeout_s, job_id=uuid.uuid4().hex,
            resize_at={str(k): v if isinstance(v, int) else sorted(v)
                       for k, v in self.resize_at.items()} if self.resize_at else None,
            on_failure=self.on_failure, elastic=self.membership_may_change,
            monitor_every=self.monitor_every, switch_at=switch_at or None,
            plans=plans or None, epoch_weights=bool(self.callbacks or self.validates),
            first_epoch=self.initial_epoch)

    def check(self, strategy: Strategy, graph_item: GraphItem, spec: ResourceSpec,
              launch: str) -> AutodistError | None:
        """Raises AutodistError naming the first bad option.

        Returns:
            Why `resize(n)` cannot work in this run (a replan still can), or
            None when it can or the run is not elastic.
        """
        self._check_values()
        for callback in self.callbacks:
            if not all(hasattr(callback, hook) for hook in _HOOKS):
                raise AutodistError("callbacks must be keras.callbacks.Callback objects. "
                                    f"Received: {callback!r}")
        if self.monitor_every and strategy.num_virtual_nodes <= len(strategy.replicas):
            raise AutodistError(
                "monitor_every estimates the noise scale from two batch sizes: the virtual "
                "nodes' and their replica's. It needs a replica with two or more virtual "
                f"nodes; the strategy has {strategy.num_virtual_nodes} virtual nodes on "
                f"{len(strategy.replicas)} replicas")
        if self.on_failure == "continue":
            self._check_recoverable(strategy, launch)
        self._check_validation()
        not_resizable = None
        if self.resize_at or self.elastic:
            if self.callbacks and self.resize_at and set(map(int, self.resize_at)) != {0}:
                raise AutodistError("with callbacks, resize_at may only give the starting size "
                                    "(step 0); resize later with run.resize(n) from a callback")
            if self.elastic and not self.followed:
                raise AutodistError("elastic=True resizes on request from a callback "
                                    "(run.resize(n)); without callbacks use resize_at")
            try:
                check_elastic(strategy, spec)
            except AutodistError as e:
                if self.resize_at:
                    raise
                not_resizable = e  # replan works; resize(n) raises this
        for step, new in sorted((self.switch_at or {}).items()):
            if not isinstance(new, Strategy):
                raise AutodistError(f"switch_at[{step}] must be a Strategy. Received: {new!r}")
            check_switch(strategy, new, graph_item, spec)
            if self.resize_at:
                check_elastic(new, spec)
        if self.switch_at and self.followed:
            raise AutodistError("with callbacks, switch strategies with run.replan(strategy) "
                                "from a callback (fit(..., elastic=True)), not switch_at")
        return not_resizable

    def _check_values(self) -> None:
        if not isinstance(self.shuffle, bool) and self.shuffle != "batch":
            raise AutodistError(f"shuffle must be True, False or 'batch' (as in Keras). "
                                f"Received: {self.shuffle!r}")
        if not isinstance(self.epochs, int) or isinstance(self.epochs, bool) or self.epochs < 1:
            raise AutodistError(f"epochs must be an integer >= 1. Received: {self.epochs!r}")
        if self.steps_per_epoch is not None and (
                not isinstance(self.steps_per_epoch, int) or
                isinstance(self.steps_per_epoch, bool) or self.steps_per_epoch < 1):
            raise AutodistError("steps_per_epoch must be an integer >= 1 (or None: every "
                                f"batch). Received: {self.steps_per_epoch!r}")
        if self.checkpoint_every_steps is not None and (
                not isinstance(self.checkpoint_every_steps, int)
                or self.checkpoint_every_steps < 1):
            raise AutodistError("checkpoint_every_steps must be an integer >= 1. "
                                f"Received: {self.checkpoint_every_steps!r}")
        if self.checkpoints_to_keep is not None and (
                isinstance(self.checkpoints_to_keep, bool)
                or not isinstance(self.checkpoints_to_keep, int) or self.checkpoints_to_keep < 1):
            raise AutodistError("checkpoints_to_keep must be an integer >= 1. "
                                f"Received: {self.checkpoints_to_keep!r}")
        if not isinstance(self.monitor_every, int) or self.monitor_every < 0:
            raise AutodistError(f"monitor_every must be an integer >= 0. Received: "
                                f"{self.monitor_every!r}")
        if self.on_failure not in ON_FAILURE:
            raise AutodistError(f"on_failure must be 'stop' or 'continue'. Received: "
                                f"{self.on_failure!r}")
        if not self.timeout_s > 0:
            raise AutodistError(f"timeout_s must be a positive number of seconds. Received: "
                                f"{self.timeout_s!r}")
        if not isinstance(self.initial_epoch, int) or not 0 <= self.initial_epoch < self.epochs:
            raise AutodistError(f"initial_epoch must be an integer in [0, epochs={self.epochs}). "
                                f"Received: {self.initial_epoch!r}")

    def _check_validation(self) -> None:
        split = self.validation_split
        if isinstance(split, bool) or not isinstance(split, (int, float)) or \
                not 0.0 <= split < 1.0:
            raise AutodistError(f"validation_split must be a number in [0, 1). Received: "
                                f"{split!r}")
        if split and self.validation_data is not None:
            raise AutodistError("give validation_data or validation_split, not both")
        freq = self.validation_freq
        if isinstance(freq, bool) or not (isinstance(freq, int) and freq >= 1 or
                                          isinstance(freq, (list, tuple)) and
                                          all(isinstance(e, int) for e in freq)):
            raise AutodistError(f"validation_freq must be an integer >= 1 or a list of epochs "
                                f"(1-based). Received: {freq!r}")
        if self.validates and self.on_failure == "continue":
            raise AutodistError("on_failure='continue' does not support validation "
                                "(validation_data / validation_split)")

    def _check_recoverable(self, strategy: Strategy, launch: str) -> None:
        # Remote: resize_at[0] alone sets the starting members; other served slots are spares.
        starting_members = launch == "remote" and set(self.resize_at or {}) <= {0, "0"}
        if self.callbacks or (self.resize_at and not starting_members) or self.switch_at:
            raise AutodistError("on_failure='continue' needs a run without callbacks, "
                                "resize_at or switch_at (under launch='remote', resize_at="
                                "{0: members} may set the starting members: served worker "
                                "slots outside them are spares)")
        asynchronous = strategy.asynchronous_shards()
        if asynchronous:
            name, i = asynchronous[0]
            raise AutodistError(f"on_failure='continue' needs synchronous training; variable "
                                f"{name!r} shard {i} is updated asynchronously")
        kinds = {sync.WhichOneof("kind") for config in strategy.variables
                 for sync in config.shards}
        if kinds == {"ps", "all_reduce"}:
            raise AutodistError("on_failure='continue' needs a strategy that is all "
                                "parameter-server or all all-reduce (a mixed step runs in "
                                "two parts, which a failure could split)")
