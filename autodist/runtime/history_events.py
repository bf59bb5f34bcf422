"""What happened during a run, as typed entries of `History`.

`History.resizes`, `noise_scale`, `actions` and `recoveries` hold these
frozen dataclasses. Read them by attribute (`history.resizes[0].step`). They
were dicts before; reading one by key (`entry["step"]`) still works, with a
`DeprecationWarning`, and `to_dict()` gives the old form.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Iterator, Mapping

from autodist.ir.errors import UnknownFieldError


class _ReadableByKey:
    """Dict-style reading of a dataclass entry (deprecated: read attributes)."""

    def to_dict(self) -> dict[str, Any]:
        """The entry as the dict History held before it was typed."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) is not None}

    def __getitem__(self, key: str) -> Any:
        warnings.warn(f"History entries are typed: read {type(self).__name__}.{key} instead of "
                      f"[{key!r}]", DeprecationWarning, stacklevel=2)
        values = self.to_dict()
        if key not in values:
            raise UnknownFieldError(f"{type(self).__name__} has no field {key!r}; it has "
                                    f"{sorted(values)}")
        return values[key]

    def get(self, key: str, default: Any = None) -> Any:
        """As `dict.get` (deprecated: read attributes)."""
        try:
            return self[key]
        except KeyError:
            return default

    def __contains__(self, key: object) -> bool:
        return key in self.to_dict()

    def keys(self) -> Iterator[str]:
        """As `dict.keys` (deprecated: read attributes)."""
        return iter(self.to_dict())

    def items(self) -> Iterator[tuple[str, Any]]:
        """As `dict.items` (deprecated: read attributes, or `to_dict()`)."""
        warnings.warn(f"History entries are typed: use {type(self).__name__}.to_dict().items()",
                      DeprecationWarning, stacklevel=2)
        return iter(self.to_dict().items())


@dataclasses.dataclass(frozen=True)
class Resize(_ReadableByKey):
    """A membership change or strategy switch of an elastic run.

    Attributes:
        step: The first step of the new membership.
        workers: Its number of worker tasks.
        plan: Its strategy (0: the run's, k: the k-th switched to).
        seconds: The chief's time from the end of the previous step to the
            start of that step (state hand-over, new program and session).
        members: Its worker tasks.
    """

    step: int
    workers: int
    plan: int
    seconds: float
    members: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class NoiseScale(_ReadableByKey):
    """The gradient noise scale measured at one monitored step (`monitor_every`).

    Attributes:
        step: The step.
        gradient_sq: |G|², the squared norm of the true gradient (estimated).
        trace_sigma: tr Σ, the per-example gradient variance.
        noise_scale: Their ratio, the simple noise scale.
        smoothed: The ratio of their moving averages (decay 0.9).
        compute_s: The slowest task's local forward and backward (timed in
            the graph), where measured.
        communication_s: The rest of the chief's step time, where measured.
    """

    step: int
    gradient_sq: float
    trace_sigma: float
    noise_scale: float
    smoothed: float
    compute_s: float | None = None
    communication_s: float | None = None


@dataclasses.dataclass(frozen=True)
class PolicyAction(_ReadableByKey):
    """An action a policy asked for.

    Attributes:
        step: The last step the driver had seen.
        action: "resize", "replan", "stop", ... (the policy's word).
        details: The action's details and reason (e.g. "workers",
            "members", "changed", "reason").
    """

    step: int
    action: str
    details: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_dict(cls, entry: Mapping[str, Any]) -> PolicyAction:
        """The typed form of a `Control.actions` entry."""
        details = {k: v for k, v in entry.items() if k not in ("step", "action")}
        return cls(int(entry["step"]), str(entry["action"]), details)

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "action": self.action, **self.details}


@dataclasses.dataclass(frozen=True)
class Recovery(_ReadableByKey):
    """A task's failure the run went on from (`on_failure="continue"`).

    Attributes:
        step: The step the job resumed at.
        failed_task: The dead task's index at that time (of `failed_job`).
        cause: The first line of the failure.
        workers: Workers after it.
        estimated_loss_steps: Steps whose global loss is the chief's estimate
            (its replicas' mean loss), because the dead worker completed them
            but died before recording its loss.
        failed_job: The dead task's job: "worker", or "ps" (a remote run's
            parameter server restarted, the run went on from a checkpoint).
    """

    step: int
    failed_task: int
    cause: str
    workers: int
    estimated_loss_steps: tuple[int, ...] = ()
    failed_job: str = "worker"

    @classmethod
    def from_dict(cls, entry: Mapping[str, Any]) -> Recovery:
        """The typed form of a `recovery.Outcome.recoveries` entry."""
        return cls(int(entry["step"]), int(entry["failed_task"]), str(entry.get("cause", "")),
                   int(entry["workers"]), tuple(entry.get("estimated_loss_steps") or ()),
                   str(entry.get("failed_job", "worker")))
