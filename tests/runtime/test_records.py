"""Records between the processes of a run: JSON round trips and named errors."""
from __future__ import annotations

import json

import pytest

from autodist.runtime.elastic import Segment
from autodist.runtime.records import (ChangeRequest, DatasetDescription, LossRecord,
                                      MonitoredStep, MonitorSample, Probe, ProgressRecord,
                                      RecordError, ResizeEvent, RunLimit, StepReport,
                                      WorkerMessage, WorkerResult)

SAMPLE = MonitorSample(batches=(8, 8, 16), sq_norms=(3.0, 5.0, 2.5), compute_s=(0.01,),
                       communication_s=(0.02,), tasks=(0,), examples=(32,))


@pytest.mark.parametrize("record", [
    StepReport(task=1, step=7, loss=0.25),
    StepReport(task=1, step=7, loss=0.25, monitor=SAMPLE),
    ProgressRecord(step=12, epoch=2, epoch_step=0, loss=1.5, seconds=0.01, examples=64,
                   last_of_epoch=False, workers=3, plan=1, monitor=SAMPLE),
    ProgressRecord(step=0, epoch=0, epoch_step=0, loss=1.5, seconds=0.01, examples=7,
                   last_of_epoch=True, workers=1, estimate=True),
    RunLimit(limit=8, final=False, segments=(Segment(0, 0, 4, (0, 1)), Segment(1, 4, 8, (0,), 1)),
             plans=("strategy text",)),
    WorkerResult(losses=(0.5, 0.25), step_times=(0.1, 0.2), steps_per_epoch=2,
                 epoch_starts=(0, 2), step_examples=(64, 64), max_lead=1,
                 resizes=(ResizeEvent(1, 2, 0, 0.5),), monitor=(MonitoredStep(0, SAMPLE),)),
    WorkerResult(steps_per_epoch=3, probe={"/job:worker/task:0/device:CPU:0":
                                           Probe(32, (0.1, 0.2))}),
    WorkerMessage(task=2, error="Traceback ..."),
    WorkerMessage(task=2, result=WorkerResult(losses=(1.0,), step_times=(0.1,),
                                              steps_per_epoch=1)),
    ChangeRequest(sequence=3, members=(0, 2)),
    ChangeRequest(sequence=4, strategy="text"),
    LossRecord(step=5, loss=0.125),
    DatasetDescription(dtypes=("float32", "int32", "float32"), shapes=((None, 8), (None,),
                                                                      (None,)),
                       num_inputs=1, num_targets=1, weighted=True, batches=None,
                       cardinality_known=False, passes_before=3),
], ids=lambda r: type(r).__name__)
def test_json_round_trip(record):
    raw = record.to_json()
    assert type(record).from_json(raw) == record


def test_a_dataset_description_needs_a_dtype_and_shape_per_component():
    raw = json.dumps({"dtypes": ["float32"], "shapes": [[None, 8]], "num_inputs": 1,
                      "num_targets": 1, "weighted": False, "batches": 3,
                      "cardinality_known": True})
    with pytest.raises(RecordError, match="needs 2 dtypes and shapes"):
        DatasetDescription.from_json(raw)
    with pytest.raises(RecordError, match="'shapes' is malformed"):
        DatasetDescription.from_json(raw.replace("[[null, 8]]", "[7]"))


def test_a_merged_monitor_sample_keeps_every_task_in_order():
    other = MonitorSample(batches=(32,), sq_norms=(1.0,), compute_s=(0.03,))
    merged = MonitorSample.merge([SAMPLE, other])
    assert merged.batches == (8, 8, 16, 32) and merged.sq_norms == (3.0, 5.0, 2.5, 1.0)
    assert merged.compute_s == (0.01, 0.03) and merged.communication_s == (0.02,)


def test_per_worker_throughput_is_examples_over_compute_time():
    other = MonitorSample(batches=(16,), sq_norms=(1.0,), compute_s=(0.04,), tasks=(2,),
                          examples=(16,))
    assert MonitorSample.merge([SAMPLE, other]).examples_per_s() == \
        pytest.approx({0: 3200.0, 2: 400.0})
    # Samples without task indices (older records) give no per-worker numbers.
    assert MonitorSample(batches=(8,), sq_norms=(1.0,), compute_s=(0.1,)).examples_per_s() == {}


@pytest.mark.parametrize("kind,raw,match", [
    (StepReport, b"not json", "a step report is not JSON"),
    (StepReport, b"[1, 2]", "a step report must be a JSON object"),
    (StepReport, json.dumps({"task": 1, "loss": 0.5}), "needs the field 'step'"),
    (StepReport, json.dumps({"task": "1", "step": 1, "loss": 0.5}),
     "field 'task' is malformed: expected an integer. Received: '1'"),
    (ProgressRecord, json.dumps({"step": 1}), "needs the field 'epoch'"),
    (RunLimit, json.dumps({"limit": 3, "final": 1}), "field 'final' is malformed"),
    (RunLimit, json.dumps({"limit": 3, "final": True, "segments": [[0, 1]]}),
     "expected \\[version, start, end, members, plan\\]"),
    (RunLimit, json.dumps({"limit": 3, "final": True, "segments": [[0, 0, 3, [2, 1], 0]]}),
     "expected sorted distinct worker tasks starting with 0"),
    (ChangeRequest, json.dumps({"sequence": 1, "members": [0, 0]}),
     "expected sorted distinct worker tasks starting with 0"),
    (WorkerResult, json.dumps({"losses": [0.1], "step_times": [0.1], "steps_per_epoch": 1,
                               "monitor": [{"step": 0, "batches": [1, 2], "sq_norms": [1.0]}]}),
     "one norm per batch"),
    (WorkerResult, json.dumps({"losses": [0.1], "step_times": [0.1], "steps_per_epoch": 1,
                               "probe": {"d": {"examples": 1, "seconds": [float("nan")]}}}),
     "expected a finite number"),
])
def test_a_malformed_record_is_a_named_error(kind, raw, match):
    with pytest.raises(RecordError, match=match):
        kind.from_json(raw)


def test_error_messages_stay_short():
    with pytest.raises(RecordError) as info:
        StepReport.from_json(json.dumps({"task": "x" * 100_000, "step": 1, "loss": 1.0}))
    assert len(str(info.value)) < 400
