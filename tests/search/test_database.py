"""Tests of the trial database (autodist.search.database).

Crash safety is tested with real processes: a writer SIGKILLed in a loop of
appends, a torn line written by hand, and two writers appending at once.
"""
from __future__ import annotations

import binascii
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import autodist
from autodist.ir.graph_item import GraphItem
from autodist.ir.resource_spec import ResourceSpec
from autodist.ir.strategy import Strategy
from autodist.proto import graph_item_pb2, strategy_pb2
from autodist.search.database import (DATABASE_SCHEMA_VERSION, Database, DatabaseError,
                                      DatabaseSchemaError, TrialRecord, encode_line,
                                      summarize_graph_item, workload_key)

GI_FP = "a" * 32
SPEC_FP = "b" * 32
REPO_ROOT = str(pathlib.Path(autodist.__file__).resolve().parent.parent)


def make_strategy(origin: str = "PS") -> Strategy:
    proto = strategy_pb2.Strategy(id="5eed", origin=origin, graph_item_fingerprint=GI_FP,
                                  resource_spec_fingerprint=SPEC_FP)
    proto.graph_config.replicas.extend(["/job:worker/task:0/device:CPU:0"])
    config = proto.variables.add(var_name="dense/kernel")
    config.shards.add().ps.reduction_destination = "/job:ps/task:0/device:CPU:0"
    return Strategy(proto)


def make_record(i: int = 0, *, workload_gi: str = GI_FP, error: str | None = None,
                step_times: tuple[float, ...] = (0.25, 0.125, 0.5),
                model_name: str = "mlp") -> TrialRecord:
    return TrialRecord(
        workload=workload_key(workload_gi, SPEC_FP), graph_item_fingerprint=workload_gi,
        resource_spec_fingerprint=SPEC_FP, model_name=model_name,
        graph_summary={"num_variables": 4.0, "total_variable_bytes": 1024.0},
        resource_spec=ResourceSpec.local(workers=2, ps=1).to_text(),
        strategy=make_strategy().serialize(), features={"ps_load_max": 0.5 + i, "shards": 2.0},
        step_times_s=() if error else step_times, error=error, origin="PS",
        predicted_step_time_s=0.3, created_at=1700000000.5 + i, extra={"i": i, "tag": ["x"]})


def _line(record: object, schema: object = DATABASE_SCHEMA_VERSION) -> bytes:
    """A line with a valid checksum around any JSON value (NaN written as NaN)."""
    canonical = json.dumps({"record": record, "schema": schema}, sort_keys=True,
                           separators=(",", ":"), ensure_ascii=True).encode()
    return b'{"crc32":"%08x",' % binascii.crc32(canonical) + canonical[1:]


# ------------------------------------------------------------------ records
def test_record_round_trips_every_field(tmp_path):
    db = Database(tmp_path / "sub" / "dir" / "trials.jsonl")   # parents are created
    record = make_record(7)
    db.append(record)
    (back,) = Database(db.path).records()
    assert back == record
    for field in ("workload", "graph_item_fingerprint", "resource_spec_fingerprint",
                  "model_name", "graph_summary", "resource_spec", "strategy", "features",
                  "step_times_s", "error", "origin", "predicted_step_time_s", "created_at",
                  "extra"):
        assert getattr(back, field) == getattr(record, field), field
    assert back.step_times_s == (0.25, 0.125, 0.5)
    assert back.ok and back.median_step_time_s == 0.25
    assert back.load_strategy() == make_strategy()
    assert back.strategy_proto() == make_strategy().proto
    assert back.strategy_proto().variables[0].var_name == "dense/kernel"
    assert back.load_resource_spec() == ResourceSpec.local(workers=2, ps=1)
    line = db.path.read_bytes()
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert json.loads(line)["schema"] == DATABASE_SCHEMA_VERSION


def test_failed_trial_is_a_record(tmp_path):
    db = Database(tmp_path / "t.jsonl")
    db.append(make_record(0, error="OOM on /job:worker/task:1"))
    db.append(TrialRecord(workload=workload_key(GI_FP, SPEC_FP), graph_item_fingerprint=GI_FP,
                          resource_spec_fingerprint=SPEC_FP, model_name="mlp", graph_summary={},
                          resource_spec="", strategy=b"", error="builder raised"))
    failed, unbuilt = db.records()
    assert failed.error == "OOM on /job:worker/task:1" and not failed.ok
    assert failed.median_step_time_s is None and failed.step_times_s == ()
    assert unbuilt.strategy == b"" and unbuilt.features == {} and unbuilt.extra == {}
    with pytest.raises(DatabaseError, match="stores no strategy"):
        unbuilt.load_strategy()


def test_from_trial_fills_fingerprints_and_summary():
    proto = graph_item_pb2.GraphItem(name="tiny")
    proto.variables.add(name="emb", shape=[10, 4], byte_size=160, sparse_gradient=True)
    proto.variables.add(name="w", shape=[4, 2], byte_size=32)
    proto.ops.add(flops=100.0)
    gi = GraphItem(proto)
    spec = ResourceSpec.local(workers=2, ps=1)
    record = TrialRecord.from_trial(gi, spec, make_strategy("AllReduce"), step_times_s=[0.1])
    assert record.workload == f"{gi.fingerprint}:{spec.fingerprint}"
    assert record.model_name == "tiny" and record.origin == "AllReduce"
    assert record.graph_summary == summarize_graph_item(gi)
    assert record.graph_summary["num_sparse_variables"] == 1.0
    assert record.graph_summary["total_variable_bytes"] == 192.0
    assert record.graph_summary["num_parameters"] == 48.0
    assert record.load_resource_spec() == spec
    assert record.strategy_proto().origin == "AllReduce"


def test_values_are_normalised_and_checked():
    record = make_record()
    normalised = TrialRecord(**{**record.__dict__, "features": {"a": 1}, "step_times_s": [1, 2]})
    assert normalised.features == {"a": 1.0} and isinstance(normalised.features["a"], float)
    assert normalised.step_times_s == (1.0, 2.0)
    bad = {
        "workload": ("x:y", "workload_key"),
        "features": ({"a": float("nan")}, r"features\['a'\] must be finite"),
        "step_times_s": ((0.1, -1.0), "must be positive"),
        "graph_summary": ({"n": "4"}, "must be a number"),
        "extra": ({"f": object()}, "JSON-able"),
        "strategy": ("not bytes", "bytes"),
        "error": (3, "error must be a string"),
    }
    for field, (value, message) in bad.items():
        with pytest.raises(DatabaseError, match=message):
            TrialRecord(**{**record.__dict__, field: value})
    with pytest.raises(DatabaseError, match="without ':'"):
        workload_key("a:b", "c")


# ------------------------------------------------------------------ queries
@pytest.mark.parametrize("in_memory", [False, True], ids=["file", "in_memory"])
def test_queries(tmp_path, in_memory):
    db = Database.in_memory() if in_memory else Database(tmp_path / "t.jsonl")
    assert db.records() == [] and len(db) == 0 and db.workloads() == []
    other = "c" * 32
    db.extend([make_record(0, step_times=(0.3,)), make_record(1, workload_gi=other),
               make_record(2, step_times=(0.1,)), make_record(3, error="boom")])
    assert len(db) == 4 and [r.extra["i"] for r in db] == [0, 1, 2, 3]
    assert db.workloads() == [workload_key(GI_FP, SPEC_FP), workload_key(other, SPEC_FP)]
    groups = db.by_workload()
    assert [r.extra["i"] for r in groups[workload_key(GI_FP, SPEC_FP)]] == [0, 2, 3]
    assert [r.extra["i"] for r in db.by_workload(ok_only=True)[db.workloads()[0]]] == [0, 2]
    assert [r.extra["i"] for r in db.filter(ok=False)] == [3]
    assert [r.extra["i"] for r in db.filter(lambda r: r.extra["i"] > 1, ok=True)] == [2]
    assert db.best(db.workloads()[0]).extra["i"] == 2
    assert db.best("nothing:here") is None
    with pytest.raises(DatabaseError, match="item 1 is a str"):
        db.extend([make_record(), "not a record"])
    assert len(db) == 4   # nothing of the rejected batch was written


def test_in_memory_database_needs_no_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    db = Database.in_memory()
    assert db.path is None and repr(db) == "Database.in_memory()"
    assert Database().path is None
    record = make_record(5)
    db.append(record)
    (back,) = db.records()
    assert back == record and back.extra == {"i": 5, "tag": ["x"]}
    assert Database.in_memory().records() == []   # each in-memory database is its own
    assert not list(tmp_path.iterdir())


# ----------------------------------------------------------- crash safety
_WRITER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {repo!r})
    from autodist.search.database import Database, TrialRecord, workload_key
    db = Database(sys.argv[1])
    writer, count, pad = sys.argv[2], int(sys.argv[3]), "x" * int(sys.argv[4])
    gi, spec = {gi!r}, {spec!r}
    for i in range(count):
        db.append(TrialRecord(workload=workload_key(gi, spec), graph_item_fingerprint=gi,
                              resource_spec_fingerprint=spec, model_name="mlp",
                              graph_summary={{}}, resource_spec="", strategy=b"s",
                              step_times_s=(0.1,), extra={{"writer": writer, "i": i,
                                                          "pad": pad}}))
""")


def start_writer(path: pathlib.Path, writer: str, count: int, pad: int) -> subprocess.Popen:
    code = _WRITER.format(repo=REPO_ROOT, gi=GI_FP, spec=SPEC_FP)
    return subprocess.Popen([sys.executable, "-c", code, str(path), writer, str(count),
                             str(pad)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def wait_for_lines(path: pathlib.Path, lines: int, proc: subprocess.Popen,
                   timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_bytes().count(b"\n") >= lines:
            return
        if proc.poll() is not None:
            raise AssertionError(f"writer exited early: {proc.stderr.read().decode()}")
        time.sleep(0.02)
    raise AssertionError(f"writer did not write {lines} lines in {timeout_s} s")


def test_database_survives_a_kill_mid_write(tmp_path):
    path = tmp_path / "trials.jsonl"
    proc = start_writer(path, "killed", 1_000_000, pad=50_000)
    try:
        wait_for_lines(path, 20, proc)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    complete = path.read_bytes().count(b"\n")
    # A torn write: half a record, no newline (as if the kill hit mid-write).
    with open(path, "ab") as f:
        line = encode_line(make_record(999))
        f.write(line[: len(line) // 2])

    db = Database(path)
    contents = db.read()
    assert [r.extra["i"] for r in contents.records] == list(range(complete))
    assert len(contents.skipped) == 1 and db.skipped == contents.skipped
    assert contents.skipped[0].line_number == complete + 1
    assert "torn" in contents.skipped[0].reason

    more = [make_record(1000 + k) for k in range(3)]
    db.append(more[0])
    db.extend(more[1:])
    again = Database(path).read()
    assert [r.extra["i"] for r in again.records] == list(range(complete)) + [1000, 1001, 1002]
    assert again.records[-3:] == more
    assert len(again.skipped) == 1 and "corrupt" in again.skipped[0].reason
    assert path.read_bytes().endswith(b"\n")


def test_corrupt_line_is_skipped_and_reported(tmp_path):
    db = Database(tmp_path / "t.jsonl")
    db.extend(make_record(i) for i in range(3))
    lines = db.path.read_bytes().split(b"\n")
    lines[1] = lines[1].replace(b'"ps_load_max":1.5', b'"ps_load_max":9.5')   # valid JSON
    db.path.write_bytes(b"\n".join(lines))
    contents = db.read()
    assert [r.extra["i"] for r in contents.records] == [0, 2]
    assert [s.line_number for s in contents.skipped] == [2]
    assert "checksum mismatch" in contents.skipped[0].reason


def test_concurrent_appenders_do_not_interleave(tmp_path):
    path = tmp_path / "trials.jsonl"
    count = 150
    procs = [start_writer(path, name, count, pad=20_000) for name in ("a", "b")]
    for proc in procs:
        try:
            assert proc.wait(timeout=120) == 0, proc.stderr.read().decode()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
            proc.stderr.close()
    contents = Database(path).read()
    assert contents.skipped == []
    assert len(contents.records) == 2 * count
    for name in ("a", "b"):
        assert [r.extra["i"] for r in contents.records if r.extra["writer"] == name] == \
            list(range(count))
    assert path.read_bytes().count(b"\n") == 2 * count


def test_newer_schema_is_a_clear_error(tmp_path):
    db = Database(tmp_path / "t.jsonl")
    db.append(make_record(0))
    with open(db.path, "ab") as f:
        f.write(_line(make_record(1).to_json_dict(), schema=DATABASE_SCHEMA_VERSION + 1) + b"\n")
    with pytest.raises(DatabaseSchemaError,
                       match=rf"line 2: line has schema version {DATABASE_SCHEMA_VERSION + 1}, "
                             r"newer than .*upgrade autodist"):
        db.records()


def test_a_flipped_bit_in_the_schema_skips_only_that_line(tmp_path):
    db = Database(tmp_path / "t.jsonl")
    db.extend(make_record(i) for i in range(3))
    lines = db.path.read_bytes().split(b"\n")
    assert lines[1].endswith(b'"schema":1}')
    lines[1] = lines[1][:-2] + b"3}"        # 0x31 -> 0x33: a newer schema, if believed
    db.path.write_bytes(b"\n".join(lines))
    contents = db.read()
    assert [r.extra["i"] for r in contents.records] == [0, 2]
    assert [s.line_number for s in contents.skipped] == [2]
    assert "checksum mismatch" in contents.skipped[0].reason


@pytest.mark.parametrize("field, value, reason", [
    ("step_times_s", None, "step_times_s must be a list of seconds. Received: None"),
    ("step_times_s", [float("nan")], "not JSON: NaN is not a number a trial record may hold"),
    ("created_at", float("inf"), "not JSON: Infinity is not a number"),
    ("created_at", 10 ** 400, "created_at must be finite. Received: inf"),
    ("extra", {"a": None}, None),
    ("features", {"x": "1"}, r"features\['x'\] must be a number. Received: '1'"),
    ("strategy", ["not", "base64"], "strategy must be a base64 string"),
    ("model_name", "x" * 100_000, None),
])
def test_malformed_records_with_valid_checksums_are_skipped(tmp_path, field, value, reason):
    record = make_record(1).to_json_dict()
    record[field] = value
    path = tmp_path / "t.jsonl"
    path.write_bytes(encode_line(make_record(0)) + _line(record) + b"\n" +
                     encode_line(make_record(2)))
    contents = Database(path).read()
    if reason is None:           # harmless: the record reads
        assert len(contents.records) == 3 and contents.skipped == []
        return
    assert [r.extra["i"] for r in contents.records] == [0, 2]
    assert len(contents.skipped) == 1 and contents.skipped[0].line_number == 2
    assert re.search(reason, contents.skipped[0].reason), contents.skipped[0].reason


def test_deep_nesting_is_a_skipped_line(tmp_path):
    deep = "[" * 100_000 + "]" * 100_000
    record = json.dumps(make_record(1).to_json_dict(), sort_keys=True, separators=(",", ":"))
    record = record.replace('"tag":["x"]', f'"tag":{deep}')
    canonical = ('{"record":' + record + ',"schema":1}').encode()
    line = b'{"crc32":"%08x",' % binascii.crc32(canonical) + canonical[1:]
    path = tmp_path / "t.jsonl"
    path.write_bytes(encode_line(make_record(0)) + line + b"\n")
    contents = Database(path).read()
    assert [r.extra["i"] for r in contents.records] == [0]
    assert "nested too deeply" in contents.skipped[0].reason
    assert len(contents.skipped[0].reason) < 200


def test_the_shipped_trial_data_reads_completely():
    contents = Database(pathlib.Path(REPO_ROOT) / "benchmarks" / "data" / "trials.jsonl").read()
    assert len(contents.records) == 1200 and contents.skipped == []


def test_path_that_is_a_directory_is_rejected(tmp_path):
    with pytest.raises(DatabaseError, match="not a file"):
        Database(tmp_path)
    assert os.path.isdir(tmp_path)
