"""Typed records that cross process boundaries during a run, with their JSON form.

Every message between the driver and the workers of a run is one of these,
so each side reads fields, never keys of a dict that the other side happened
to write, and a malformed message is a `RecordError` naming the field:

* `StepReport`: a non-chief worker -> the chief, per step of a followed run
  (its part of the step's loss, and its gradient norms on monitored steps).
* `ProgressRecord`: the chief -> the driver, one line of ``progress.jsonl``
  per step, carrying the step's global index.
* `RunLimit`: the chief -> the other workers: how far the run may go, and
  who runs which steps with which strategy (`elastic.Segment`).
* `WorkerResult`: each worker -> the chief -> the driver
  (``results/worker_<i>.json``): its per-step losses and times, resizes,
  monitored steps, or its probe of throughputs.
* `WorkerMessage`: what a worker sends the chief at its end, a result or
  the error it failed with.
* `LossRecord`: one worker's loss of one step, kept beside the job by
  recoverable runs.
* `ChangeRequest`: the driver -> the chief: the membership to run next
  (`DistributedRun.resize` / `replan`).
* `DatasetDescription`: the driver -> every worker, in the job: how to read
  the dataset of a `fit(dataset)` that the workers stream.
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Callable, Mapping, Sequence, TypeVar

from autodist.ir.errors import AutodistError
from autodist.runtime.elastic import Segment

_T = TypeVar("_T")
_REPR_LIMIT = 200


class RecordError(AutodistError, ValueError):
    """A record between the processes of a run is malformed (names the field)."""


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _REPR_LIMIT else text[:_REPR_LIMIT] + "..."


def _field(data: Mapping[str, Any], kind: str, name: str, check: Callable[[Any], _T],
           default: Any = dataclasses.MISSING) -> _T:
    if not isinstance(data, Mapping):
        raise RecordError(f"a {kind} must be a JSON object. Received: {_short(data)}")
    if name not in data:
        if default is dataclasses.MISSING:
            raise RecordError(f"a {kind} needs the field {name!r}. Received: {_short(data)}")
        return default
    try:
        return check(data[name])
    except (TypeError, ValueError) as e:
        raise RecordError(f"{kind} field {name!r} is malformed: {e}. Received: "
                          f"{_short(data[name])}") from None


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError("expected an integer")
    return value


def _float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError("expected a number")
    return float(value)


def _finite(value: Any) -> float:
    number = _float(value)
    if not math.isfinite(number):
        raise ValueError("expected a finite number")
    return number


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError("expected true or false")
    return value


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError("expected a string")
    return value


def _list_of(check: Callable[[Any], _T]) -> Callable[[Any], list[_T]]:
    def convert(value: Any) -> list[_T]:
        if not isinstance(value, list):
            raise TypeError("expected a list")
        return [check(v) for v in value]
    return convert


def _numbers(value: Any, depth: int = 0) -> Any:
    """A number, or a (nested) list of numbers: one metric variable's state."""
    if depth > 8:
        raise ValueError("nested too deeply")
    if isinstance(value, list):
        return [_numbers(v, depth + 1) for v in value]
    return _float(value)


def _states(value: Any) -> tuple[Any, ...]:
    if not isinstance(value, list):
        raise TypeError("expected a list of metric states")
    return tuple(_numbers(v) for v in value)


def add_states(a: Sequence[Any], b: Sequence[Any]) -> tuple[Any, ...]:
    """The element-wise sum of two metric states (per variable: a number or nested lists);
    an empty state is zero."""
    if not a:
        return tuple(b)
    if not b:
        return tuple(a)
    return tuple(_add(u, v) for u, v in zip(a, b))


def _add(u: Any, v: Any) -> Any:
    if isinstance(u, list):
        return [_add(p, q) for p, q in zip(u, v)]
    return u + v


def _optional(check: Callable[[Any], _T]) -> Callable[[Any], _T | None]:
    return lambda value: None if value is None else check(value)


def _loads(raw: bytes | str, kind: str) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise RecordError(f"a {kind} is not JSON: {e}. Received: {_short(raw)}") from None
    except RecursionError:   # what a peer sends may nest without bound
        raise RecordError(f"a {kind} is nested too deeply. Received: {_short(raw)}") from None


@dataclasses.dataclass(frozen=True)
class MonitorSample:
    """Squared gradient norms of a monitored step (one task's, or every task's merged).

    Attributes:
        batches: The batch size of each norm: each virtual node's (when a
            replica has several) and each replica's.
        sq_norms: The squared gradient norms, in the order of `batches`.
        compute_s: Per task, its local forward and backward, timed in the graph.
        communication_s: Per task, the rest of its step.
        tasks: The task index of each `compute_s` entry (empty: not recorded).
        examples: Per task, the examples its replicas computed in the step.
    """

    batches: tuple[int, ...]
    sq_norms: tuple[float, ...]
    compute_s: tuple[float, ...] = ()
    communication_s: tuple[float, ...] = ()
    tasks: tuple[int, ...] = ()
    examples: tuple[int, ...] = ()

    def examples_per_s(self) -> dict[int, float]:
        """Each task's examples over its compute time (a straggler computes slowly)."""
        if len(self.tasks) != len(self.compute_s) or len(self.examples) != len(self.tasks):
            return {}
        return {t: n / c for t, n, c in zip(self.tasks, self.examples, self.compute_s) if c > 0}

    @staticmethod
    def merge(samples: Sequence[MonitorSample]) -> MonitorSample:
        """Every task's sample of one step as one."""
        return MonitorSample(
            batches=tuple(b for s in samples for b in s.batches),
            sq_norms=tuple(n for s in samples for n in s.sq_norms),
            compute_s=tuple(c for s in samples for c in s.compute_s),
            communication_s=tuple(c for s in samples for c in s.communication_s),
            tasks=tuple(t for s in samples for t in s.tasks),
            examples=tuple(n for s in samples for n in s.examples))

    def to_dict(self) -> dict[str, Any]:
        return {"batches": list(self.batches), "sq_norms": list(self.sq_norms),
                "compute_s": list(self.compute_s), "communication_s": list(self.communication_s),
                "tasks": list(self.tasks), "examples": list(self.examples)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MonitorSample:
        kind = "monitor sample"
        sample = cls(batches=tuple(_field(data, kind, "batches", _list_of(_int))),
                     sq_norms=tuple(_field(data, kind, "sq_norms", _list_of(_float))),
                     compute_s=tuple(_field(data, kind, "compute_s", _list_of(_float), [])),
                     communication_s=tuple(_field(data, kind, "communication_s",
                                                  _list_of(_float), [])),
                     tasks=tuple(_field(data, kind, "tasks", _list_of(_int), [])),
                     examples=tuple(_field(data, kind, "examples", _list_of(_int), [])))
        if len(sample.batches) != len(sample.sq_norms):
            raise RecordError(f"a monitor sample needs one norm per batch. Received "
                              f"{len(sample.batches)} batches, {len(sample.sq_norms)} norms")
        return sample


@dataclasses.dataclass(frozen=True)
class StepReport:
    """A non-chief worker's part of one step (followed runs).

    Attributes:
        task: The worker's task index.
        step: The step's global index (over the whole run, from 0).
        loss: The worker's weighted loss: the global loss is the sum over workers.
        monitor: Its gradient norms on a monitored step, else None.
        metrics: Its contribution to every metric variable's state in the
            step (in the capture's order; empty without metrics).
    """

    task: int
    step: int
    loss: float
    monitor: MonitorSample | None = None
    metrics: tuple[Any, ...] = ()

    def to_json(self) -> bytes:
        return json.dumps({"task": self.task, "step": self.step, "loss": self.loss,
                           "monitor": None if self.monitor is None
                           else self.monitor.to_dict(),
                           "metrics": list(self.metrics)}).encode()

    @classmethod
    def from_json(cls, raw: bytes | str) -> StepReport:
        data, kind = _loads(raw, "step report"), "step report"
        return cls(task=_field(data, kind, "task", _int), step=_field(data, kind, "step", _int),
                   loss=_field(data, kind, "loss", _float),
                   monitor=_field(data, kind, "monitor",
                                  _optional(MonitorSample.from_dict), None),
                   metrics=_field(data, kind, "metrics", _states, ()))


@dataclasses.dataclass(frozen=True)
class ProgressRecord:
    """One step as the driver sees it (a line of ``progress.jsonl``).

    Attributes:
        step: The step's global index over the whole run (from 0), whatever
            the epochs' lengths.
        epoch: Its epoch.
        epoch_step: Its index within the epoch.
        loss: The step's global loss; with `estimate`, the chief's estimate
            (its replicas' mean loss), as in a run nobody follows.
        seconds: The chief's time of the step.
        examples: Examples in the step's global batch.
        last_of_epoch: The epoch's last step.
        workers: Workers that ran it.
        plan: The strategy that ran it (0: the run's; k: the k-th switched to).
        monitor: Every worker's gradient norms on a monitored step, else None.
        estimate: `loss` (and `metrics`) are the chief's estimate, not the sum
            of every worker's.
        metrics: The step's contribution to every metric variable's state
            (summed over workers; empty without metrics).
    """

    step: int
    epoch: int
    epoch_step: int
    loss: float
    seconds: float
    examples: int
    last_of_epoch: bool
    workers: int
    plan: int = 0
    monitor: MonitorSample | None = None
    estimate: bool = False
    metrics: tuple[Any, ...] = ()

    def to_json(self) -> str:
        """One line of JSON, newline included."""
        data = dataclasses.asdict(self)
        data["monitor"] = None if self.monitor is None else self.monitor.to_dict()
        data["metrics"] = list(self.metrics)
        return json.dumps(data) + "\n"

    @classmethod
    def from_json(cls, raw: bytes | str) -> ProgressRecord:
        data, kind = _loads(raw, "progress record"), "progress record"
        return cls(step=_field(data, kind, "step", _int),
                   epoch=_field(data, kind, "epoch", _int),
                   epoch_step=_field(data, kind, "epoch_step", _int),
                   loss=_field(data, kind, "loss", _float),
                   seconds=_field(data, kind, "seconds", _float),
                   examples=_field(data, kind, "examples", _int),
                   last_of_epoch=_field(data, kind, "last_of_epoch", _bool),
                   workers=_field(data, kind, "workers", _int),
                   plan=_field(data, kind, "plan", _int, 0),
                   monitor=_field(data, kind, "monitor", _optional(MonitorSample.from_dict),
                                  None),
                   estimate=_field(data, kind, "estimate", _bool, False),
                   metrics=_field(data, kind, "metrics", _states, ()))


def _segment(value: Any) -> Segment:
    if not isinstance(value, list) or len(value) != 5:
        raise TypeError("expected [version, start, end, members, plan]")
    version, start, end, plan = (_int(v) for v in value[:3] + value[4:])
    return Segment(version, start, end, _members(value[3]), plan)


def _members(value: Any) -> tuple[int, ...]:
    members = tuple(_list_of(_int)(value))
    if not members or list(members) != sorted(set(members)) or members[0] != 0:
        raise TypeError("expected sorted distinct worker tasks starting with 0")
    return members


@dataclasses.dataclass(frozen=True)
class RunLimit:
    """The chief's word on how far the run goes (followed runs).

    Attributes:
        limit: Workers may start step i (a global index) only while i < limit.
        final: The limit is the run's end (else: an epoch's end, extended
            after the driver's decision).
        segments: Who runs which steps, with which strategy.
        plans: The strategies switched to, as text (plan k is plans[k-1]).
    """

    limit: int
    final: bool
    segments: tuple[Segment, ...] = ()
    plans: tuple[str, ...] = ()
    learning_rates: tuple[tuple[int, float], ...] = ()
    state_changes: tuple[tuple[int, dict[str, Any]], ...] = ()

    def to_json(self) -> bytes:
        return json.dumps({"limit": self.limit, "final": self.final,
                           "segments": [[s.version, s.start, s.end, list(s.members), s.plan]
                                        for s in self.segments],
                           "plans": list(self.plans),
                           "learning_rates": [[s, r] for s, r in self.learning_rates],
                           "state_changes": [[s, v] for s, v in self.state_changes]}).encode()

    @classmethod
    def from_json(cls, raw: bytes | str) -> RunLimit:
        data, kind = _loads(raw, "run limit"), "run limit"
        return cls(limit=_field(data, kind, "limit", _int),
                   final=_field(data, kind, "final", _bool),
                   segments=tuple(_field(data, kind, "segments", _list_of(_segment), [])),
                   plans=tuple(_field(data, kind, "plans", _list_of(_str), [])),
                   learning_rates=tuple(_field(data, kind, "learning_rates",
                                               _list_of(_rate_change), [])),
                   state_changes=tuple(_field(data, kind, "state_changes",
                                              _list_of(_state_change), [])))


def _state_values(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise TypeError("expected an object of state variable -> value")
    return {k: _numbers(v) for k, v in value.items()}


def _state_change(value: Any) -> tuple[int, dict[str, Any]]:
    if not isinstance(value, list) or len(value) != 2:
        raise TypeError("expected [first step, state values]")
    return _int(value[0]), _state_values(value[1])


def _rate_change(value: Any) -> tuple[int, float]:
    if not isinstance(value, list) or len(value) != 2:
        raise TypeError("expected [first step, learning rate]")
    return _int(value[0]), _finite(value[1])


@dataclasses.dataclass(frozen=True)
class EpochDecision:
    """The driver's word at an epoch's end (followed runs): stop, or go on (with the
    learning rate a callback set for the next epoch, None: unchanged, and the state
    variables validation or a callback changed, by name)."""

    stop: bool
    learning_rate: float | None = None
    state: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_json(self) -> bytes:
        return json.dumps({"stop": self.stop, "learning_rate": self.learning_rate,
                           "state": self.state}).encode()

    @classmethod
    def from_json(cls, raw: bytes | str) -> EpochDecision:
        data, kind = _loads(raw, "epoch decision"), "epoch decision"
        return cls(stop=_field(data, kind, "stop", _bool),
                   learning_rate=_field(data, kind, "learning_rate", _optional(_finite), None),
                   state=_field(data, kind, "state", _state_values, {}))


@dataclasses.dataclass(frozen=True)
class ResizeEvent:
    """A membership change as the chief saw it.

    Attributes:
        step: First step of the new membership.
        workers: Its size.
        plan: Its strategy (0: the run's, k: the k-th switched to).
        seconds: The chief's time from the end of the previous step to the
            start of this one (state hand-over, new program and session).
        members: Its worker tasks.
    """

    step: int
    workers: int
    plan: int
    seconds: float
    members: tuple[int, ...] = ()

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ResizeEvent:
        kind = "resize event"
        return cls(step=_field(data, kind, "step", _int),
                   workers=_field(data, kind, "workers", _int),
                   plan=_field(data, kind, "plan", _int, 0),
                   seconds=_field(data, kind, "seconds", _float),
                   members=tuple(_field(data, kind, "members", _list_of(_int), [])))


@dataclasses.dataclass(frozen=True)
class MonitoredStep:
    """One task's gradient norms of one monitored step."""

    step: int
    sample: MonitorSample

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, **self.sample.to_dict()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MonitoredStep:
        return cls(step=_field(data, "monitored step", "step", _int),
                   sample=MonitorSample.from_dict(data))


@dataclasses.dataclass(frozen=True)
class Probe:
    """A replica's measured forward and backward passes (`measure_throughput`)."""

    examples: int
    seconds: tuple[float, ...]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Probe:
        return cls(examples=_field(data, "probe", "examples", _int),
                   seconds=tuple(_field(data, "probe", "seconds", _list_of(_finite))))


def _probes(value: Any) -> dict[str, Probe]:
    if not isinstance(value, dict):
        raise TypeError("expected an object of device -> probe")
    return {_str(k): Probe.from_dict(v) for k, v in value.items()}


@dataclasses.dataclass(frozen=True)
class WorkerResult:
    """What one worker did over the run.

    Attributes:
        losses: Its weighted loss of each step it ran (0.0 while idle).
        step_times: Its time of each step.
        steps_per_epoch: Steps of the first epoch.
        epoch_starts: The global index of each epoch's first step (and the
            run's end); epochs may differ in length after a batch change.
        step_examples: Examples in each step's global batch.
        max_lead: Asynchronous runs: the most steps it started ahead of the slowest.
        resizes: The chief's: every membership change.
        monitor: Its gradient norms of every monitored step.
        probe: `measure_throughput` runs: replica device -> its probe.
        epoch_metrics: Per epoch it ran, its contribution to every metric
            variable's state over the epoch (empty without metrics).
    """

    losses: tuple[float, ...] = ()
    step_times: tuple[float, ...] = ()
    steps_per_epoch: int = 0
    epoch_starts: tuple[int, ...] = ()
    step_examples: tuple[int, ...] = ()
    max_lead: int = 0
    resizes: tuple[ResizeEvent, ...] = ()
    monitor: tuple[MonitoredStep, ...] = ()
    probe: dict[str, Probe] = dataclasses.field(default_factory=dict)
    epoch_metrics: tuple[tuple[Any, ...], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"losses": list(self.losses), "step_times": list(self.step_times),
                "steps_per_epoch": self.steps_per_epoch,
                "epoch_starts": list(self.epoch_starts),
                "step_examples": list(self.step_examples), "max_lead": self.max_lead,
                "resizes": [dataclasses.asdict(r) for r in self.resizes],
                "monitor": [m.to_dict() for m in self.monitor],
                "probe": {d: {"examples": p.examples, "seconds": list(p.seconds)}
                          for d, p in self.probe.items()},
                "epoch_metrics": [list(e) for e in self.epoch_metrics]}

    def to_json(self) -> bytes:
        return json.dumps(self.to_dict()).encode()

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> WorkerResult:
        kind = "worker result"
        return cls(losses=tuple(_field(data, kind, "losses", _list_of(_float))),
                   step_times=tuple(_field(data, kind, "step_times", _list_of(_float))),
                   steps_per_epoch=_field(data, kind, "steps_per_epoch", _int),
                   epoch_starts=tuple(_field(data, kind, "epoch_starts", _list_of(_int), [])),
                   step_examples=tuple(_field(data, kind, "step_examples", _list_of(_int),
                                              [])),
                   max_lead=_field(data, kind, "max_lead", _int, 0),
                   resizes=tuple(ResizeEvent.from_dict(r) for r in
                                 _field(data, kind, "resizes", _list_of(dict), [])),
                   monitor=tuple(MonitoredStep.from_dict(m) for m in
                                 _field(data, kind, "monitor", _list_of(dict), [])),
                   probe=_field(data, kind, "probe", _probes, {}),
                   epoch_metrics=tuple(_field(data, kind, "epoch_metrics",
                                              _list_of(_states), [])))

    @classmethod
    def from_json(cls, raw: bytes | str) -> WorkerResult:
        return cls.from_dict(_loads(raw, "worker result"))


@dataclasses.dataclass(frozen=True)
class WorkerMessage:
    """A worker's last word to the chief: its result, or why it failed."""

    task: int
    result: WorkerResult | None = None
    error: str | None = None

    def to_json(self) -> bytes:
        data: dict[str, Any] = {"task": self.task}
        if self.result is not None:
            data["result"] = self.result.to_dict()
        if self.error is not None:
            data["error"] = self.error
        return json.dumps(data).encode()

    @classmethod
    def from_json(cls, raw: bytes | str) -> WorkerMessage:
        data, kind = _loads(raw, "worker message"), "worker message"
        return cls(task=_field(data, kind, "task", _int),
                   result=_field(data, kind, "result", _optional(WorkerResult.from_dict), None),
                   error=_field(data, kind, "error", _optional(_str), None))


@dataclasses.dataclass(frozen=True)
class LossRecord:
    """One worker's weighted loss of one step (recoverable runs keep these beside the job)."""

    step: int
    loss: float

    def to_json(self) -> str:
        """One line of JSON, newline included."""
        return json.dumps({"step": self.step, "loss": self.loss}) + "\n"

    @classmethod
    def from_json(cls, raw: bytes | str) -> LossRecord:
        data, kind = _loads(raw, "loss record"), "loss record"
        return cls(step=_field(data, kind, "step", _int), loss=_field(data, kind, "loss", _float))


@dataclasses.dataclass(frozen=True)
class ChangeRequest:
    """The driver's latest request for a membership: member tasks, a strategy, or both.

    The request holds the whole target (None: unchanged), so a later request
    never loses an earlier one the chief has not read yet.

    Attributes:
        sequence: Increases with every request of the fit.
        members: The member worker tasks (sorted, with 0), or None.
        strategy: The strategy to switch to, as text, or None.
    """

    sequence: int
    members: tuple[int, ...] | None = None
    strategy: str | None = None

    def to_json(self) -> bytes:
        members = None if self.members is None else list(self.members)
        return json.dumps({"sequence": self.sequence, "members": members,
                           "strategy": self.strategy}).encode()

    @classmethod
    def from_json(cls, raw: bytes | str) -> ChangeRequest:
        data, kind = _loads(raw, "change request"), "change request"
        return cls(sequence=_field(data, kind, "sequence", _int),
                   members=_field(data, kind, "members", _optional(_members), None),
                   strategy=_field(data, kind, "strategy", _optional(_str), None))


def _shape(value: Any) -> tuple[int | None, ...]:
    if not isinstance(value, list):
        raise TypeError("expected a list of dimensions")
    return tuple(None if d is None else _int(d) for d in value)


@dataclasses.dataclass(frozen=True)
class DatasetDescription:
    """How a worker reads the dataset of a `fit(dataset)` (its graph is beside it).

    Each element of the dataset, as the job holds it, is one global batch as
    a flat tuple: the model inputs in the GraphItem's order, then the
    targets, then the per-example weights when `weighted`.

    Attributes:
        dtypes: Each component's dtype name.
        shapes: Each component's static shape (None: unknown dimension).
        num_inputs: Model inputs among the components.
        num_targets: Targets after them.
        weighted: The last component holds the per-example weights.
        batches: Batches in one pass over the dataset (None: infinite).
        cardinality_known: Whether the dataset's cardinality says so (else
            the driver counted them), which changes how Keras reads it.
        passes_before: Passes started on the dataset before this fit (each
            drew its shuffles' seeds: the run's earlier fits, an `adapt` on
            it, found in the driver): the workers start as many unread.
        epoch_lengths: The steps of each epoch, read in turn from one pass,
            when the dataset's elements are already the run's batches in order
            (a generator or PyDataset read in the driver); None: the epochs
            Keras' reading of the dataset gives (`batching.dataset_epochs`).
        runs_out: With `epoch_lengths`, whether Keras' step after the last epoch
            finds the input's end (a generator read to its end).
        end_step: Whether Keras' fit runs a step that finds the data's end
            (with `steps_per_execution` > 1 it runs none there): where not, no
            epoch runs out (`autodist.runtime.run_outs`).
    """

    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int | None, ...], ...]
    num_inputs: int
    num_targets: int
    weighted: bool
    batches: int | None
    cardinality_known: bool
    passes_before: int = 0
    epoch_lengths: tuple[int, ...] | None = None
    runs_out: bool = False
    end_step: bool = True

    def to_json(self) -> bytes:
        return json.dumps({"dtypes": list(self.dtypes),
                           "shapes": [list(s) for s in self.shapes],
                           "num_inputs": self.num_inputs, "num_targets": self.num_targets,
                           "weighted": self.weighted, "batches": self.batches,
                           "cardinality_known": self.cardinality_known,
                           "passes_before": self.passes_before,
                           "epoch_lengths": None if self.epoch_lengths is None
                           else list(self.epoch_lengths),
                           "runs_out": self.runs_out, "end_step": self.end_step}).encode()

    @classmethod
    def from_json(cls, raw: bytes | str) -> DatasetDescription:
        data, kind = _loads(raw, "dataset description"), "dataset description"
        description = cls(
            dtypes=tuple(_field(data, kind, "dtypes", _list_of(_str))),
            shapes=tuple(_field(data, kind, "shapes", _list_of(_shape))),
            num_inputs=_field(data, kind, "num_inputs", _int),
            num_targets=_field(data, kind, "num_targets", _int),
            weighted=_field(data, kind, "weighted", _bool),
            batches=_field(data, kind, "batches", _optional(_int)),
            cardinality_known=_field(data, kind, "cardinality_known", _bool),
            passes_before=_field(data, kind, "passes_before", _int, 0),
            epoch_lengths=_field(data, kind, "epoch_lengths",
                                 _optional(lambda v: tuple(_list_of(_int)(v))), None),
            runs_out=_field(data, kind, "runs_out", _bool, False),
            end_step=_field(data, kind, "end_step", _bool, True))
        components = description.num_inputs + description.num_targets + description.weighted
        if len(description.dtypes) != components or len(description.shapes) != components:
            raise RecordError(f"a {kind} needs {components} dtypes and shapes (inputs, "
                              f"targets, weights). Received: {_short(data)}")
        return description
