"""Chaos: a seeded schedule of kills, stops and delays over a 512-step run.

Four workers train an MLP with 4 virtual nodes (global batch 16) for 512 steps
with `on_failure="continue"`. A schedule drawn from a seeded generator
delays workers (SIGSTOP for 0.5-2 s, then SIGCONT: slow, not hung), kills
one (SIGKILL) and stops another for good (SIGSTOP: alive and silent; the
launcher names it by its stale heartbeat and kills it). The run recovers
from both on the survivors, keeps the global batch and loses no applied
update: its weights equal single-device Keras `fit` on the same batches.

The learning rate is small (SGD 0.01 with momentum 0.9): at 0.1 this MLP's
training amplifies float32 summation order alone (replicas summing the
virtual nodes' gradients in other orders than one device) to 3e-2 over 512
steps without any failure; at 0.01 a run without failures is within 2.4e-7.
"""
from __future__ import annotations

import os
import pathlib
import random
import signal
import threading
import time

import numpy as np
import pytest

import keras
import autodist
from autodist import models
from autodist.runtime.entry import TASK_MODULE
from autodist.search import builders
from tests import small_mlp

pytestmark = pytest.mark.cluster

EXAMPLES, BATCH, EPOCHS = 256, 16, 32      # 512 steps
TOLERANCE = 2e-5
SEED = 20261205


def _mlp():
    return models.mlp(input_dim=20, hidden=(16,),
                      optimizer=keras.optimizers.SGD(0.01, momentum=0.9))


def _schedule(seed: int) -> list[tuple[int, str, int, float]]:
    """(step, action, worker task at that time, seconds) in step order: delays of workers
    0 and 1 (which survive), worker 3 killed, then worker 2 stopped for good."""
    rng = random.Random(seed)
    kill_at = rng.randrange(100, 180)
    stop_at = rng.randrange(280, 360)
    events = [(kill_at, "kill", 3, 0.0), (stop_at, "stop", 2, 0.0)]
    for _ in range(4):
        events.append((rng.randrange(20, 480), "delay", rng.choice((0, 1)),
                       rng.uniform(0.5, 2.0)))
    return sorted(events)


def _newest_task_pid(job_root: pathlib.Path, task: int) -> int | None:
    """The pid of worker `task` of the newest job under `job_root` (recoveries run in
    ``recovery-<k>`` below it, their tasks renumbered)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                args = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if TASK_MODULE not in args or "--job-dir" not in args:
            continue
        job_dir = args[args.index("--job-dir") + 1]
        if job_dir.startswith(str(job_root)) and args[args.index("--job") + 1] == "worker" \
                and args[args.index("--task") + 1] == str(task):
            found.append((len(pathlib.Path(job_dir).parts), job_dir, int(entry)))
    return max(found)[2] if found else None


def _steps_done(job_root: pathlib.Path) -> int:
    """The newest global step the chief of any job under `job_root` recorded."""
    newest = -1
    for path in [job_root / "progress.jsonl"] + list(job_root.glob("recovery-*/progress.jsonl")):
        try:
            lines = path.read_text().splitlines()
        except OSError:
            continue
        if lines:
            import json
            try:
                newest = max(newest, json.loads(lines[-1])["step"])
            except (ValueError, KeyError):
                pass   # a line being written
    return newest + 1


class _Chaos:
    """Carries out a schedule against the run under `job_root`, from a thread."""

    def __init__(self, job_root: pathlib.Path, events, timeout_s: float = 600.0):
        self.job_root, self.events, self.timeout_s = job_root, list(events), timeout_s
        self.done: list[tuple[int, str, int]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while self.events and not self.stop.is_set() and time.monotonic() < deadline:
            step, action, task, seconds = self.events[0]
            if _steps_done(self.job_root) < step:
                time.sleep(0.005)
                continue
            pid = _newest_task_pid(self.job_root, task)
            if pid is None:      # between a failure and its recovery job's start
                time.sleep(0.05)
                continue
            self.events.pop(0)
            try:
                if action == "kill":
                    os.kill(pid, signal.SIGKILL)
                elif action == "stop":
                    os.kill(pid, signal.SIGSTOP)
                else:
                    os.kill(pid, signal.SIGSTOP)
                    time.sleep(seconds)
                    os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                continue
            self.done.append((_steps_done(self.job_root), action, task))


def test_a_seeded_schedule_of_kills_stops_and_delays_loses_nothing(tmp_path):
    x, y = small_mlp.data(EXAMPLES)
    model = _mlp()
    reference = models.single_device_twin(model)
    reference.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    spec = autodist.ResourceSpec.local(workers=4)
    strategy = builders.AllReduce().build(autodist.capture(model), spec).with_virtual_nodes(
        BATCH, 4)
    job_root = tmp_path / "job"
    # A step times out after 20 s; a task silent for 10 s is hung; delays stay below.
    run = autodist.distribute(model, strategy, spec, job_dir=str(job_root), step_timeout_s=20)
    events = _schedule(SEED)
    chaos = _Chaos(job_root, events)
    chaos.thread.start()
    try:
        history = run.fit(x, y, epochs=EPOCHS, shuffle=False, verbose=0, on_failure="continue")
    finally:
        chaos.stop.set()
        chaos.thread.join(timeout=10)
    assert [a for _, a, _ in chaos.done].count("delay") == 4, chaos.done
    assert [(e.failed_task, e.workers) for e in history.recoveries] == [(3, 3), (2, 2)], \
        (history.recoveries, chaos.done)
    assert "stopped responding" in history.recoveries[1].cause, history.recoveries
    assert len(history.step_losses) == EPOCHS * EXAMPLES // BATCH
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)
