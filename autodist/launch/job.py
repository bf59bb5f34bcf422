"""A job directory: everything a task process needs, as files.

Workers never run the user's script: they read the GraphItem, Strategy and
ResourceSpec protobufs, the initial values and the training data from here.
Local clusters share the driver's job directory; a task on another host gets
its own copy, packed into one archive (`JobDir.pack`) and shipped to it over
TensorFlow (see `autodist.launch.remote`), with only the rows of the data its
replicas read. Only the chief writes outputs, into the driver's directory
(which it shares in both cases, being started by the driver).

    job_dir/
      graph_item.pb  strategy.pb  resource_spec.pb
      run.json         the run's config (`runtime.run_config.RunConfig`: batching,
                       epochs, timeouts), carried unread but for `JobSettings`
      cluster.json     ports of every node
      init.npz         initial values by variable name
      data/x_0.npy ... data/y.npy
      data/shard.json, data/rows.npy   a shipped shard: the full example count,
                                       and which examples the arrays hold
      data/dataset.pb, data/dataset.json   instead of arrays: a dataset the
                                       workers read themselves (its graph, and
                                       how to read it)
      data/dataset_shard_<t>.pb       instead of dataset.pb: worker task t's
                                       own shard of every batch (ShardedDataset)
      logs/<job>_<task>.log
      ready/<job>_<task>         written when a (local) task's server is up
      control/stop               driver -> chief: stop at the next step boundary
      control/epoch-<e>          driver -> chief: "continue" or "stop" after epoch e
      results/worker_<i>.json    per-step losses and times (written by the chief)
      progress.jsonl             the chief's progress, one line per step
      final_weights.npz          trained values by variable name (chief)

Job directories are private (`autodist.launch.private_files`): 0700, their
files 0600, written under new temporary names that are never followed.
"""
from __future__ import annotations

import dataclasses
import io
import json
import os
import pathlib
import re
import shutil
import tarfile
import tempfile
from typing import Any, BinaryIO, Protocol

import numpy as np

from autodist.ir.graph_item import GraphItem
from autodist.ir.resource_spec import ResourceSpec
from autodist.ir.strategy import Strategy
from autodist.launch.errors import JobArchiveError
from autodist.launch.private_files import (DIR_MODE, make_private_dir, private_writer,
                                           write_private)


class JobConfig(Protocol):
    """A job's config as the launcher carries it: written whole as run.json (the
    runtime's `RunConfig` is one), read by the tasks' runtime."""

    def to_json(self) -> dict[str, Any]:
        """The config as a JSON object."""


@dataclasses.dataclass(frozen=True)
class JobSettings:
    """What the launcher itself reads of a job's config (run.json), which it otherwise
    carries without reading (the runtime's `RunConfig` writes and reads it whole).

    Attributes:
        job_id: Tags the job's messages between tasks (see `mailbox`).
        job_timeout_s: Bound on the whole job (a task waiting for its end).
    """

    job_id: str
    job_timeout_s: float


@dataclasses.dataclass(frozen=True)
class DatasetFiles:
    """A dataset the workers read themselves, instead of arrays (opaque to the launcher).

    Attributes:
        graph: Its serialized graph, which every worker reads (empty when
            sharded).
        description: How to read it (JSON).
        shard_graphs: Instead of `graph`, each worker task's own dataset
            (its rows of every global batch), by task index; empty for a
            task that reads none.
    """

    graph: bytes
    description: bytes
    shard_graphs: tuple[bytes, ...] = ()


# Files an archive may hold (anything else in one is refused).
_ARCHIVE_FILES = ("graph_item.pb", "strategy.pb", "resource_spec.pb", "run.json",
                  "cluster.json", "init.npz")
_ARCHIVE_DATA = re.compile(
    r"data/(x_[0-9]{1,6}\.npy|y\.npy|rows\.npy|order\.npy|shard\.json|dataset\.pb|"
    r"dataset\.json|"
    r"dataset_shard_[0-9]{1,6}\.pb)")
_MAX_ARCHIVE_MEMBERS = 10_000
_COPY_BYTES = 16 << 20   # a block of rows packed, or of a member unpacked, at a time
_TAR_BUFFER_BYTES = 1 << 20
_SUBDIRS = ("logs", "ready", "results", "data", "control")


class JobDir:
    """Paths and readers/writers of one job directory."""

    def __init__(self, path: str | pathlib.Path) -> None:
        self.path = pathlib.Path(path)

    @classmethod
    def create(cls, path: str | pathlib.Path | None = None) -> JobDir:
        """A private job directory: `path`, or a new temporary one (None).

        A missing `path` is created with mode 0700; an existing one must
        belong to this user and be closed to others (it is refused, not
        changed: see `private_files.make_private_dir`).

        Raises:
            PrivateDirError: `path` exists and others could reach it.
        """
        if path is None:
            return cls(tempfile.mkdtemp(prefix="autodist-job-"))  # 0700
        return cls(make_private_dir(path))

    # paths
    def file(self, name: str) -> pathlib.Path:
        return self.path / name

    def log(self, job: str, task: int) -> pathlib.Path:
        return self.path / "logs" / f"{job}_{task}.log"

    def ready_flag(self, job: str, task: int) -> pathlib.Path:
        return self.path / "ready" / f"{job}_{task}"

    def heartbeat(self, job: str, task: int) -> pathlib.Path:
        """A file the task touches every `HEARTBEAT_PERIOD_S` while its process runs
        (a stopped or hung process stops touching it: `launch.heartbeats`)."""
        return self.path / "ready" / f"{job}_{task}.alive"

    def recovery(self) -> pathlib.Path:
        """The chief's state after the last completed step of a failed run (npz)."""
        return self.path / "recovery.npz"

    def unreachable_peer(self, job: str, task: int) -> pathlib.Path:
        """Written by task job:task when its step failed because another task stopped
        answering: that task's "job:index" (`errors.unreachable_peer`)."""
        return self.file(f"logs/{job}_{task}.unreachable")

    def result(self, task: int) -> pathlib.Path:
        return self.path / "results" / f"worker_{task}.json"

    def stop_request(self) -> pathlib.Path:
        return self.path / "control" / "stop"

    def resize_request(self) -> pathlib.Path:
        """The driver's requested membership: workers and plan (JSON)."""
        return self.path / "control" / "resize"

    def epoch_decision(self, epoch: int) -> pathlib.Path:
        return self.path / "control" / f"epoch-{epoch}"

    # writing (driver side)
    def write(self, graph_item: GraphItem, strategy: Strategy, spec: ResourceSpec,
              config: JobConfig, init_values: dict[str, np.ndarray],
              inputs: list[np.ndarray], targets: np.ndarray | None,
              dataset: DatasetFiles | None = None, order: np.ndarray | None = None) -> None:
        """Writes a job; clears what an earlier job in the same directory left behind.

        The data are `inputs` and `targets`, or a `dataset` (then neither);
        `order` is the order of the examples in every pass, when known
        (Keras' shuffled order), else None.
        """
        self._make_subdirs()
        stale = [self.file("progress.jsonl"), self.file("final_weights.npz"),
                 self.path / "data" / "shard.json", self.path / "data" / "rows.npy",
                 self.path / "data" / "y.npy", self.path / "data" / "dataset.pb",
                 self.path / "data" / "order.npy",
                 self.path / "data" / "dataset.json"]
        for sub in ("results", "control"):
            stale += (self.path / sub).iterdir()
        stale += (self.path / "data").glob("x_*.npy")
        stale += (self.path / "data").glob("dataset_shard_*.pb")
        for path in stale:
            path.unlink(missing_ok=True)
        write_private(self.file("graph_item.pb"), graph_item.serialize())
        write_private(self.file("strategy.pb"), strategy.serialize())
        write_private(self.file("resource_spec.pb"), spec.serialize())
        self.write_config(config)
        with private_writer(self.file("init.npz")) as f:
            np.savez(f, **init_values)
        if dataset is not None:
            if dataset.shard_graphs:
                for task, graph in enumerate(dataset.shard_graphs):
                    if graph:
                        write_private(self._shard_graph(task), graph)
            else:
                write_private(self.path / "data" / "dataset.pb", dataset.graph)
            write_private(self.path / "data" / "dataset.json", dataset.description)
            return
        for i, x in enumerate(inputs):
            with private_writer(self.path / "data" / f"x_{i}.npy") as f:
                np.save(f, x)
        with private_writer(self.path / "data" / "y.npy") as f:
            np.save(f, targets)
        if order is not None:
            with private_writer(self.path / "data" / "order.npy") as f:
                np.save(f, np.asarray(order, np.int64))

    def write_config(self, config: JobConfig) -> None:
        """Replaces the job's config (before its tasks start)."""
        write_private(self.file("run.json"), json.dumps(config.to_json()).encode())

    def write_ports(self, ports: list[int]) -> None:
        write_private(self.file("cluster.json"), json.dumps({"ports": ports}).encode())

    def write_file(self, path: pathlib.Path, data: bytes) -> None:
        """Replaces a file of this job (a control file, ...) with `data`, privately."""
        path.parent.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        write_private(path, data)

    def _make_subdirs(self) -> None:
        self.path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        for sub in _SUBDIRS:
            (self.path / sub).mkdir(mode=DIR_MODE, exist_ok=True)

    # reading (task side)
    def graph_item(self) -> GraphItem:
        return GraphItem.load(self.file("graph_item.pb"))

    def strategy(self) -> Strategy:
        return Strategy.load(self.file("strategy.pb"))

    def resource_spec(self) -> ResourceSpec:
        return ResourceSpec.deserialize(self.file("resource_spec.pb").read_bytes())

    def config(self) -> dict[str, Any]:
        """The job's config (run.json) as written, a JSON object; the runtime reads it
        (`runtime.run_config.RunConfig.of_job`).

        Raises:
            JobArchiveError: run.json is not a JSON object.
        """
        return self._json_object("run.json")

    def settings(self) -> JobSettings:
        """What the launcher reads of the job's config: its id and timeout.

        Raises:
            JobArchiveError: run.json lacks them or holds values of another type.
        """
        data = self.config()
        job_id, timeout = data.get("job_id"), data.get("job_timeout_s")
        if not isinstance(job_id, str) or isinstance(timeout, bool) or \
                not isinstance(timeout, (int, float)) or not timeout > 0:
            raise JobArchiveError(
                f"run.json of job {str(self.path)!r} names no job id (a string) and job "
                f"timeout (seconds > 0): received job_id={str(job_id)[:64]!r}, "
                f"job_timeout_s={str(timeout)[:64]!r}")
        return JobSettings(job_id, float(timeout))

    def ports(self) -> list[int]:
        """The tasks' ports (cluster.json).

        Raises:
            JobArchiveError: cluster.json holds no list of ports.
        """
        ports = self._json_object("cluster.json").get("ports")
        if not isinstance(ports, list) or not all(
                isinstance(p, int) and not isinstance(p, bool) and 0 <= p < 65536 for p in ports):
            raise JobArchiveError(f"cluster.json of job {str(self.path)!r} holds no list of "
                                  f"ports. Received: {str(ports)[:200]}")
        return ports

    def _json_object(self, name: str) -> dict[str, Any]:
        """A JSON object file of the job; JobArchiveError if it is anything else."""
        try:
            data = json.loads(self.file(name).read_bytes())
        except FileNotFoundError:
            raise JobArchiveError(f"job {str(self.path)!r} has no {name}") from None
        except (ValueError, RecursionError) as e:
            raise JobArchiveError(f"{name} of job {str(self.path)!r} is not JSON: "
                                  f"{type(e).__name__}") from None
        if not isinstance(data, dict):
            raise JobArchiveError(f"{name} of job {str(self.path)!r} is not a JSON object")
        return data

    def init_values(self) -> dict[str, np.ndarray]:
        with np.load(self.file("init.npz")) as data:
            return {k: data[k] for k in data.files}

    def data(self) -> tuple[list[np.ndarray], np.ndarray]:
        """The input arrays and the targets (of the shard, if this is one)."""
        xs = sorted((self.path / "data").glob("x_*.npy"), key=lambda p: int(p.stem[2:]))
        return ([np.load(p, mmap_mode="r") for p in xs],
                np.load(self.path / "data" / "y.npy", mmap_mode="r"))

    def order(self) -> np.ndarray | None:
        """The order of the examples in every pass (Keras' shuffled order), or None."""
        path = self.path / "data" / "order.npy"
        return np.load(path) if path.exists() else None

    def dataset(self) -> DatasetFiles | None:
        """The dataset the workers read, or None when the data are arrays."""
        description = self.path / "data" / "dataset.json"
        if not description.exists():
            return None
        graph = self.path / "data" / "dataset.pb"
        if graph.exists():
            return DatasetFiles(graph.read_bytes(), description.read_bytes())
        shards = {int(p.stem[len("dataset_shard_"):]): p.read_bytes()
                  for p in (self.path / "data").glob("dataset_shard_*.pb")}
        count = max(shards, default=-1) + 1
        return DatasetFiles(b"", description.read_bytes(),
                            tuple(shards.get(t, b"") for t in range(count)))

    def _shard_graph(self, task: int) -> pathlib.Path:
        return self.path / "data" / f"dataset_shard_{task}.pb"

    def shard(self) -> tuple[int, np.ndarray | None]:
        """(examples in the full data set, sorted example indices the arrays hold).

        The indices are None when the arrays hold every example.
        """
        meta = self.path / "data" / "shard.json"
        if not meta.exists():
            return len(np.load(self.path / "data" / "y.npy", mmap_mode="r")), None
        return (int(json.loads(meta.read_text())["num_examples"]),
                np.load(self.path / "data" / "rows.npy"))

    # shipping (to a task on another host)
    def pack(self, rows: np.ndarray | None = None, *, with_data: bool = True) -> bytes:
        """This job as one uncompressed tar archive, in memory (see `pack_into`)."""
        buffer = io.BytesIO()
        self.pack_into(buffer, rows, with_data=with_data)
        return buffer.getvalue()

    def pack_into(self, out: BinaryIO, rows: np.ndarray | None = None, *,
                  with_data: bool = True) -> None:
        """Writes this job as one uncompressed tar archive into `out` (a file, for big jobs).

        The rows of the data are written block by block, read from the job's
        arrays (memory-mapped), so packing holds a block of rows in memory at
        a time, not a copy of the task's data.

        Args:
            out: Where the archive goes (written from its current position).
            rows: Sorted example indices to ship (None: every example; a
                job with a dataset ships the dataset's files).
            with_data: False leaves out the data and initial values (for a
                parameter-server task, which needs neither).

        Raises:
            JobArchiveError: rows of a job with a dataset, or of a shipped shard.
        """
        with tarfile.open(fileobj=out, mode="w", copybufsize=_TAR_BUFFER_BYTES) as tar:
            names = _ARCHIVE_FILES if with_data else _ARCHIVE_FILES[:-1]
            for name in names:
                tar.add(self.file(name), arcname=name)
            if with_data and self.dataset() is not None:
                if rows is not None:
                    raise JobArchiveError("a job with a dataset ships the dataset, not rows")
                # dataset.pb, or each task's dataset_shard_<t>.pb
                graphs = sorted((self.path / "data").glob("dataset*.pb"))
                for name in ["data/dataset.json"] + [f"data/{p.name}" for p in graphs]:
                    tar.add(self.file(name), arcname=name)
            elif with_data:
                inputs, targets = self.data()
                num_examples, held = self.shard()
                if held is not None:
                    raise JobArchiveError("a shipped shard cannot be shipped again")
                arrays = {f"x_{i}": x for i, x in enumerate(inputs)} | {"y": targets}
                order = self.order()
                if rows is not None:
                    rows = np.asarray(rows, dtype=np.int64)
                    for key, array in arrays.items():
                        _add_npy(tar, f"data/{key}.npy", array, rows)
                    arrays = {"rows": rows}
                    _add_bytes(tar, "data/shard.json",
                               json.dumps({"num_examples": num_examples}).encode())
                if order is not None:   # indices of the full data, as `rows`
                    arrays["order"] = order
                for key, array in arrays.items():
                    _add_npy(tar, f"data/{key}.npy", array)

    @classmethod
    def unpack(cls, archive: bytes | os.PathLike, path: str | pathlib.Path) -> JobDir:
        """Writes an archive made by `pack` into `path` (a new or empty private directory).

        Only regular files with the names `pack` writes are accepted (no
        links, directories, devices, absolute paths or ``..``); every member
        is checked before anything is written, and members are copied a block
        at a time.

        Args:
            archive: The archive's bytes, or the path of a file holding it (a
                job that arrived in chunks).
            path: The job directory to write.

        Raises:
            JobArchiveError: the archive is not one `pack` writes (damaged, or holding
                anything else).
        """
        job = cls(path)
        try:
            if isinstance(archive, (bytes, bytearray, memoryview)):
                return job._unpack(io.BytesIO(archive))
            with open(archive, "rb") as source:
                return job._unpack(source)
        except (tarfile.TarError, EOFError) as e:   # not a tar archive, or a damaged one
            raise JobArchiveError(f"the job archive cannot be read: {type(e).__name__}: "
                                  f"{str(e)[:200]}") from None

    def _unpack(self, archive: BinaryIO) -> JobDir:
        job = self
        with tarfile.open(fileobj=archive, mode="r:", copybufsize=_TAR_BUFFER_BYTES) as tar:
            members = []
            for member in tar:   # stops early: an archive of too many members is refused
                members.append(member)
                if len(members) > _MAX_ARCHIVE_MEMBERS:
                    raise JobArchiveError(f"job archive has more than {_MAX_ARCHIVE_MEMBERS} "
                                          "members")
            for member in members:
                name = member.name
                allowed = name in _ARCHIVE_FILES or _ARCHIVE_DATA.fullmatch(name)
                if not member.isfile() or not allowed:
                    raise JobArchiveError(f"job archive holds an unexpected member {name[:200]!r}")
            # Every archive holds these (a parameter server's has no initial values).
            missing = sorted(set(_ARCHIVE_FILES[:-1]) - {m.name for m in members})
            if missing:
                raise JobArchiveError(f"job archive misses {missing}")
            job._make_subdirs()
            for member in members:
                source = tar.extractfile(member)
                assert source is not None
                with private_writer(job.path / member.name) as out:
                    shutil.copyfileobj(source, out, _COPY_BYTES)
        return job

    def read_json(self, path: pathlib.Path) -> Any:
        return json.loads(path.read_text())


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def _add_npy(tar: tarfile.TarFile, name: str, array: np.ndarray,
             rows: np.ndarray | None = None) -> None:
    """Adds `array[rows]` (all of `array`: None) as the .npy file `name`, a block at a time.

    What `np.save` writes, without a copy of the selected rows in memory;
    arrays of Python objects or with named fields are saved whole instead.
    """
    array = np.asarray(array) if not isinstance(array, np.ndarray) else array
    if array.dtype.hasobject or array.dtype.names is not None or array.ndim == 0:
        out = io.BytesIO()
        np.save(out, np.asarray(array if rows is None else array[rows]))
        _add_bytes(tar, name, out.getvalue())
        return
    stream = _NpyRows(array, rows)
    info = tarfile.TarInfo(name)
    info.size = stream.size
    tar.addfile(info, stream)


class _NpyRows(io.RawIOBase):
    """A readable .npy file of `array[rows]`: its header, then its rows in C order, made
    a block of rows at a time as they are read."""

    def __init__(self, array: np.ndarray, rows: np.ndarray | None) -> None:
        super().__init__()
        self._array, self._rows = array, rows
        shape = array.shape if rows is None else (len(rows),) + array.shape[1:]
        header = io.BytesIO()
        np.lib.format.write_array_header_1_0(header, {
            "descr": np.lib.format.dtype_to_descr(array.dtype), "fortran_order": False,
            "shape": shape})
        row_bytes = array.dtype.itemsize * int(np.prod(array.shape[1:], dtype=np.int64))
        self._block = max(1, _COPY_BYTES // max(row_bytes, 1))
        self._length = shape[0]
        self.size = len(header.getvalue()) + self._length * row_bytes
        self._pending = bytearray(header.getvalue())
        self._next = 0   # the next row to make

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        while len(self._pending) < len(view) and self._next < self._length:
            stop = min(self._next + self._block, self._length)
            block = (self._array[self._next:stop] if self._rows is None else
                     self._array[self._rows[self._next:stop]])
            self._pending += np.ascontiguousarray(block).tobytes()
            self._next = stop
        size = min(len(view), len(self._pending))
        view[:size] = self._pending[:size]
        del self._pending[:size]
        return size
