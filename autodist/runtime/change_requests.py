"""The driver's requests to a running fit: resize, re-plan, stop; one channel.

While `fit` runs, a callback (a policy) may ask for other workers
(`DistributedRun.resize`) or another strategy (`DistributedRun.replan`), and
Ctrl-C asks the chief to stop. The requests are checked here against the run
(what it may still change, what the strategy allows) and written to the
job's control files, which the chief reads between steps
(`autodist.runtime.follow`). Which worker tasks a resize to n workers takes
or gives back is the run's task provider's choice
(`autodist.adapt.task_providers`).
"""
from __future__ import annotations

from typing import Sequence

from autodist.adapt.task_providers import LocalProcesses, TaskProvider
from autodist.ir.errors import AutodistError
from autodist.ir.graph_item import GraphItem
from autodist.ir.resource_spec import ResourceSpec
from autodist.ir.strategy import Strategy
from autodist.kernels import global_batch
from autodist.launch.job import JobDir
from autodist.runtime import follow
from autodist.runtime.elastic import check_elastic, check_switch, members_for
from autodist.runtime.run_config import RunConfig


class ChangeRequests:
    """The requests the driver sends a running fit, and what the fit allows.

    Args:
        graph_item: The run's model capture.
        strategy: The run's strategy (requests are checked against it).
        spec: The run's cluster.
        provider: Which worker tasks a resize to n workers takes and gives
            back (default `LocalProcesses`: the lowest-numbered idle tasks
            join, the highest-numbered members leave).
    """

    def __init__(self, graph_item: GraphItem, strategy: Strategy, spec: ResourceSpec,
                 provider: TaskProvider | None = None) -> None:
        self.graph_item = graph_item
        self.strategy = strategy
        self.spec = spec
        self.provider = provider or LocalProcesses(spec.num_worker_tasks)
        if self.provider.max_workers != spec.num_worker_tasks:
            raise AutodistError(f"the task provider {self.provider!r} picks among "
                                f"{self.provider.max_workers} worker tasks; the cluster has "
                                f"{spec.num_worker_tasks}")
        self.members: tuple[int, ...] = tuple(range(spec.num_worker_tasks))
        self._job: JobDir | None = None
        self._config: RunConfig | None = None
        self._sequence = 0
        self._requested_members: tuple[int, ...] | None = None
        self._requested_strategy: str | None = None
        self._batch = 0
        self._num_examples: int | None = None
        self._streaming = False
        self._not_resizable: AutodistError | None = None

    def open(self, job: JobDir, config: RunConfig, *, members: tuple[int, ...], batch: int,
             num_examples: int | None, streaming: bool,
             not_resizable: AutodistError | None) -> None:
        """A fit starts: requests go to `job` until `close`.

        Args:
            job: The running job.
            config: Its config (only a followed, elastic one takes resizes).
            members: The worker tasks it starts on.
            batch: Its global batch.
            num_examples: Examples of a pass (None: a dataset).
            streaming: The workers read a dataset (the batch cannot change).
            not_resizable: Why `resize` cannot work in this run, or None.
        """
        self._job, self._config = (job, config) if config.follow_steps else (None, None)
        self.members = members
        self._requested_members = self._requested_strategy = None
        self._batch, self._num_examples, self._streaming = batch, num_examples, streaming
        self._not_resizable = not_resizable

    def close(self) -> None:
        """The fit ended: no more requests."""
        self._job = self._config = None

    def stop(self, job: JobDir) -> None:
        """Asks the chief of `job` to stop at its next step boundary (Ctrl-C)."""
        follow.request_stop(job)

    def resize(self, workers: int | Sequence[int]) -> tuple[int, ...]:
        """Asks for other workers (see `DistributedRun.resize`).

        Args:
            workers: A number n: the provider grows or shrinks the members
                last asked for to n tasks. Or the member tasks themselves
                (checked, not asked of the provider).

        Returns:
            The member tasks asked for.

        Raises:
            TaskProviderError: a grow for which the provider has fewer tasks
                available than asked for (under launch="remote", slots whose
                `autodist serve` answers); nothing is asked of the run.
            AutodistError: the run cannot resize, or bad `workers`.
        """
        self._check_elastic("resize(workers)")
        if self._not_resizable is not None:
            raise self._not_resizable
        limit = self.spec.num_worker_tasks
        current = self._requested_members or self.members
        members = members_for(current, workers, limit, "resize's workers")  # checks
        if isinstance(workers, int) and not isinstance(workers, bool):
            members = self.provider.resize(current, workers)
        self._requested_members = members
        self._send()
        return members

    def replan(self, strategy: Strategy) -> None:
        """Asks for another strategy (see `DistributedRun.replan`)."""
        self._check_elastic("replan(strategy)")
        if self._streaming and strategy.global_batch_size != self.strategy.global_batch_size:
            raise AutodistError(
                "with a dataset the global batch is the dataset's batch; a strategy switched "
                f"to must keep it (global batch {self.strategy.global_batch_size}); received "
                f"one with {strategy.global_batch_size}")
        batch = strategy.global_batch_size or self._config.global_batch_size
        changes_batch = batch != self._batch
        check_switch(self.strategy, strategy, self.graph_item, self.spec,
                     batch_change=changes_batch)
        if changes_batch:
            last = self._num_examples % batch
            smallest, why = global_batch.smallest_batch(self.graph_item, strategy)
            if strategy.global_batch_size is None or 0 < last < smallest:
                raise AutodistError(
                    f"a new global batch ({batch}) needs a strategy with virtual nodes "
                    "(strategy.with_virtual_nodes(B, V)) whose last batch of an epoch "
                    f"({self._num_examples} examples) holds at least {smallest} examples "
                    f"({why})")
        if self._not_resizable is None:
            check_elastic(strategy, self.spec)
        self._batch = batch
        self._requested_strategy = strategy.to_text()
        self._send()

    def _check_elastic(self, what: str) -> None:
        if self._config is None or not self._config.elastic:
            raise AutodistError(f"{what} works while fit(..., elastic=True, callbacks=[...]) "
                                "runs (call it from a callback)")

    def _send(self) -> None:
        self._sequence += 1
        follow.request_change(self._job, self._sequence, self._requested_members,
                              self._requested_strategy)
