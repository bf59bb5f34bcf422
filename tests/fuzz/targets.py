"""The readers under fuzz, one `Target` per input format.

A target builds a small corpus of valid inputs (`setup`), turns a case's
random source into one mutated input (`case`) and runs the reader and what a
caller does next with the result (`check`). `check` returns normally for an
input that reads as a valid object and raises for anything else; the
harness decides whether the exception is the format's named error.

Inputs are a dict of relative file name -> bytes (None: the file is absent),
so multi-file formats (checkpoints) and single files are handled alike.
"""
from __future__ import annotations

import binascii
import copy
import json
import math
import pathlib
import random
import shutil
from typing import Any

from tests.fuzz.mutations import TOKENS, extreme_value, mutate_bytes, set_random_path

REPO = pathlib.Path(__file__).resolve().parents[2]
Files = dict[str, Any]
# Placeholder for a deeply nested value, spliced into text after dumping (a
# dumper would recurse too deep itself).
_DEEP = "__fuzz_deep__"


def _splice_deep(text: str, rng: random.Random) -> str:
    depth = rng.choice((100, 5_000, 200_000))
    opener, closer = rng.choice((("[", "]"), ('{"a":', "}")))
    return text.replace(json.dumps(_DEEP), opener * depth + "0" + closer * depth, 1) \
        .replace(_DEEP, opener * depth + "0" + closer * depth, 1)


def _maybe_deep(rng: random.Random) -> Any:
    return _DEEP if rng.random() < 0.08 else extreme_value(rng)


class FileTree:
    """A directory whose files are set case by case, writing only what changed."""

    def __init__(self, directory: pathlib.Path) -> None:
        self.directory = directory
        self.current: dict[str, bytes] = {}
        if directory.exists():
            shutil.rmtree(directory)
        directory.mkdir(parents=True)

    def set(self, files: dict[str, bytes | None]) -> None:
        wanted = {name: data for name, data in files.items() if data is not None}
        for name in set(self.current) - set(wanted):
            (self.directory / name).unlink()
        for name, data in wanted.items():
            if self.current.get(name) != data:
                path = self.directory / name
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)
        self.current = wanted


class Target:
    """One input format and its reader."""

    name = ""
    # The error type the reader must raise for a malformed input (resolved in `setup`).
    error: type = Exception
    # The reader calls into C++ that may abort the process on bad input.
    native = False

    def setup(self, workdir: pathlib.Path) -> None:
        raise NotImplementedError

    def case(self, rng: random.Random) -> Files:
        raise NotImplementedError

    def check(self, files: Files, workdir: pathlib.Path) -> None:
        raise NotImplementedError


# ------------------------------------------------------------------ protobuf
def _is_repeated(fd) -> bool:
    return fd.is_repeated if hasattr(fd, "is_repeated") else fd.label == fd.LABEL_REPEATED


def _is_map(fd) -> bool:
    return fd.message_type is not None and fd.message_type.GetOptions().map_entry


_INT_LIMITS = {"int32": (-2 ** 31, 2 ** 31 - 1), "int64": (-2 ** 63, 2 ** 63 - 1),
               "uint32": (0, 2 ** 32 - 1), "uint64": (0, 2 ** 64 - 1)}


def _field_kind(fd) -> str:
    t = fd.type
    if t in (fd.TYPE_INT32, fd.TYPE_SINT32, fd.TYPE_SFIXED32):
        return "int32"
    if t in (fd.TYPE_INT64, fd.TYPE_SINT64, fd.TYPE_SFIXED64):
        return "int64"
    if t in (fd.TYPE_UINT32, fd.TYPE_FIXED32):
        return "uint32"
    if t in (fd.TYPE_UINT64, fd.TYPE_FIXED64):
        return "uint64"
    if t in (fd.TYPE_DOUBLE, fd.TYPE_FLOAT):
        return "float"
    if t == fd.TYPE_BOOL:
        return "bool"
    if t == fd.TYPE_ENUM:
        return "enum"
    if t == fd.TYPE_STRING:
        return "string"
    if t == fd.TYPE_BYTES:
        return "bytes"
    return "message"


def _scalar(kind: str, rng: random.Random, strings: list[str]) -> Any:
    if kind in _INT_LIMITS:
        lo, hi = _INT_LIMITS[kind]
        value = rng.choice((-1, 0, 1, 2, 3, 7, 64, 1000, 65537, 2 ** 31 - 1, -2 ** 31, 2 ** 31,
                            2 ** 32 - 1, 2 ** 62, 2 ** 63 - 1, -2 ** 63))
        return min(max(value, lo), hi)
    if kind == "float":
        return rng.choice((float("nan"), float("inf"), float("-inf"), -1.0, 0.0, 1e308,
                           5e-324, -0.5, 0.5, 2.0))
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "enum":
        return rng.choice((-1, 0, 1, 2, 3, 4, 7, 99, 2 ** 31 - 1, -2 ** 31))
    if kind == "bytes":
        return rng.choice((b"", b"\x00" * 10, bytes(range(256))))
    return rng.choice(strings + ["", "x" * 100_000, "\u202e", "/job:worker/task:99/device:CPU:0",
                                 "/job:ps/task:0/device:GPU:0", "../x", "learning_rate"])


def mutate_proto(message, rng: random.Random, strings: list[str],
                 map_keys: tuple[str, ...] = ()) -> None:
    """Sets one field somewhere in `message` to an extreme or wrong value, in place."""
    fields = []

    def walk(m) -> None:
        for fd in m.DESCRIPTOR.fields:
            fields.append((m, fd))
            if _field_kind(fd) != "message" or _is_map(fd):
                continue
            if _is_repeated(fd):
                for child in getattr(m, fd.name):
                    walk(child)
            elif m.HasField(fd.name):
                walk(getattr(m, fd.name))

    walk(message)
    m, fd = rng.choice(fields)
    kind = _field_kind(fd)
    value = getattr(m, fd.name)
    if _is_map(fd):
        key = rng.choice(map_keys + ("x" * 1000, "", "unknown")) if map_keys else "k"
        value_fd = fd.message_type.fields_by_name["value"]
        value[key] = _scalar(_field_kind(value_fd), rng, strings)
        return
    if _is_repeated(fd):
        roll = rng.random()
        if roll < 0.25:
            del value[:]
        elif kind == "message":
            if len(value) and roll < 0.6:
                value.add().CopyFrom(value[rng.randrange(len(value))])
            elif len(value) and roll < 0.8:
                del value[rng.randrange(len(value))]
            else:
                value.add()
        elif len(value) and roll < 0.6:
            value[rng.randrange(len(value))] = _scalar(kind, rng, strings)
        else:
            item = _scalar(kind, rng, strings)
            count = rng.choice((1, 3) if kind in ("string", "bytes") else (1, 3, 1000))
            value.extend([item] * count)
        return
    if kind == "message":
        if rng.random() < 0.5:
            m.ClearField(fd.name)
        else:
            getattr(m, fd.name).SetInParent()
        return
    setattr(m, fd.name, _scalar(kind, rng, strings))


# ------------------------------------------------------------------ strategy
class _StrategyTarget(Target):
    suffix = ".pb"

    def setup(self, workdir: pathlib.Path) -> None:
        from autodist.ir.errors import StrategyError
        from autodist.ir.resource_spec import ResourceSpec
        from autodist.ir.strategy import Strategy
        from autodist.search import builders
        from tests.search.workloads import graph_item

        self.error = StrategyError
        self.Strategy = Strategy
        gi = graph_item([("emb", (1000, 16), True), ("dense/kernel", (16, 8), False),
                         ("dense/bias", (8,), False), ("out/kernel", (8, 1), False)],
                        optimizer="adam")
        proto = gi.proto
        for key, value in (("learning_rate", 0.001), ("beta_1", 0.9), ("beta_2", 0.999),
                           ("epsilon", 1e-7), ("weight_decay", 0.004)):
            proto.optimizer.hyperparameters[key] = value
        self.gi = type(gi)(proto)
        self.spec = ResourceSpec.local(workers=2, ps=2)
        bases = [builders.PS().build(self.gi, self.spec),
                 builders.PartitionedPS(min_shard_bytes=64).build(self.gi, self.spec),
                 builders.AllReduce().build(self.gi, self.spec).with_compressor("fp16"),
                 builders.Parallax().build(self.gi, self.spec)
                 .with_virtual_nodes(64, 4).with_hyperparameters(learning_rate=0.01)]
        stale = builders.PS().build(self.gi, self.spec)
        for config in stale.proto.variables:
            for sync in config.shards:
                sync.ps.sync, sync.ps.staleness = True, 2
        bases.append(stale)
        bases[0].proto.performance.predicted_step_time_s = 0.01
        bases[0].proto.performance.measured_step_time_s.extend([0.01, 0.02])
        for s in bases:
            s.validate(self.gi, self.spec)
        self.bases = bases
        self.strings = list(self.spec.device_names) + list(self.gi.variable_names)

    def _structured(self, rng: random.Random):
        proto = copy.deepcopy(rng.choice(self.bases).proto)
        for _ in range(rng.choice((1, 1, 2, 3))):
            mutate_proto(proto, rng, self.strings,
                         map_keys=("learning_rate", "beta_1", "beta_2", "epsilon",
                                   "weight_decay", "momentum", "nesterov"))
        return proto

    def check(self, files: Files, workdir: pathlib.Path) -> None:
        path = workdir / f"strategy{self.suffix}"
        path.write_bytes(files["strategy"])
        s = self.Strategy.load(path)
        # What a user does with a strategy file before and after validating it.
        repr(s)
        s.summary()
        s.to_text()
        s.validate(self.gi, self.spec)
        _ = s.num_virtual_nodes, s.virtual_node_devices, s.global_batch_size, s.hyperparameters
        hash(s)
        _sane_strategy(s)


def _sane_strategy(s) -> None:
    """What a validated strategy promises the runtime (absurd values are refused)."""
    from autodist.proto import strategy_pb2

    ar = strategy_pb2.AllReduceSynchronizer
    for key, value in s.hyperparameters.items():
        assert math.isfinite(value), f"hyperparameter {key} = {value} accepted"
        assert value >= 0, f"hyperparameter {key} = {value} accepted"
    vn = s.proto.graph_config.virtual_nodes
    assert vn.num_virtual_nodes <= 1 << 20 and vn.global_batch_size < 1 << 31, vn
    for config in s.proto.variables:
        for sync in config.shards:
            if sync.WhichOneof("kind") == "ps":
                assert sync.ps.staleness <= 1 << 20, f"staleness {sync.ps.staleness} accepted"
            else:
                assert sync.all_reduce.spec in ar.Spec.values(), sync
                assert sync.all_reduce.compressor in ar.Compressor.values(), sync


class StrategyBinary(_StrategyTarget):
    name = "strategy_binary"
    suffix = ".pb"

    def case(self, rng: random.Random) -> Files:
        roll = rng.random()
        if roll < 0.5:
            data = self._structured(rng).SerializeToString()
        else:
            data = rng.choice(self.bases).serialize()
        if roll >= 0.4:
            data = mutate_bytes(data, rng)
        return {"strategy": data}


class StrategyText(_StrategyTarget):
    name = "strategy_text"
    suffix = ".pbtxt"

    def case(self, rng: random.Random) -> Files:
        from google.protobuf import text_format

        roll = rng.random()
        if roll < 0.5:
            text = text_format.MessageToString(self._structured(rng))
        else:
            text = rng.choice(self.bases).to_text()
        data = text.encode()
        if roll >= 0.4:
            data = mutate_bytes(data, rng)
        return {"strategy": data}


# ------------------------------------------------------------- resource spec
_SPEC_YAMLS = (
    """nodes:
  - address: 10.0.0.1
    gpus: [0, 1]
    chief: true
    network_bandwidth: 25
  - address: 10.0.0.2
    gpus: [0, 1]
    network_bandwidth: 25
""",
    """nodes:
  - {address: "w0:2222", chief: true, cpus: [0], roles: [worker]}
  - {address: "w1:2222", roles: [worker]}
  - {address: "p0:2222", roles: [ps], network_bandwidth: 1.5}
""",
    """defaults: &defaults
  gpus: 2
  network_bandwidth: 10
nodes:
  - <<: *defaults
    address: a
    chief: true
  - <<: *defaults
    address: b
    port: 3333
""",
)


def alias_bomb(rng: random.Random) -> str:
    width, depth = rng.choice(((9, 9), (10, 7), (4, 20), (2, 40)))
    lines = [f"a0: &a0 [{', '.join(['0'] * width)}]"]
    for level in range(1, depth):
        lines.append(f"a{level}: &a{level} [{', '.join([f'*a{level - 1}'] * width)}]")
    where = rng.choice(("nodes: *a{d}", "nodes: [{{address: h, gpus: *a{d}}}]",
                        "nodes: [{{address: h, roles: *a{d}}}]",
                        "nodes: [{{address: *a{d}}}]", "nodes: [{{address: h, bad: *a{d}}}]",
                        "nodes: [*a{d}]"))
    lines.append(where.format(d=depth - 1))
    return "\n".join(lines) + "\n"


class ResourceSpecYaml(Target):
    name = "resource_spec_yaml"

    def setup(self, workdir: pathlib.Path) -> None:
        import yaml

        from autodist.ir.errors import ResourceSpecError
        from autodist.ir.resource_spec import ResourceSpec

        self.error = ResourceSpecError
        self.ResourceSpec = ResourceSpec
        self.yaml = yaml
        self.dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
        self.bases = [yaml.safe_load(text) for text in _SPEC_YAMLS]

    def case(self, rng: random.Random) -> Files:
        roll = rng.random()
        if roll < 0.1:
            text = alias_bomb(rng)
        elif roll < 0.55:
            data = copy.deepcopy(rng.choice(self.bases))
            for _ in range(rng.choice((1, 1, 2))):
                data = set_random_path(data, rng, _maybe_deep(rng))
            try:
                text = self.yaml.dump(data, Dumper=self.dumper)
            except (self.yaml.YAMLError, UnicodeEncodeError):   # libyaml refuses some strings
                text = self.yaml.dump(data, Dumper=self.yaml.SafeDumper)
            text = _splice_deep(text, rng)
        else:
            text = rng.choice(_SPEC_YAMLS)
        data = text.encode("utf-8", "surrogatepass")
        if roll >= 0.45:
            data = mutate_bytes(data, rng)
        return {"spec.yaml": data}

    def check(self, files: Files, workdir: pathlib.Path) -> None:
        path = workdir / "spec.yaml"
        path.write_bytes(files["spec.yaml"])
        _use_spec(self.ResourceSpec.from_yaml(path))


def _use_spec(spec) -> None:
    """What the runtime and the search do with a spec (absurd values must be refused)."""
    devices = sum(len(n.cpus) + len(n.gpus) for n in spec.nodes)
    assert devices <= 1 << 20, f"{devices} devices accepted"
    for node in spec.nodes:
        assert math.isfinite(node.network_bandwidth_gbps), node.network_bandwidth_gbps
    _ = spec.device_names, spec.replica_devices, spec.ps_devices, spec.chief_index
    _ = spec.num_worker_tasks, spec.fingerprint, repr(spec), spec.to_text()
    for i in range(len(spec.nodes)):
        spec.bandwidth_gbps(i)
        spec.task_of(i)
    spec.cluster_def(ports=[20000 + i for i in range(len(spec.nodes))])
    type(spec).deserialize(spec.serialize())


_TF_CONFIGS = (
    {"cluster": {"chief": ["c:2222"], "worker": ["w0:2222", "w1:2222"], "ps": ["p:2222"]},
     "task": {"type": "worker", "index": 0}},
    {"cluster": {"worker": ["localhost:1", "localhost:2"]}},
    {"cluster": {"worker": ["[::1]:2222"], "evaluator": ["e:1"]}, "task": {"type": "worker"}},
)


class TfConfig(Target):
    name = "tf_config"

    def setup(self, workdir: pathlib.Path) -> None:
        from autodist.ir.errors import ResourceSpecError
        from autodist.ir.resource_spec import ResourceSpec

        self.error = ResourceSpecError
        self.ResourceSpec = ResourceSpec

    def case(self, rng: random.Random) -> Files:
        roll = rng.random()
        if roll < 0.55:
            data = copy.deepcopy(rng.choice(_TF_CONFIGS))
            for _ in range(rng.choice((1, 1, 2))):
                data = set_random_path(data, rng, _maybe_deep(rng))
            text = _splice_deep(json.dumps(data), rng)
        else:
            text = json.dumps(rng.choice(_TF_CONFIGS))
        data = text.encode("utf-8", "surrogatepass")
        if roll >= 0.45:
            data = mutate_bytes(data, rng)
        return {"tf_config": data}

    def check(self, files: Files, workdir: pathlib.Path) -> None:
        text = files["tf_config"].decode("utf-8", "surrogateescape")
        _use_spec(self.ResourceSpec.from_tf_config(text))


class ResourceSpecBinary(Target):
    name = "resource_spec_binary"

    def setup(self, workdir: pathlib.Path) -> None:
        from autodist.ir.errors import ResourceSpecError
        from autodist.ir.resource_spec import ResourceSpec

        self.error = ResourceSpecError
        self.ResourceSpec = ResourceSpec
        import yaml
        self.bases = [ResourceSpec.from_dict(yaml.safe_load(t)) for t in _SPEC_YAMLS] + \
            [ResourceSpec.local(workers=3, ps=2, bandwidth_gbps=1.0)]

    def case(self, rng: random.Random) -> Files:
        roll = rng.random()
        if roll < 0.5:
            proto = rng.choice(self.bases).proto
            for _ in range(rng.choice((1, 2))):
                mutate_proto(proto, rng, ["worker", "ps", "chief", "localhost"])
            data = proto.SerializeToString()
        else:
            data = rng.choice(self.bases).serialize()
        if roll >= 0.4:
            data = mutate_bytes(data, rng)
        return {"spec.pb": data}

    def check(self, files: Files, workdir: pathlib.Path) -> None:
        _use_spec(self.ResourceSpec.deserialize(files["spec.pb"]))


# ------------------------------------------------------------ trial database
def _record_crc(schema: Any, record: Any) -> str:
    canonical = json.dumps({"record": record, "schema": schema}, sort_keys=True,
                           separators=(",", ":"), ensure_ascii=True, allow_nan=True).encode()
    return f"{binascii.crc32(canonical):08x}"


class DatabaseLines(Target):
    name = "database"

    def setup(self, workdir: pathlib.Path) -> None:
        from autodist.search import database

        self.error = database.DatabaseError
        self.db = database
        real = (REPO / "benchmarks" / "data" / "trials.jsonl").read_bytes().split(b"\n")[:2]
        record = database.TrialRecord(
            workload="g:r", graph_item_fingerprint="g", resource_spec_fingerprint="r",
            model_name="m", graph_summary={"num_variables": 2.0}, resource_spec="",
            strategy=b"\x08\x01", error="it failed", created_at=1.0,
            extra={"nested": {"list": [1, 2.5, "x"]}})
        self.lines = real + [database.encode_line(record).rstrip(b"\n")]
        self.created_at = [database.decode_line(line).created_at for line in self.lines]

    def case(self, rng: random.Random) -> Files:
        lines = list(self.lines)
        k = rng.randrange(len(lines))
        roll = rng.random()
        newer = False
        if roll < 0.5:
            obj = json.loads(lines[k])
            if rng.random() < 0.85:
                set_random_path(obj["record"], rng, _maybe_deep(rng))
            else:
                field = rng.choice(("schema", "crc32", "record"))
                obj[field] = _maybe_deep(rng)
                newer = field == "schema"
            if rng.random() < 0.9 and isinstance(obj, dict) and "crc32" in obj:
                try:
                    obj["crc32"] = _record_crc(obj.get("schema"), obj.get("record"))
                except (TypeError, ValueError):
                    pass
            text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
            line = _splice_deep(text, rng).encode()
        else:
            line = mutate_bytes(lines[k], rng)
        lines[k] = line
        tail = b"\n" if rng.random() < 0.9 else b""
        return {"trials.jsonl": b"\n".join(lines) + tail,
                "intact": json.dumps([i for i in range(len(lines)) if i != k]).encode(),
                # An intact line of a newer schema (its checksum recomputed) may
                # stop the read with DatabaseSchemaError; a damaged one may not.
                "newer": b"1" if newer else b""}

    def check(self, files: Files, workdir: pathlib.Path) -> None:
        path = workdir / "trials.jsonl"
        path.write_bytes(files["trials.jsonl"])
        db = self.db.Database(path)
        try:
            contents = db.read()
        except self.db.DatabaseSchemaError as e:
            if files["newer"]:
                raise
            raise AssertionError(f"a damaged line made the whole file unreadable: {e}") from e
        intact = {self.created_at[i] for i in json.loads(files["intact"])}
        got = {r.created_at for r in contents.records}
        if not intact <= got:
            raise AssertionError(f"undamaged lines were lost: {len(intact - got)}")
        for r in contents.records:
            if r.created_at in intact:
                continue
            # A damaged record that reads must be usable and written again as it was.
            _ = r.ok, r.median_step_time_s
            if self.db.decode_line(self.db.encode_line(r).rstrip(b"\n")) != r:
                raise AssertionError("a record read does not survive writing it again")
        for s in contents.skipped:
            if not isinstance(s.reason, str) or len(s.reason) > 4096:
                raise AssertionError(f"skip reason not bounded: {len(s.reason)} chars")


# ---------------------------------------------------------------- graph item
class GraphItemBinary(Target):
    """A saved GraphItem (`autodist` CLI's MODEL.pb, a job's graph_item.pb), read and
    then used as the search uses it: its summary, two builders' strategies validated
    against it, and the simulator's predictions of sampled candidates."""

    name = "graph_item"

    def setup(self, workdir: pathlib.Path) -> None:
        from autodist.ir.errors import AutodistError
        from autodist.ir.graph_item import GraphItem
        from autodist.ir.resource_spec import ResourceSpec
        from tests.search.workloads import graph_item

        self.error = AutodistError
        self.GraphItem = GraphItem
        gi = graph_item([("emb", (1000, 16), True), ("dense/kernel", (16, 8), False),
                         ("dense/bias", (8,), False), ("out/kernel", (8, 1), False)],
                        optimizer="adam", ops=[("MatMul", "forward", 4096),
                                               ("MatMul", "backward", 4096)])
        gi.proto.optimizer.hyperparameters["learning_rate"] = 0.001
        gi.proto.loss_tensor = "loss:0"
        self.base = type(gi)(gi.proto).serialize()
        self.spec = ResourceSpec.local(workers=2, ps=1)
        self.check({"graph_item.pb": self.base}, workdir)   # the base reads and is usable
        self.strings = list(gi.variable_names) + ["float32", "int64", "forward", "x:0"]

    def case(self, rng: random.Random) -> Files:
        from autodist.proto import graph_item_pb2

        if rng.random() < 0.7:
            proto = graph_item_pb2.GraphItem()
            proto.ParseFromString(self.base)
            for _ in range(rng.choice((1, 1, 2, 3))):
                mutate_proto(proto, rng, self.strings)
            return {"graph_item.pb": proto.SerializeToString()}
        return {"graph_item.pb": mutate_bytes(self.base, rng)}

    def check(self, files: Files, workdir: pathlib.Path) -> None:
        import numpy as np

        from autodist.search import builders
        from autodist.search.simulator import Simulator
        from autodist.search.space import SearchSpace

        gi = self.GraphItem.deserialize(files["graph_item.pb"])
        gi.summary()
        for builder in (builders.AllReduce(), builders.PS()):
            builder.build(gi, self.spec).validate(gi, self.spec)
        space = SearchSpace(gi, self.spec)
        candidates = space.sample(4, np.random.default_rng(0))
        prediction = Simulator(space).predict(candidates)
        if not np.all(np.isfinite(prediction.step_time_s)):
            raise AssertionError(f"a GraphItem that reads predicts {prediction.step_time_s}")


# ---------------------------------------------------------------- records
class RecordMessages(Target):
    """The JSON records between a run's processes (mailboxes, job files): step reports,
    progress lines, run limits, epoch decisions, results, worker messages, loss records,
    change requests and dataset descriptions. A peer or a damaged job file can send any
    bytes; each must read as a record or raise `RecordError`."""

    name = "records"

    def setup(self, workdir: pathlib.Path) -> None:
        from autodist.runtime import records as r
        from autodist.runtime.elastic import Segment

        self.error = r.RecordError
        sample = r.MonitorSample(batches=(8, 8, 16), sq_norms=(3.0, 5.0, 2.5),
                                 compute_s=(0.01,), communication_s=(0.02,), tasks=(0,),
                                 examples=(32,))
        result = r.WorkerResult(
            losses=(0.5, 0.25), step_times=(0.1, 0.2), steps_per_epoch=2, epoch_starts=(0, 2),
            step_examples=(64, 64), max_lead=1, resizes=(r.ResizeEvent(1, 2, 0, 0.5),),
            monitor=(r.MonitoredStep(0, sample),), epoch_metrics=((1.0, [2.0, 3.0]),))
        self.records = [
            r.StepReport(task=1, step=7, loss=0.25, monitor=sample, metrics=(1.0, [2.0])),
            r.ProgressRecord(step=12, epoch=2, epoch_step=0, loss=1.5, seconds=0.01,
                             examples=64, last_of_epoch=False, workers=3, plan=1,
                             monitor=sample),
            r.RunLimit(limit=8, final=False, segments=(Segment(0, 0, 4, (0, 1)),
                                                       Segment(1, 4, 8, (0,), 1)),
                       plans=("strategy text",)),
            result,
            r.WorkerResult(steps_per_epoch=3, probe={"/job:worker/task:0/device:CPU:0":
                                                     r.Probe(32, (0.1, 0.2))}),
            r.WorkerMessage(task=2, error="Traceback ..."),
            r.WorkerMessage(task=2, result=result),
            r.ChangeRequest(sequence=3, members=(0, 2)),
            r.ChangeRequest(sequence=4, strategy="text"),
            r.LossRecord(step=5, loss=0.125),
            r.DatasetDescription(dtypes=("float32", "int32", "float32"),
                                 shapes=((None, 8), (None,), (None,)), num_inputs=1,
                                 num_targets=1, weighted=True, batches=None,
                                 cardinality_known=False, passes_before=3),
        ]
        self.raw = [record.to_json() for record in self.records]
        self.raw = [raw.encode() if isinstance(raw, str) else raw for raw in self.raw]

    def case(self, rng: random.Random) -> Files:
        k = rng.randrange(len(self.records))
        data = self.raw[k]
        if rng.random() < 0.6:
            obj = json.loads(data)
            for _ in range(rng.choice((1, 1, 2))):
                set_random_path(obj, rng, _maybe_deep(rng))
            data = _splice_deep(json.dumps(obj), rng).encode("utf-8", "surrogatepass")
        else:
            data = mutate_bytes(data, rng)
        return {"record": data, "kind": str(k).encode()}

    def check(self, files: Files, workdir: pathlib.Path) -> None:
        kind = type(self.records[int(files["kind"])])
        record = kind.from_json(files["record"])
        again = record.to_json()   # what reads is a record: it writes again as it read
        if kind.from_json(again) != record:
            raise AssertionError(f"a {kind.__name__} read does not survive writing it again")


# ---------------------------------------------------------------- job messages
class JobMessages(Target):
    """What reaches `autodist serve`'s job box from anyone on the network: the messages of a
    job, read by `signing.unseal_part` with the cluster's secret and without one
    (``--insecure``) and kept by a `chunks.Receiver`, then the archive unpacked and its
    config and ports read, as a serving task does before it runs a job. Format v1 (a whole
    job in one message, as older chiefs send) and format v2 (a job in chunks, each signed:
    damaged, dropped, repeated, reordered, of another job, with header fields set to
    extreme values and signed anyway). Each sequence must give a job or raise a named error
    (`AutodistError`: rejected, damaged archive, foreign config), a chunk's rejection
    leaving the task serving the next message."""

    name = "job_message"

    def setup(self, workdir: pathlib.Path) -> None:
        import dataclasses
        import io
        import logging
        import tarfile
        import time

        from autodist.ir.errors import AutodistError
        from autodist.launch import chunks, signing
        from autodist.launch.job import JobDir
        from autodist.runtime.run_config import RunConfig
        self.error = AutodistError
        self.signing, self.chunks, self.JobDir = signing, chunks, JobDir
        self.RunConfig = RunConfig
        # A dropped unfinished job is logged as a warning: not one per case.
        logging.getLogger(chunks.__name__).setLevel(logging.ERROR)
        self.secret = b"a-cluster-secret-of-some-length"
        self.now = time.time()
        files = {"graph_item.pb": b"\x08\x01", "strategy.pb": b"", "resource_spec.pb": b"",
                 "run.json": json.dumps(dataclasses.asdict(
                     RunConfig(global_batch_size=16, job_id="cafe01"))).encode(),
                 "cluster.json": json.dumps({"ports": [2222, 2223]}).encode(),
                 "init.npz": b"PK\x05\x06" + b"\x00" * 18,
                 "data/y.npy": b"\x93NUMPY"}
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            for name, data in files.items():
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        self.archive = buffer.getvalue()
        self.work = workdir

    def case(self, rng: random.Random) -> Files:
        secret = self.secret if rng.random() < 0.5 else None
        signer = self.secret if secret is not None and rng.random() < 0.8 else None
        messages = (self._whole(rng, signer) if rng.random() < 0.4 else
                    self._chunked(rng, signer))
        return {"secret": b"1" if secret is not None else b""} | {
            f"message_{i}": m for i, m in enumerate(messages)}

    def _whole(self, rng: random.Random, signer: bytes | None) -> list[bytes]:
        """Format v1: one message."""
        archive = self.archive
        roll = rng.random()
        if roll < 0.35:   # a damaged archive, sealed as it is: only the reader stands
            archive = mutate_bytes(archive, rng)
        header_id = rng.choice(("cafe01", "x" * 64, "cafe01\"", ""))
        message = self.signing.seal(signer, header_id, "worker:1", archive,
                                    self.now + rng.choice((0, 0, 0, 1e6, -1e6)))
        if roll >= 0.35:
            message = mutate_bytes(message, rng) if rng.random() < 0.8 else \
                rng.choice((b"[" * 3000, b"", message[:20], message + b"\x00" * 100))
        return [message]

    def _chunked(self, rng: random.Random, signer: bytes | None) -> list[bytes]:
        """Format v2: a job in chunks, then 0 to 2 of the ways a sequence goes wrong."""
        import io

        archive = self.archive
        if rng.random() < 0.2:   # a damaged archive, chunked and sealed as it is
            archive = mutate_bytes(archive, rng)
        chunk_bytes = rng.choice((512, 1000, 4096, len(archive), 1 << 20))
        job_id = rng.choice(("cafe01", "cafe01", "x" * 64, "beef02"))
        skew = rng.choice((0,) * 8 + (1e6, -1e6))

        def sealed(data: bytes, job: str, size: int) -> list[bytes]:
            return list(self.chunks.sealed_chunks(signer, job, "worker:1", io.BytesIO(data),
                                                  chunk_bytes=size,
                                                  clock=lambda: self.now + skew))

        messages = sealed(archive, job_id, chunk_bytes)
        for _ in range(rng.choice((0, 1, 1, 1, 2))):
            if not messages:
                break
            how = rng.randrange(8)
            i = rng.randrange(len(messages))
            if how == 0:
                messages[i] = mutate_bytes(messages[i], rng)
            elif how == 1 and len(messages) > 1:
                del messages[i]
            elif how == 2:
                rng.shuffle(messages)
            elif how == 3:
                messages.insert(rng.randrange(len(messages) + 1), messages[i])
            elif how == 4:   # chunks of another job, or of the same with another archive
                other = sealed(archive[:rng.randrange(len(archive) + 1)],
                               rng.choice(("beef02", job_id)), rng.choice((512, chunk_bytes)))
                at = rng.randrange(len(messages) + 1)
                messages[at:at] = other[:rng.choice((1, len(other)))]
            elif how == 5:   # a header field set to an extreme value, signed anyway
                messages[i] = self._forged(rng, signer, messages[i], skew)
            elif how == 6:
                messages[i] = rng.choice((b"[" * 3000, b"", messages[i][:20],
                                          messages[i] + b"\x00" * 100,
                                          b"ADJOB\x00v3" + messages[i][8:]))
            else:
                del messages[rng.randrange(len(messages) + 1):]
        return messages

    def _forged(self, rng: random.Random, signer: bytes | None, message: bytes,
                skew: float) -> bytes:
        import dataclasses

        try:
            part = self.signing.unseal_part(message, None, "worker:1", self.now + skew)
        except self.signing.JobRejectedError:
            return message
        field = rng.choice(("job_id", "index", "count", "total", "chunk_bytes", "sha256",
                            "data"))
        value = mutate_bytes(bytes(part.data), rng) if field == "data" else extreme_value(rng)
        forged = dataclasses.replace(part, **{field: value})
        return self.signing.seal_chunk(signer, "worker:1", forged, self.now + skew)

    def check(self, files: Files, workdir: pathlib.Path) -> None:
        import shutil
        import tempfile

        secret = self.secret if files["secret"] else None
        messages = sorted((int(k.split("_")[1]), v) for k, v in files.items()
                          if k.startswith("message_"))
        receiver = self.chunks.Receiver(workdir)
        last: Exception | None = None
        try:
            for _, message in messages:   # as `autodist serve` takes them, one by one
                try:
                    archive = receiver.add(self.signing.unseal_part(message, secret,
                                                                    "worker:1", self.now))
                except self.signing.JobRejectedError as e:   # rejected; the task serves on
                    receiver.discard(e.job_id)
                    last = e
                    continue
                if archive is None:
                    continue
                work = pathlib.Path(tempfile.mkdtemp(dir=workdir))
                try:
                    job = self.JobDir.unpack(archive, work)
                    job.settings(), self.RunConfig.of_job(job), job.ports()
                    return
                finally:
                    shutil.rmtree(work, ignore_errors=True)
            raise last or self.signing.JobRejectedError(
                f"no complete job: {receiver.pending() or 'no chunk'}")
        finally:
            receiver.discard()
            leftovers = list(workdir.glob("autodist-incoming-*"))
            if leftovers:
                raise AssertionError(f"a dropped job left files: {leftovers}")


# ---------------------------------------------------------------- cost model
class CostModelFile(Target):
    name = "cost_model"
    native = True

    def setup(self, workdir: pathlib.Path) -> None:
        import numpy as np

        from autodist.search import cost_model

        self.error = cost_model.CostModelError
        self.cm = cost_model
        rng = np.random.default_rng(0)
        X = rng.uniform(size=(60, 4))
        times = np.exp(X @ np.array([1.0, 0.5, 0.1, 0.0])) * 0.01
        workloads = [f"w{i % 3}" for i in range(60)]
        model = cost_model.CostModel("ranker", num_boost_round=4, params={"num_leaves": 4})
        model.fit(X, times, workloads, ["a", "b", "c", "d"])
        workdir.mkdir(parents=True, exist_ok=True)
        path = workdir / "base_model.txt"
        model.save(path)
        self.base = path.read_bytes()
        self.X = X[:5]

    def _structured(self, rng: random.Random) -> bytes:
        """A metadata field set to an extreme value; the model text and its checksum kept."""
        doc = json.loads(self.base)
        kept = {key: doc.pop(key) for key in ("model", "model_sha256") if key in doc}
        for _ in range(rng.choice((1, 2))):
            set_random_path(doc, rng, _maybe_deep(rng))
        doc.update(kept)
        return _splice_deep(json.dumps(doc, indent=1, sort_keys=True), rng) \
            .encode("utf-8", "surrogatepass")

    def _edited_text(self, rng: random.Random) -> bytes:
        """The LightGBM model text edited and its checksum recomputed, as a user who
        edits the file by hand would: only the model text's own checks stand."""
        import hashlib

        doc = json.loads(self.base)
        lines = doc["model"].split("\n")
        for _ in range(rng.choice((1, 1, 2, 3))):
            i = rng.randrange(len(lines))
            key, sep, value = lines[i].partition("=")
            roll = rng.random()
            if sep and value and roll < 0.6:   # one number of a field replaced
                parts = value.split(" ")
                parts[rng.randrange(len(parts))] = rng.choice((
                    "-1", "-2", "0", "1", "3", "4", "7", "-9", "65536", "2147483647",
                    "-2147483648", "9999999999", "nan", "inf", "-inf", "1e308", "x", ""))
                lines[i] = key + "=" + " ".join(parts)
            elif roll < 0.7:
                del lines[i]
            elif roll < 0.8:
                lines.insert(i, lines[rng.randrange(len(lines))])
            elif roll < 0.9 and sep:
                lines[i] = key + "=" + " ".join([value] * rng.choice((2, 1000)))
            else:
                lines[i:i] = ["Tree=" + str(rng.choice((0, 1, 5, 10 ** 6)))]
        doc["model"] = "\n".join(lines)
        doc["model_sha256"] = hashlib.sha256(doc["model"].encode("utf-8",
                                                                 "surrogatepass")).hexdigest()
        return json.dumps(doc, indent=1, sort_keys=True).encode("utf-8", "surrogatepass")

    def case(self, rng: random.Random) -> Files:
        roll = rng.random()
        if roll < 0.4:
            return {"model.txt": self._edited_text(rng)}
        data = self._structured(rng) if roll < 0.6 else self.base
        if roll >= 0.55:
            data = mutate_bytes(data, rng)
        return {"model.txt": data}

    def check(self, files: Files, workdir: pathlib.Path) -> None:
        path = workdir / "model.txt"
        path.write_bytes(files["model.txt"])
        model = self.cm.CostModel.load(path)
        model.predict(self.X[:, :len(model.feature_names)])
        model.feature_importance(), repr(model), model.training_stats


# ---------------------------------------------------------------- checkpoint
class CheckpointFiles(Target):
    name = "checkpoint"
    native = True

    def setup(self, workdir: pathlib.Path) -> None:
        import numpy as np
        import tensorflow as tf

        from autodist.runtime import checkpoint

        self.error = checkpoint.CheckpointError
        self.ckpt = checkpoint
        rng = np.random.default_rng(0)
        self.expected = []
        directory = workdir / "base"
        for step in (3, 6):
            tensors = {"dense/kernel": rng.normal(size=(4, 3)).astype("float32"),
                       "dense/kernel/optimizer/m": rng.normal(size=(4, 3)).astype("float32"),
                       "emb/embeddings": rng.normal(size=(50, 8)).astype("float32"),
                       checkpoint.ITERATIONS: np.asarray(step, np.int64)}
            names = sorted(tensors)

            def write(prefix: str, names=names, tensors=tensors) -> None:
                tf.raw_ops.SaveV2(prefix=prefix, tensor_names=names,
                                  shape_and_slices=[""] * len(names),
                                  tensors=[tensors[n] for n in names])

            checkpoint.save(directory, step, write)
            self.expected.append(tensors)
        self.base = {str(p.relative_to(directory)): p.read_bytes()
                     for p in sorted(directory.rglob("*")) if p.is_file()}
        self.tree = None
        self.step_dirs = sorted({name.split("/")[0] for name in self.base if "/" in name})

    def case(self, rng: random.Random) -> Files:
        files = dict(self.base)
        roll = rng.random()
        names = sorted(files)
        if roll < 0.1:
            files[rng.choice(names)] = None
        elif roll < 0.25:
            files["latest"] = rng.choice((
                b"../base", b"/etc", b"step-00000003/../../x", b"", b"step-99999999", b".",
                b"..", b"step-00000003\x00", b"x" * 5000, b"step-00000003/ckpt", b"latest",
                b"step-00000003\n", b" step-00000006 ", rng.choice(TOKENS)))
        elif roll < 0.4:
            name = rng.choice(names)
            data = files[name]
            files[name] = data[:rng.randrange(len(data) + 1)]
        else:
            name = rng.choice(names)
            files[name] = mutate_bytes(files[name], rng)
        target = rng.choice(("dir", "dir", "step", "prefix"))
        return {"files": files, "target": target}

    def check(self, files: Files, workdir: pathlib.Path) -> None:
        import numpy as np

        if self.tree is None:
            self.tree = FileTree(workdir / "ckpt")
        self.tree.set(files["files"])
        directory = self.tree.directory
        target = directory
        if files["target"] != "dir":
            target = directory / self.step_dirs[-1]
            if files["target"] == "prefix":
                target = target / self.ckpt.PREFIX
        values = self.ckpt.load(target)
        for expected in self.expected:
            if sorted(values) == sorted(expected) and all(
                    np.array_equal(values[k], expected[k]) for k in expected):
                return
        raise AssertionError("a damaged checkpoint loaded with values it was not saved with")


# ------------------------------------------------------------ harness check
class HarnessSelfTest(Target):
    """A reader that crashes, hangs and misbehaves on purpose (tests the harness)."""

    name = "selftest"

    def setup(self, workdir: pathlib.Path) -> None:
        self.error = ValueError

    def case(self, rng: random.Random) -> Files:
        return {"roll": str(rng.randrange(10)).encode()}

    def check(self, files: Files, workdir: pathlib.Path) -> None:
        import os
        import time

        roll = int(files["roll"])
        if roll == 3:
            os.abort()
        if roll == 5:
            time.sleep(3600)
        if roll == 7:
            raise KeyError("not the named error")
        if roll == 8:
            raise ValueError("x" * 10_000)
        if roll % 2:
            raise ValueError("the named error")


TARGETS: dict[str, type[Target]] = {t.name: t for t in (
    StrategyBinary, StrategyText, ResourceSpecYaml, TfConfig, ResourceSpecBinary,
    GraphItemBinary, DatabaseLines, RecordMessages, JobMessages, CostModelFile,
    CheckpointFiles)}
SELF_TESTS: dict[str, type[Target]] = {HarnessSelfTest.name: HarnessSelfTest}
