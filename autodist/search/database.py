"""The trial database: append-only, crash-safe records of strategy trials.

One file in JSON Lines. Each line holds one `TrialRecord` with the schema
version and a CRC32 of its canonical JSON, so a line torn by a crash or
corrupted on disk is detected and skipped (and reported), never mistaken for
a trial. The checksum is verified on the line's bytes before anything in it
is parsed or believed (its schema included), so one damaged line never makes
the file unreadable. A failed trial is a record with its `error`, never a crash.

An append is one `os.write` of the complete line on an `O_APPEND` descriptor
under an exclusive `flock`, followed by `fsync`: concurrent writers (threads
or processes) never interleave, and a writer killed mid-append leaves at most
one torn line, which later appends step over by starting on a fresh line.

`Database.in_memory()` (or `Database()`) keeps the same lines in memory
instead, for tests and short searches that need no file.

Example:
    >>> db = Database("trials.jsonl")                               # doctest: +SKIP
    >>> db.append(TrialRecord.from_trial(gi, spec, strategy,
    ...                                  step_times_s=[0.12, 0.11]))  # doctest: +SKIP
    >>> contents = db.read(); contents.records, contents.skipped    # doctest: +SKIP
"""
from __future__ import annotations

import base64
import binascii
import dataclasses
import fcntl
import json
import logging
import math
import os
import re
import pathlib
import statistics
import threading
import time
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

from autodist.ir.errors import AutodistError, short_repr, shorten
from autodist.ir.graph_item import GraphItem
from autodist.ir.resource_spec import ResourceSpec
from autodist.ir.strategy import Strategy
from autodist.proto import strategy_pb2

# Version of the line format; a reader refuses lines of a newer version.
DATABASE_SCHEMA_VERSION = 1

_FIELDS_OF_LINE = ("schema", "crc32", "record")
# A line as `encode_line` writes it: '{"crc32":"<8 hex>",' + the checksummed
# canonical JSON of {"record", "schema"} without its opening brace.
_LINE_HEAD = re.compile(rb'\{"crc32":"([0-9a-f]{8})",')

logger = logging.getLogger(__name__)


class DatabaseError(AutodistError, ValueError):
    """A trial record is malformed, or the database file cannot be used."""


class DatabaseSchemaError(DatabaseError):
    """The database file was written by a newer autodist (a newer line schema)."""


def workload_key(graph_item_fingerprint: str, resource_spec_fingerprint: str) -> str:
    """The workload a trial belongs to: one model on one cluster.

    Args:
        graph_item_fingerprint: `GraphItem.fingerprint` of the model's step.
        resource_spec_fingerprint: `ResourceSpec.fingerprint` of the cluster.

    Returns:
        "<graph item fingerprint>:<resource spec fingerprint>".
    """
    for name, value in (("graph_item_fingerprint", graph_item_fingerprint),
                        ("resource_spec_fingerprint", resource_spec_fingerprint)):
        if not isinstance(value, str) or not value or ":" in value:
            raise DatabaseError(f"{name} must be a non-empty string without ':'. "
                                f"Received: {value!r}")
    return f"{graph_item_fingerprint}:{resource_spec_fingerprint}"


def summarize_graph_item(graph_item: GraphItem) -> dict[str, float]:
    """Numeric facts about a GraphItem, for `TrialRecord.graph_summary`.

    Returns:
        num_variables, num_sparse_variables, num_parameters,
        total_variable_bytes, sparse_variable_bytes, num_ops, total_flops.
    """
    variables = graph_item.variables
    sparse = [v for v in variables if v.sparse_gradient]
    return {
        "num_variables": float(len(variables)),
        "num_sparse_variables": float(len(sparse)),
        "num_parameters": float(graph_item.num_parameters),
        "total_variable_bytes": float(graph_item.total_variable_bytes),
        "sparse_variable_bytes": float(sum(v.byte_size for v in sparse)),
        "num_ops": float(len(graph_item.ops)),
        "total_flops": float(graph_item.total_flops),
    }


# --------------------------------------------------------------------- record
@dataclasses.dataclass(frozen=True)
class TrialRecord:
    """One trial of one strategy on one workload: measured, predicted or failed.

    Values are normalised on construction (numbers to float, step times to a
    tuple) and checked; a bad value raises `DatabaseError` naming the field.
    `extra` must be JSON-able; it is stored as JSON, so tuples in it read back
    as lists.
    """

    # "<graph item fingerprint>:<resource spec fingerprint>" (see `workload_key`).
    workload: str
    # `GraphItem.fingerprint` of the model's training step.
    graph_item_fingerprint: str
    # `ResourceSpec.fingerprint` of the cluster.
    resource_spec_fingerprint: str
    # Human name of the model, e.g. "ncf"; groups workloads across clusters.
    model_name: str
    # Numeric facts about the GraphItem (see `summarize_graph_item`).
    graph_summary: dict[str, float]
    # The cluster in text form (`ResourceSpec.to_text()`).
    resource_spec: str
    # The serialized `strategy_pb2.Strategy` (may be empty if building it failed).
    strategy: bytes
    # Feature vector of the strategy, by feature name (may be empty).
    features: dict[str, float] = dataclasses.field(default_factory=dict)
    # Measured step times in seconds (empty when not measured or failed).
    step_times_s: tuple[float, ...] = ()
    # Why the trial failed, or None.
    error: str | None = None
    # What proposed the strategy: a builder's name, "search", "user", ...
    origin: str = ""
    # The cost model's prediction for this strategy, if any.
    predicted_step_time_s: float | None = None
    # Unix time the record was made.
    created_at: float = dataclasses.field(default_factory=time.time)
    # Anything else, JSON-able (e.g. per-step logs, host names).
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("graph_item_fingerprint", "resource_spec_fingerprint", "workload"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise DatabaseError(f"TrialRecord.{name} must be a non-empty string. "
                                    f"Received: {short_repr(getattr(self, name))}")
        expected = workload_key(self.graph_item_fingerprint, self.resource_spec_fingerprint)
        if self.workload != expected:
            raise DatabaseError(f"TrialRecord.workload must be {short_repr(expected)} "
                                f"(workload_key of the two fingerprints). "
                                f"Received: {short_repr(self.workload)}")
        for name in ("model_name", "resource_spec", "origin"):
            if not isinstance(getattr(self, name), str):
                raise DatabaseError(f"TrialRecord.{name} must be a string. "
                                    f"Received: {short_repr(getattr(self, name))}")
        if not isinstance(self.strategy, (bytes, bytearray)):
            raise DatabaseError("TrialRecord.strategy must be the serialized Strategy "
                                f"(bytes). Received: {type(self.strategy).__name__}")
        object.__setattr__(self, "strategy", bytes(self.strategy))
        object.__setattr__(self, "graph_summary", _numeric_dict(self.graph_summary,
                                                                "graph_summary"))
        object.__setattr__(self, "features", _numeric_dict(self.features, "features"))
        object.__setattr__(self, "step_times_s", _step_times(self.step_times_s))
        if self.error is not None and not isinstance(self.error, str):
            raise DatabaseError(f"TrialRecord.error must be a string or None. "
                                f"Received: {short_repr(self.error)}")
        if self.predicted_step_time_s is not None:
            object.__setattr__(self, "predicted_step_time_s",
                               _finite(self.predicted_step_time_s, "predicted_step_time_s"))
        object.__setattr__(self, "created_at", _finite(self.created_at, "created_at"))
        if not isinstance(self.extra, Mapping):
            raise DatabaseError(f"TrialRecord.extra must be a dict. "
                                f"Received: {short_repr(self.extra)}")
        try:
            json.dumps(self.extra, allow_nan=False)
        except (TypeError, ValueError, RecursionError) as e:
            why = "nested too deeply" if isinstance(e, RecursionError) else shorten(str(e), 500)
            raise DatabaseError(f"TrialRecord.extra must be JSON-able (finite numbers, "
                                f"strings, lists, dicts): {why}") from e
        object.__setattr__(self, "extra", dict(self.extra))

    @classmethod
    def from_trial(cls, graph_item: GraphItem, resource_spec: ResourceSpec,
                   strategy: Strategy | strategy_pb2.Strategy | bytes | None, *,
                   model_name: str = "", step_times_s: Sequence[float] = (),
                   error: str | None = None, origin: str | None = None,
                   features: Mapping[str, float] | None = None,
                   predicted_step_time_s: float | None = None,
                   graph_summary: Mapping[str, float] | None = None,
                   extra: Mapping[str, Any] | None = None) -> TrialRecord:
        """Makes a record from the objects of a trial, filling fingerprints and summaries.

        Args:
            graph_item: The model's GraphItem.
            resource_spec: The cluster.
            strategy: The strategy tried (None or b"" if it could not be built).
            model_name: Human name of the model; defaults to `graph_item.name`.
            step_times_s: Measured step times in seconds.
            error: Why the trial failed, or None.
            origin: What proposed the strategy; defaults to the strategy's origin.
            features: The strategy's feature vector.
            predicted_step_time_s: The cost model's prediction.
            graph_summary: Defaults to `summarize_graph_item(graph_item)`.
            extra: JSON-able extras.
        """
        if isinstance(strategy, Strategy):
            proto = strategy.proto
        elif isinstance(strategy, strategy_pb2.Strategy):
            proto = strategy
        else:
            proto = None
        data = (proto.SerializeToString(deterministic=True) if proto is not None
                else bytes(strategy or b""))
        if origin is None:
            origin = proto.origin if proto is not None else ""
        gi_fp, spec_fp = graph_item.fingerprint, resource_spec.fingerprint
        return cls(workload=workload_key(gi_fp, spec_fp), graph_item_fingerprint=gi_fp,
                   resource_spec_fingerprint=spec_fp,
                   model_name=model_name or graph_item.name,
                   graph_summary=dict(graph_summary if graph_summary is not None
                                      else summarize_graph_item(graph_item)),
                   resource_spec=resource_spec.to_text(), strategy=data,
                   features=dict(features or {}), step_times_s=tuple(step_times_s),
                   error=error, origin=origin, predicted_step_time_s=predicted_step_time_s,
                   extra=dict(extra or {}))

    # ---------------------------------------------------------- derived
    @property
    def ok(self) -> bool:
        """True when the trial did not fail and has measured step times."""
        return self.error is None and len(self.step_times_s) > 0

    @property
    def median_step_time_s(self) -> float | None:
        """Median of the measured step times; None when there are none."""
        if not self.step_times_s:
            return None
        return float(statistics.median(self.step_times_s))

    def strategy_proto(self) -> strategy_pb2.Strategy:
        """The stored strategy as a protobuf (raises `DatabaseError` if it has none)."""
        return self.load_strategy().proto

    def load_strategy(self) -> Strategy:
        """The stored strategy as a `Strategy` (raises `DatabaseError` if it has none)."""
        if not self.strategy:
            raise DatabaseError(f"trial of workload {self.workload} stores no strategy "
                                f"(error: {self.error!r})")
        return Strategy.deserialize(self.strategy, source=f"trial of workload {self.workload}")

    def load_resource_spec(self) -> ResourceSpec:
        """The stored cluster as a `ResourceSpec`."""
        return ResourceSpec.from_text(self.resource_spec)

    # ---------------------------------------------------------- JSON form
    def to_json_dict(self) -> dict[str, Any]:
        """The record as a JSON-able dict (bytes in base64)."""
        out = dataclasses.asdict(self)
        out["strategy"] = base64.b64encode(self.strategy).decode("ascii")
        out["step_times_s"] = list(self.step_times_s)
        return out

    @classmethod
    def from_json_dict(cls, data: Mapping[str, Any]) -> TrialRecord:
        """Inverse of `to_json_dict`; raises `DatabaseError` on a missing or unknown field."""
        if not isinstance(data, Mapping):
            raise DatabaseError(f"a trial record must be a JSON object. "
                                f"Received: {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise DatabaseError(f"unknown trial record fields {unknown}")
        missing = sorted(f.name for f in dataclasses.fields(cls)
                         if f.name not in data and f.default is dataclasses.MISSING
                         and f.default_factory is dataclasses.MISSING)
        if missing:
            raise DatabaseError(f"trial record misses fields {missing}")
        values = dict(data)
        if not isinstance(values["strategy"], str):
            raise DatabaseError(f"trial record strategy must be a base64 string. "
                                f"Received: {short_repr(values['strategy'])}")
        try:
            values["strategy"] = base64.b64decode(values["strategy"], validate=True)
        except (TypeError, ValueError) as e:   # binascii.Error is a ValueError
            raise DatabaseError(f"trial record strategy is not base64: {e}") from e
        if "step_times_s" in values:
            if not isinstance(values["step_times_s"], list):
                raise DatabaseError(f"trial record step_times_s must be a list of seconds. "
                                    f"Received: {short_repr(values['step_times_s'])}")
            values["step_times_s"] = tuple(values["step_times_s"])
        return cls(**values)


def _finite(value: Any, name: str, key: str | None = None) -> float:
    """`value` as a finite float; `name` (and `key` of it, if given) name it in errors."""
    if isinstance(value, float) and math.isfinite(value):
        return value
    where = name if key is None else f"{name}[{short_repr(key, 60)}]"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise DatabaseError(f"TrialRecord.{where} must be a number. "
                            f"Received: {short_repr(value)}")
    try:
        value = float(value)
    except OverflowError:   # an integer beyond the float range
        value = math.inf
    if not math.isfinite(value):
        raise DatabaseError(f"TrialRecord.{where} must be finite. Received: {value!r}")
    return value


def _numeric_dict(values: Any, name: str) -> dict[str, float]:
    if not isinstance(values, Mapping):
        raise DatabaseError(f"TrialRecord.{name} must be a dict of str to float. "
                            f"Received: {type(values).__name__}")
    out = {}
    for key, value in values.items():
        if not isinstance(key, str):
            raise DatabaseError(f"TrialRecord.{name} keys must be strings. "
                                f"Received: {short_repr(key)}")
        out[key] = _finite(value, name, key)
    return out


def _step_times(values: Any) -> tuple[float, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise DatabaseError(f"TrialRecord.step_times_s must be a sequence of seconds. "
                            f"Received: {short_repr(values)}")
    out = tuple(_finite(v, "step_times_s") for v in values)
    bad = [v for v in out if v <= 0]
    if bad:
        raise DatabaseError(f"TrialRecord.step_times_s must be positive. "
                            f"Received: {short_repr(bad)}")
    return out


# ------------------------------------------------------------------- lines
def _canonical(schema: int, record: Mapping[str, Any]) -> bytes:
    """The bytes the checksum covers: the schema and the record, canonical JSON."""
    return json.dumps({"record": record, "schema": schema}, sort_keys=True,
                      separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def encode_line(record: TrialRecord) -> bytes:
    """One database line (ending in "\\n") holding `record` and its checksum."""
    payload = record.to_json_dict()
    crc = binascii.crc32(_canonical(DATABASE_SCHEMA_VERSION, payload))
    line = {"schema": DATABASE_SCHEMA_VERSION, "crc32": f"{crc:08x}", "record": payload}
    return json.dumps(line, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode() + b"\n"


def decode_line(line: bytes) -> TrialRecord:
    """The record of one complete line (without its "\\n").

    The checksum is verified on the line's bytes first; only a line that
    matches it is parsed, and only then is its schema believed.

    Raises:
        DatabaseSchemaError: The line is intact and has a newer schema than
            this reader knows.
        DatabaseError: The line's checksum does not match (or it has none),
            or its record is malformed.
    """
    head = _LINE_HEAD.match(line)
    if head is None:
        raise DatabaseError("not a database line: it does not start with "
                            '\'{"crc32":"<8 hex digits>",\'')
    stored = head.group(1).decode()
    crc = f"{binascii.crc32(b'{' + line[head.end():]):08x}"
    if stored != crc:
        raise DatabaseError(f"checksum mismatch: stored {stored!r}, computed {crc!r}")
    try:
        obj = json.loads(line, parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        why = "nested too deeply" if isinstance(e, RecursionError) else shorten(str(e), 500)
        raise DatabaseError(f"not JSON: {why}") from e
    if not isinstance(obj, dict) or sorted(obj) != sorted(_FIELDS_OF_LINE) or \
            obj["crc32"] != stored:
        raise DatabaseError(f"a line must be an object with fields {list(_FIELDS_OF_LINE)}")
    schema = obj["schema"]
    if isinstance(schema, bool) or not isinstance(schema, int) or schema < 1:
        raise DatabaseError(f"schema must be a positive integer. Received: {short_repr(schema)}")
    if schema > DATABASE_SCHEMA_VERSION:
        raise DatabaseSchemaError(
            f"line has schema version {schema}, newer than {DATABASE_SCHEMA_VERSION}, the "
            "newest this autodist reads; upgrade autodist to read this database")
    return TrialRecord.from_json_dict(obj["record"])


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number a trial record may hold")


@dataclasses.dataclass(frozen=True)
class SkippedLine:
    """A line of the database file that holds no valid record."""

    # 1-based line number in the file.
    line_number: int
    # Why it was skipped, e.g. "torn final line (no newline)" or "checksum mismatch ...".
    reason: str


@dataclasses.dataclass(frozen=True)
class DatabaseContents:
    """What one read of the database found."""

    # The valid records, in file order.
    records: list[TrialRecord]
    # The lines that held no valid record (torn or corrupt), in file order.
    skipped: list[SkippedLine]


# ---------------------------------------------------------------- database
class Database:
    """An append-only file of `TrialRecord`s (JSON Lines with checksums), or its lines in memory.

    Safe for concurrent appends from several processes on one host and for a
    writer killed at any point; see the module docstring. Every read reads the
    file afresh; `skipped` keeps the skipped lines of the latest read.
    Without a path the same lines are kept in this object (appends from
    several threads are safe); nothing outlives it.

    Args:
        path: The file; it and its parent directories are created on the first
            append. None: in memory (`Database.in_memory()`).
    """

    def __init__(self, path: str | os.PathLike | None = None) -> None:
        self._path = None if path is None else pathlib.Path(path)
        if self._path is not None and self._path.exists() and not self._path.is_file():
            raise DatabaseError(f"database path {str(self._path)!r} exists and is not a file")
        self._memory: list[bytes] | None = [] if self._path is None else None
        self._memory_lock = threading.Lock()
        self.skipped: list[SkippedLine] = []

    @classmethod
    def in_memory(cls) -> Database:
        """A database with no file: for tests and short searches."""
        return cls(None)

    @property
    def path(self) -> pathlib.Path | None:
        """The file, or None for an in-memory database."""
        return self._path

    # --------------------------------------------------------------- write
    def append(self, record: TrialRecord) -> None:
        """Appends one record durably (written and fsynced when this returns)."""
        self.extend([record])

    def extend(self, records: Iterable[TrialRecord]) -> None:
        """Appends records in order, each as its own line, under one lock and one fsync."""
        records = list(records)
        for i, record in enumerate(records):
            if not isinstance(record, TrialRecord):
                raise DatabaseError(f"Database.extend takes TrialRecords; item {i} is a "
                                    f"{type(record).__name__}")
        if not records:
            return
        data = b"".join(encode_line(r) for r in records)
        if self._memory is not None:
            with self._memory_lock:
                self._memory.append(data)
            return
        created = not self._path.exists()
        self._path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self._path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                size = os.fstat(fd).st_size
                if size and os.pread(fd, 1, size - 1) != b"\n":
                    data = b"\n" + data   # step over a torn final line
                _write_all(fd, data)
                os.fsync(fd)
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
        if created:
            _fsync_dir(self._path.parent)

    # ---------------------------------------------------------------- read
    def read(self) -> DatabaseContents:
        """Reads every valid record, skipping (and listing) torn or corrupt lines.

        A line is skipped, with its reason in `skipped` (and a logged warning),
        when its checksum does not match its bytes or its record is malformed
        (wrong types, null, NaN, too deeply nested, ...); the other lines read.

        Raises:
            DatabaseSchemaError: An intact line (its checksum matches) was
                written with a newer schema.
        """
        data = self._read_bytes()
        lines = data.split(b"\n")
        tail = lines.pop()   # b"" when the file ends in a newline
        records, skipped = [], []
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                records.append(decode_line(line))
            except DatabaseSchemaError as e:
                raise DatabaseSchemaError(f"{self._name} line {number}: {e}") from e
            except DatabaseError as e:
                skipped.append(SkippedLine(number, f"corrupt line: {e}"))
        if tail.strip():
            # A final line without its newline is a torn append, unless its
            # checksum proves it complete (the crash came just before the newline).
            try:
                records.append(decode_line(tail))
            except DatabaseError:
                skipped.append(SkippedLine(len(lines) + 1, "torn final line (no newline)"))
        if skipped:
            logger.warning("trial database %s: skipped %d damaged line(s); first: line %d: %s",
                           self._name, len(skipped), skipped[0].line_number, skipped[0].reason)
        self.skipped = skipped
        return DatabaseContents(records, skipped)

    def _read_bytes(self) -> bytes:
        if self._memory is not None:
            with self._memory_lock:
                return b"".join(self._memory)
        try:
            with open(self._path, "rb") as f:
                fcntl.flock(f.fileno(), fcntl.LOCK_SH)
                try:
                    return f.read()
                finally:
                    fcntl.flock(f.fileno(), fcntl.LOCK_UN)
        except FileNotFoundError:
            return b""

    @property
    def _name(self) -> str:
        return "(in memory)" if self._path is None else str(self._path)

    def records(self) -> list[TrialRecord]:
        """The valid records in file order (skipped lines go to `self.skipped`)."""
        return self.read().records

    def __iter__(self) -> Iterator[TrialRecord]:
        return iter(self.records())

    def __len__(self) -> int:
        return len(self.records())

    def workloads(self) -> list[str]:
        """The distinct workloads, in order of first appearance."""
        return list(self.by_workload())

    def by_workload(self, *, ok_only: bool = False) -> dict[str, list[TrialRecord]]:
        """Records grouped by workload (in order of first appearance).

        Args:
            ok_only: Keep only records whose trial succeeded (`TrialRecord.ok`).
        """
        groups: dict[str, list[TrialRecord]] = {}
        for record in self.records():
            if ok_only and not record.ok:
                continue
            groups.setdefault(record.workload, []).append(record)
        return groups

    def filter(self, predicate: Callable[[TrialRecord], bool] | None = None, *,
               workload: str | None = None, model_name: str | None = None,
               ok: bool | None = None) -> list[TrialRecord]:
        """The records matching every given condition, in file order.

        Args:
            predicate: Any test on a record.
            workload: Keep only this workload.
            model_name: Keep only this model.
            ok: Keep only successful (True) or only failed/unmeasured (False) trials.
        """
        out = []
        for record in self.records():
            if workload is not None and record.workload != workload:
                continue
            if model_name is not None and record.model_name != model_name:
                continue
            if ok is not None and record.ok != ok:
                continue
            if predicate is not None and not predicate(record):
                continue
            out.append(record)
        return out

    def best(self, workload: str) -> TrialRecord | None:
        """The successful trial of `workload` with the lowest median step time, or None."""
        trials = self.filter(workload=workload, ok=True)
        return min(trials, key=lambda r: r.median_step_time_s, default=None)

    def __repr__(self) -> str:
        return "Database.in_memory()" if self._path is None else f"Database({str(self._path)!r})"


def _write_all(fd: int, data: bytes) -> None:
    """Writes `data` at the end of `fd`: one write, continued only if the kernel writes short."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        if written <= 0:
            raise DatabaseError(f"write to the trial database wrote {written} bytes")
        view = view[written:]


def _fsync_dir(directory: pathlib.Path) -> None:
    """Makes a newly created file's directory entry durable."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
