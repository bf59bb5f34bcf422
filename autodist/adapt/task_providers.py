"""Where an elastic run's worker tasks come from: the autoscaler's task providers.

The autoscaler (`autodist.adapt.autoscaler`) decides how many workers a run
should have; a `TaskProvider` decides which worker tasks of the cluster's
declared slots those are: which ones a grow acquires and which ones a shrink
releases. TensorFlow 2.21 cannot grow a job past the slots its ClusterSpec
declares (`docs/tf_elastic_notes.md`), so a provider only ever picks among
them; the chief (worker task 0) holds the run's state and is never released.

* `LocalProcesses`: every slot has a process (a local cluster starts them
  all): a grow takes the lowest-numbered idle tasks, a shrink drops the
  highest-numbered members (as `DistributedRun.resize(n)` does).
* `ServedHosts`: a pool of TF_CONFIG slots, each served (or not yet) by an
  `autodist serve --tf-config` on its host: a grow takes only idle slots
  whose `autodist serve` answers, so it may land on a host that had nothing
  of the job before; a shrink releases the members that joined last first.

A run's `resize(n)` (`DistributedRun.resize`, and so every policy's and the
autoscaler's resize, which go through it) asks its provider
(`DistributedRun(..., task_provider=...)`; default `ServedHosts.from_spec`
under launch="remote", `LocalProcesses` otherwise); a resize to a list of
tasks names them itself. Nothing here starts a process: `ServedHosts` only
asks whether something accepts connections at a slot's address.
"""
from __future__ import annotations

import abc
from typing import Callable, Sequence

from autodist.ir.addresses import accepts
from autodist.ir.errors import AutodistError
from autodist.ir.resource_spec import ResourceSpec


class TaskProviderError(AutodistError, ValueError):
    """A provider cannot give the tasks asked for."""


class TaskProvider(abc.ABC):
    """Picks the worker tasks of an elastic run as it grows and shrinks.

    Args:
        max_workers: The worker slots the cluster declares (task 0, the
            chief, always among the members).
    """

    def __init__(self, max_workers: int) -> None:
        if not isinstance(max_workers, int) or isinstance(max_workers, bool) or \
                max_workers < 1:
            raise TaskProviderError(f"max_workers must be an integer >= 1. Received: "
                                    f"{max_workers!r}")
        self.max_workers = max_workers

    @abc.abstractmethod
    def available(self, members: Sequence[int]) -> list[int]:
        """The idle worker tasks that could join `members` now, the preferred first."""

    def releasable(self, members: Sequence[int]) -> list[int]:
        """The members a shrink releases first, in order (never the chief): by default
        the highest-numbered first."""
        return sorted((t for t in members if t != 0), reverse=True)

    def acquire(self, members: Sequence[int], count: int) -> tuple[int, ...]:
        """`members` with `count` more tasks (the first `available` ones), sorted.

        Raises:
            TaskProviderError: fewer than `count` tasks are available; it names
                how many are.
        """
        idle = self.available(self._checked(members))
        if count > len(idle):
            raise TaskProviderError(
                f"{type(self).__name__} has {len(idle)} worker tasks available "
                f"({idle}) to add to {sorted(members)}; {count} were asked for"
                f"{self._unavailable(members, idle)}")
        return tuple(sorted(set(members) | set(idle[:count])))

    def _unavailable(self, members: Sequence[int], idle: Sequence[int]) -> str:
        """Why the other tasks outside `members` are not available (for an error), or ""."""
        return ""

    def release(self, members: Sequence[int], count: int) -> tuple[int, ...]:
        """`members` without `count` of them (the first `releasable` ones), sorted.

        Raises:
            TaskProviderError: that would release the chief.
        """
        leaving = self.releasable(self._checked(members))
        if count > len(leaving):
            raise TaskProviderError(f"cannot release {count} of the members {sorted(members)}: "
                                    "the chief (worker task 0) holds the run's state")
        return tuple(sorted(set(members) - set(leaving[:count])))

    def resize(self, members: Sequence[int], workers: int) -> tuple[int, ...]:
        """`members` grown or shrunk to `workers` tasks.

        Raises:
            TaskProviderError: `workers` outside 1..max_workers, or not enough
                tasks available to grow.
        """
        if not isinstance(workers, int) or isinstance(workers, bool) or \
                not 1 <= workers <= self.max_workers:
            raise TaskProviderError(f"workers must be a number in 1..{self.max_workers} (the "
                                    f"cluster's worker slots). Received: {workers!r}")
        current = self._checked(members)
        if workers >= len(current):
            return self.acquire(current, workers - len(current))
        return self.release(current, len(current) - workers)

    def _checked(self, members: Sequence[int]) -> tuple[int, ...]:
        members = tuple(sorted(members))
        if 0 not in members or len(set(members)) != len(members) or \
                any(not 0 <= t < self.max_workers for t in members):
            raise TaskProviderError(f"members must be distinct worker tasks in "
                                    f"0..{self.max_workers - 1} with the chief (0). Received: "
                                    f"{list(members)}")
        return members


class LocalProcesses(TaskProvider):
    """Every worker slot has a process: a grow takes the lowest-numbered idle tasks (as
    `elastic.resized`)."""

    def available(self, members: Sequence[int]) -> list[int]:
        return [t for t in range(self.max_workers) if t not in members]

    def __repr__(self) -> str:
        return f"LocalProcesses(max_workers={self.max_workers})"


class ServedHosts(TaskProvider):
    """A pool of TF_CONFIG worker slots, each served by `autodist serve --tf-config` on
    its host, or not yet: a grow takes only idle slots whose serve answers (the
    lowest-numbered first), so a slot served after launch can join; a shrink releases
    the members that joined last first.

    Args:
        addresses: "host:port" of each worker slot, by task index (worker 0:
            the chief's).
        is_served: Whether a slot's `autodist serve` answers at an address
            (default `accepts`: it accepts connections).
    """

    def __init__(self, addresses: Sequence[str],
                 is_served: Callable[[str], bool] = accepts) -> None:
        super().__init__(len(addresses))
        self.addresses = list(addresses)
        self.is_served = is_served
        self._joined: list[int] = []   # in the order they were acquired

    @classmethod
    def from_spec(cls, spec: ResourceSpec, is_served: Callable[[str], bool] = accepts,
                  ) -> ServedHosts:
        """The worker slots of `spec` (e.g. `ResourceSpec.from_tf_config()`)."""
        return cls(list(spec.cluster_def().get("worker", [])), is_served)

    def available(self, members: Sequence[int]) -> list[int]:
        return [t for t in range(self.max_workers)
                if t not in members and self.is_served(self.addresses[t])]

    def acquire(self, members: Sequence[int], count: int) -> tuple[int, ...]:
        grown = super().acquire(members, count)
        self._joined += [t for t in grown if t not in members]
        return grown

    def _unavailable(self, members: Sequence[int], idle: Sequence[int]) -> str:
        unserved = [t for t in range(self.max_workers) if t not in members and t not in idle]
        if not unserved:
            return ""
        return ("; nothing answers at the slots of worker tasks " +
                ", ".join(f"{t} ({self.addresses[t]})" for t in unserved) +
                " (start `autodist serve --tf-config` there to let the run grow onto them)")

    def releasable(self, members: Sequence[int]) -> list[int]:
        joined = [t for t in reversed(self._joined) if t in members]
        return joined + [t for t in super().releasable(members) if t not in joined]

    def release(self, members: Sequence[int], count: int) -> tuple[int, ...]:
        shrunk = super().release(members, count)
        self._joined = [t for t in self._joined if t in shrunk]
        return shrunk

    def __repr__(self) -> str:
        return f"ServedHosts({self.addresses!r})"
